"""The `loop` engine: grpo_hf's decoding loop for CPUs (and any device), exact to `model.generate`.

Each distinct prompt is prefilled once and its cache copied to the G rows of its group, for every kind of cache
layer transformers builds (`cache_layers.REPEATABLE`: full attention, sliding-window and chunked attention, Gated
DeltaNet, convolution and Mamba states); full-attention layers' keys and values live in preallocated tensors instead
of growing by concatenation, the other layers are transformers' own; finished rows leave the decoding batch
(`cache_layers.select_rows`) when enough steps remain to pay for it; a token costs one uniform draw per row (inverse
transform sampling) instead of `torch.multinomial`'s one exponential per vocabulary entry. The logits
go through the same `transformers` processors, in the same order, as in `model.generate`, so the
sampled distribution is the configured one. On a GPU it is bound by kernel launches: use `cuda_graph`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from grpo_hf.cache_layers import REPEATABLE, cache_layer_classes, select_rows
from grpo_hf.rollout.engine import RolloutEngine
from grpo_hf.rollout.sampling import (
    cache_keyword,
    logits_processors,
    prefill_distinct_prompts,
    resolve_sampling_settings,
    sample_categorical,
    unsupported_reason,
)
from grpo_hf.vision import has_images, position_offsets


class LoopEngine(RolloutEngine):
    """`sample_groups` behind the engine interface."""

    name = "loop"
    takes_images = True
    can_record_logps = True

    @classmethod
    def unsupported_reason(cls, model, generation_config) -> str | None:
        return unsupported_reason(model, generation_config, layers=REPEATABLE)

    def sample(self, model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, images=None) -> torch.Tensor:
        logps = None
        if self.record_logps:
            shape = (prompt_ids.size(0), self.generation_config.max_new_tokens)
            logps = torch.zeros(shape, dtype=torch.float32, device=prompt_ids.device)  # [N, max_new_tokens]
        completion_ids = sample_groups(
            model,
            prompt_ids,
            prompt_mask,
            self.generation_config,
            self.eos_token_ids,
            images=images,
            blocked_token_ids=self.blocked_token_ids,
            logps=logps,
        )  # [N, T]
        if logps is not None:
            self.sampling_logps = logps[:, : completion_ids.size(1)]
        return completion_ids

    def decode_turns(self, model, source) -> None:
        """Tool episodes' turns, each joining the batch at the next token step (`decode_turns`), in eval mode."""
        was_training = model.training
        model.eval()
        try:
            decode_turns(
                model, source, self.generation_config, self.eos_token_ids, blocked_token_ids=self.blocked_token_ids
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
) -> torch.Tensor:
    """Sample one completion per row, the prompt of each run of identical rows prefilled once.

    The same computation as `model.generate` with `do_sample=True` (HF's `_sample` loop): the
    logits at each step go through `logits_processors`, softmax, one draw per row; a row that has
    produced an EOS is padded with `pad_token_id`; the loop stops when every row has finished or after
    `max_new_tokens` steps. What differs is how: the U distinct prompts [U, P] are prefilled once and
    their KV cache repeated to the N rows, the cache is preallocated (`_PreallocatedLayer`) instead of
    grown by concatenation each step, finished rows leave the decoding batch
    (when enough steps remain to pay for copying the cache), and the draw is `sample_categorical`,
    with one uniform number per row and step whether or not the row is still in the batch.
    A VLM's rows' image inputs (`images`) go to the prefill; `blocked_token_ids` (image tokens) are never drawn.
    `logps` [N, max_new_tokens] float32 (None: nothing recorded) gets each token's log-prob under the distribution it
    was drawn from, at its row and column (`_draw`).
    Call it in eval mode. Returns `completion_ids [N, T]` with T <= max_new_tokens.
    """
    (N, P), T, device = prompt_ids.shape, generation_config.max_new_tokens, prompt_ids.device
    cache = _preallocated_cache(model.config, P + T)
    logits, next_position = _prefill(model, prompt_ids, prompt_mask, cache, images)  # [N, V], [N, 1]
    eos = torch.tensor(list(eos_token_ids), device=device)
    pad = generation_config.pad_token_id
    sequences = torch.cat([prompt_ids, prompt_ids.new_full((N, T), pad)], dim=1)  # [N, P + T]
    attention_mask = torch.cat([prompt_mask, prompt_mask.new_ones((N, T))], dim=1)  # [N, P + T]
    # The decoding batch: rows that have not produced an EOS yet (finished rows keep the pad they start with).
    rows = torch.arange(N, device=device)  # [A] row of `sequences` of each batch row
    finished = torch.zeros(N, dtype=torch.bool, device=device)  # [A]
    generation_config = resolve_sampling_settings(model, generation_config)
    processors = logits_processors(generation_config, prompt_mask)
    blocked = torch.tensor(list(blocked_token_ids), dtype=torch.long, device=device)  # [K]
    keyword = cache_keyword(model)  # looked up once, not per token
    uniform_dtype = torch.float32 if device.type == "mps" else torch.float64
    for t in range(T):
        if blocked.numel():
            logits = logits.index_fill(1, blocked, float("-inf"))
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
            processors = logits_processors(generation_config, prompt_mask[rows])
        logits = _next_logits(
            model, tokens, attention_mask[rows, : P + t + 1], next_position[rows] + t, cache, keyword
        )
    return sequences[:, P : P + t + 1]  # [N, T]


def _draw(scores, uniform, finished, pad: int, logps, rows, t: int) -> torch.Tensor:
    """The batch's tokens [A] drawn from processed scores [A, V] with `uniform` [A, 1], pad where `finished` [A]; with
    `logps` [N, T], each token's log-prob under the distribution it was drawn from (the scores' log-softmax) goes to
    `logps[rows, t]` (a finished row's: the pad's, for the caller to mask)."""
    tokens = sample_categorical(torch.softmax(scores, dim=-1), uniform).masked_fill(finished, pad)  # [A]
    if logps is not None:
        logps[rows, t] = torch.log_softmax(scores, dim=-1).gather(1, tokens[:, None]).squeeze(1)
    return tokens


def _prefill(model, prompt_ids, prompt_mask, cache, images) -> tuple[torch.Tensor, torch.Tensor]:
    """Each distinct prompt prefilled once into `cache`, its rows repeated to the N rows: fp32 logits [N, V] and the
    position of each row's first completion token [N, 1] (M-RoPE models: shifted by the span of its images)."""
    logits, prompt_of_row = prefill_distinct_prompts(model, prompt_ids, prompt_mask, cache, images)  # [U, V], [N]
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
    output = model(
        input_ids=tokens[:, None],
        attention_mask=attention_mask,
        position_ids=positions,
        use_cache=True,
        logits_to_keep=1,
        **{keyword: cache},
    )
    return output.logits[:, -1].float()


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


@torch.no_grad()
def decode_turns(
    model, source, generation_config, eos_token_ids: Sequence[int], blocked_token_ids: Sequence[int] = ()
) -> None:
    """Sample turns as `source` hands them out, each row joining the decoding batch at the next token step.

    `source.poll(block)` gives the rows ready to sample a turn, as `(key, context ids, max new tokens)`; with
    `block=True` (nothing left to decode) it waits until some are, and `[]` then means there are no more.
    `source.turn_done(key, turn, logps)` gets each row's turn as soon as it ends (an EOS, or its budget), with
    the log-probs of its tokens under the sampling distribution; the row leaves the batch. The draw at each step is
    the `loop` engine's (the same processors as `model.generate`); a joining row's context is prefilled once;
    `blocked_token_ids` (a VLM's image tokens) are never drawn. A source with a `draws(keys)` method gives the joining
    rows' random streams (`sampling.RowDraws`), and each row draws its uniforms from its own stream, so its tokens do
    not depend on which rows share the batch or when it joined; without one, each step draws from the global
    generator. The batch keeps only the columns its rows attend to: when rows leave, the leading columns that are
    padding in every remaining row are dropped, from the cache too, so its width stays the longest live context. A
    cache with layers other than full attention (sliding windows, linear-attention states: `_joins_mid_decode`) takes
    no rows while some are decoding: ready rows wait for the batch to finish, then start the next. Call it in eval
    mode.
    """
    config = resolve_sampling_settings(model, generation_config)
    device = next(model.parameters()).device
    eos = torch.tensor(list(eos_token_ids), device=device)
    keyword, cache, rows = cache_keyword(model), None, None
    joins = _joins_mid_decode(model.config)
    streams_of = getattr(source, "draws", None)  # keys -> the rows' own random streams (RowDraws); None: global
    draws = None  # RowDraws of the batch's rows, in order
    uniform_dtype = torch.float32 if device.type == "mps" else torch.float64
    blocked = torch.tensor(list(blocked_token_ids), dtype=torch.long, device=device)  # [K]
    while True:
        ready = source.poll(block=rows is None) if rows is None or joins else []
        if ready:
            cache, rows = _join(model, cache, rows, ready, config.pad_token_id, keyword, device)
            if streams_of is not None:
                joined = streams_of([turn[0] for turn in ready]).to(device)
                draws = joined if draws is None else draws.cat(joined)
        if rows is None:
            return
        logits = rows.logits.index_fill(1, blocked, float("-inf")) if blocked.numel() else rows.logits  # [A, V]
        scores = logits_processors(config, rows.mask)(rows.tokens, logits)  # [A, V]
        probs = torch.softmax(scores, dim=-1)
        if draws is not None:
            uniform = draws.uniform(uniform_dtype)  # [A, 1]
        else:
            uniform = torch.rand((probs.size(0), 1), dtype=uniform_dtype, device=device)  # [A, 1]
        tokens = sample_categorical(probs, uniform)  # [A]
        token_logps = torch.log_softmax(scores, dim=-1).gather(1, tokens[:, None]).squeeze(1)  # [A]
        positions = rows.mask.sum(dim=1, keepdim=True)  # [A, 1] the new token's position
        finished = _append_tokens(rows, tokens, token_logps, eos, source)  # [A]
        if bool(finished.all()):
            cache, rows, draws = None, None, None
            continue
        if bool(finished.any()):
            keep = torch.nonzero(~finished).flatten()  # [A']
            rows, tokens, positions = _take(rows, keep), tokens[keep], positions[keep]
            draws = draws.take(keep) if draws is not None else None
            select_rows(cache, keep)
            if joins:
                _drop_padding_columns(rows, cache)
        rows.logits = _next_logits(model, tokens, rows.mask, positions, cache, keyword)


def _append_tokens(rows: _Decoding, tokens, token_logps, eos, source) -> torch.Tensor:
    """Append each row's new token [A] and its log-prob [A] to the batch's rows; each turn that ends (an EOS, or its
    budget) goes to `source.turn_done`. Returns which rows ended [A] bool."""
    rows.tokens = torch.cat([rows.tokens, tokens[:, None]], dim=1)
    rows.mask = torch.cat([rows.mask, torch.ones_like(tokens)[:, None]], dim=1)
    rows.sampled += 1
    finished = torch.isin(tokens, eos) | (rows.sampled >= rows.budgets)  # [A]
    for turn, logps, token, logp in zip(rows.turns, rows.logps, tokens.tolist(), token_logps.tolist(), strict=True):
        turn.append(token)
        logps.append(logp)
    for key, turn, logps, is_done in zip(rows.keys, rows.turns, rows.logps, finished.tolist(), strict=True):
        if is_done:
            source.turn_done(key, turn, logps)
    return finished


def _joins_mid_decode(config) -> bool:
    """Whether rows can join `config`'s cache mid-decode (`_join`, `_drop_padding_columns`): full attention only,
    whose keys and values pad and cut by column; a sliding window's or a linear-attention state's do not."""
    classes = cache_layer_classes(config)
    return classes is not None and all(cls is DynamicLayer for cls in classes)


def _join(model, cache, rows: _Decoding | None, ready, pad: int, keyword: str, device) -> tuple[Any, _Decoding]:
    """Prefill the contexts of `ready` and add them to the batch: every row right-aligned to the longest context or
    the batch's current length, whichever is longer (the batch's rows and cache padded on the left if needed)."""
    keys, contexts, budgets = zip(*ready, strict=True)
    width = max(max(len(ids) for ids in contexts), 0 if rows is None else rows.tokens.size(1))
    ids = torch.full((len(contexts), width), pad, dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for i, context in enumerate(contexts):
        ids[i, width - len(context) :] = torch.tensor(context, dtype=torch.long, device=device)
        mask[i, width - len(context) :] = 1
    fresh = DynamicCache(config=model.config)
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)  # [k, width] as `generate` numbers them
    logits = (
        model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **{keyword: fresh},
        )
        .logits[:, -1]
        .float()
    )  # [k, V]
    new = _Decoding(
        keys=list(keys),
        tokens=ids,
        mask=mask,
        budgets=torch.tensor(budgets, device=device),
        sampled=torch.zeros(len(keys), dtype=torch.long, device=device),
        turns=[[] for _ in keys],
        logps=[[] for _ in keys],
        logits=logits,
    )
    if rows is None:
        return fresh, new
    missing = width - rows.tokens.size(1)  # the batch's rows, padded on the left to the new width
    rows.tokens = nn.functional.pad(rows.tokens, (missing, 0), value=pad)
    rows.mask = nn.functional.pad(rows.mask, (missing, 0))
    for layer, joined in zip(cache.layers, fresh.layers, strict=True):
        old_keys, old_values = (nn.functional.pad(x, (0, 0, missing, 0)) for x in (layer.keys, layer.values))
        layer.keys, layer.values = torch.cat([old_keys, joined.keys]), torch.cat([old_values, joined.values])
    merged = _Decoding(
        keys=rows.keys + new.keys,
        tokens=torch.cat([rows.tokens, new.tokens]),
        mask=torch.cat([rows.mask, new.mask]),
        budgets=torch.cat([rows.budgets, new.budgets]),
        sampled=torch.cat([rows.sampled, new.sampled]),
        turns=rows.turns + new.turns,
        logps=rows.logps + new.logps,
        logits=torch.cat([rows.logits, new.logits]),
    )
    return cache, merged


def _drop_padding_columns(rows: _Decoding, cache) -> None:
    """Drop the batch's leading columns that are padding in every row, from its tokens, mask and cache, in place:
    rows are right-aligned, so what is left is as wide as the longest row's context, and no row's attention changes
    (the dropped columns were masked for all). The cache holds every column but the last (the next input token)."""
    first = int(rows.mask.any(dim=0).int().argmax())  # the first column some row attends to
    if first == 0:
        return
    rows.tokens, rows.mask = rows.tokens[:, first:], rows.mask[:, first:]
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys[:, :, first:], layer.values[:, :, first:]


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
    )
