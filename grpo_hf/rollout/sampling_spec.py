"""One description of what a rollout engine samples from, read by every engine and by the replay (`SamplingSpec`).

A spec is built once from (engine kind, generation config, the model's generation config, blocked tokens) and says
which processors run, with which values, in which order. The engines draw through it (`loop`, `generate`: its
`stage`, then its warpers) or pass its values on (`vllm`, `continuous_batching`, `cuda_graph`), and the correction's
replay (`sampling.replayed_logps`) applies the same processors to the trainer's logits, so that an importance weight
compares the sampler's log-probs with the trainer's under one distribution. A setting the spec cannot describe, or
that the engine kind does not apply as described, is named by `refusal`; a trainer with a correction refuses it when
it is built (`check`), never silently skipped.

The stage before the warpers, transformers' order (`GenerationMixin._get_logits_processor`), each written here from
its formula so that every transformers version draws and replays alike:

| processor              | what it does to a row's scores                                         | reads |
|------------------------|-------------------------------------------------------------------------|------|
| blocked tokens         | -inf on a VLM's image tokens (the engines never sample them)            | nothing |
| `sequence_bias`        | + bias on a sequence's last token where the context ends with the rest  | suffix |
| `repetition_penalty`   | score / p where > 0, score * p otherwise, on every token of the context | set |
| `no_repeat_ngram_size` | -inf on a token that would repeat an n-gram of the context              | context |
| `bad_words_ids`        | -inf on a word's last token where the context ends with the rest        | suffix |
| `min_new_tokens`       | -inf on the EOS tokens while fewer tokens were sampled                  | count |
| `suppress_tokens`      | -inf on the tokens                                                      | nothing |
| `begin_suppress_tokens`| -inf on the tokens at the first sampled token                           | count |

Then the warpers, in the engine kind's order: transformers' (`loop`, `generate`, `cuda_graph`,
`continuous_batching`): temperature, top-k, top-p, min-p; vLLM's (`vllm/v1/sample/sampler.py`: penalties, then
temperature, the argmax-invariant min-p processor, then `apply_top_k_top_p`): temperature, min-p, top-k, top-p.

A row's context is its tokens from its first real one: left padding is never read by the n-gram, bad-word or bias
processors; the repetition penalty reads it where the installed `generate` does (`sampling.GENERATE_SKIPS_PADDING`)
unless the spec says otherwise (`penalty_skips_padding`: vLLM and tool episodes skip it). `top_k` of -1 (vLLM's
"off"), 0 or at least the vocabulary means no top-k for every engine and the replay.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import torch
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

# Sampling settings `sample_groups` implements, with the value `generate` uses when neither the call's config nor the
# model's `generation_config` sets one (transformers' global defaults).
_SAMPLING_DEFAULTS = {"temperature": 1.0, "top_k": 50, "top_p": 1.0, "min_p": None, "repetition_penalty": 1.0}
# Settings the stage before the warpers implements, with the value that turns each off in `generate`
# (`neutral_generation_config` gives `generate` these, so that it applies none of them itself).
STAGE_SETTINGS = {
    "sequence_bias": None,
    "repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "bad_words_ids": None,
    "min_new_tokens": 0,
    "suppress_tokens": [],
    "begin_suppress_tokens": [],
}
WARPER_SETTINGS = ("temperature", "top_k", "top_p", "min_p")
# Settings that change nothing in how tokens are drawn (besides the sampling ones above).
NEUTRAL_SETTINGS = frozenset(
    {
        "max_new_tokens",
        "max_length",
        "do_sample",
        "pad_token_id",
        "eos_token_id",
        "bos_token_id",
        "use_cache",
        "cache_implementation",
        "output_attentions",
        "output_hidden_states",
        "output_scores",
        "output_logits",
        "return_dict_in_generate",
        "transformers_version",
        "_from_model_config",
    }
)
# What each engine kind applies as this module describes it, besides the warpers (the rest it refuses).
KIND_APPLIES = {
    "transformers": frozenset(STAGE_SETTINGS),
    "vllm": frozenset({"repetition_penalty"}),
    # transformers' continuous batching penalises only each step's query tokens and crashes on bad_words_ids and
    # no_repeat_ngram_size (transformers 5.25): only the warpers are what this module describes
    "continuous_batching": frozenset(),
}
# transformers 5.25's continuous batching fails on these ("'GenerationConfig' object has no attribute
# '_eos_token_tensor'", "too many indices for tensor"): refused with or without a correction
_CRASHES_CONTINUOUS_BATCHING = frozenset({"bad_words_ids", "no_repeat_ngram_size"})
_ALTERNATIVES = {
    "transformers": "rollout_engine='loop' or 'generate'",
    "vllm": "use_vllm=False with rollout_engine='loop' or 'generate'",
    "continuous_batching": "rollout_engine='loop' or 'generate'",
}


def resolve_sampling_settings(model, generation_config):
    """A copy of `generation_config` whose unset sampling settings hold the values `generate` would use.

    An unset (None) setting takes the model's `generation_config` value, else transformers' default
    (`_SAMPLING_DEFAULTS`, e.g. top_k=50), as `GenerationMixin._prepare_generation_config` does. A top_k that
    truncates nothing (-1, vLLM's "off", or at least the vocabulary) is 0, for every engine
    (`sampling_spec.normal_top_k`).
    """
    resolved = copy.deepcopy(generation_config)
    model_settings = getattr(model, "generation_config", None)
    for name, default in _SAMPLING_DEFAULTS.items():
        if getattr(resolved, name, None) is None:
            value = getattr(model_settings, name, None) if model_settings is not None else None
            setattr(resolved, name, default if value is None else value)
    for name in STAGE_SETTINGS:  # n-grams, bad words, ...: the model's where the call sets none, as `generate`
        if getattr(resolved, name, None) is None and model_settings is not None:
            setattr(resolved, name, copy.deepcopy(getattr(model_settings, name, None)))
    resolved.top_k = normal_top_k(resolved.top_k, vocab_size_of(model))  # -1, 0, >= vocabulary: no top-k
    return resolved


def _penalty_skips_padding() -> bool:
    """Whether the installed `RepetitionPenaltyLogitsProcessor` takes a per-row `prompt_ignore_length` (a 1-D tensor):
    from transformers 5.23 on it does, and `generate` passes it each row's left padding (`GENERATE_SKIPS_PADDING`)."""
    try:
        RepetitionPenaltyLogitsProcessor(1.5, prompt_ignore_length=torch.zeros(1, dtype=torch.long))
    except (TypeError, ValueError):  # 5.19 to 5.22: "`prompt_ignore_length` has to be a positive integer"
        return False
    return True


# Whether `model.generate`'s repetition penalty skips each row's left padding, with the installed transformers.
# transformers >= 5.23: yes; `GenerationMixin._get_logits_processor` builds the processor with `prompt_ignore_length`
# = each row's left-padding length (`(attention_mask != 0).int().argmax(1)`), a per-row tensor that the processor
# accepts from 5.23 on (both changed in 5.23), so a row's penalised tokens are its own. transformers 5.19 to 5.22: no;
# `generate` builds `RepetitionPenaltyLogitsProcessor(penalty)`, which penalises every input token, the pad token of
# a left-padded row included (which rows are padded depends on the batch), and the processor rejects a tensor.
# Probed once, at import, by constructing the processor with a 1-D tensor (both changed together, so the processor's
# signature says what `generate` does); every place that must agree with `generate` reads it (`unpenalised_padding`).
GENERATE_SKIPS_PADDING: bool = _penalty_skips_padding()


def engine_kind(rollout_engine: str, use_vllm: bool = False) -> str:
    """The kind of engine (`KIND_APPLIES`) that samples for these settings."""
    if use_vllm or rollout_engine == "vllm":
        return "vllm"
    return "continuous_batching" if rollout_engine == "continuous_batching" else "transformers"


def normal_top_k(top_k, vocab_size: int | None = None) -> int:
    """`top_k` as every engine applies it: 0 (no top-k) for None, 0, -1 (vLLM's "off") or at least the vocabulary."""
    if top_k is None or top_k <= 0 or (vocab_size is not None and top_k >= vocab_size):
        return 0
    return int(top_k)


def vocab_size_of(model) -> int | None:
    """The width of the model's logits (its output embeddings' rows), or the config's vocab_size; None if unknown."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    if weight is not None and weight.dim() == 2:
        return int(weight.size(0))
    config = getattr(model, "config", None)
    text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
    return getattr(text, "vocab_size", None)


def _token_lists(value) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(i) for i in ids) for ids in value or ())


def _bias_entries(value) -> tuple[tuple[tuple[int, ...], float], ...]:
    """`sequence_bias` as (ids, bias) pairs: from a dict {ids: bias} or transformers' list [[ids, bias], ...]."""
    items = value.items() if isinstance(value, dict) else (value or ())
    return tuple((tuple(int(i) for i in ids), float(bias)) for ids, bias in items)


@dataclass(frozen=True)
class SamplingSpec:
    """What an engine draws each token from: the stage before the warpers (see the module table) and the warpers in
    the kind's order. Frozen; built by `of`."""

    kind: str  # "transformers", "vllm" or "continuous_batching" (`engine_kind`)
    do_sample: bool
    temperature: float
    top_k: int  # 0: none (`normal_top_k`)
    top_p: float
    min_p: float | None
    repetition_penalty: float
    penalty_skips_padding: bool  # the penalty reads a row from its first real token (else its padding too)
    sequence_bias: tuple[tuple[tuple[int, ...], float], ...] = ()
    no_repeat_ngram_size: int = 0
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    min_new_tokens: int = 0
    suppress_tokens: tuple[int, ...] = ()
    begin_suppress_tokens: tuple[int, ...] = ()
    blocked_token_ids: tuple[int, ...] = ()  # a VLM's image tokens
    eos_token_ids: tuple[int, ...] = ()  # what min_new_tokens holds back
    unknown: tuple[str, ...] = ()  # `name=value` of each setting set that this module does not describe

    @classmethod
    def of(cls, model, generation_config, *, kind="transformers", skip_padding=None, blocked_token_ids=()):
        """The spec of `generation_config` for `model`: an unset setting takes the model's `generation_config` value,
        else transformers' default, as `generate` resolves them (`sampling.resolve_sampling_settings`), and top_k at
        or above the model's vocabulary is none. `skip_padding`: whether the repetition penalty skips a row's left
        padding (None: as the installed `generate` does)."""
        config = resolve_sampling_settings(model, generation_config)
        model_config = getattr(model, "generation_config", None)
        spec = cls.from_config(config, kind=kind, skip_padding=skip_padding, blocked_token_ids=blocked_token_ids)
        return dataclasses.replace(spec, unknown=_unknown_settings(generation_config, model_config))

    @classmethod
    def from_config(cls, config, *, kind="transformers", skip_padding=None, blocked_token_ids=()) -> SamplingSpec:
        """The spec of a resolved `config` (every sampling setting set, `of` resolves them) as it is."""
        eos = config.eos_token_id
        return cls(
            kind=kind,
            do_sample=bool(config.do_sample),
            temperature=float(config.temperature if config.temperature is not None else 1.0),
            top_k=normal_top_k(config.top_k),
            top_p=float(config.top_p if config.top_p is not None else 1.0),
            min_p=config.min_p or None,
            repetition_penalty=float(config.repetition_penalty or 1.0),
            penalty_skips_padding=GENERATE_SKIPS_PADDING if skip_padding is None else bool(skip_padding),
            sequence_bias=_bias_entries(config.sequence_bias),
            no_repeat_ngram_size=int(config.no_repeat_ngram_size or 0),
            bad_words_ids=_token_lists(config.bad_words_ids),
            min_new_tokens=int(config.min_new_tokens or 0),
            suppress_tokens=tuple(int(i) for i in config.suppress_tokens or ()),
            begin_suppress_tokens=tuple(int(i) for i in config.begin_suppress_tokens or ()),
            blocked_token_ids=tuple(int(i) for i in blocked_token_ids),
            eos_token_ids=tuple([eos] if isinstance(eos, int) else eos or ()),
        )

    # ---- what is set, and whether it can be replayed ---------------------------------------------------------------
    def stage_settings(self) -> list[str]:
        """The stage's settings that are on (`STAGE_SETTINGS` names)."""
        on = {
            "sequence_bias": bool(self.sequence_bias),
            "repetition_penalty": self.repetition_penalty != 1.0,
            "no_repeat_ngram_size": self.no_repeat_ngram_size > 0,
            "bad_words_ids": bool(self.bad_words_ids),
            "min_new_tokens": self.min_new_tokens > 0,
            "suppress_tokens": bool(self.suppress_tokens),
            "begin_suppress_tokens": bool(self.begin_suppress_tokens),
        }
        return [name for name in STAGE_SETTINGS if on[name]]

    def refusal(self, *, corrected: bool, multi_turn: bool = False) -> str | None:
        """Why this spec cannot be sampled as described by its kind of engine, or, with a correction on
        (`corrected`), replayed on the trainer's logits; None when it can. `multi_turn`: tool episodes, whose turns
        each count their own tokens (min_new_tokens, begin_suppress_tokens), which the replay cannot see."""
        refused = [name for name in self.stage_settings() if name not in KIND_APPLIES[self.kind]]
        if self.kind == "continuous_batching" and not corrected:  # what it applies its own way, uncorrected
            refused = [name for name in refused if name in _CRASHES_CONTINUOUS_BATCHING]
        if refused:
            named = f"the generation settings set {', '.join(refused)}"
            if self.kind == "vllm":
                why = f"vLLM samples with temperature, top_k, top_p, min_p and repetition_penalty only, and {named}"
            else:
                why = (
                    "rollout_engine='continuous_batching' (transformers' continuous batching) fails on "
                    "bad_words_ids and no_repeat_ngram_size and applies the other settings of the sampling stage its "
                    "own way (the repetition penalty to each step's query tokens only), which the importance-sampling "
                    f"correction cannot replay, and {named}"
                )
            it = "it" if len(refused) == 1 else "them"
            return f"{why}. Remove {it} (generation_kwargs / GRPOConfig), or use {_ALTERNATIVES[self.kind]}."
        positional = [name for name in ("min_new_tokens", "begin_suppress_tokens") if name in self.stage_settings()]
        if corrected and multi_turn and positional:
            return (
                f"The generation settings set {', '.join(positional)}, which count each tool-episode turn's tokens "
                "apart, and the importance-sampling correction replays a whole episode's completion as one. Remove "
                "them from generation_kwargs, or turn the correction off (max_staleness=0; "
                "vllm_importance_sampling_correction=False)."
            )
        if corrected and self.unknown:
            return (
                f"The generation settings set {', '.join(self.unknown)}, which the importance-sampling correction "
                "cannot replay on the trainer's logits (it replays temperature, top_k, top_p, min_p, "
                f"{', '.join(STAGE_SETTINGS)}), so its weights would be off 1 at unchanged weights. Remove "
                + ("it" if len(self.unknown) == 1 else "them")
                + " from generation_kwargs, or turn the correction off (max_staleness=0; "
                "vllm_importance_sampling_correction=False)."
            )
        return None

    def check(self, *, corrected: bool, multi_turn: bool = False) -> None:
        """Raise `refusal` (a ValueError naming the settings and the alternative), if any."""
        why = self.refusal(corrected=corrected, multi_turn=multi_turn)
        if why is not None:
            raise ValueError(why)

    def changes_distribution(self, temperature: float = 1.0) -> bool:
        """Whether the engines draw from another distribution than the softmax of the logits at `temperature` (the
        trainer's log-probs): a stage processor, blocked tokens, a truncation or another temperature."""
        truncates = bool(self.top_k) or self.top_p < 1.0 or bool(self.min_p)
        return bool(self.stage_settings() or self.blocked_token_ids or truncates or self.temperature != temperature)

    def reads_context(self) -> bool:
        """Whether the stage reads the tokens before a position (a penalty, n-grams, a word or bias of several
        tokens), not only their count."""
        longer = any(len(ids) > 1 for ids in self.bad_words_ids) or any(len(ids) > 1 for ids, _ in self.sequence_bias)
        return self.repetition_penalty != 1.0 or self.no_repeat_ngram_size > 0 or longer

    def for_kind(self, kind: str) -> SamplingSpec:
        return dataclasses.replace(self, kind=kind)

    # ---- the processors -------------------------------------------------------------------------------------------
    def warpers(self) -> LogitsProcessorList:
        """The warpers that are on, in the kind's order (transformers': temperature, top-k, top-p, min-p; vLLM's:
        temperature, min-p, top-k, top-p)."""
        made = {
            "temperature": TemperatureLogitsWarper(self.temperature) if self.temperature != 1.0 else None,
            "top_k": TopKLogitsWarper(top_k=self.top_k, min_tokens_to_keep=1) if self.top_k else None,
            "top_p": TopPLogitsWarper(top_p=self.top_p, min_tokens_to_keep=1) if self.top_p < 1.0 else None,
            "min_p": MinPLogitsWarper(min_p=self.min_p, min_tokens_to_keep=1) if self.min_p else None,
        }
        order = ("temperature", "min_p", "top_k", "top_p") if self.kind == "vllm" else WARPER_SETTINGS
        return LogitsProcessorList([made[name] for name in order if made[name] is not None])

    def processors(self, prompt_mask: torch.Tensor, sampling: bool = True, new_tokens=None) -> LogitsProcessorList:
        """The whole processing for rows whose contexts start with the prompts of mask `prompt_mask` [N, P] (left
        padding 0): the stage (`Stage`), then, when `sampling` (greedy decoding applies none), the warpers.
        `new_tokens` [N]: the tokens each row sampled so far (None: the context's width past P)."""
        processors = LogitsProcessorList([Stage(self, prompt_mask, new_tokens)])
        if sampling:
            processors.extend(self.warpers())
        return processors

    def apply_stage(self, context, scores, lead, new_tokens) -> torch.Tensor:
        """The stage on float scores [N, V] of rows whose contexts are `context` [N, L], each read from position
        `lead` [N] on (left padding, and what the replay fills in), having sampled `new_tokens` [N] (or an int)."""
        banned = torch.zeros_like(scores, dtype=torch.bool)  # [N, V]
        static = [*self.blocked_token_ids, *self.suppress_tokens] + [w[0] for w in self.bad_words_ids if len(w) == 1]
        if static:
            banned[:, torch.tensor(static, dtype=torch.long, device=scores.device)] = True
        if self.sequence_bias:
            scores = scores + _suffix_values(context, lead, self.sequence_bias, scores)
        if self.repetition_penalty != 1.0:
            penalty_lead = lead if self.penalty_skips_padding else torch.zeros_like(lead)
            scores = repetition_penalty(scores, context, penalty_lead, self.repetition_penalty)
        if self.no_repeat_ngram_size > 0:
            banned |= repeated_ngram_tokens(context, lead, self.no_repeat_ngram_size, scores.size(-1))
        longer = [(w, float("-inf")) for w in self.bad_words_ids if len(w) > 1]
        if longer:
            banned |= _suffix_values(context, lead, longer, scores).isinf()
        new_tokens = torch.as_tensor(new_tokens, device=scores.device).expand(scores.size(0))  # [N]
        positional = (
            (self.eos_token_ids if self.min_new_tokens > 0 else (), new_tokens < self.min_new_tokens),
            (self.begin_suppress_tokens, new_tokens == 0),
        )
        for tokens, when in positional:
            if tokens:
                ids = torch.tensor(tokens, dtype=torch.long, device=scores.device)
                banned[:, ids] |= when[:, None]
        return scores.masked_fill(banned, float("-inf"))


class Stage(LogitsProcessor):
    """A spec's stage as a logits processor over `input_ids` that start with the prompts of `prompt_mask` [N, P]:
    each row read from its first real token, the tokens sampled so far `new_tokens` [N] (None: the width past P)."""

    def __init__(self, spec: SamplingSpec, prompt_mask: torch.Tensor, new_tokens=None):
        self.spec, self.width, self.new_tokens = spec, prompt_mask.size(1), new_tokens
        self.lead = (prompt_mask != 0).int().argmax(dim=1)  # [N] each row's left padding

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        new_tokens = self.new_tokens if self.new_tokens is not None else input_ids.size(1) - self.width
        return self.spec.apply_stage(input_ids, scores, self.lead.to(input_ids.device), new_tokens)


def _unknown_settings(generation_config, model_config) -> tuple[str, ...]:
    """`name=value` of each setting set, in the config or the model's, that this module does not describe."""
    known = NEUTRAL_SETTINGS | set(STAGE_SETTINGS) | set(WARPER_SETTINGS)
    found = {}
    for settings in (model_config, generation_config):
        if settings is not None:
            found.update({k: v for k, v in settings.to_diff_dict().items() if k not in known})
    for key in ("logits_processor", "stopping_criteria"):  # kept as plain attributes, outside the diff
        if getattr(generation_config, key, None):
            found[key] = getattr(generation_config, key)
    return tuple(f"{name}={found[name]!r}" for name in sorted(found))


def repetition_penalty(scores, context, lead, penalty: float) -> torch.Tensor:
    """transformers' formula on each row's tokens `context[i, lead[i]:]` [N, L]: score / penalty where it is > 0,
    score * penalty elsewhere. The positions before `lead` are given the first read token (a token of the set
    already), so the penalised set is the row's own; one scatter, no host sync."""
    positions = torch.arange(context.size(1), device=context.device)[None]  # [1, L]
    first = context.gather(1, lead.clamp(max=max(context.size(1) - 1, 0))[:, None])  # [N, 1]
    ids = torch.where(positions < lead[:, None], first, context)  # [N, L]
    V = scores.size(-1)  # an id >= V (a token without a logit) lands in a column that is dropped
    seen = scores.new_zeros((scores.size(0), V + 1), dtype=torch.bool).scatter_(1, ids.clamp(max=V), True)[:, :V]
    penalised = torch.where(scores < 0, scores * penalty, scores / penalty)
    return torch.where(seen, penalised, scores)


def repeated_ngram_tokens(context, lead, n: int, vocab: int) -> torch.Tensor:
    """[N, V] bool: the tokens that would complete an n-gram already in `context[i, lead[i]:]` [N, L] (its n - 1
    last tokens followed by the token elsewhere in the row), as transformers' `NoRepeatNGramLogitsProcessor` on the
    row alone."""
    N, L = context.shape
    banned = torch.zeros((N, vocab + 1), dtype=torch.int32, device=context.device)  # column `vocab`: ids past it
    if L < n:
        return banned[:, :vocab].bool()
    windows = context.unfold(1, n, 1)  # [N, L - n + 1, n]
    prefix = context[:, L - n + 1 :]  # [N, n - 1] the last n - 1 tokens
    starts = torch.arange(L - n + 1, device=context.device)[None]  # [1, L - n + 1]
    match = (windows[..., :-1] == prefix[:, None]).all(dim=-1) & (starts >= lead[:, None])  # [N, L - n + 1]
    return banned.scatter_add_(1, windows[..., -1].clamp(max=vocab), match.int())[:, :vocab] > 0


def _suffix_values(context, lead, entries, scores) -> torch.Tensor:
    """[N, V]: for each (ids, value) of `entries`, `value` added on ids[-1] of the rows whose read context
    (`context[i, lead[i]:]`) ends with ids[:-1] (every row for a single id)."""
    out = torch.zeros_like(scores)
    N, L = context.shape
    for ids, value in entries:
        *rest, last = ids
        if not rest:
            hit = torch.ones(N, dtype=torch.bool, device=scores.device)
        elif len(rest) > L:
            continue
        else:
            tail = torch.tensor(rest, dtype=context.dtype, device=context.device)
            hit = (context[:, L - len(rest) :] == tail).all(dim=1) & (L - len(rest) >= lead)  # [N]
        out[:, last] += torch.where(hit, value, 0.0)
    return out


class StageOffConfig(GenerationConfig):
    """A `GenerationConfig` whose stage settings (`STAGE_SETTINGS`) the model's own `generation_config` cannot fill.

    `model.generate` merges the model's `generation_config` into the one it is given: every setting that is None takes
    the model's value (`GenerationMixin._prepare_generation_config`: `update(defaults_only=True)`, transformers 5.19 to
    5.25). `sequence_bias` and `bad_words_ids` have no "off" value other than None (transformers' processors refuse an
    empty one), so a model whose config sets them had `generate` apply them a second time, before the spec's stage,
    which reads the model's config too (`resolve_sampling_settings`). The merge skips them here; an explicit update
    (`defaults_only=False`) is left as it is."""

    def update(self, defaults_only=False, allow_custom_entries=False, **kwargs):
        if defaults_only:
            kwargs = {name: value for name, value in kwargs.items() if name not in STAGE_SETTINGS}
        return super().update(defaults_only=defaults_only, allow_custom_entries=allow_custom_entries, **kwargs)


def neutral_generation_config(generation_config, spec: SamplingSpec) -> StageOffConfig:
    """A copy of `generation_config` for `model.generate` with every stage setting off (`STAGE_SETTINGS`: the
    engine applies the spec's `Stage` instead), also where the model's `generation_config` sets them
    (`StageOffConfig`), and the spec's top_k, so that `generate` applies the warpers only."""
    config = StageOffConfig.__new__(StageOffConfig)
    config.__dict__.update(copy.copy(generation_config).__dict__)
    for name, neutral in STAGE_SETTINGS.items():
        setattr(config, name, copy.copy(neutral))
    config.top_k = spec.top_k
    return config
