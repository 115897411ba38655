"""The `loop` engine: grpo_hf's decoding loop for CPUs (and any device), exact to `model.generate`.

Each distinct prompt is prefilled once and its cache copied to the G rows of its group, for every kind of cache
layer transformers builds (`cache_layers.SELECTABLE`: full attention, sliding-window and chunked attention, Gated
DeltaNet, convolution and Mamba states); full-attention layers' keys and values live in preallocated tensors instead
of growing by concatenation, the other layers are transformers' own; finished rows leave the decoding batch
(`cache_layers.select_rows`) when enough steps remain to pay for it; a token costs one uniform draw per row (inverse
transform sampling) instead of `torch.multinomial`'s one exponential per vocabulary entry. The logits
go through the same `transformers` processors, in the same order, as in `model.generate`, so the
sampled distribution is the configured one (the repetition penalty reads a row's left padding as the installed
`generate` does: `sampling.GENERATE_SKIPS_PADDING`; tool episodes' turns, `decode_turns`, skip it on every version).
On a GPU it is bound by kernel launches: use `cuda_graph`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from grpo_hf.cache_layers import (
    JOIN_PROBLEMS,
    JOINABLE,
    SELECTABLE,
    cache_layer_classes,
    cat_rows,
    drop_columns,
    layers_outside,
    pad_columns,
    select_rows,
    stack_rows,
)
from grpo_hf.rollout.engine import RolloutEngine
from grpo_hf.rollout.episode_cache import DEFAULT_BUDGET_GB, EpisodeCache, cache_entry, row_entry
from grpo_hf.rollout.routes import ROUTE_DTYPE, StepRoutes, masked, no_routes, recording_steps
from grpo_hf.rollout.sampling import (
    cache_keyword,
    prefill_distinct_prompts,
    resolve_sampling_settings,
    sample_categorical,
    unsupported_reason,
)
from grpo_hf.rollout.sampling_spec import SamplingSpec
from grpo_hf.routers import recording
from grpo_hf.vision import has_images, position_offsets

logger = logging.getLogger(__name__)


class LoopEngine(RolloutEngine):
    """`sample_groups` behind the engine interface."""

    name = "loop"
    takes_images = True
    can_record_logps = True
    can_record_routes = True
    options = ("args", "episode_cache_bytes")

    def __init__(self, generation_config, eos_token_ids: Sequence[int], args=None, episode_cache_bytes=None):
        """`episode_cache_bytes`: the budget of the KV caches tool episodes keep between turns (`decode_turns`; 0:
        none, every turn prefills its whole context); None: `args.episode_cache_gb` (a `GRPOConfig`), else
        `episode_cache.DEFAULT_BUDGET_GB`."""
        super().__init__(generation_config, eos_token_ids)
        if episode_cache_bytes is None:
            gb = getattr(args, "episode_cache_gb", DEFAULT_BUDGET_GB)
            episode_cache_bytes = int(gb * 2**30)
        self.episode_cache_bytes = episode_cache_bytes
        self.episode_cache: EpisodeCache | None = None  # the last `decode_turns` call's (its `stats`), if any

    @classmethod
    def unsupported_reason(cls, model, generation_config) -> str | None:
        return unsupported_reason(model, generation_config, layers=SELECTABLE)

    def sample(self, model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, images=None) -> torch.Tensor:
        logps = None
        if self.record_logps:
            shape = (prompt_ids.size(0), self.generation_config.max_new_tokens)
            logps = torch.zeros(shape, dtype=torch.float32, device=prompt_ids.device)  # [N, max_new_tokens]
        (N, P), T = prompt_ids.shape, self.generation_config.max_new_tokens
        with recording_steps(model, self.record_routes, N, P + T) as routes:
            completion_ids = sample_groups(
                model,
                prompt_ids,
                prompt_mask,
                self.generation_config,
                self.eos_token_ids,
                images=images,
                blocked_token_ids=self.blocked_token_ids,
                logps=logps,
                routes=routes,
            )  # [N, T]
        if logps is not None:
            self.sampling_logps = logps[:, : completion_ids.size(1)]
        if routes is not None:
            self.sampling_routes = routes.result(P + completion_ids.size(1))  # [N, P + T, L, k]
        return completion_ids

    def decode_turns(self, model, source) -> None:
        """Tool episodes' turns, each joining the batch at the next token step (`decode_turns`), in eval mode."""
        was_training = model.training
        model.eval()
        self.episode_cache = EpisodeCache(self.episode_cache_bytes) if self.episode_cache_bytes > 0 else None
        try:
            with recording(model) if self.record_routes else contextlib.nullcontext() as recorder:
                decode_turns(
                    model,
                    source,
                    self.generation_config,
                    self.eos_token_ids,
                    blocked_token_ids=self.blocked_token_ids,
                    episode_cache=self.episode_cache,
                    recorder=recorder,
                )
        finally:
            model.train(was_training)


class _PreallocatedLayer(DynamicLayer):
    """A `DynamicLayer` whose keys and values live in buffers of `capacity` positions, allocated at the first update.

    `DynamicLayer` concatenates each step's keys/values onto the whole cache, copying it every step
    (O(T^2) copies; 20% of decoding time for SmolLM2 at 64 tokens). Here a step writes its positions in
    place and `keys`/`values` are views of the filled part, so attention and the mask see exactly what
    `DynamicLayer` would give. The two buffers take the dtypes of the first keys and values, which can
    differ (under autocast with fp32 weights, rotary embeddings leave the keys fp32 and the values bf16).
    """

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._keys = key_states.new_empty((*key_states.shape[:2], self.capacity, key_states.shape[-1]))
        self._values = value_states.new_empty((*value_states.shape[:2], self.capacity, value_states.shape[-1]))

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.capacity:
            raise RuntimeError(f"KV cache of {self.capacity} positions overflowed ({end}).")
        self._keys[:, :, self.length : end] = key_states
        self._values[:, :, self.length : end] = value_states
        self.length = end
        self.keys, self.values = self._keys[:, :, :end], self._values[:, :, :end]
        return self.keys, self.values

    def reorder_cache(self, index: torch.Tensor) -> None:
        """Keep rows `index` (any length: rows may repeat), in place (`cache_layers.select_rows`)."""
        self._keys, self._values = self._keys.index_select(0, index), self._values.index_select(0, index)
        self.keys, self.values = self._keys[:, :, : self.length], self._values[:, :, : self.length]


def _preallocated_cache(config, capacity: int) -> DynamicCache:
    """The `DynamicCache` `generate` makes for `config`, its full-attention layers (`DynamicLayer`) replaced by
    `_PreallocatedLayer`s of `capacity` positions; the other kinds keep transformers' own layers (a sliding window
    keeps at most window - 1 positions, a linear-attention layer states of fixed size)."""
    cache = DynamicCache(config=config)
    cache.layers = [_PreallocatedLayer(capacity) if type(x) is DynamicLayer else x for x in cache.layers]
    return cache


# A finished row leaves the decoding batch (its cache rows are copied out) only if at least this many
# steps remain: dropping it saves about one row of compute per step, copying the cache costs a few steps' worth.
_MIN_STEPS_TO_DROP_ROWS = 8


@torch.no_grad()
def sample_groups(
    model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    generation_config,
    eos_token_ids: Sequence[int],
    images=None,
    blocked_token_ids: Sequence[int] = (),
    logps: torch.Tensor | None = None,
    routes: StepRoutes | None = None,
) -> torch.Tensor:
    """Sample one completion per row, the prompt of each run of identical rows prefilled once.

    The same computation as `model.generate` with `do_sample=True` (HF's `_sample` loop): the logits at each step go
    through the spec's processors (`sampling_spec.SamplingSpec`), softmax, one draw per row; a row that has produced an
    EOS is padded with `pad_token_id`; the loop stops when every row has finished or after `max_new_tokens` steps.
    What differs is how: the U distinct prompts [U, P] are prefilled once and their KV cache repeated to the N rows,
    the cache is preallocated (`_PreallocatedLayer`) instead of grown by concatenation each step, finished rows leave
    the decoding batch (when enough steps remain to pay for copying the cache), and the draw is `sample_categorical`,
    with one uniform number per row and step whether or not the row is still in the batch.
    A VLM's rows' image inputs (`images`) go to the prefill; `blocked_token_ids` (image tokens) are never drawn.
    `logps` [N, max_new_tokens] float32 (None: nothing recorded) gets each token's log-prob under the distribution it
    was drawn from, at its row and column (`_draw`); `routes` (`routes.StepRoutes` [N, P + T]) each forward's MoE
    routes, at the columns it fed of the batch's rows. Eval mode. Returns `completion_ids` [N, T <= max_new_tokens].
    """
    (N, P), T, device = prompt_ids.shape, generation_config.max_new_tokens, prompt_ids.device
    cache = _preallocated_cache(model.config, P + T)
    logits, next_position = _prefill(model, prompt_ids, prompt_mask, cache, images, routes)  # [N, V], [N, 1]
    eos = torch.tensor(list(eos_token_ids), device=device)
    pad = generation_config.pad_token_id
    sequences = torch.cat([prompt_ids, prompt_ids.new_full((N, T), pad)], dim=1)  # [N, P + T]
    attention_mask = torch.cat([prompt_mask, prompt_mask.new_ones((N, T))], dim=1)  # [N, P + T]
    # The decoding batch: rows that have not produced an EOS yet (finished rows keep the pad they start with).
    rows = torch.arange(N, device=device)  # [A] row of `sequences` of each batch row
    finished = torch.zeros(N, dtype=torch.bool, device=device)  # [A]
    generation_config = resolve_sampling_settings(model, generation_config)
    spec = SamplingSpec.of(model, generation_config, blocked_token_ids=blocked_token_ids)  # blocked: never drawn
    processors = spec.processors(prompt_mask)
    keyword = cache_keyword(model)  # looked up once, not per token
    uniform_dtype = torch.float32 if device.type == "mps" else torch.float64
    for t in range(T):
        scores = processors(sequences[rows, : P + t], logits)  # [A, V]
        # One uniform per original row and step, whichever rows are still in the batch.
        uniform = torch.rand((N, 1), dtype=uniform_dtype, device=device)[rows]  # [A, 1]
        tokens = _draw(scores, uniform, finished, pad, logps, rows, t)  # [A]
        sequences[rows, P + t] = tokens
        finished |= torch.isin(tokens, eos)
        if t == T - 1 or bool(finished.all()):
            break
        if T - 1 - t >= _MIN_STEPS_TO_DROP_ROWS and bool(finished.any()):
            keep = torch.nonzero(~finished).flatten()  # [A']
            select_rows(cache, keep)
            rows, tokens, finished = rows[keep], tokens[keep], finished[keep]
            processors = spec.processors(prompt_mask[rows])
        logits = _next_logits(
            model, tokens, attention_mask[rows, : P + t + 1], next_position[rows] + t, cache, keyword
        )
        if routes is not None:
            routes.step(rows, P + t)
    return sequences[:, P : P + t + 1]  # [N, T]


def _draw(scores, uniform, finished, pad: int, logps, rows, t: int) -> torch.Tensor:
    """The batch's tokens [A] drawn from processed scores [A, V] with `uniform` [A, 1], pad where `finished` [A]; with
    `logps` [N, T], each token's log-prob under the distribution it was drawn from (the scores' log-softmax) goes to
    `logps[rows, t]` (a finished row's: the pad's, for the caller to mask)."""
    tokens = sample_categorical(torch.softmax(scores, dim=-1), uniform).masked_fill(finished, pad)  # [A]
    if logps is not None:
        logps[rows, t] = torch.log_softmax(scores, dim=-1).gather(1, tokens[:, None]).squeeze(1)
    return tokens


def _prefill(model, prompt_ids, prompt_mask, cache, images, routes=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each distinct prompt prefilled once into `cache`, its rows repeated to the N rows: fp32 logits [N, V] and the
    position of each row's first completion token [N, 1] (M-RoPE models: shifted by the span of its images). The
    prefill's MoE routes go to every row of its prompt (`routes`, if any)."""
    logits, prompt_of_row = prefill_distinct_prompts(model, prompt_ids, prompt_mask, cache, images)  # [U, V], [N]
    if routes is not None:
        routes.prefill(logits.size(0), prompt_of_row)
    logits = logits.float()
    next_position = prompt_mask.long().sum(-1, keepdim=True)  # [N, 1]
    offsets = position_offsets(model) if has_images(images) else None  # [U, 1]
    if offsets is not None:
        next_position = next_position + offsets.to(next_position.device)[prompt_of_row]
    if logits.size(0) < prompt_ids.size(0):
        select_rows(cache, prompt_of_row)
        logits = logits[prompt_of_row]  # [N, V]
    return logits, next_position


def _next_logits(model, tokens, attention_mask, positions, cache, keyword: str) -> torch.Tensor:
    """fp32 logits [A, V] after one more token per row (`tokens` [A] at `positions` [A, 1]), the cache (passed as
    `keyword`, `cache_keyword`) extended."""
    return _forward_last(model, tokens[:, None], attention_mask, positions, cache, keyword)


# ---- tool episodes: turns that join the decoding batch at the next token step ---------------------------------------
@dataclass
class _Decoding:
    """The rows being decoded, each a turn of an episode, in one KV cache: each row's context right-aligned (left
    padding masked), so a row that joins later takes the columns up to the current end."""

    keys: list  # [A] the source's key of each row
    tokens: torch.Tensor  # [A, C] long: each row's context and sampled tokens, left-padded
    mask: torch.Tensor  # [A, C] long: 1 on real tokens
    budgets: torch.Tensor  # [A] long: the most tokens each row may sample in this turn
    sampled: torch.Tensor  # [A] long: tokens sampled so far in this turn
    turns: list[list[int]]  # [A] this turn's tokens so far
    logps: list[list[float]]  # [A] their log-probs under the sampling distribution
    logits: torch.Tensor  # [A, V] fp32: the next token's
    # [A, C, L, k] the MoE routes of each column's token (`rollout.routes`, -1: none), when recording; else None
    routes: torch.Tensor | None = None


class _TurnRoutes:
    """The MoE routes of `decode_turns`' forwards, under `routers.recording` (`recorder`): each forward's, popped
    right after it, and the shared prefix's (`prefix` [n, L, k]), which the rows on it did not prefill."""

    def __init__(self, recorder):
        self.recorder, self.prefix = recorder, None

    def of(self, rows: int, mask: torch.Tensor) -> torch.Tensor:
        """The last forward's routes [rows, s, L, k] (`ROUTE_DTYPE`), -1 where `mask` [rows, s] is 0."""
        return masked(self.recorder.pop(rows).to(ROUTE_DTYPE), mask != 0)


@torch.no_grad()
def decode_turns(
    model,
    source,
    generation_config,
    eos_token_ids: Sequence[int],
    blocked_token_ids: Sequence[int] = (),
    episode_cache: EpisodeCache | None = None,
    recorder=None,
) -> None:
    """Sample turns as `source` hands them out, each row joining the decoding batch at the next token step.

    `source.poll(block)` gives the rows ready to sample a turn, as `(key, context ids, max new tokens)`; with
    `block=True` (nothing left to decode) it waits until some are, and `[]` then means there are no more.
    `source.turn_done(key, turn, logps)` gets each row's turn as soon as it ends (an EOS, or its budget), with
    the log-probs of its tokens under the sampling distribution, and returns whether the episode comes back for another
    turn (a source that returns None is taken to); the row leaves the batch. The draw at each step is the `loop`
    engine's (the same processors as `model.generate`; `do_sample=False`: the most likely token), the repetition
    penalty reading a row's own tokens and never its left padding, on every transformers version (before 5.23,
    `generate` also penalises the pad token of a padded row: `sampling.GENERATE_SKIPS_PADDING`, which would make a
    row's tokens depend on the rows beside it and on when it joined); `blocked_token_ids`
    (a VLM's image tokens) are never drawn. A source with a `draws(keys)` method gives the joining rows' random streams
    (`sampling.RowDraws`), and each row draws its uniforms from its own stream, so its tokens do not depend on which
    rows share the batch or when it joined; without one, each step draws from the global generator.

    Without `episode_cache`, a joining row's whole context is prefilled, right-aligned to the batch's width. With one
    (`episode_cache.EpisodeCache`), a row whose turn ends keeps its state until it rejoins (dropped when a source with
    an `ended()` method names its episode as one that will not come back), the batch's shared prefix is prefilled
    once, identical contexts once, and a joining row feeds only what follows its base, with the rows of like rests
    (`_buckets`: padding within `PADDING_SLACK`, and none between a base and its rest unless every layer is full
    attention). The batch keeps only the columns its rows attend to: when rows leave, the leading columns that are
    padding in every remaining row are dropped, from the cache too. Every layer kind the `loop` engine serves
    (`cache_layers.JOINABLE`: full, sliding-window and linear attention, convolution, Mamba, hybrid, KV-shared) is
    cut, stacked, padded and joined by row in `cache_layers`; a cache with another kind takes no rows while some are
    decoding and keeps nothing between turns (one log line says which). Call it in eval mode.

    `recorder` (`routers.recording`'s; None: nothing recorded): each turn also gives `source.turn_done` the MoE routes
    of its context and turn (`routes=` [c, L, k], -1 on the turn's last token and on the tokens it did not feed: a base
    of the episode's own, prefilled by an earlier turn; a shared prefix's are given).
    """
    routes = _TurnRoutes(recorder) if recorder is not None else None
    try:
        _decode(model, source, generation_config, eos_token_ids, blocked_token_ids, episode_cache, routes)
    finally:
        if episode_cache is not None:
            episode_cache.clear()


def _decode(model, source, generation_config, eos_token_ids, blocked_token_ids, episode_cache, log=None) -> None:
    """`decode_turns`' loop: join the ready rows, draw a token per row, let the finished turns go, run a step."""
    config = resolve_sampling_settings(model, generation_config)
    device = next(model.parameters()).device
    joins = _joins_mid_decode(model.config)
    step = _Step(config, device, eos_token_ids, blocked_token_ids)
    store = episode_cache
    keeps = store if joins else None  # where rows keep their states between turns (None: they keep nothing)
    keyword, cache, rows = cache_keyword(model), None, None
    streams_of = getattr(source, "draws", None)  # keys -> the rows' own random streams (RowDraws); None: global
    ended = getattr(source, "ended", None)  # -> keys of episodes that will not come back (their entries go)
    while True:
        ready = source.poll(block=rows is None) if rows is None or joins else []
        if keeps is not None and ended is not None:
            for key in ended():
                keeps.drop(key)
        if ready:
            pad = config.pad_token_id
            cache, rows, order = _join(model, cache, rows, ready, pad, keyword, device, store, joins, log)
            if streams_of is not None:
                joined = streams_of(order).to(device)
                step.draws = joined if step.draws is None else step.draws.cat(joined)
        if rows is None:
            return
        tokens, token_logps = step.sample(rows)  # [A], [A]
        positions = rows.mask.sum(dim=1, keepdim=True)  # [A, 1] the new token's position
        finished = _append_tokens(rows, tokens, token_logps, step.eos, source, cache, keeps)  # [A]
        if bool(finished.all()):
            cache, rows, step.draws = None, None, None
            continue
        if bool(finished.any()):
            keep = torch.nonzero(~finished).flatten()  # [A']
            rows, tokens, positions = _take(rows, keep), tokens[keep], positions[keep]
            step.draws = step.draws.take(keep) if step.draws is not None else None
            select_rows(cache, keep)
            if joins:
                _drop_padding_columns(rows, cache)
        rows.logits = _next_logits(model, tokens, rows.mask, positions, cache, keyword)
        if log is not None:  # the token fed now is the last column's
            rows.routes[:, -1] = log.of(tokens.size(0), torch.ones_like(tokens)[:, None])[:, 0]


class _Step:
    """One token step of `decode_turns`: the processors, the draw (each row's stream, or the global generator; the
    argmax when not sampling) and each token's log-prob under the distribution it was drawn from."""

    def __init__(self, config, device, eos_token_ids: Sequence[int], blocked_token_ids: Sequence[int]):
        self.config, self.device = config, device
        self.eos = torch.tensor(list(eos_token_ids), device=device)
        # blocked tokens (a VLM's image tokens) are never drawn; the penalty skips the padding on every transformers
        # version: a row's tokens do not depend on its batch
        self.spec = SamplingSpec.from_config(config, skip_padding=True, blocked_token_ids=blocked_token_ids)
        self.uniform_dtype = torch.float32 if device.type == "mps" else torch.float64
        self.draws = None  # RowDraws of the batch's rows, in order

    def sample(self, rows: _Decoding) -> tuple[torch.Tensor, torch.Tensor]:
        logits = rows.logits
        sampling = bool(self.config.do_sample)
        processors = self.spec.processors(rows.mask, sampling=sampling, new_tokens=rows.sampled)
        scores = processors(rows.tokens, logits)  # [A, V]
        if not sampling:
            tokens = scores.argmax(dim=-1)  # [A]
        else:
            if self.draws is not None:
                uniform = self.draws.uniform(self.uniform_dtype)  # [A, 1]
            else:
                uniform = torch.rand((scores.size(0), 1), dtype=self.uniform_dtype, device=self.device)  # [A, 1]
            tokens = sample_categorical(torch.softmax(scores, dim=-1), uniform)  # [A]
        return tokens, torch.log_softmax(scores, dim=-1).gather(1, tokens[:, None]).squeeze(1)


def _append_tokens(rows: _Decoding, tokens, token_logps, eos, source, cache, store) -> torch.Tensor:
    """Append each row's new token [A] and its log-prob [A] to the batch's rows; each turn that ends (an EOS, or its
    budget) goes to `source.turn_done`, and with an episode cache (`store`) the row's keys and values are kept for
    its next turn (unless the source says the episode is over). Returns which rows ended [A] bool."""
    rows.tokens = torch.cat([rows.tokens, tokens[:, None]], dim=1)
    rows.mask = torch.cat([rows.mask, torch.ones_like(tokens)[:, None]], dim=1)
    if rows.routes is not None:  # the new token's column: routed once it is fed (never, for a turn's last)
        rows.routes = torch.cat([rows.routes, no_routes(rows.routes.size(0), 1, rows.routes)], dim=1)
    rows.sampled += 1
    finished = torch.isin(tokens, eos) | (rows.sampled >= rows.budgets)  # [A]
    for turn, logps, token, logp in zip(rows.turns, rows.logps, tokens.tolist(), token_logps.tolist(), strict=True):
        turn.append(token)
        logps.append(logp)
    for row, (key, turn, logps, is_done) in enumerate(
        zip(rows.keys, rows.turns, rows.logps, finished.tolist(), strict=True)
    ):
        extra = {} if rows.routes is None or not is_done else {"routes": rows.routes[row][rows.mask[row] != 0]}
        if is_done and source.turn_done(key, turn, logps, **extra) is not False and store is not None:
            store.keep(key, row_entry(cache, rows.tokens, rows.mask, row, rows.tokens.size(1) - 1))
    return finished


def _joins_mid_decode(config) -> bool:
    """Whether rows can join `config`'s cache mid-decode and keep their states between turns: every layer is of a kind
    `cache_layers` cuts, stacks, pads and joins by row (`cache_layers.JOINABLE`, checked at import: full,
    sliding-window and linear attention, convolution, Mamba, hybrid, KV-shared). Else one log line (once a kind) says
    which layers keep nothing, and each turn prefills its whole context."""
    outside = layers_outside(config, JOINABLE, why=JOIN_PROBLEMS)
    if outside is not None and outside not in _LOGGED:
        _LOGGED.add(outside)
        logger.warning(
            "decode_turns: no row joins the batch mid-decode or keeps its cache between turns on this model, whose "
            "cache holds %s (not in cache_layers.JOINABLE): every turn prefills its whole context",
            outside,
        )
    return outside is None


_LOGGED: set[str] = set()  # what `_joins_mid_decode` has logged


def _join(model, cache, rows: _Decoding | None, ready, pad: int, keyword: str, device, store=None, joins=True,
          log=None):  # fmt: skip
    """Prefill the turns of `ready` and add them to the batch (`rows` and its `cache`; None: a new batch): with an
    episode cache (`store`) on a model whose rows can keep their states (`joins`), each on its base, in buckets of
    rows of like rests (`_prefill_on_bases`), else each whole context, right-aligned to the batch's width
    (`_prefill_contexts`, counted in `store` if any). The narrower of the batch and the joining rows is padded on the
    left. Returns the batch's cache and rows, and the keys of the joined rows in the order they were added. `log`
    (`_TurnRoutes`, if recording) gives the joined rows' routes."""
    if store is not None and joins:
        parts = _prefill_on_bases(model, ready, store, keyword, device, log)
    else:
        keys, contexts, _ = zip(*ready, strict=True)
        width = max(max(len(ids) for ids in contexts), 0 if rows is None else rows.tokens.size(1))
        parts = [(list(keys), *_prefill_contexts(model, contexts, width, pad, keyword, device, log))]
        if store is not None:
            store.count_prefill(sum(map(len, contexts)), len(contexts) * width)
    budget_of = {key: budget for key, _, budget in ready}
    order = []
    for keys, fresh, ids, mask, logits, routes in parts:
        new = _Decoding(
            keys=keys,
            tokens=ids,
            mask=mask,
            budgets=torch.tensor([budget_of[key] for key in keys], device=device),
            sampled=torch.zeros(len(keys), dtype=torch.long, device=device),
            turns=[[] for _ in keys],
            logps=[[] for _ in keys],
            logits=logits,
            routes=routes,
        )
        cache, rows = _merge(cache, rows, fresh, new, pad)
        order += keys
    return cache, rows, order


def _merge(cache, rows: _Decoding | None, fresh, new: _Decoding, pad: int):
    """The batch (`cache`, `rows`; None: none yet) with the rows `new` (of cache `fresh`) appended, the narrower of
    the two padded on the left."""
    if rows is None:
        return fresh, new
    _pad_left(rows, cache, new.tokens.size(1), pad)
    _pad_left(new, fresh, rows.tokens.size(1), pad)
    for layer, joined in zip(cache.layers, fresh.layers, strict=True):
        cat_rows(layer, joined)
    merged = _Decoding(
        keys=rows.keys + new.keys,
        tokens=torch.cat([rows.tokens, new.tokens]),
        mask=torch.cat([rows.mask, new.mask]),
        budgets=torch.cat([rows.budgets, new.budgets]),
        sampled=torch.cat([rows.sampled, new.sampled]),
        turns=rows.turns + new.turns,
        logps=rows.logps + new.logps,
        logits=torch.cat([rows.logits, new.logits]),
        routes=None if rows.routes is None else torch.cat([rows.routes, new.routes]),
    )
    return cache, merged


def _pad_left(rows: _Decoding, cache, width: int, pad: int) -> None:
    """Pad the rows' tokens, mask and cache on the left to `width` columns (masked), in place, if narrower."""
    missing = width - rows.tokens.size(1)
    if missing <= 0:
        return
    rows.tokens = nn.functional.pad(rows.tokens, (missing, 0), value=pad)
    rows.mask = nn.functional.pad(rows.mask, (missing, 0))
    if rows.routes is not None:
        rows.routes = torch.cat([no_routes(rows.routes.size(0), missing, rows.routes), rows.routes], dim=1)
    for layer in cache.layers:
        pad_columns(layer, missing)


def _prefill_contexts(model, contexts, width: int, pad: int, keyword: str, device, log=None):
    """Each of `contexts` prefilled whole, right-aligned to `width` columns: (cache, ids [k, width], mask [k, width],
    fp32 logits of the next token [k, V], routes [k, width, L, k] or None without `log`)."""
    ids = torch.full((len(contexts), width), pad, dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for i, context in enumerate(contexts):
        ids[i, width - len(context) :] = torch.tensor(context, dtype=torch.long, device=device)
        mask[i, width - len(context) :] = 1
    fresh = DynamicCache(config=model.config)
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)  # [k, width] as `generate` numbers them
    logits = _forward_last(model, ids, mask, positions, fresh, keyword)
    return fresh, ids, mask, logits, (log.of(len(contexts), mask) if log is not None else None)


def _forward_last(model, ids, attention_mask, positions, cache, keyword: str) -> torch.Tensor:
    """fp32 logits [k, V] of the next token after `ids` [k, s] (on top of `cache`, extended in place)."""
    output = model(
        input_ids=ids,
        attention_mask=attention_mask,
        position_ids=positions,
        use_cache=True,
        logits_to_keep=1,
        **{keyword: cache},
    )
    return output.logits[:, -1].float()


# Rows whose rests differ share a prefill while its positions (padding included) stay within this factor of its tokens.
PADDING_SLACK = 1.2


def _prefill_on_bases(model, ready, store: EpisodeCache, keyword: str, device, log=None) -> list[tuple]:
    """The joining rows `ready` prefilled on their bases (`EpisodeCache.base`: the episode's kept states, the shared
    prefix, or nothing), in buckets of rows whose rests are alike (`_buckets`), each distinct (base, rest) once: per
    bucket (keys, cache, ids [k, W], mask [k, W], fp32 logits [k, V], routes [k, W, L, k] or None without `log`)."""
    keys, contexts, _ = zip(*ready, strict=True)
    _set_shared_prefix(model, contexts, store, keyword, device, log)  # once a run (`shared_prefix_length`)
    bases = [store.base(key, context) for key, context in zip(keys, contexts, strict=True)]
    store.stats["reused_tokens"] += sum(len(b.tokens) for b in bases if b is not None)
    rests = [len(c) - (len(b.tokens) if b is not None else 0) for b, c in zip(bases, contexts, strict=True)]
    gaps = _gaps_allowed(model.config)
    paddable = [gaps or b is None for b in bases]
    return [
        _prefill_bucket(model, [keys[i] for i in bucket], [bases[i] for i in bucket], [contexts[i] for i in bucket],
                        store, keyword, device, log)
        for bucket in _buckets(rests, paddable)
    ]  # fmt: skip


def _gaps_allowed(config) -> bool:
    """Whether a row may have masked columns between its base and its rest: with full attention only (keys are per
    position, and the positions are passed). A sliding window counts columns, and a linear-attention state would fold
    the gap in after its base."""
    classes = cache_layer_classes(config)
    return classes is not None and all(cls is DynamicLayer for cls in classes)


def _buckets(rests: list[int], paddable: list[bool]) -> list[list[int]]:
    """The rows (indices of `rests`, each row's tokens to prefill) in buckets that share a prefill, longest first: a
    row joins a bucket of longer rests only if it is `paddable` and the bucket's positions (rows x its longest rest)
    stay within `PADDING_SLACK` x its tokens; rows of equal rests always share one."""
    left, buckets = sorted(range(len(rests)), key=lambda i: -rests[i]), []
    while left:
        longest, bucket, tokens, rest = rests[left[0]], [left[0]], rests[left[0]], []
        for i in left[1:]:
            padded = (len(bucket) + 1) * longest <= PADDING_SLACK * (tokens + rests[i])
            if rests[i] == longest or (paddable[i] and padded):
                bucket.append(i)
                tokens += rests[i]
            else:
                rest.append(i)
        buckets.append(sorted(bucket))
        left = rest
    return buckets


def _prefill_bucket(model, keys, bases, contexts, store: EpisodeCache, keyword: str, device, log=None) -> tuple:
    """One bucket of `_prefill_on_bases`: (keys, cache, ids [k, W], mask [k, W], fp32 logits [k, V], routes or None:
    `_bucket_routes`). Row u's
    W = Wb + S columns are its base right-aligned in the first Wb (the widest base), then the rest right-aligned in the
    last S (the longest rest); a gap between is masked, and filled with the row's first token so that the repetition
    penalty, which reads every token after the left padding, sees the tokens it would."""
    signature = [(id(b), tuple(c[len(b.tokens) if b else 0 :])) for b, c in zip(bases, contexts, strict=True)]
    first = {s: i for i, s in reversed(list(enumerate(signature)))}  # each distinct row's first occurrence
    distinct = sorted(first.values())
    index = torch.tensor([distinct.index(first[s]) for s in signature], device=device)  # [k] its distinct row
    fresh, ids, mask, positions = _on_bases(
        [bases[i] for i in distinct], [contexts[i] for i in distinct], model, device
    )
    rest = positions.size(1)
    store.count_prefill(int(mask[:, -rest:].sum()), mask.size(0) * rest)
    logits = _forward_last(model, ids[:, -rest:], mask, positions, fresh, keyword)  # [U, V]
    routes = _bucket_routes(log, [bases[i] for i in distinct], store, mask, rest) if log is not None else None
    if len(distinct) < len(keys):
        select_rows(fresh, index)
        ids, mask, logits = ids[index], mask[index], logits[index]
        routes = routes[index] if routes is not None else None
    return list(keys), fresh, ids, mask, logits, routes


def _bucket_routes(log: _TurnRoutes, bases: list, store: EpisodeCache, mask: torch.Tensor, rest: int) -> torch.Tensor:
    """[U, W, L, k] the routes of a bucket's rows (`mask` [U, W]) after its forward of their last `rest` columns:
    those, and a base's when it is the shared prefix (its forward's, `log.prefix`); -1 on an episode's own base
    (read and recorded by an earlier turn)."""
    fed = log.of(mask.size(0), mask[:, -rest:])  # [U, S, L, k]
    routes = torch.cat([no_routes(mask.size(0), mask.size(1) - rest, fed), fed], dim=1)
    width = mask.size(1) - rest
    for u, base in enumerate(bases):
        if base is not None and base is store.prefix and log.prefix is not None:
            routes[u, width - len(base.tokens) : width] = log.prefix[: len(base.tokens)]
    return routes


def _on_bases(bases: list, contexts: list, model, device):
    """The batch of `_prefill_bucket` before its forward: a cache of the bases' states (`cache_layers.stack_rows`:
    zeros where a row's base is shorter), each row's tokens [U, W] and mask [U, W], and the positions of the rest
    [U, S]."""
    lengths = [len(b.tokens) if b is not None else 0 for b in bases]
    width, rest = max(lengths), max(len(c) - n for c, n in zip(contexts, lengths, strict=True))
    ids = torch.empty((len(contexts), width + rest), dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for u, (context, n) in enumerate(zip(contexts, lengths, strict=True)):
        ids[u] = context[0]
        ids[u, width - n : width] = torch.tensor(context[:n], dtype=torch.long, device=device)
        ids[u, width + rest - (len(context) - n) :] = torch.tensor(context[n:], dtype=torch.long, device=device)
        mask[u, width - n : width] = 1
        mask[u, width + rest - (len(context) - n) :] = 1
    lengths_t = torch.tensor(lengths, device=device)[:, None]  # [U, 1]
    positions = (lengths_t + mask[:, width:].cumsum(-1) - 1).masked_fill(mask[:, width:] == 0, 1)  # [U, S]
    cache = DynamicCache(config=model.config)
    if width:
        for li, layer in enumerate(cache.layers):
            stack_rows(layer, [b.layers[li] if b is not None else None for b in bases], width)
    return cache, ids, mask, positions


def _set_shared_prefix(model, contexts, store: EpisodeCache, keyword: str, device, log=None) -> None:
    """Prefill the longest prefix of `contexts` (`EpisodeCache.shared_prefix_length`) once, as the store's prefix."""
    length = store.shared_prefix_length(contexts)
    if not length:
        return
    ids = torch.tensor([list(contexts[0][:length])], dtype=torch.long, device=device)  # [1, L]
    cache = DynamicCache(config=model.config)
    model(input_ids=ids, use_cache=True, logits_to_keep=1, **{keyword: cache})
    if log is not None:
        log.prefix = log.of(1, torch.ones_like(ids))[0]  # [L, L', k]
    store.count_prefill(length, length)
    store.set_prefix(cache_entry(cache, ids))


def _drop_padding_columns(rows: _Decoding, cache) -> None:
    """Drop the batch's leading columns that are padding in every row, from its tokens, mask and cache, in place:
    rows are right-aligned, so what is left is as wide as the longest row's context, and no row's attention changes
    (the dropped columns were masked for all). The cache holds every column but the last (the next input token)."""
    first = int(rows.mask.any(dim=0).int().argmax())  # the first column some row attends to
    if first == 0:
        return
    rows.tokens, rows.mask = rows.tokens[:, first:], rows.mask[:, first:]
    rows.routes = rows.routes[:, first:] if rows.routes is not None else None
    for layer in cache.layers:
        drop_columns(layer, first)


def _take(rows: _Decoding, keep: torch.Tensor) -> _Decoding:
    """Rows `keep` of the batch (the others' turns have ended)."""
    index = keep.tolist()
    return _Decoding(
        keys=[rows.keys[i] for i in index],
        tokens=rows.tokens[keep],
        mask=rows.mask[keep],
        budgets=rows.budgets[keep],
        sampled=rows.sampled[keep],
        turns=[rows.turns[i] for i in index],
        logps=[rows.logps[i] for i in index],
        logits=rows.logits[keep],
        routes=rows.routes[keep] if rows.routes is not None else None,
    )
