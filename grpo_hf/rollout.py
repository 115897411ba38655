"""Rollouts: prompts -> groups of sampled completions, with masks and truncation flags.

Pieces, each small and testable on its own:

- `RepeatSampler` orders dataset indices so every prompt's G copies are consecutive and every
  generation batch is served to `repeat_count` training micro-steps.
- `tokenize_prompts` applies the chat template, left-truncates to `max_prompt_length`, left-pads,
  and encodes each distinct prompt once (a group's G copies share one encoding).
- `completion_mask` marks completion tokens up to and including the first EOS (DESIGN.md §5, `m`).
- `prompt_runs` finds the groups inside a batch: runs of identical consecutive prompt rows.
- `generate` samples completions with the KV cache on, in eval mode, and returns
  `completion_ids`, `completion_mask` and `is_truncated`. Its own decoding loop (`sample_groups`)
  prefills each distinct prompt once and copies its KV cache to the G rows of its group, keeps the
  cache in preallocated tensors, and draws each token by inverse transform sampling (one uniform
  number per row instead of `torch.multinomial`'s one exponential per vocabulary entry). The logits
  go through the same `transformers` processors, in the same order, as in `model.generate`, so the
  sampled distribution is the configured one; settings the loop does not implement fall back to
  `model.generate`.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import Sampler
from transformers import (
    DynamicCache,
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.cache_utils import DynamicLayer


class RepeatSampler(Sampler[int]):
    """Dataset indices for GRPO: whole groups, each generation batch repeated.

    With `num_generations=2`, `prompts_per_batch=3`, `repeat_count=2` and a dataset of 7 prompts
    `[a b c d e f g]` shuffled to `[e c g a b f d]`, it yields::

        e e c c g g  e e c c g g   <- generation batch 1, served to 2 micro-steps
        a a b b f f  a a b b f f   <- generation batch 2
                                      (d: too few prompts left for a batch, dropped)

    Prompts are shuffled under `seed`, with a new order on every pass over the data (deterministic:
    pass k uses seed + k); the copies inside a group never are. `accelerate` then hands each
    process its contiguous share of each batch, so a group may straddle processes; the trainer
    gathers rewards before normalising.
    """

    def __init__(
        self,
        num_prompts: int,
        num_generations: int,
        prompts_per_batch: int,
        repeat_count: int = 1,
        shuffle: bool = True,
        seed: int = 0,
    ):
        if num_prompts < prompts_per_batch:
            raise ValueError(
                f"The dataset has {num_prompts} prompts but one generation batch needs {prompts_per_batch} "
                "(generation_batch_size / num_generations). Use a larger dataset or a smaller batch."
            )
        self.num_prompts = num_prompts
        self.num_generations = num_generations
        self.prompts_per_batch = prompts_per_batch
        self.repeat_count = repeat_count
        self.shuffle = shuffle
        self.seed = seed
        self.num_passes = 0

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.num_passes)
            order = torch.randperm(self.num_prompts, generator=generator).tolist()
        else:
            order = list(range(self.num_prompts))
        self.num_passes += 1
        num_batches = self.num_prompts // self.prompts_per_batch
        for b in range(num_batches):
            prompts = order[b * self.prompts_per_batch : (b + 1) * self.prompts_per_batch]
            batch = [index for index in prompts for _ in range(self.num_generations)]
            for _ in range(self.repeat_count):
                yield from batch

    def __len__(self) -> int:
        num_batches = self.num_prompts // self.prompts_per_batch
        return num_batches * self.prompts_per_batch * self.num_generations * self.repeat_count


def is_conversational(prompt: Any) -> bool:
    """A prompt is conversational when it is a list of `{"role", "content"}` messages."""
    return isinstance(prompt, list) and len(prompt) > 0 and isinstance(prompt[0], dict) and "role" in prompt[0]


def prompt_text(tokenizer, prompt: str | list[dict], chat_template_kwargs: dict | None = None) -> str:
    """The text the model sees: the chat template with a generation prompt, or the string itself."""
    if is_conversational(prompt):
        return tokenizer.apply_chat_template(
            prompt, tokenize=False, add_generation_prompt=True, **(chat_template_kwargs or {})
        )
    if isinstance(prompt, str):
        return prompt
    raise TypeError(
        f"A prompt must be a string or a list of chat messages with 'role' and 'content'; got {type(prompt).__name__}."
    )


def tokenize_prompts(
    tokenizer,
    prompts: Sequence[str | list[dict]],
    max_prompt_length: int | None = None,
    chat_template_kwargs: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Encode prompts once per run of identical consecutive prompts (a group), left-pad and left-truncate.

    Returns `prompt_ids [N, P]`, `prompt_mask [N, P]` and `is_prompt_truncated [N]` (bool).
    Special tokens are not added again: chat templates already contain them.
    """
    # Runs of identical consecutive prompts: a group's G copies are encoded once.
    starts = [i for i in range(len(prompts)) if i == 0 or prompts[i] != prompts[i - 1]]
    counts = [b - a for a, b in zip(starts, starts[1:] + [len(prompts)], strict=True)]
    texts = [prompt_text(tokenizer, prompts[i], chat_template_kwargs) for i in starts]
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]

    truncated = []
    for k, ids in enumerate(encoded):
        too_long = max_prompt_length is not None and len(ids) > max_prompt_length
        truncated.append(too_long)
        if too_long:
            encoded[k] = ids[-max_prompt_length:]  # keep the end: it holds the question and generation prompt
    if any(len(ids) == 0 for ids in encoded):
        raise ValueError("A prompt encodes to zero tokens; remove empty prompts from the dataset.")

    width = max(len(ids) for ids in encoded)
    pad = tokenizer.pad_token_id
    unique_ids = torch.full((len(encoded), width), pad, dtype=torch.long)  # [U, P]
    unique_mask = torch.zeros((len(encoded), width), dtype=torch.long)  # [U, P]
    for k, ids in enumerate(encoded):
        unique_ids[k, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
        unique_mask[k, width - len(ids) :] = 1
    repeats = torch.tensor(counts)
    prompt_ids = unique_ids.repeat_interleave(repeats, dim=0)  # [N, P]
    prompt_mask = unique_mask.repeat_interleave(repeats, dim=0)  # [N, P]
    is_prompt_truncated = torch.tensor(truncated).repeat_interleave(repeats)  # [N]
    return prompt_ids, prompt_mask, is_prompt_truncated


def completion_mask(completion_ids: torch.Tensor, eos_token_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask of real completion tokens, up to and including the first EOS, and the truncation flags.

    Returns `completion_mask [N, T]` (long, 1 = real token) and `is_truncated [N]` (bool: no EOS
    within the completion, i.e. it hit max_completion_length).
    """
    eos = torch.isin(completion_ids, torch.tensor(list(eos_token_ids), device=completion_ids.device))  # [N, T]
    T = completion_ids.size(1)
    has_eos = eos.any(dim=1)  # [N]
    first_eos = torch.where(has_eos, eos.int().argmax(dim=1), torch.full_like(has_eos, T, dtype=torch.long))  # [N]
    positions = torch.arange(T, device=completion_ids.device).unsqueeze(0)  # [1, T]
    mask = (positions <= first_eos.unsqueeze(1)).long()  # [N, T]
    return mask, ~has_eos


def eos_token_ids_of(model, tokenizer) -> list[int]:
    """Every id that ends a completion: the generation config's EOS ids plus the tokenizer's."""
    ids: set[int] = set()
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(configured, int):
        ids.add(configured)
    elif configured is not None:
        ids.update(int(i) for i in configured)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    if not ids:
        raise ValueError("Neither the model's generation_config nor the tokenizer defines an EOS token.")
    return sorted(ids)


def prompt_runs(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> list[tuple[int, int]]:
    """`(start, stop)` of every run of identical consecutive rows of `prompt_ids`/`prompt_mask` [N, P].

    A group's G copies of one prompt are such a run (`RepeatSampler` keeps them together); a group
    split across processes or micro-batches gives one run per piece.
    """
    if prompt_ids.size(0) == 0:
        return []
    same = (prompt_ids[1:] == prompt_ids[:-1]).all(dim=1) & (prompt_mask[1:] == prompt_mask[:-1]).all(dim=1)  # [N-1]
    starts = [0, *(torch.nonzero(~same).flatten() + 1).tolist()]
    return list(zip(starts, [*starts[1:], prompt_ids.size(0)], strict=True))


@torch.no_grad()
def generate(
    model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    generation_config,
    eos_token_ids: Sequence[int],
    *,
    use_model_generate: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample one completion per row of `prompt_ids`. The model is put in eval mode for the call.

    Uses `sample_groups` when it implements every setting of `generation_config` (see
    `supports_sample_groups`) and `use_model_generate` is False; `model.generate` otherwise.
    Returns `completion_ids [N, T]`, `completion_mask [N, T]` and `is_truncated [N]`.
    """
    was_training = model.training
    model.eval()
    try:
        if not use_model_generate and supports_sample_groups(model, generation_config):
            completion_ids = sample_groups(model, prompt_ids, prompt_mask, generation_config, eos_token_ids)
        else:
            output = model.generate(
                input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=generation_config
            )  # [N, P + T]
            completion_ids = output[:, prompt_ids.size(1) :]  # [N, T]
    finally:
        model.train(was_training)
    if completion_ids.size(1) == 0:  # the model produced nothing at all
        completion_ids = torch.full(
            (prompt_ids.size(0), 1), generation_config.pad_token_id, dtype=torch.long, device=prompt_ids.device
        )
        mask = torch.zeros_like(completion_ids)
        return completion_ids, mask, torch.ones(prompt_ids.size(0), dtype=torch.bool, device=prompt_ids.device)
    mask, is_truncated = completion_mask(completion_ids, eos_token_ids)
    completion_ids = completion_ids.masked_fill(mask == 0, generation_config.pad_token_id)
    return completion_ids, mask, is_truncated


# Sampling settings `sample_groups` implements, with the value `generate` uses when neither the call's config nor the
# model's `generation_config` sets one (transformers' global defaults).
_SAMPLING_DEFAULTS = {"temperature": 1.0, "top_k": 50, "top_p": 1.0, "min_p": None, "repetition_penalty": 1.0}
# Other settings that may be present: they change nothing in how tokens are drawn.
_NEUTRAL_SETTINGS = frozenset(
    {
        "max_new_tokens",
        "max_length",
        "do_sample",
        "pad_token_id",
        "eos_token_id",
        "bos_token_id",
        "use_cache",
        "output_attentions",
        "output_hidden_states",
        "output_scores",
        "output_logits",
        "return_dict_in_generate",
        "transformers_version",
        "_from_model_config",
    }
)


def supports_sample_groups(model, generation_config) -> bool:
    """Whether `sample_groups` draws what `model.generate` would for this model and config.

    It needs sampling (`do_sample=True`), `max_new_tokens` and a pad token; neither the config nor the
    model's own `generation_config` (whose values `generate` uses where the config has none) may set
    anything but the sampling settings of `_SAMPLING_DEFAULTS` and the neutral ones; and the model must
    be decoder-only with a KV cache of plain full-attention layers (no sliding window, no linear attention).
    """
    config = getattr(model, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False) or not hasattr(model, "get_decoder"):
        return False
    if not generation_config.do_sample or generation_config.max_new_tokens is None:
        return False
    if generation_config.pad_token_id is None:
        return False
    allowed = _NEUTRAL_SETTINGS | set(_SAMPLING_DEFAULTS)
    for settings in (generation_config, getattr(model, "generation_config", None)):
        if settings is not None and not set(settings.to_diff_dict()) <= allowed:
            return False
    try:
        cache = DynamicCache(config=config)
    except Exception:  # a config the cache classes do not understand: leave it to `generate`
        return False
    return all(type(layer) is DynamicLayer for layer in cache.layers)


def resolve_sampling_settings(model, generation_config):
    """A copy of `generation_config` whose unset sampling settings hold the values `generate` would use.

    An unset (None) setting takes the model's `generation_config` value, else transformers' default
    (`_SAMPLING_DEFAULTS`, e.g. top_k=50), as `GenerationMixin._prepare_generation_config` does.
    """
    resolved = copy.deepcopy(generation_config)
    model_settings = getattr(model, "generation_config", None)
    for name, default in _SAMPLING_DEFAULTS.items():
        if getattr(resolved, name, None) is None:
            value = getattr(model_settings, name, None) if model_settings is not None else None
            setattr(resolved, name, default if value is None else value)
    return resolved


def logits_processors(generation_config, prompt_mask: torch.Tensor) -> LogitsProcessorList:
    """The processors `model.generate` applies for these sampling settings, in its order.

    Repetition penalty first (the prompt's left padding excluded, as in `generate`), then temperature,
    top-k, top-p and min-p (`GenerationMixin._get_logits_processor`).
    """
    processors = LogitsProcessorList()
    config = generation_config
    if config.repetition_penalty is not None and config.repetition_penalty != 1.0:
        padding_lengths = (prompt_mask != 0).int().argmax(dim=1)  # [N]
        processors.append(RepetitionPenaltyLogitsProcessor(config.repetition_penalty, padding_lengths))
    if config.temperature is not None and config.temperature != 1.0:
        processors.append(TemperatureLogitsWarper(config.temperature))
    if config.top_k is not None and config.top_k != 0:
        processors.append(TopKLogitsWarper(top_k=config.top_k, min_tokens_to_keep=1))
    if config.top_p is not None and config.top_p < 1.0:
        processors.append(TopPLogitsWarper(top_p=config.top_p, min_tokens_to_keep=1))
    if config.min_p is not None:
        processors.append(MinPLogitsWarper(min_p=config.min_p, min_tokens_to_keep=1))
    return processors


def sample_categorical(probs: torch.Tensor, uniform: torch.Tensor | None = None) -> torch.Tensor:
    """One index per row of `probs` [N, V], drawn with probability `probs[i, v] / probs[i].sum()`.

    Inverse transform sampling: the first v whose cumulative probability exceeds u * total, with u
    uniform in [0, 1) (`uniform` [N, 1], drawn here when None). The cumulative sum is taken in float64
    (float32 where the device has no float64), so a token's interval has its probability's width to
    ~1e-16. A zero-probability token is never drawn: its interval is empty, and rounding at the very
    top is sent to the last token with p > 0. Returns `[N]` (long).
    """
    dtype = torch.float32 if probs.device.type == "mps" else torch.float64
    cdf = probs.to(dtype).cumsum(dim=-1)  # [N, V]
    if uniform is None:
        uniform = torch.rand((probs.size(0), 1), dtype=dtype, device=probs.device)
    index = torch.searchsorted(cdf, uniform.to(dtype) * cdf[:, -1:], right=True).squeeze(1)  # [N]
    last_positive = probs.size(-1) - 1 - (probs.flip(-1) > 0).int().argmax(dim=-1)  # [N]
    return torch.minimum(index, last_positive)


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
    model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, generation_config, eos_token_ids: Sequence[int]
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
    Call it in eval mode. Returns `completion_ids [N, T]` with T <= max_new_tokens.
    """
    N, P = prompt_ids.shape
    T = generation_config.max_new_tokens
    device = prompt_ids.device
    runs = prompt_runs(prompt_ids, prompt_mask)
    counts = torch.tensor([stop - start for start, stop in runs], device=device)  # [U]
    starts = [start for start, _ in runs]
    unique_ids, unique_mask = prompt_ids[starts], prompt_mask[starts]  # [U, P]

    cache = _preallocated_cache(model.config, P + T)
    # Positions as `generate` numbers them: the first real prompt token is 0, padding gets 1.
    position_ids = (unique_mask.long().cumsum(-1) - 1).masked_fill(unique_mask == 0, 1)  # [U, P]
    logits = (
        model(
            input_ids=unique_ids,
            attention_mask=unique_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        .logits[:, -1]
        .float()
    )  # [U, V]
    if len(runs) < N:
        _take_cache_rows(cache, torch.arange(len(runs), device=device).repeat_interleave(counts))
        logits = logits.repeat_interleave(counts, dim=0)  # [N, V]

    eos = torch.tensor(list(eos_token_ids), device=device)
    pad = generation_config.pad_token_id
    sequences = torch.cat([prompt_ids, prompt_ids.new_full((N, T), pad)], dim=1)  # [N, P + T]
    attention_mask = torch.cat([prompt_mask, prompt_mask.new_ones((N, T))], dim=1)  # [N, P + T]
    next_position = prompt_mask.long().sum(-1, keepdim=True)  # [N, 1]
    # The decoding batch: rows that have not produced an EOS yet (finished rows keep the pad they start with).
    rows = torch.arange(N, device=device)  # [A] row of `sequences` of each batch row
    finished = torch.zeros(N, dtype=torch.bool, device=device)  # [A]
    generation_config = resolve_sampling_settings(model, generation_config)
    processors = logits_processors(generation_config, prompt_mask)
    uniform_dtype = torch.float32 if device.type == "mps" else torch.float64
    for t in range(T):
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
        logits = (
            model(
                input_ids=tokens[:, None],
                attention_mask=attention_mask[rows, : P + t + 1],
                position_ids=next_position[rows] + t,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            .logits[:, -1]
            .float()
        )  # [A, V]
    return sequences[:, P : P + t + 1]  # [N, T]
