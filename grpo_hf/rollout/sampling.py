"""Sampling settings shared by the decoding engines: the settings an engine must resolve as `generate` does, the
processors they apply (`logits_processors`, the description of `sampling_spec.SamplingSpec`), an exact categorical
draw, per-row random streams (`RowDraws`): counter-based uniforms, so that what a row samples does not depend on which
batch, step or thread draws it, `RecordLogps`, which records the log-probs `model.generate` drew its tokens with, and
`SamplingReplay`, which applies the same spec to the trainer's logits, so that an importance weight compares the
sampler's log-probs with the trainer's under one distribution.

The repetition penalty and left padding: which tokens the installed `generate` penalises is checked once, at import
(`GENERATE_SKIPS_PADDING`): transformers >= 5.23 skips each row's left padding, 5.19 to 5.22 penalise every input
token, the pad token of a left-padded row included. The engines that follow `generate` (`loop`, `generate` through
the spec's stage, `cuda_graph`) and the replay read it (`SamplingSpec.penalty_skips_padding`, `unpenalised_padding`);
a multi-turn decoder whose batch is not `generate`'s (`loop.decode_turns`) skips the padding on every version, so
that a row's tokens do not depend on its batch. The penalty itself is written from its formula
(`sampling_spec.repetition_penalty`), so every transformers version applies it alike.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import transformers
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.cache_utils import DynamicLayer

from grpo_hf.cache_layers import cache_keyword, cache_layer_classes, layers_outside
from grpo_hf.core import CHUNK_ELEMENTS, prompt_runs
from grpo_hf.rollout.sampling_spec import (  # noqa: F401 (resolve_sampling_settings, GENERATE_SKIPS_PADDING: here too)
    _SAMPLING_DEFAULTS,
    GENERATE_SKIPS_PADDING,
    NEUTRAL_SETTINGS,
    STAGE_SETTINGS,
    SamplingSpec,
    resolve_sampling_settings,
)
from grpo_hf.vision import forward_kwargs, split_runs, uses_mrope

logger = logging.getLogger(__name__)

# The settings an engine of its own may leave aside: those that change nothing in how tokens are drawn
# (`sampling_spec.NEUTRAL_SETTINGS`) but `cache_implementation`, which names a cache only `generate` builds.
_NEUTRAL_SETTINGS = NEUTRAL_SETTINGS - {"cache_implementation"}


def unsupported_reason(
    model, generation_config, *, layers: tuple[type, ...] = (DynamicLayer,), stage: bool = True
) -> str | None:
    """Why grpo_hf's own decoders (`loop`, `cuda_graph`) would not draw what `model.generate` draws, or None.

    They need sampling (`do_sample=True`), `max_new_tokens` and a pad token; neither the config nor the
    model's own `generation_config` (whose values `generate` uses where the config has none) may set
    anything but the sampling settings of `_SAMPLING_DEFAULTS`, the neutral ones and, where the engine applies the
    spec's stage (`stage`: `loop`; `sampling_spec.STAGE_SETTINGS`), n-grams, bad words, biases, min_new_tokens and
    suppressed tokens; and the model must
    be decoder-only, with the `DynamicCache` that `generate` builds for it, every layer of which is one of the
    cache layer classes `layers` that the engine serves (`cuda_graph`: full attention; `loop`:
    `cache_layers.SELECTABLE`). The reason names the layers it does not serve, by class and index.
    """
    config = getattr(model, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False) or not hasattr(model, "get_decoder"):
        return "the model is not a decoder-only causal LM"
    if not generation_config.do_sample:
        return "do_sample=False"
    if generation_config.max_new_tokens is None:
        return "max_new_tokens is not set"
    if generation_config.pad_token_id is None:
        return "there is no pad token"
    allowed = _NEUTRAL_SETTINGS | set(_SAMPLING_DEFAULTS) | (set(STAGE_SETTINGS) if stage else set())
    for where, settings in (("generation settings", generation_config), ("model's generation_config", None)):
        settings = settings if settings is not None else getattr(model, "generation_config", None)
        extra = sorted(set(settings.to_diff_dict()) - allowed) if settings is not None else []
        if extra:
            return f"the {where} set {', '.join(extra)}, which only model.generate implements"
    supports_dynamic = getattr(model, "_supports_default_dynamic_cache", None)
    if supports_dynamic is not None and not supports_dynamic():
        return f"{type(model).__name__} makes its own cache in model.generate, not a DynamicCache"
    if cache_layer_classes(config) is None:  # a config the cache classes do not understand: leave it to `generate`
        return f"transformers builds no DynamicCache for {type(config).__name__}"
    odd = layers_outside(config, layers)
    if odd is not None:
        return f"the model's cache has layers this engine does not serve: {odd}"
    return None


def supports_sample_groups(model, generation_config) -> bool:
    """Whether `sample_groups` draws what `model.generate` would for this model and config."""
    return unsupported_reason(model, generation_config) is None


def unpenalised_padding(prompt_mask: torch.Tensor, skip_padding: bool | None = None) -> torch.Tensor:
    """[N] long: how many leading positions of each row the repetition penalty does not read: the row's left padding
    (`prompt_mask` [N, P] is 0 there) where the padding is skipped, else 0. `skip_padding` None: as the installed
    `generate` does (`GENERATE_SKIPS_PADDING`)."""
    if skip_padding is None:
        skip_padding = GENERATE_SKIPS_PADDING
    if not skip_padding:
        return torch.zeros(prompt_mask.size(0), dtype=torch.long, device=prompt_mask.device)
    return (prompt_mask != 0).int().argmax(dim=1)  # [N]


def logits_processors(
    generation_config, prompt_mask: torch.Tensor, sampling: bool = True, skip_padding: bool | None = None
) -> LogitsProcessorList:
    """The processors the engines apply for these resolved settings, in `generate`'s order
    (`sampling_spec.SamplingSpec.processors`): the stage (repetition penalty, read as the installed `generate` reads
    the prompts' left padding, or as `skip_padding` says; n-grams, bad words, biases, suppressed tokens), then, when
    `sampling` (greedy decoding applies none of them), temperature, top-k, top-p and min-p."""
    spec = SamplingSpec.from_config(generation_config, skip_padding=skip_padding)
    return spec.processors(prompt_mask, sampling=sampling)


def sampling_warpers(generation_config) -> LogitsProcessorList:
    """The processors `model.generate` applies only when sampling, in its order: temperature, top-k, top-p, min-p."""
    return SamplingSpec.from_config(generation_config).warpers()


def sample_categorical(probs: torch.Tensor, uniform: torch.Tensor | None = None) -> torch.Tensor:
    """One index per row of `probs` [N, V], drawn with probability `probs[i, v] / probs[i].sum()`.

    Inverse transform sampling: the first v whose cumulative probability exceeds u * total, with u
    uniform in [0, 1) (`uniform` [N, 1], drawn here when None). The cumulative sum is taken in float64
    (float32 where the device has no float64), so a token's interval has its probability's width to
    ~1e-16. A zero-probability token is never drawn: its interval is empty, and rounding at the very
    top is sent to the last token with p > 0. Returns `[N]` (long).
    """
    dtype = torch.float32 if probs.device.type == "mps" else torch.float64
    if uniform is None:
        uniform = torch.rand((probs.size(0), 1), dtype=dtype, device=probs.device)
    return inverse_cdf(probs.to(dtype), uniform.to(dtype))


@torch.library.custom_op("grpo_hf::inverse_cdf", mutates_args=())
def inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """The index [N] of the first entry of each row of `probs` [N, V] whose cumulative sum exceeds `uniform` [N, 1]
    times the row's total, kept at or below the row's last positive entry (`sample_categorical`).

    An operator of its own, which `torch.compile` calls rather than lowers: inductor turns a cumulative sum over a
    whole vocabulary row (151,936 entries for Qwen2.5) into a split scan, and its Triton code for a float64 one fails
    in torch 2.11 ("list indices must be integers or slices, not NoneType", seen on an H100), which left the compiled
    decode step eager. As an operator the draw runs the same eager kernels in every build, compiled or not, and is
    captured into the CUDA graph like any other kernel.
    """
    cdf = probs.cumsum(dim=-1)  # [N, V]
    index = torch.searchsorted(cdf, uniform * cdf[:, -1:], right=True).squeeze(1)  # [N]
    last_positive = probs.size(-1) - 1 - (probs.flip(-1) > 0).int().argmax(dim=-1)  # [N]
    return torch.minimum(index, last_positive)


@inverse_cdf.register_fake
def _(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    return probs.new_empty(probs.size(0), dtype=torch.long)


@torch.library.custom_op("grpo_hf::cumsum", mutates_args=())
def cumsum(values: torch.Tensor) -> torch.Tensor:
    """`values.cumsum(dim=-1)` as an operator that `torch.compile` calls rather than lowers (see `inverse_cdf`); top-p
    sums the sorted vocabulary with it."""
    return values.cumsum(dim=-1)


@cumsum.register_fake
def _(values: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(values)


def prefill_distinct_prompts(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, cache, images=None):
    """Forward each distinct prompt (a run of identical rows, `prompt_runs`; with `images`, also the same image
    inputs, `grpo_hf.vision`) once into `cache`.

    Positions are numbered as `generate` numbers them (the first real token is 0, left padding gets 1); a model with
    3-D positions (M-RoPE) numbers a batch with images itself. Returns the last position's logits [U, V] and, for each
    of the N rows, the index of its prompt [N].
    """
    runs = split_runs(prompt_runs(prompt_ids, prompt_mask), images)
    counts = torch.tensor([stop - start for start, stop in runs], device=prompt_ids.device)  # [U]
    rows = torch.arange(len(runs), device=prompt_ids.device).repeat_interleave(counts)  # [N]
    starts = [start for start, _ in runs]
    unique_ids, unique_mask = prompt_ids[starts], prompt_mask[starts]  # [U, P]
    position_ids = (unique_mask.long().cumsum(-1) - 1).masked_fill(unique_mask == 0, 1)  # [U, P]
    vision = forward_kwargs(model, unique_ids, [images[i] for i in starts] if images is not None else None)
    if vision and uses_mrope(model):
        position_ids = None  # the model's own 3-D numbering, which also records each prompt's offset
    logits = model(
        input_ids=unique_ids,
        attention_mask=unique_mask,
        position_ids=position_ids,
        use_cache=True,
        logits_to_keep=1,
        **vision,
        **{cache_keyword(model): cache},
    ).logits[:, -1]  # [U, V]
    return logits, rows


# ---- per-row random streams -----------------------------------------------------------------------------------------
_GAMMA = -7046029254386353131  # 0x9e3779b97f4a7c15 (splitmix64's increment) as a signed 64-bit integer
_MIX1 = -4658895280553007687  # 0xbf58476d1ce4e5b9
_MIX2 = -7723592293110705685  # 0x94d049bb133111eb


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """`z >> bits` on the 64 bits of an int64 tensor read as unsigned (torch's `>>` copies the sign bit)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def _mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors (their multiplication and addition wrap modulo 2**64)."""
    z = (z ^ _shift_right(z, 30)) * _MIX1
    z = (z ^ _shift_right(z, 27)) * _MIX2
    return z ^ _shift_right(z, 31)


def counter_uniform(seed: int, streams: torch.Tensor, counters: torch.Tensor, dtype=torch.float64) -> torch.Tensor:
    """The uniform in [0, 1) [A, 1] of each stream `streams` [A] at its draw `counters` [A] (int64): a hash of
    (seed, stream, counter), nothing else, so a row draws the same numbers in any batch, at any step, on any thread.

    splitmix64's finaliser applied twice, `mix(mix(seed + stream * gamma) + counter * gamma)` in wrapping 64-bit
    arithmetic; its top 53 bits (24 for float32, where the device has no float64) make the uniform."""
    key = _mix64(_mix64(streams * _GAMMA + seed) + counters * _GAMMA)  # [A]
    bits = 53 if dtype == torch.float64 else 24
    return (_shift_right(key, 64 - bits).to(dtype) * 2.0**-bits)[:, None]


def draw_seed() -> int:
    """A stream seed: one draw from torch's global (CPU) generator, so `torch.manual_seed` fixes it."""
    return int(torch.randint(-(2**63), 2**63 - 1, (1,), dtype=torch.long))


@dataclass
class RowDraws:
    """Each row's random stream, counter-based: a row's k-th draw is `counter_uniform(seed, stream, k)`.

    A row that samples a turn of an episode holds its episode's stream and the number of tokens the episode has
    sampled so far, so the uniform behind every sampled token depends on (seed, episode, its index) alone: not on
    which other rows share the batch, at which step the turn started, or how long the tools took."""

    seed: int
    streams: torch.Tensor  # [A] long: each row's stream
    counters: torch.Tensor  # [A] long: each row's next draw

    def uniform(self, dtype=torch.float64) -> torch.Tensor:
        """Each row's next uniform [A, 1]; the counters move on by one."""
        uniform = counter_uniform(self.seed, self.streams, self.counters, dtype)
        self.counters = self.counters + 1
        return uniform

    def to(self, device) -> RowDraws:
        return RowDraws(self.seed, self.streams.to(device), self.counters.to(device))

    def take(self, index: torch.Tensor) -> RowDraws:
        """Rows `index` [A']."""
        return RowDraws(self.seed, self.streams[index], self.counters[index])

    def cat(self, other: RowDraws) -> RowDraws:
        """These rows, then `other`'s (the same seed)."""
        streams, counters = torch.cat([self.streams, other.streams]), torch.cat([self.counters, other.counters])
        return RowDraws(self.seed, streams, counters)


# `model.generate` warpers that `DrawFromStreams` does not implement (with one set it cannot draw in their place).
_OTHER_WARPERS = {"typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "top_h": None}


def streams_unsupported_reason(model, generation_config) -> str | None:
    """Why `DrawFromStreams` cannot draw what `model.generate` would for `model` with these settings, or None."""
    if not generation_config.do_sample:
        return "do_sample=False (greedy decoding draws nothing)"
    for settings in (generation_config, getattr(model, "generation_config", None)):
        for name, neutral in _OTHER_WARPERS.items():
            value = getattr(settings, name, None)
            if value is not None and value != neutral:
                return f"{name}={value} is set, which only model.generate's own draw implements"
    return None


class DrawFromStreams(LogitsProcessor):
    """Makes `model.generate` draw each row's token from the row's own stream (`RowDraws`).

    `generate` runs a caller's processors after its own and before its sampling warpers, then draws with
    `torch.multinomial` from the global generator. This processor applies those warpers itself (`sampling_warpers`
    of the settings `resolve_sampling_settings` gives), draws each row's token by inverse transform with the row's
    next uniform, and returns scores that are 0 on that token and -inf elsewhere: `generate`'s warpers keep such a
    row as it is, and `multinomial` can only pick the token. The distribution drawn from is `generate`'s; the
    randomness is the rows' streams."""

    def __init__(self, generation_config, draws: RowDraws):
        self.warpers, self.draws = sampling_warpers(generation_config), draws

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.warpers(input_ids, scores).float(), dim=-1)  # [A, V]
        dtype = torch.float32 if scores.device.type == "mps" else torch.float64
        tokens = sample_categorical(probs, self.draws.uniform(dtype))  # [A]
        return torch.full_like(scores, float("-inf")).scatter_(1, tokens[:, None], 0.0)


class RecordLogps(LogitsProcessor):
    """Records the log-probability each token `model.generate` samples was drawn with; changes no score.

    A caller's processor runs after `generate`'s own (repetition penalty, suppressed tokens) and before its sampling
    warpers, so it sees the scores those warpers take. This one applies the same warpers (`sampling_warpers` of the
    settings `resolve_sampling_settings` gives) to a copy, keeps the log-softmax [N, V] of the result (the
    distribution `generate` draws from, or `DrawFromStreams`, which must come after it in the list), and reads the
    token drawn from it at its next call, whose `input_ids` end with that token; `logps` reads the last one from the
    completion. For the settings `streams_unsupported_reason` accepts."""

    def __init__(self, generation_config):
        self.warpers = sampling_warpers(generation_config)
        self.columns: list[torch.Tensor] = []  # [N, 1] per token drawn and read back so far
        self.pending: torch.Tensor | None = None  # [N, V] float32: the log-probs the last token was drawn from

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.pending is not None:
            self.columns.append(self.pending.gather(1, input_ids[:, -1:]))
        self.pending = torch.log_softmax(self.warpers(input_ids, scores).float(), dim=-1)  # [N, V]
        return scores

    def logps(self, completion_ids: torch.Tensor) -> torch.Tensor:
        """The log-probs [N, T] float32 of `completion_ids` [N, T], the tokens `generate` drew while this recorded."""
        if self.pending is None or len(self.columns) + 1 != completion_ids.size(1):
            raise RuntimeError(
                f"RecordLogps saw {len(self.columns) + (self.pending is not None)} draws for a completion of "
                f"{completion_ids.size(1)} tokens: it must record every step of one `generate` call."
            )
        last = self.pending.gather(1, completion_ids[:, -1:])  # [N, 1]
        return torch.cat([*self.columns, last], dim=1)  # [N, T]


# ---- the sampling distribution, replayed on the trainer's logits ----------------------------------------------------
def changes_distribution(generation_config, temperature: float = 1.0) -> bool:
    """Whether the resolved settings draw from another distribution than the softmax of the logits at `temperature`
    (`SamplingSpec.changes_distribution`)."""
    return SamplingSpec.from_config(generation_config).changes_distribution(temperature)


@torch.no_grad()
def replayed_logps(
    logits: torch.Tensor,
    completion_ids: torch.Tensor,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    mask: torch.Tensor,
    spec: SamplingSpec,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """The log-probs [n, t] float32 of `completion_ids` [n, t] under the distribution the engines draw each token from,
    from the logits [n, t, V] that predict them: `spec`'s stage and warpers, exactly as the engines apply them at that
    token's step, then log-softmax. At the positions of `mask` [n, t]; 0 off it.

    A token outside the kept support (top-k, top-p, min-p, a banned token) gets -inf. The stage reads each position's
    context, the row's prompt (`prompt_ids` [n, P], from its first real token: `prompt_mask` is 0 on its left
    padding; the repetition penalty reads the padding where the spec says) and its completion before the position
    (tool output included), with the count of tokens before it: each position's context is right-aligned to the
    widest one, [P + t - 1] tokens, and what lies before it is read by no processor (`lead`). Positions go
    `chunk_size` at a time (default: `CHUNK_ELEMENTS` logits, or context ids, per chunk), each upcast to float32 as
    `generate` upcasts its scores: a few chunk-sized temporaries, never a float32 copy of `logits`.
    """
    n, t, V = logits.shape
    logps = torch.zeros((n, t), dtype=torch.float32, device=logits.device)  # [n, t]
    rows, columns = mask[:, :t].nonzero(as_tuple=True)  # [K] the positions to replay
    P, warpers = prompt_ids.size(1), spec.warpers()
    reads = spec.reads_context()  # else the stage reads only the counts, and the warpers nothing
    context = torch.cat([prompt_ids, completion_ids[:, : max(t - 1, 0)]], dim=1) if reads else None  # [n, P + t - 1]
    padding = (prompt_mask != 0).int().argmax(dim=1)  # [n]
    step = chunk_size or max(1, CHUNK_ELEMENTS // max(V, context.size(1) if reads else 0))
    for start in range(0, rows.numel(), step):
        r, c = rows[start : start + step], columns[start : start + step]  # [k]
        tokens = completion_ids[r, c]  # [k]
        if reads:
            shift = context.size(1) - (P + c)  # [k] positions before each context, once right-aligned
            positions = torch.arange(context.size(1), device=context.device)[None]  # [1, W]
            inputs = context[r].gather(1, (positions - shift[:, None]).clamp(min=0))  # [k, W]
            lead = shift + padding[r]  # [k] what lies before each row's first real token
        else:
            inputs, lead = tokens[:, None], torch.zeros_like(c)  # [k, 1]: read by nothing
        scores = warpers(inputs, spec.apply_stage(inputs, logits[r, c].float(), lead, c))  # [k, V]
        logps[r, c] = torch.log_softmax(scores, dim=-1).gather(1, tokens[:, None]).squeeze(1)
    return logps


@dataclass(frozen=True)
class SamplingReplay:
    """The engines' sampling distribution, replayed on the trainer's logits (`replayed_logps`).

    Every engine records the log-probs its tokens were drawn with (after the spec's stage, temperature and
    truncation), which the trainer's temperature-only log-probs over the whole vocabulary are not. A weight
    pi_prox / pi_behav that compares the two carries log(kept mass) at every token, even with unchanged weights; with
    the proximal policy's log-probs replayed under the same processors, it measures the policy's drift only.
    `of` gives None where the two distributions are one (nothing processed, the same temperature).

    The repetition penalty reads a row's left padding as the spec says (`SamplingSpec.penalty_skips_padding`: as the
    installed `generate` does, unless the sampler has no padding: vLLM). Before transformers 5.23, `generate`
    penalises the pad token of the rows it got left-padded, and a training micro-batch pads its rows anew, so a row's
    replay can then differ from its draw by that token's penalty (`of` warns)."""

    spec: SamplingSpec  # what the engines sample from (`SamplingSpec.of`)

    @classmethod
    def of(cls, spec: SamplingSpec, temperature: float) -> SamplingReplay | None:
        """The replay of `spec`, or None when it is the softmax at the trainer's `temperature`."""
        if not spec.changes_distribution(temperature):
            return None
        if spec.repetition_penalty != 1.0 and not spec.penalty_skips_padding:
            logger.warning(
                "transformers %s's generate applies the repetition penalty to the pad token of every row it gets "
                "left-padded (transformers >= 5.23 skips the padding), and a training micro-batch pads its rows "
                "anew: the replayed sampling log-probs of a row whose padding differs there are off by that token's "
                "penalty, and so is its importance weight. Upgrade transformers to 5.23 or later for exact weights.",
                transformers.__version__,
            )
        return cls(spec)

    def __call__(self, batch, rows: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """`replayed_logps` [n, t] of the rows `rows` [n] of `batch` (a `batching.Sequences`), from their logits
        [n, t, V] at the first t completion positions, on their completion mask."""
        t = logits.size(1)
        completion_ids = batch.completion_ids[rows, :t]  # [n, t]
        mask = batch.completion_mask[rows, :t]  # [n, t]
        prompt_ids, prompt_mask = batch.prompt_ids[rows], batch.prompt_mask[rows]  # [n, P]
        return replayed_logps(logits, completion_ids, prompt_ids, prompt_mask, mask, self.spec)
