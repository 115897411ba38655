"""The `loop` engine: grpo_hf's decoding loop for CPUs (and any device), exact to `model.generate`.

Each distinct prompt is prefilled once and its KV cache copied to the G rows of its group; the cache
lives in preallocated tensors instead of growing by concatenation; finished rows leave the decoding
batch when enough steps remain to pay for it; a token costs one uniform draw per row (inverse
transform sampling) instead of `torch.multinomial`'s one exponential per vocabulary entry. The logits
go through the same `transformers` processors, in the same order, as in `model.generate`, so the
sampled distribution is the configured one. On a GPU it is bound by kernel launches: use `cuda_graph`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

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

    @classmethod
    def unsupported_reason(cls, model, generation_config) -> str | None:
        return unsupported_reason(model, generation_config)

    def sample(self, model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, images=None) -> torch.Tensor:
        return sample_groups(
            model,
            prompt_ids,
            prompt_mask,
            self.generation_config,
            self.eos_token_ids,
            images=images,
            blocked_token_ids=self.blocked_token_ids,
        )


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

    def take_rows(self, index: torch.Tensor) -> None:
        """Keep rows `index` (any length: rows may repeat), in place."""
        self._keys, self._values = self._keys.index_select(0, index), self._values.index_select(0, index)
        self.keys, self.values = self._keys[:, :, : self.length], self._values[:, :, : self.length]


def _preallocated_cache(config, capacity: int) -> DynamicCache:
    """A `DynamicCache` for `config` whose layers are `_PreallocatedLayer`s of `capacity` positions."""
    cache = DynamicCache(config=config)
    cache.layers = [_PreallocatedLayer(capacity) for _ in cache.layers]
    return cache


def _take_cache_rows(cache, index: torch.Tensor) -> None:
    """Keep rows `index` of every layer of `cache` (repeating rows where `index` repeats), in place."""
    for layer in cache.layers:
        layer.take_rows(index)


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
    Call it in eval mode. Returns `completion_ids [N, T]` with T <= max_new_tokens.
    """
    N, P = prompt_ids.shape
    T = generation_config.max_new_tokens
    device = prompt_ids.device
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
        tokens = sample_categorical(torch.softmax(scores, dim=-1), uniform).masked_fill(finished, pad)  # [A]
        sequences[rows, P + t] = tokens
        finished |= torch.isin(tokens, eos)
        if t == T - 1 or bool(finished.all()):
            break
        if T - 1 - t >= _MIN_STEPS_TO_DROP_ROWS and bool(finished.any()):
            keep = torch.nonzero(~finished).flatten()  # [A']
            _take_cache_rows(cache, keep)
            rows, tokens, finished = rows[keep], tokens[keep], finished[keep]
            processors = logits_processors(generation_config, prompt_mask[rows])
        logits = _next_logits(
            model, tokens, attention_mask[rows, : P + t + 1], next_position[rows] + t, cache, keyword
        )
    return sequences[:, P : P + t + 1]  # [N, T]


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
        _take_cache_rows(cache, prompt_of_row)
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
