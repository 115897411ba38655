"""The `cuda_graph` engine: the whole decode step (forward, logits processors, draw) as one static-shape function,
captured as a CUDA graph by `torch.compile(mode="reduce-overhead")`; no host sync per token.

It samples what `model.generate` samples (the same processors, in the same order, with the model's
`generation_config` defaults; an exact inverse-transform draw), as `loop` does. What differs is where the work runs:

- Prefill: each distinct prompt (`prompt_runs`) is prefilled once, eagerly, into a `DynamicCache`; its keys and
  values are copied into a static KV cache of N rows x (P_bucket + max_new_tokens) positions, the prompt right-aligned
  at position P_bucket. P_bucket is the prompt length rounded up to `prompt_bucket`; a shorter prompt reuses a larger
  bucket (more masked left padding), and when the step is compiled, so does a batch of fewer rows, down to a quarter
  of the bucket's (`max_row_padding`): the spare rows repeat the first prompt and start finished; decoding is bound
  by reading the weights, so they cost little, but they draw from the RNG too, so a sampled batch depends on the
  bucket it ran in. The step compiles once per bucket, in the bucket's first step, and only when a batch fits no
  bucket seen.
- `decode_step`: one token per row. The model gets a 4-D mask [N, 1, 1, L] (boolean for sdpa, additive for eager),
  which transformers' `masking_utils` passes through as is, plus `position_ids`; a model with sliding-window layers
  (Gemma 3, GPT-OSS) gets one mask per layer type (`step_masks`), the sliding one cut to the last `window` slots,
  its sliding layers' buffers spanning every slot as the full layers' do (the prefill's last window - 1 keys
  loaded at the prompt's end); the cache writes at a device
  index (`StaticRowsLayer`). Grouped-query models (Qwen2.5: 14 query heads over 2 KV heads) attend with
  `grouped_decode_attention`: the query heads of a KV head read the cache as one group, where transformers' sdpa
  path would repeat the whole cache per layer and token under torch.compile. The processors are pure tensor
  functions (`process_logits`: repetition penalty with a [N, V] "seen" mask instead of the growing `input_ids`,
  temperature, top-k, top-p, min-p); the draw takes its uniforms from `torch.rand` on the device (inductor is told
  to call it as eager does, `fallback_random`, rather than draw float32 and cast: the compiled step draws exactly
  what the eager one draws); a finished row emits pad; EOS goes into a device mask. Every tensor the step touches
  lives in `DecodeState` and is updated in place, at a fixed address, so a captured graph replays it. With
  `record_logps`, the step also writes each drawn token's log-probability (the processed scores' log-softmax) into a
  device buffer [N, T] of the state, at the token's column: in the graph, no sync; the buckets of a recording engine
  are a family of their own.
- The host asks "have all rows finished?" every `check_every` tokens, and reads the answer posted at the previous
  check (`_FinishedPoll`: a non-blocking copy to pinned memory plus an event), so it never waits for a running step.
  At most ~2 x `check_every` steps run after the last row finished; their tokens are pad and are cut off.
- Weights: the graph reads the parameters where they live, nothing copies them, so in-place optimizer updates are
  seen by the next call. `on_weights_updated` drops the buffers and the compiled step if the parameters moved.
  PEFT/LoRA: the PEFT wrapper's base model is called, so its LoRA layers run inside the step; under the trainer's
  `Sampler` they run as one matmul with merged copies (`lora_decode`), which the graph reads in place as it does the
  parameters (refreshed by `copy_`, so the captured graph stays valid).
- Precision: the call runs under the trainer's autocast (`autocast`), also where the model called is a PEFT
  wrapper's base model, which accelerate's autocast wrapper does not cover. The static cache keeps the prefill's key
  and value dtypes, as `generate`'s cache does (under autocast with fp32 weights: fp32 keys, and bf16 values, or fp32
  ones where transformers < 5.24 promotes them to the keys' dtype), and the step writes its states in them.
- Failures: a compiled bucket's first calls (compile, CUDA-graph recording, first replay) run guarded; an error there
  restores the step's state and leaves the bucket eager, with one warning (the traceback at DEBUG).
- Compiles: Dynamo keeps one entry per bucket the step was ever compiled for, in this process (the code object is
  shared by every engine), and under `fullgraph=True` raises past its recompile limit (8 by default), which would
  stop a run at its ninth shape. The engine decodes with that limit raised to `max_compiles` (64). A compile that
  fails, or one past the limit, leaves that bucket on the same step run eagerly, with one warning; nothing of the
  batch is lost.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch
import transformers
from transformers import DynamicCache
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer, DynamicSlidingWindowLayer
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from grpo_hf.peft_utils import base_model
from grpo_hf.rollout.engine import RolloutEngine
from grpo_hf.rollout.sampling import (
    cache_keyword,
    cumsum,
    prefill_distinct_prompts,
    resolve_sampling_settings,
    sample_categorical,
    unpenalised_padding,
    unsupported_reason,
)

logger = logging.getLogger(__name__)

# Dynamo's per-function limit on compiled entries (`cache_size_limit` in older torch), and what it raises there under
# fullgraph=True; a compile that fails raises a TorchDynamoException.
_RECOMPILE_LIMIT = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
_COMPILE_ERRORS = (
    torch._dynamo.exc.TorchDynamoException,
    *(
        getattr(torch._dynamo.exc, name)
        for name in ("FailOnRecompileLimitHit", "FailOnCacheLimitHit")
        if hasattr(torch._dynamo.exc, name)
    ),
)


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
    """[N, V] bool: the tokens of each prompt row that the installed `generate`'s repetition penalty reads: from its
    first real token on (transformers >= 5.23), or all, its left padding's pad token included (5.19 to 5.22;
    `sampling.unpenalised_padding`); ids >= vocab_size (no logit) are dropped."""
    skipped = unpenalised_padding(prompt_mask)[:, None]  # [N, 1]
    positions = torch.arange(prompt_ids.size(1), device=prompt_ids.device)[None]  # [1, P]
    ids = prompt_ids.masked_fill(positions < skipped, vocab_size).clamp(max=vocab_size)  # [N, P]
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
    remove = cumsum(sorted_scores.softmax(dim=-1)) <= (1 - top_p)  # [N, V] in ascending order
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
# Decode attention for grouped-query models, without repeating the cache

GROUPED_DECODE = "grpo_hf_grouped_decode"  # the name the attention function is registered under in transformers


def grouped_decode_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """sdpa for one query token per row, with the query heads that share a KV head attending as one group to the
    un-repeated cache: query [N, H, 1, D] is viewed as [N, H_kv, H / H_kv, D], so the H / H_kv query heads of each KV
    head are that head's "query positions", and the mask [N, 1, 1, L] broadcasts over both. transformers' sdpa path
    repeats the cache H / H_kv times instead (`repeat_kv`) whenever a mask is given under torch.compile: a copy of the
    whole cache per layer and token. Query head h belongs to KV head h // (H / H_kv), as `repeat_kv` has it.
    Returns [N, 1, H, D] and no weights, as transformers' attention functions do."""
    N, H, q_len, D = query.shape
    kv_heads = key.size(1)
    grouped = query.reshape(N, kv_heads, H // kv_heads * q_len, D)  # [N, H_kv, G, D]: q_len is 1
    output = torch.nn.functional.scaled_dot_product_attention(
        grouped, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling
    )  # [N, H_kv, G, Dv]
    return output.reshape(N, H, q_len, -1).transpose(1, 2).contiguous(), None  # [N, 1, H, Dv]


ALL_ATTENTION_FUNCTIONS.register(GROUPED_DECODE, grouped_decode_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(GROUPED_DECODE, sdpa_mask)  # unused: the step passes its own 4-D mask


def uses_grouped_queries(model) -> bool:
    """An sdpa model with fewer KV heads than query heads (GQA, MQA): `grouped_decode_attention` applies."""
    config = model.config
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return config._attn_implementation == "sdpa" and heads is not None and kv_heads < heads


@contextlib.contextmanager
def decode_attention(model, grouped: bool):
    """Within: the model's attention layers run `grouped_decode_attention` (when `grouped`; the config's
    `_attn_implementation` is what they look the function up by at each call). The prefill, outside, keeps sdpa."""
    if not grouped:
        yield
        return
    config = model.config
    saved = config._attn_implementation
    config._attn_implementation = GROUPED_DECODE
    try:
        yield
    finally:
        config._attn_implementation = saved


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
        # In the buffers' dtypes, the prefill's: under autocast with fp32 weights, the step's values are bf16, and
        # transformers < 5.24's DynamicLayer promotes them to the keys' fp32 in the prefill, as in `generate`'s cache.
        self.keys.index_copy_(2, self.slot, key_states.to(self.keys.dtype))
        self.values.index_copy_(2, self.slot, value_states.to(self.values.dtype))
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.keys.size(2), 0

    def get_seq_length(self) -> int:
        return self.keys.size(2)  # positions are passed explicitly; the mask says which slots hold tokens

    def get_max_length(self) -> int:
        return self.keys.size(2)


def sliding_window_reason(model) -> str | None:
    """Why the step cannot give `model`'s sliding-window layers their window (`step_masks`), or None: it needs the
    layer types `full_attention` and `sliding_attention` only (a chunked layer's mask is a chunk, not a window) and a
    decoder whose forward takes a dict of masks by layer type as built (transformers' own convention, which
    `generate` uses: `isinstance(causal_mask_mapping := attention_mask, dict)` in the forward's code)."""
    config = model.config.get_text_config(decoder=True)
    windows = _windows(DynamicCache(config=config))
    if not windows:
        return None
    if len(windows) > 1:
        return f"sliding windows of {sorted(windows)} tokens (the step has one window mask)"
    odd = sorted(set(getattr(config, "layer_types", None) or ["(none)"]) - {"full_attention", "sliding_attention"})
    if odd:
        return f"layer types {', '.join(odd)} (the step masks full_attention and sliding_attention layers only)"
    decoder = model.get_decoder()
    try:
        source = inspect.getsource(type(decoder).forward)
    except (OSError, TypeError):  # no source to read: do not guess
        source = ""
    if "isinstance(causal_mask_mapping := attention_mask, dict)" not in source:
        return f"{type(decoder).__name__}'s forward does not take a mask per layer type (its sliding window's)"
    return None


def static_cache_reason() -> str | None:
    """Why `StaticRowsLayer` cannot be built with the installed transformers (say, an abstract method added to
    `CacheLayerMixin`, or a changed `Cache` constructor), or None; checked before the engine is chosen."""
    try:
        keys = torch.zeros((1, 1, 2, 1))  # [N, H, L, D]
        Cache(layers=[StaticRowsLayer(keys, keys.clone(), torch.zeros(1, dtype=torch.long))])
    except Exception as error:  # whatever the new version raises: the engine is skipped with the reason, not run
        return (
            f"transformers {transformers.__version__} cannot build the engine's static cache layer "
            f"({type(error).__name__}: {error})"
        )
    return None


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
    logps: torch.Tensor | None = None  # [N, T] float32: each drawn token's log-prob (None: not recorded)
    window: torch.Tensor | None = None  # [1] long: the sliding window (None: every layer attends to all it sees)


@dataclass
class _Bucket:
    prompt_slots: int  # P_bucket: the prompt ends at this cache position
    settings: SamplingSettings  # constants of its compiled step
    cache: Cache
    state: DecodeState
    compiled: bool = False  # its first step has run (and compiled, its time logged)
    eager: bool = False  # its compiled step failed: the step runs eagerly
    trial_calls: int = 0  # compiled steps run under `_guarded_step` so far (warm-up, recording, first replay)


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
    if state.logps is not None:  # fixed per bucket: no branch in the graph
        state.logps.index_copy_(1, state.column, torch.log_softmax(scores, dim=-1).gather(1, tokens[:, None]))
    state.column.add_(1)
    state.input_ids.copy_(tokens[:, None])
    if state.seen is not None:
        state.seen.scatter_(1, tokens[:, None], True)


def decode_step(
    model, cache: Cache, state: DecodeState, settings: SamplingSettings, cache_keyword: str = "past_key_values"
) -> None:
    """One token for every row: forward the last token, process the logits, draw. Static shapes, no host sync, no
    data-dependent Python branch: `torch.compile(decode_step, fullgraph=True, mode="reduce-overhead")` captures it.
    `cache_keyword`: the keyword the model's forward takes the cache by (`sampling.cache_keyword`)."""
    attend = True if state.attention_mask.dtype == torch.bool else 0.0
    state.attention_mask.index_fill_(-1, state.slot, attend)  # the new token sees itself
    logits = model(
        input_ids=state.input_ids,
        attention_mask=step_masks(state),
        position_ids=state.position_ids,
        use_cache=True,
        **{cache_keyword: cache},
    ).logits[:, -1]  # [N, V]
    state.slot.add_(1)
    state.position_ids.add_(1)
    draw(logits, state, settings)


def step_masks(state: DecodeState):
    """The 4-D mask [N, 1, 1, L] the step's token attends with; with a sliding window, one per layer type, the
    models' own convention (`{"full_attention": ..., "sliding_attention": ...}`, which their forward takes as built):
    a sliding layer's token at slot s sees the slots s - window + 1 ... s, its last `window` positions (a prompt's and
    its completion's slots are contiguous), of those the full mask shows."""
    if state.window is None:  # fixed per bucket: no branch in the graph
        return state.attention_mask
    mask = state.attention_mask  # [N, 1, 1, L]
    recent = torch.arange(mask.size(-1), device=mask.device) > state.slot - state.window  # [L]
    if mask.dtype == torch.bool:
        sliding = mask & recent
    else:
        sliding = mask.masked_fill(~recent, torch.finfo(mask.dtype).min)
    return {"full_attention": mask, "sliding_attention": sliding}


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


def _weights_pointers(model) -> tuple[int, ...]:
    return tuple(p.data_ptr() for p in model.parameters())


# ----------------------------------------------------------------------------------------------------
# The engine


class CUDAGraphEngine(RolloutEngine):
    """A static KV cache and `decode_step` compiled with `mode="reduce-overhead"` (one CUDA graph per bucket).

    `compile`: None compiles on CUDA and runs the same step eagerly elsewhere; `compile_kwargs` are what
    `torch.compile` gets. `autocast`: a context manager factory the whole call runs under (the trainer's
    `accelerator.autocast`), so that the decode runs in the training precision also where the model called is not the
    autocast-wrapped one (a PEFT wrapper's base model). `prompt_bucket` rounds prompt lengths up; `check_every` is how
    often (in tokens) the host asks whether every row has finished; `max_row_padding`: a compiled bucket takes batches
    of down to 1 / `max_row_padding` of its rows; `max_compiles`: Dynamo's recompile limit for the step while the
    engine decodes (unless set higher), i.e. how many shapes it may be compiled for in this process; past it, a new
    bucket's step runs eagerly. `trial_calls`: a compiled bucket's first calls (warm-up, CUDA-graph recording, first
    replay) run guarded: an error there leaves the bucket eager, with the batch intact. `grouped_query_attention`:
    decode GQA models with `grouped_decode_attention` (no copy of the cache).
    """

    name = "cuda_graph"
    options = ("compile", "autocast")
    can_record_logps = True
    fixed_length = True  # one captured graph per length: a tool episode's shorter turns are cut, not recaptured
    prompt_bucket = 64
    check_every = 16
    max_row_padding = 4
    max_compiles = 64
    trial_calls = 3
    grouped_query_attention = True

    def __init__(
        self, generation_config, eos_token_ids, compile: bool | None = None, autocast: Callable | None = None
    ):
        super().__init__(generation_config, eos_token_ids)
        self.compile = compile
        self.autocast = autocast or contextlib.nullcontext
        self.compile_kwargs = {"mode": "reduce-overhead", "fullgraph": True, "dynamic": False}
        self._buckets: dict[tuple, _Bucket] = {}  # by (family, rows, prompt slots)
        self._step = None  # the compiled decode_step, made at first use
        self._weights = None  # data pointers of the parameters the buffers and graphs were made with

    @classmethod
    def unsupported_reason(cls, model, generation_config) -> str | None:
        layers = (DynamicLayer, DynamicSlidingWindowLayer)  # and the warpers and repetition penalty only, no stage
        reason = unsupported_reason(model, generation_config, layers=layers, stage=False)
        if reason is not None:
            return reason
        model = base_model(model)
        if not getattr(model, "_can_compile_fullgraph", False):
            return f"{type(model).__name__} does not support a static, compiled cache"
        attention = getattr(model.config, "_attn_implementation", None)
        if attention not in ("sdpa", "eager"):
            return f"attention {attention!r} does not take a 4-D mask as is (sdpa and eager do)"
        return sliding_window_reason(model) or static_cache_reason()

    def on_weights_updated(self, model) -> None:
        """In-place updates need nothing (the graph reads the parameters where they are); moved parameters drop the
        buffers and the compiled step, so that nothing keeps the old ones alive."""
        if self._weights is not None and _weights_pointers(base_model(model)) != self._weights:
            logger.info("cuda_graph: the parameters moved; dropping the static buffers and the compiled step")
            self._buckets.clear()
            self._step, self._weights = None, None

    @torch.no_grad()
    def sample(self, model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> torch.Tensor:
        model = base_model(model)
        self.on_weights_updated(model)
        self._weights = _weights_pointers(model)
        settings = SamplingSettings.of(model, self.generation_config)
        compiles = self._compiles(model)
        with self.autocast():
            logits, prefill, rows = _prefill(model, prompt_ids, prompt_mask)  # [U, V], cache of U rows, [N]
            bucket = self._bucket(model, prompt_ids.shape, prefill, logits.size(-1), settings, share_rows=compiles)
            rows = _load_prompts(bucket, prompt_ids, prompt_mask, prefill, rows)  # [N_bucket]
            del prefill
            draw(logits[rows], bucket.state, settings)
            limit = max(self.max_compiles, getattr(torch._dynamo.config, _RECOMPILE_LIMIT))
            grouped = self.grouped_query_attention and uses_grouped_queries(model)
            # fallback_random: inductor draws torch.rand as eager does (its own kernel draws float32, then casts)
            patches = torch._dynamo.config.patch(**{_RECOMPILE_LIMIT: limit})
            with patches, torch._inductor.config.patch(fallback_random=True), decode_attention(model, grouped):
                step = self._compiled_step() if compiles and not bucket.eager else decode_step
                self._decode(step, model, bucket, limit, cache_keyword(model))
        length = int(bucket.state.running_steps[0])  # the one sync that waits for the last step
        if bucket.state.logps is not None:
            self.sampling_logps = bucket.state.logps[: prompt_ids.size(0), :length].clone()  # [N, T]
        return bucket.state.completion_ids[: prompt_ids.size(0), :length].clone()  # [N, T]: the buffer is reused

    def _decode(self, step, model, bucket: _Bucket, limit: int, keyword: str) -> None:
        """Decode steps until max_new_tokens or until every row has finished (asked every `check_every` tokens)."""
        poll = _FinishedPoll(bucket.state.finished.device)
        for t in range(1, self.generation_config.max_new_tokens):
            if t % self.check_every == 0:
                if poll.read():
                    break
                poll.post(bucket.state.finished)
            if step is not decode_step and bucket.trial_calls < self.trial_calls:
                step = self._guarded_step(step, model, bucket, limit, keyword)
                continue
            step(model, bucket.cache, bucket.state, bucket.settings, keyword)

    def _guarded_step(self, step, model, bucket: _Bucket, limit: int, keyword: str):
        """One of a compiled bucket's first `trial_calls` steps (the first compiles and is timed for the log; with
        CUDA graphs the second records one and the third replays it). An error (a compile that fails or passes the
        recompile limit, a failed capture, an out-of-memory in the graph pool, a failed kernel launch) restores the
        state as it was before the step and leaves the bucket eager, with one warning: the batch goes on, eagerly.
        Returns the step to go on with."""
        state = bucket.state
        saved = [(t, t.clone()) for t in (getattr(state, f.name) for f in fields(state)) if t is not None]
        start = time.perf_counter()
        try:
            step(model, bucket.cache, state, bucket.settings, keyword)
            if state.finished.is_cuda:
                torch.cuda.synchronize()  # a launch failure shows here, in the guard (paid for a few steps only)
        except torch._dynamo.exc.RecompileError:  # `error_on_recompile=True`: asked for, so not caught
            raise
        except (RuntimeError, *_COMPILE_ERRORS) as error:
            for tensor, copy in saved:
                tensor.copy_(copy)
            self._warn_fallback(bucket, error, limit)
            bucket.compiled = bucket.eager = True
            decode_step(model, bucket.cache, state, bucket.settings, keyword)
            return decode_step
        bucket.trial_calls += 1
        if not bucket.compiled:
            bucket.compiled = True
            rows, positions = state.attention_mask.size(0), state.attention_mask.size(-1)
            seconds = time.perf_counter() - start
            logger.info(
                "cuda_graph: compiled the decode step for %d rows x %d positions in %.1f s (once per bucket)",
                rows,
                positions,
                seconds,
            )
        return step

    def _warn_fallback(self, bucket: _Bucket, error: BaseException, limit: int) -> None:
        rows, positions = bucket.state.attention_mask.size(0), bucket.state.attention_mask.size(-1)
        stage = "compile" if not bucket.compiled else f"run (compiled call {bucket.trial_calls + 1})"
        logger.warning(
            "cuda_graph: the decode step for %d rows x %d positions did not %s (%s: %s); it runs eagerly for this "
            "shape. Each new shape compiles once, up to %d shapes per process (CUDAGraphEngine.max_compiles or "
            "torch._dynamo.config.%s, whichever is higher); TORCH_LOGS=recompiles,cudagraphs says more, and the "
            "grpo_hf.rollout logger at DEBUG gives the traceback",
            rows,
            positions,
            stage,
            type(error).__name__,
            " ".join(str(error).strip().split("\n\n")[0].split())[:500],  # its first paragraph
            limit,
            _RECOMPILE_LIMIT,
        )
        logger.debug("cuda_graph: the error in full", exc_info=error)

    def _compiles(self, model) -> bool:
        if self.compile is None:
            return next(model.parameters()).device.type == "cuda"
        return self.compile

    def _compiled_step(self):
        if self._step is None:
            self._step = torch.compile(decode_step, **self.compile_kwargs)
        return self._step

    def _bucket(self, model, batch_shape, prefill: DynamicCache, vocab_size: int, settings, share_rows) -> _Bucket:
        """The static buffers for N rows x P prompt positions: of the buckets of the same family (every other size,
        the dtypes, the sampling settings), the smallest that holds them (as many prompt slots or more; when
        `share_rows`, up to `max_row_padding` times the rows), else a new one, which replaces the buckets of its
        family that it would hold."""
        N, P = batch_shape
        first = prefill.layers[0]
        attention = model.config._attn_implementation
        mask_dtype = torch.bool if attention == "sdpa" else model.get_input_embeddings().weight.dtype
        T = self.generation_config.max_new_tokens
        heads, head_dim, value_dim = first.keys.size(1), first.keys.size(3), first.values.size(3)
        family = (T, vocab_size, len(prefill.layers), first.keys.device, heads, head_dim, value_dim)
        family = (*family, first.keys.dtype, first.values.dtype, mask_dtype, settings, self.record_logps)
        family = (*family, _sliding_window(prefill))

        def holds(rows: int, slots: int, n: int, p: int) -> bool:
            return slots >= p and (n <= rows <= self.max_row_padding * n if share_rows else rows == n)

        fits = [(rows, slots) for kin, rows, slots in self._buckets if kin == family and holds(rows, slots, N, P)]
        if fits:
            return self._buckets[(family, *min(fits))]
        prompt_slots = -(-P // self.prompt_bucket) * self.prompt_bucket
        for key in [key for key in self._buckets if key[0] == family and holds(N, prompt_slots, *key[1:])]:
            del self._buckets[key]
        bucket = _new_bucket(
            prefill, N, prompt_slots, T, vocab_size, mask_dtype, settings, self.eos_token_ids, self.record_logps
        )
        self._buckets[(family, N, prompt_slots)] = bucket
        return bucket


def _new_bucket(
    prefill, N, prompt_slots, T, vocab_size, mask_dtype, settings, eos_token_ids, record_logps=False
) -> _Bucket:
    """The static cache (in the prefill's key and value dtypes, which differ under autocast) and decode state (with a
    log-prob buffer when `record_logps`, the sliding window when some layers have one). A sliding-window layer's
    buffers span every slot too: the step's mask gives it its window (`step_masks`)."""
    device = prefill.layers[0].keys.device
    window = _sliding_window(prefill)
    L = prompt_slots + T
    with_seen = settings.repetition_penalty != 1  # the repetition penalty's [N, V] mask
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
        logps=torch.zeros((N, T), dtype=torch.float32, device=device) if record_logps else None,
        window=None if window is None else torch.tensor([window], dtype=torch.long, device=device),
    )
    _mark_static(*(getattr(state, name) for name in state.__dataclass_fields__))
    return _Bucket(prompt_slots, settings, Cache(layers=layers), state)


def _windows(cache: DynamicCache) -> set[int]:
    return {layer.sliding_window for layer in cache.layers if isinstance(layer, DynamicSlidingWindowLayer)}


def _sliding_window(prefill: DynamicCache) -> int | None:
    """The window of the prefill's sliding-window layers (one: `sliding_window_reason`), or None."""
    return max(_windows(prefill), default=None)


@torch.no_grad()
def _prefill(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor):
    """Forward each distinct prompt once (eagerly): last-position logits [U, V], their `DynamicCache`, and the index
    [N] of each row's distinct prompt."""
    cache = DynamicCache(config=model.config)
    logits, rows = prefill_distinct_prompts(model, prompt_ids, prompt_mask, cache)  # [U, V], [N]
    return logits, cache, rows


def _load_prompts(bucket: _Bucket, prompt_ids, prompt_mask, prefill: DynamicCache, rows) -> torch.Tensor:
    """Reset `bucket` in place for this batch: prompts' keys/values into the cache rows, masks, positions, counters.
    The bucket's rows beyond the batch's repeat its first row and start finished. Returns each bucket row's index into
    the prefill's distinct prompts [N_bucket]."""
    N, P = prompt_ids.shape
    state = bucket.state
    spare = state.finished.size(0) - N
    if spare:
        pick = torch.arange(N + spare, device=prompt_ids.device)  # [N_bucket]
        pick[N:] = 0
        prompt_ids, prompt_mask, rows = prompt_ids[pick], prompt_mask[pick], rows[pick]
    start, stop = bucket.prompt_slots - P, bucket.prompt_slots
    for layer, source in zip(bucket.cache.layers, prefill.layers, strict=True):
        kept = source.keys.size(2)  # P; a sliding-window layer keeps its last window - 1 (the step's mask hides more)
        layer.keys[:, :, stop - kept : stop].copy_(source.keys[rows])
        layer.values[:, :, stop - kept : stop].copy_(source.values[rows])
    visible = torch.zeros((N + spare, state.attention_mask.size(-1)), dtype=torch.bool, device=prompt_ids.device)
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
    state.finished[N:] = True
    state.completion_ids.fill_(bucket.settings.pad_token_id)
    state.column.zero_()
    state.running_steps.zero_()
    if state.logps is not None:
        state.logps.zero_()
    if state.seen is not None:
        state.seen.copy_(prompt_seen_mask(prompt_ids, prompt_mask, state.seen.size(1)))
    return rows
