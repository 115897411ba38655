"""Reward models: a sequence-classification model that scores prompt + completion, wrapped as a reward function.

As in TRL's `GRPOTrainer`, a reward model is an `AutoModelForSequenceClassification` with one label; the reward is
`logits[:, 0]` of the text `prompt + completion`, tokenized with the reward model's *own* tokenizer (the policy's
token ids are never reused: the two vocabularies may differ). `RewardModel` makes such a model a callable with the
standard reward signature, so `compute_rewards` treats it like any other reward function.

Departures from TRL, on purpose:
- Plain-text inputs are tokenized with the tokenizer's special tokens (BOS), as `RewardTrainer` tokenizes its
  training data; chat-templated text is tokenized without them (the template already holds them), as in TRL.
- Texts longer than `max_length` keep their *last* `max_length` tokens: the score is read at the last token, so the
  end of the completion is what must survive truncation.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from grpo_hf.paths import check_local_path
from grpo_hf.rewards.answers import completion_text
from grpo_hf.rewards.functions import get_reward_funcs, names_a_reward_model, reward_func_name

logger = logging.getLogger(__name__)

__all__ = ["RewardModel", "build_reward_funcs", "load_reward_model", "reward_weights"]


def _is_conversational(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and len(value) > 0 and isinstance(value[0], dict) and "role" in value[0]


def _as_messages(value: Any, role: str) -> list[dict]:
    return list(value) if _is_conversational(value) else [{"role": role, "content": completion_text(value)}]


class RewardModel:
    """A sequence-classification model (num_labels=1) as a reward function: `rm(prompts, completions) -> list[float]`.

    Args:
        model: a `PreTrainedModel` for sequence classification, or a path / Hub id loaded with
            `AutoModelForSequenceClassification.from_pretrained(model, num_labels=1)`.
        processing_class: the reward model's tokenizer (or a path to one); by default loaded from the model's
            `name_or_path`. A missing pad token is set to the EOS token, and `model.config.pad_token_id` to match.
        batch_size: texts per forward pass.
        max_length: keep at most this many tokens per text (the last ones); `None`: no limit.
        model_init_kwargs: extra `from_pretrained` arguments when `model` is a path (e.g. `{"dtype": "bfloat16"}`);
            its `trust_remote_code` also applies to the tokenizer loaded from a path.

    Scoring: for conversational samples (lists of chat messages) the prompt and completion messages are joined and
    rendered with the tokenizer's chat template when it has one; otherwise, and for plain strings, the text is
    `prompt + completion`. The model runs in eval mode under `torch.no_grad()` on the device of its parameters (move
    it with `.to(device)`). `__name__` is the basename of the model's `name_or_path` (the metric name).
    """

    def __init__(
        self,
        model: PreTrainedModel | str | os.PathLike,
        processing_class: PreTrainedTokenizerBase | str | None = None,
        *,
        batch_size: int = 16,
        max_length: int | None = None,
        model_init_kwargs: dict[str, Any] | None = None,
    ):
        if isinstance(model, (str, os.PathLike)):
            model = AutoModelForSequenceClassification.from_pretrained(
                check_local_path(os.fspath(model), "reward model"), num_labels=1, **(model_init_kwargs or {})
            )
        if not isinstance(model, PreTrainedModel):
            raise TypeError(f"RewardModel needs a PreTrainedModel or a path to one, got {type(model).__name__}.")
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1.")
        if max_length is not None and max_length < 1:
            raise ValueError(f"max_length={max_length} must be >= 1 (or None).")
        name_or_path = getattr(model.config, "_name_or_path", "") or ""
        if processing_class is None or isinstance(processing_class, (str, os.PathLike)):
            source = os.fspath(processing_class) if processing_class is not None else name_or_path
            if not source:
                raise ValueError(
                    "RewardModel got a model built in memory and no processing_class: pass the reward model's "
                    "tokenizer (GRPOTrainer: reward_processing_classes)."
                )
            processing_class = AutoTokenizer.from_pretrained(
                check_local_path(source, "reward tokenizer"),
                trust_remote_code=(model_init_kwargs or {}).get("trust_remote_code", False),
            )
        if processing_class.pad_token is None:
            if processing_class.eos_token is None:
                raise ValueError("The reward tokenizer has neither a pad token nor an EOS token to pad with; set one.")
            processing_class.pad_token = processing_class.eos_token
        if model.config.pad_token_id is None:
            model.config.pad_token_id = processing_class.pad_token_id
        num_labels = getattr(model.config, "num_labels", 1)
        if num_labels != 1:
            logger.warning("Reward model %r has num_labels=%d; the reward is logits[:, 0].", name_or_path, num_labels)

        self.model = model.eval()
        self.processing_class = processing_class
        self.batch_size = batch_size
        self.max_length = max_length
        self.__name__ = os.path.basename(name_or_path.rstrip("/\\")) or type(model).__name__
        self._warned_truncation = False

    def to(self, device: torch.device | str) -> RewardModel:
        self.model.to(device)
        return self

    def texts(self, prompts: list, completions: list) -> tuple[list[str], list[bool]]:
        """The texts the model scores, and whether each is tokenized with special tokens (False for chat templates)."""
        tokenizer = self.processing_class
        texts, add_special = [], []
        for prompt, completion in zip(prompts, completions, strict=True):
            if (_is_conversational(prompt) or _is_conversational(completion)) and tokenizer.chat_template:
                messages = _as_messages(prompt, "user") + _as_messages(completion, "assistant")
                texts.append(tokenizer.apply_chat_template(messages, tokenize=False))
                add_special.append(False)
            else:
                texts.append(completion_text(prompt) + completion_text(completion))
                add_special.append(True)
        return texts, add_special

    def _encode(self, texts: list[str], add_special: list[bool]) -> list[list[int]]:
        ids: list[list[int] | None] = [None] * len(texts)
        for flag in (True, False):
            idx = [i for i, f in enumerate(add_special) if f is flag]
            if idx:
                encoded = self.processing_class([texts[i] for i in idx], add_special_tokens=flag)["input_ids"]
                for i, row in zip(idx, encoded, strict=True):
                    ids[i] = list(row)
        if self.max_length is not None and any(len(row) > self.max_length for row in ids):
            if not self._warned_truncation:
                logger.warning("Reward model %r: texts longer than %d tokens keep their last tokens.", self.__name__,
                               self.max_length)  # fmt: skip
                self._warned_truncation = True
            ids = [row[-self.max_length :] for row in ids]
        return ids

    @torch.no_grad()
    def __call__(self, prompts, completions, completion_ids=None, trainer_state=None, **kwargs) -> list[float]:
        texts, add_special = self.texts(prompts, completions)
        ids = self._encode(texts, add_special)
        device = next(self.model.parameters()).device
        pad_id = self.processing_class.pad_token_id
        rewards: list[float] = []
        for start in range(0, len(ids), self.batch_size):
            batch = ids[start : start + self.batch_size]
            width = max(len(row) for row in batch)
            input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)  # [B, L], right padded
            attention_mask = torch.zeros((len(batch), width), dtype=torch.long)  # [B, L]
            for i, row in enumerate(batch):
                input_ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
                attention_mask[i, : len(row)] = 1
            logits = self.model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device)).logits
            rewards.extend(logits[:, 0].float().tolist())  # [B]
        return rewards

    def __repr__(self) -> str:
        return f"RewardModel({self.__name__!r}, batch_size={self.batch_size}, max_length={self.max_length})"


def load_reward_model(
    path: str | os.PathLike, processing_class: PreTrainedTokenizerBase | str | None = None, **kwargs: Any
) -> RewardModel:
    """`RewardModel(path, processing_class, **kwargs)`: load a sequence-classification reward model from a path."""
    return RewardModel(path, processing_class, **kwargs)


def build_reward_funcs(reward_funcs, reward_processing_classes=None, model_init_kwargs=None) -> list[Callable]:
    """`GRPOTrainer`'s `reward_funcs` as a list of callables: functions as they are, registry names and
    "module:function" through `get_reward_funcs`, models and model paths / Hub ids as `RewardModel`s (a path loaded
    with `model_init_kwargs`, the policy's: dtype, trust_remote_code, ..., as TRL loads them)."""
    if reward_funcs is None or (isinstance(reward_funcs, list | tuple) and len(reward_funcs) == 0):
        raise ValueError(  # TRL's opening words, so that ported code that matches them still does
            "No reward source provided: reward_funcs is empty. Pass at least one reward function, registry name or "
            "reward model, e.g. reward_funcs=['accuracy', 'format_gsm8k'] or reward_funcs=[my_reward], or an "
            "environment_factory whose environment defines a `get_reward` method."
        )
    if not isinstance(reward_funcs, list | tuple):
        reward_funcs = [reward_funcs]
    if reward_processing_classes is not None and not isinstance(reward_processing_classes, list | tuple):
        reward_processing_classes = [reward_processing_classes]
    if reward_processing_classes is not None and len(reward_processing_classes) != len(reward_funcs):
        raise ValueError(  # TRL's message, word for word
            f"The number of reward processing classes ({len(reward_processing_classes)}) must match the number of "
            f"reward functions ({len(reward_funcs)})."
        )
    funcs = []
    for k, func in enumerate(reward_funcs):
        tokenizer = reward_processing_classes[k] if reward_processing_classes is not None else None
        # Strings: registry names and "module:function" first; paths and Hub ids ("org/name") are
        # reward models; anything else fails with the registry's list of known names.
        if isinstance(func, str) and not names_a_reward_model(func):
            funcs.extend(get_reward_funcs(func))
        elif isinstance(func, str | PreTrainedModel):
            funcs.append(RewardModel(func, tokenizer, model_init_kwargs=model_init_kwargs))
        elif callable(func):
            funcs.append(func)
        else:
            raise TypeError(f"reward_funcs[{k}] is a {type(func).__name__}; expected a callable, name or model.")
    return funcs


def reward_weights(weights: list[float] | None, names: list[str]) -> torch.Tensor:
    """One weight per reward function [R] (all 1.0 by default)."""
    if weights is not None and len(weights) != len(names):
        raise ValueError(
            f"reward_weights has {len(weights)} entries but there are {len(names)} reward functions ({names}). "
            "Give one weight per function."
        )
    return torch.tensor(weights or [1.0] * len(names), dtype=torch.float32)


def reward_sources(reward_funcs, reward_processing_classes, args, owned: list[Callable]):
    """A run's reward functions, their names and weights [R]: `reward_funcs` (built by `build_reward_funcs`,
    weighted by `args.reward_weights`), then `owned` (an environment's own rewards, weight 1 each, as TRL). With
    `owned` rewards, `reward_funcs` may be None."""
    none_given = reward_funcs is None or (isinstance(reward_funcs, list | tuple) and not reward_funcs)
    funcs = (
        []
        if owned and none_given
        else build_reward_funcs(reward_funcs, reward_processing_classes, args.model_load_kwargs())
    )
    names = [reward_func_name(f) for f in funcs]
    weights = torch.cat([reward_weights(args.reward_weights, names), torch.ones(len(owned))])
    return funcs + list(owned), names + [f.__name__ for f in owned], weights


def reward_processing_classes_of(reward_funcs: list) -> list:
    """TRL's `trainer.reward_processing_classes`: one entry per reward function, the tokenizer of each reward model
    (`RewardModel.processing_class`), None for the other functions."""
    return [func.processing_class if isinstance(func, RewardModel) else None for func in reward_funcs]
