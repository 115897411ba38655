"""The `cuda_graph` engine: the whole decode step (forward, logits processors, draw) as one static-shape function,
captured as a CUDA graph by `torch.compile(mode="reduce-overhead")`; no host sync per token.

It samples what `model.generate` samples (the same processors, in the same order, with the model's
`generation_config` defaults; an exact inverse-transform draw), as `loop` does. What differs is where the work runs:

- Prefill: each distinct prompt (`prompt_runs`) is prefilled once, eagerly, into a `DynamicCache`; its keys and
  values are copied into a static KV cache of N rows x (P_bucket + max_new_tokens) positions, the prompt right-aligned
  at position P_bucket. P_bucket is the prompt length rounded up to `prompt_bucket`; a shorter prompt reuses a larger
  bucket (more masked left padding), so the step recompiles only when prompts grow past every bucket seen.
- `decode_step`: one token per row. The model gets a 4-D mask [N, 1, 1, L] (boolean for sdpa, additive for eager),
  which transformers' `masking_utils` passes through as is, plus `position_ids`; the cache writes at a device
  index (`StaticRowsLayer`). The processors are pure tensor functions (`process_logits`: repetition penalty with a
  [N, V] "seen" mask instead of the growing `input_ids`, temperature, top-k, top-p, min-p), the draw takes its
  uniforms from `torch.rand` on the device, a finished row emits pad, EOS goes into a device mask. Every tensor the
  step touches lives in `DecodeState` and is updated in place, at a fixed address, so a captured graph replays it.
- The host asks "have all rows finished?" every `check_every` tokens, and reads the answer posted at the previous
  check (`_FinishedPoll`: a non-blocking copy to pinned memory plus an event), so it never waits for a running step.
  At most ~2 x `check_every` steps run after the last row finished; their tokens are pad and are cut off.
- Weights: the graph reads the parameters where they live, nothing copies them, so in-place optimizer updates are
  seen by the next call. `on_weights_updated` drops the buffers and the compiled step if the parameters moved.
  PEFT/LoRA: the PEFT wrapper's base model is called; its LoRA layers run inside the step (no merge).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, CacheLayerMixin

from grpo_hf.rollout.engine import RolloutEngine
from grpo_hf.rollout.sampling import (
    prefill_distinct_prompts,
    resolve_sampling_settings,
    sample_categorical,
    unsupported_reason,
)

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------------
# Logits processors as pure tensor functions (generate's `RepetitionPenalty`, `Temperature`, `TopK`, `TopP`, `MinP`)


@dataclass(frozen=True)
class SamplingSettings:
    """The sampling settings `generate` would use, as Python numbers: constants of the compiled step."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    min_p: float | None = None
    repetition_penalty: float = 1.0
    pad_token_id: int = 0

    @classmethod
    def of(cls, model, generation_config) -> SamplingSettings:
        """The call's settings, unset ones taken from the model's `generation_config` (`resolve_sampling_settings`)."""
        config = resolve_sampling_settings(model, generation_config)
        return cls(
            temperature=float(config.temperature),
            top_k=int(config.top_k) if config.top_k else None,
            top_p=float(config.top_p),
            min_p=None if config.min_p is None else float(config.min_p),
            repetition_penalty=float(config.repetition_penalty),
            pad_token_id=int(config.pad_token_id),
        )


def prompt_seen_mask(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[N, V] bool: the tokens of each prompt row from its first real token on (the left padding is skipped, as
    `generate`'s repetition penalty does); ids >= vocab_size (no logit) are dropped."""
    first_real = (prompt_mask != 0).int().argmax(dim=1, keepdim=True)  # [N, 1]
    positions = torch.arange(prompt_ids.size(1), device=prompt_ids.device)[None]  # [1, P]
    ids = prompt_ids.masked_fill(positions < first_real, vocab_size).clamp(max=vocab_size)  # [N, P]
    seen = torch.zeros((prompt_ids.size(0), vocab_size + 1), dtype=torch.bool, device=prompt_ids.device)  # [N, V + 1]
    return seen.scatter_(1, ids, True)[:, :vocab_size]


def repetition_penalty(scores: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL's penalty on the tokens seen ([N, V] bool): a logit < 0 is multiplied by `penalty`, others divided."""
    return torch.where(seen, torch.where(scores < 0, scores * penalty, scores / penalty), scores)


def top_k_filter(scores: torch.Tensor, top_k: int) -> torch.Tensor:
    """-inf below the k-th largest score of each row (ties with it are kept)."""
    k = min(max(top_k, 1), scores.size(-1))
    kth = torch.topk(scores, k, dim=-1).values[..., -1:]  # [N, 1]
    return scores.masked_fill(scores < kth, -float("inf"))


def top_p_filter(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus: -inf on the least likely tokens whose cumulative probability is <= 1 - top_p (the top one stays)."""
    sorted_scores, order = torch.sort(scores, descending=False)  # [N, V]
    remove = sorted_scores.softmax(dim=-1).cumsum(dim=-1) <= (1 - top_p)  # [N, V] in ascending order
    remove[..., -1] = False
    return scores.masked_fill(remove.scatter(1, order, remove), -float("inf"))


def min_p_filter(scores: torch.Tensor, min_p: float) -> torch.Tensor:
    """-inf on tokens whose probability is below `min_p` times the top token's (which is always kept)."""
    probs = torch.softmax(scores, dim=-1)  # [N, V]
    remove = probs < min_p * probs.amax(dim=-1, keepdim=True)  # [N, V]
    remove = remove.scatter(-1, probs.argmax(dim=-1, keepdim=True), False)
    return scores.masked_fill(remove, -float("inf"))


def process_logits(scores: torch.Tensor, seen: torch.Tensor | None, settings: SamplingSettings) -> torch.Tensor:
    """generate's processors on float32 scores [N, V], in its order (`sampling.logits_processors`): repetition
    penalty, temperature, top-k, top-p, min-p; a setting at its neutral value is skipped, as there."""
    if settings.repetition_penalty != 1.0:
        scores = repetition_penalty(scores, seen, settings.repetition_penalty)
    if settings.temperature != 1.0:
        scores = scores / settings.temperature
    if settings.top_k:
        scores = top_k_filter(scores, settings.top_k)
    if settings.top_p < 1.0:
        scores = top_p_filter(scores, settings.top_p)
    if settings.min_p is not None:
        scores = min_p_filter(scores, settings.min_p)
    return scores


# ----------------------------------------------------------------------------------------------------
# Static state: the KV cache and everything else the step reads and writes


class StaticRowsLayer(CacheLayerMixin):
    """One layer's keys and values in preallocated buffers [N, H, L, D]; `update` writes one step at the position held
    by the device tensor `slot` [1] and returns the whole buffers (the 4-D mask hides the unwritten positions)."""

    is_compileable = True

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, slot: torch.Tensor):
        super().__init__()
        self.keys, self.values, self.slot = keys, values, slot
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to do: the buffers are allocated up front."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.keys.index_copy_(2, self.slot, key_states)
        self.values.index_copy_(2, self.slot, value_states)
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.keys.size(2), 0

    def get_seq_length(self) -> int:
        return self.keys.size(2)  # positions are passed explicitly; the mask says which slots hold tokens

    def get_max_length(self) -> int:
        return self.keys.size(2)


@dataclass
class DecodeState:
    """Every tensor the decode step reads or writes, at fixed addresses (one set per bucket, reset per call)."""

    input_ids: torch.Tensor  # [N, 1] the last token drawn
    position_ids: torch.Tensor  # [N, 1] its position (the first real prompt token is 0)
    slot: torch.Tensor  # [1] the cache position its keys and values go to
    attention_mask: torch.Tensor  # [N, 1, 1, L] bool (True = attend) for sdpa, additive (0 / min) for eager
    seen: torch.Tensor | None  # [N, V] bool: tokens the repetition penalty applies to (None without a penalty)
    finished: torch.Tensor  # [N] bool: the row has drawn an EOS
    completion_ids: torch.Tensor  # [N, T] tokens drawn, pad after EOS
    column: torch.Tensor  # [1] the column of `completion_ids` the next draw goes to
    running_steps: torch.Tensor  # [1] draws made while some row was still running: the completion length
    eos_token_ids: torch.Tensor  # [E]


@dataclass
class _Bucket:
    prompt_slots: int  # P_bucket: the prompt ends at this cache position
    cache: Cache
    state: DecodeState
    compiled: bool = False  # the compiled step has run on it (its compile time was logged)


def _mark_static(*tensors: torch.Tensor | None) -> None:
    """Tell cudagraphs these inputs keep their address across calls (no copy into the graph's own buffers)."""
    for tensor in tensors:
        if tensor is not None:
            torch._dynamo.mark_static_address(tensor)


# ----------------------------------------------------------------------------------------------------
# The step


def draw(logits: torch.Tensor, state: DecodeState, settings: SamplingSettings) -> None:
    """Draw one token per row from logits [N, V] and record it in `state`, all on the device, in place."""
    scores = process_logits(logits.float(), state.seen, settings)  # [N, V]
    tokens = sample_categorical(torch.softmax(scores, dim=-1))  # [N] one uniform per row from torch.rand
    tokens = tokens.masked_fill(state.finished, settings.pad_token_id)  # [N]
    state.running_steps.add_((~state.finished).any().long())
    state.finished.logical_or_(torch.isin(tokens, state.eos_token_ids))
    state.completion_ids.index_copy_(1, state.column, tokens[:, None])
    state.column.add_(1)
    state.input_ids.copy_(tokens[:, None])
    if state.seen is not None:
        state.seen.scatter_(1, tokens[:, None], True)


def decode_step(model, cache: Cache, state: DecodeState, settings: SamplingSettings) -> None:
    """One token for every row: forward the last token, process the logits, draw. Static shapes, no host sync, no
    data-dependent Python branch: `torch.compile(decode_step, fullgraph=True, mode="reduce-overhead")` captures it."""
    attend = True if state.attention_mask.dtype == torch.bool else 0.0
    state.attention_mask.index_fill_(-1, state.slot, attend)  # the new token sees itself
    logits = model(
        input_ids=state.input_ids,
        attention_mask=state.attention_mask,
        position_ids=state.position_ids,
        past_key_values=cache,
        use_cache=True,
    ).logits[:, -1]  # [N, V]
    state.slot.add_(1)
    state.position_ids.add_(1)
    draw(logits, state, settings)


class _FinishedPoll:
    """Answers "have all rows finished?" without stalling the device: `post` queues a copy of the answer to (pinned)
    host memory and records an event; `read` returns the answer posted before, waiting (briefly, if at all) for its
    event, which keeps the host at most one check interval ahead of the device."""

    def __init__(self, device: torch.device):
        self.host = torch.zeros(1, dtype=torch.bool, pin_memory=device.type == "cuda")
        self.event = None

    def post(self, finished: torch.Tensor) -> None:
        self.host.copy_(finished.all().view(1), non_blocking=True)
        if finished.is_cuda:
            self.event = torch.cuda.Event()
            self.event.record()

    def read(self) -> bool:
        if self.event is not None:
            self.event.synchronize()
        return bool(self.host[0])


def decoder_model(model):
    """The transformers model to call: a PEFT wrapper's base model, whose LoRA layers run inside it."""
    get_base_model = getattr(model, "get_base_model", None)
    return get_base_model() if callable(get_base_model) else model


def _weights_pointers(model) -> tuple[int, ...]:
    return tuple(p.data_ptr() for p in model.parameters())


# ----------------------------------------------------------------------------------------------------
# The engine


class CUDAGraphEngine(RolloutEngine):
    """A static KV cache and `decode_step` compiled with `mode="reduce-overhead"` (one CUDA graph per bucket).

    `compile`: None compiles on CUDA and runs the same step eagerly elsewhere; `compile_kwargs` are what
    `torch.compile` gets. `prompt_bucket` rounds prompt lengths up; `check_every` is how often (in tokens) the host
    asks whether every row has finished.
    """

    name = "cuda_graph"
    options = ("compile",)
    prompt_bucket = 64
    check_every = 16

    def __init__(self, generation_config, eos_token_ids, compile: bool | None = None):
        super().__init__(generation_config, eos_token_ids)
        self.compile = compile
        self.compile_kwargs = {"mode": "reduce-overhead", "fullgraph": True, "dynamic": False}
        self._buckets: dict[tuple, _Bucket] = {}
        self._step = None  # the compiled decode_step, made at first use
        self._weights = None  # data pointers of the parameters the buffers and graphs were made with

    @classmethod
    def unsupported_reason(cls, model, generation_config) -> str | None:
        reason = unsupported_reason(model, generation_config)
        if reason is not None:
            return reason
        model = decoder_model(model)
        if not getattr(model, "_can_compile_fullgraph", False):
            return f"{type(model).__name__} does not support a static, compiled cache"
        attention = getattr(model.config, "_attn_implementation", None)
        if attention not in ("sdpa", "eager"):
            return f"attention {attention!r} does not take a 4-D mask as is (sdpa and eager do)"
        return None

    def on_weights_updated(self, model) -> None:
        """In-place updates need nothing (the graph reads the parameters where they are); moved parameters drop the
        buffers and the compiled step, so that nothing keeps the old ones alive."""
        if self._weights is not None and _weights_pointers(decoder_model(model)) != self._weights:
            logger.info("cuda_graph: the parameters moved; dropping the static buffers and the compiled step")
            self._buckets.clear()
            self._step, self._weights = None, None

    def sample(self, model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> torch.Tensor:
        model = decoder_model(model)
        self.on_weights_updated(model)
        self._weights = _weights_pointers(model)
        settings = SamplingSettings.of(model, self.generation_config)
        logits, prefill, rows = _prefill(model, prompt_ids, prompt_mask)  # [U, V], cache of U rows, [N]
        bucket = self._bucket(model, prompt_ids, prefill, logits.size(-1), settings)
        _load_prompts(bucket, prompt_ids, prompt_mask, prefill, rows, settings)
        del prefill
        draw(logits[rows], bucket.state, settings)
        step = self._compiled_step() if self._compiles(model) else decode_step
        poll = _FinishedPoll(prompt_ids.device)
        for t in range(1, self.generation_config.max_new_tokens):
            if t % self.check_every == 0:
                if poll.read():
                    break
                poll.post(bucket.state.finished)
            if t == 1 and step is not decode_step and not bucket.compiled:
                self._first_step(step, model, bucket, settings)
                continue
            step(model, bucket.cache, bucket.state, settings)
        length = int(bucket.state.running_steps[0])  # the one sync that waits for the last step
        return bucket.state.completion_ids[:, :length].clone()  # [N, T]: the buffer is reused by the next call

    def _first_step(self, step, model, bucket: _Bucket, settings) -> None:
        """The bucket's first compiled step, timed once for the log (it compiles; a sync here is paid once)."""
        start = time.perf_counter()
        step(model, bucket.cache, bucket.state, settings)
        if bucket.state.finished.is_cuda:
            torch.cuda.synchronize()
        bucket.compiled = True
        rows, positions = bucket.state.attention_mask.size(0), bucket.state.attention_mask.size(-1)
        logger.info(
            "cuda_graph: compiled the decode step for %d rows x %d positions in %.1f s (once per bucket)",
            rows,
            positions,
            time.perf_counter() - start,
        )

    def _compiles(self, model) -> bool:
        if self.compile is None:
            return next(model.parameters()).device.type == "cuda"
        return self.compile

    def _compiled_step(self):
        if self._step is None:
            self._step = torch.compile(decode_step, **self.compile_kwargs)
        return self._step

    def _bucket(self, model, prompt_ids: torch.Tensor, prefill: DynamicCache, vocab_size: int, settings) -> _Bucket:
        """The static buffers for this batch: the smallest bucket that holds the prompts, else a new one (which
        replaces the smaller buckets of the same shape)."""
        N, P = prompt_ids.shape
        T = self.generation_config.max_new_tokens
        first = prefill.layers[0]
        attention = model.config._attn_implementation
        mask_dtype = torch.bool if attention == "sdpa" else model.get_input_embeddings().weight.dtype
        layout = (
            len(prefill.layers),
            first.keys.device,
            first.keys.shape[1],
            first.keys.shape[3],
            first.values.shape[3],
        )
        shape = (N, T, vocab_size, *layout, first.keys.dtype, first.values.dtype, mask_dtype)
        shape = (*shape, settings.repetition_penalty != 1)  # last: whether the state has a "seen" mask
        fits = [key for key in self._buckets if key[1:] == shape and key[0] >= P]
        if fits:
            return self._buckets[min(fits)]
        for key in [key for key in self._buckets if key[1:] == shape]:
            del self._buckets[key]
        prompt_slots = -(-P // self.prompt_bucket) * self.prompt_bucket
        bucket = _new_bucket(prefill, N, prompt_slots, T, vocab_size, mask_dtype, shape[-1], self.eos_token_ids)
        self._buckets[(prompt_slots, *shape)] = bucket
        return bucket


def _new_bucket(prefill, N, prompt_slots, T, vocab_size, mask_dtype, with_seen, eos_token_ids) -> _Bucket:
    """The static cache (in the prefill's key and value dtypes, which differ under autocast) and decode state."""
    device = prefill.layers[0].keys.device
    L = prompt_slots + T
    slot = torch.zeros(1, dtype=torch.long, device=device)  # [1]
    layers = []
    for layer in prefill.layers:
        keys = layer.keys.new_zeros((N, layer.keys.size(1), L, layer.keys.size(3)))  # [N, H, L, D]
        values = layer.values.new_zeros((N, layer.values.size(1), L, layer.values.size(3)))  # [N, H, L, D]
        _mark_static(keys, values)
        layers.append(StaticRowsLayer(keys, values, slot))
    state = DecodeState(
        input_ids=torch.zeros((N, 1), dtype=torch.long, device=device),
        position_ids=torch.zeros((N, 1), dtype=torch.long, device=device),
        slot=slot,
        attention_mask=torch.zeros((N, 1, 1, L), dtype=mask_dtype, device=device),
        seen=torch.zeros((N, vocab_size), dtype=torch.bool, device=device) if with_seen else None,
        finished=torch.zeros(N, dtype=torch.bool, device=device),
        completion_ids=torch.zeros((N, T), dtype=torch.long, device=device),
        column=torch.zeros(1, dtype=torch.long, device=device),
        running_steps=torch.zeros(1, dtype=torch.long, device=device),
        eos_token_ids=torch.tensor(list(eos_token_ids), dtype=torch.long, device=device),
    )
    _mark_static(*(getattr(state, name) for name in state.__dataclass_fields__))
    return _Bucket(prompt_slots, Cache(layers=layers), state)


@torch.no_grad()
def _prefill(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor):
    """Forward each distinct prompt once (eagerly): last-position logits [U, V], their `DynamicCache`, and the index
    [N] of each row's distinct prompt."""
    cache = DynamicCache(config=model.config)
    logits, rows = prefill_distinct_prompts(model, prompt_ids, prompt_mask, cache)  # [U, V], [N]
    return logits, cache, rows


def _load_prompts(bucket: _Bucket, prompt_ids, prompt_mask, prefill: DynamicCache, rows, settings) -> None:
    """Reset `bucket` in place for this batch: prompts' keys/values into the cache rows, masks, positions, counters."""
    N, P = prompt_ids.shape
    start, stop = bucket.prompt_slots - P, bucket.prompt_slots
    for layer, source in zip(bucket.cache.layers, prefill.layers, strict=True):
        layer.keys[:, :, start:stop].copy_(source.keys[rows])
        layer.values[:, :, start:stop].copy_(source.values[rows])
    state = bucket.state
    visible = torch.zeros((N, state.attention_mask.size(-1)), dtype=torch.bool, device=prompt_ids.device)  # [N, L]
    visible[:, start:stop] = prompt_mask != 0
    if state.attention_mask.dtype == torch.bool:
        state.attention_mask.copy_(visible[:, None, None])
    else:
        blocked = torch.finfo(state.attention_mask.dtype).min
        state.attention_mask.copy_(
            torch.zeros_like(visible, dtype=state.attention_mask.dtype).masked_fill(~visible, blocked)[:, None, None]
        )
    state.position_ids.copy_(prompt_mask.long().sum(-1, keepdim=True))
    state.slot.fill_(stop)
    state.finished.zero_()
    state.completion_ids.fill_(settings.pad_token_id)
    state.column.zero_()
    state.running_steps.zero_()
    if state.seen is not None:
        state.seen.copy_(prompt_seen_mask(prompt_ids, prompt_mask, state.seen.size(1)))
