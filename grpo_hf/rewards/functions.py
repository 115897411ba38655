r"""The built-in reward functions and the registry that resolves reward names.

Rewards: `accuracy_reward` (numeric final answer against the gold, parsed by `grpo_hf.rewards.answers`),
`format_reward` (DeepSeek-R1 `<think>/<answer>`), `gsm8k_format_reward` (`#### N` last line), `tag_count_reward`
(open-r1's 0.25-per-tag partial credit) and `soft_overlong_punishment` (DAPO eq. 13). The code rewards live in
`grpo_hf.rewards.code` and the MATH-style LaTeX reward in `grpo_hf.rewards.latex`.

The registry: `REWARD_FUNCS` maps a name to a ready reward function (standard library only, nothing to set up);
`REWARD_FACTORIES` maps a name to the import path of a factory that builds the reward when the name is looked up,
for rewards that start a sandbox or a worker process (`code`, `code_pass_rate`, `math_accuracy`). `get_reward_funcs`
resolves both, plus `"package.module:function"` import paths and callables.
"""

from __future__ import annotations

import functools
import importlib
import os
import re
from collections.abc import Callable, Iterable
from typing import Any

from grpo_hf.rewards.answers import answers_match, completion_text, extract_answer, extract_gold

__all__ = [
    "REWARD_FACTORIES",
    "REWARD_FUNCS",
    "AccuracyReward",
    "SoftOverlongPunishment",
    "accuracy_reward",
    "format_reward",
    "get_reward_funcs",
    "gsm8k_format_reward",
    "is_reward_func_name",
    "make_accuracy_reward",
    "reward_func_name",
    "soft_overlong_punishment",
    "tag_count_reward",
]

# ---------------------------------------------------------------------------------------------------------------------
# Built-in reward functions
# ---------------------------------------------------------------------------------------------------------------------


class AccuracyReward:
    """1.0 if the completion's final answer equals the gold answer numerically, else 0.0; None if the gold is unusable.

    Picklable (a class, not a closure). Build variants with `make_accuracy_reward`.
    """

    def __init__(self, answer_column: str = "answer", fallback_last_number: bool = False, name: str | None = None):
        self.answer_column = answer_column
        self.fallback_last_number = fallback_last_number
        self.__name__ = name or "accuracy_reward"

    def __call__(self, prompts=None, completions=None, completion_ids=None, trainer_state=None, **kwargs):
        if self.answer_column not in kwargs:
            raise KeyError(
                f"{self.__name__} needs the gold answers in the dataset column {self.answer_column!r}, but the reward "
                f"function received only the columns {sorted(kwargs)}. Add that column, or use "
                "make_accuracy_reward(answer_column=...) to read another one."
            )
        golds = kwargs[self.answer_column]
        rewards: list[float | None] = []
        for completion, gold in zip(completions, golds, strict=True):
            gold_answer = extract_gold(gold)
            if gold_answer is None:
                rewards.append(None)
                continue
            pred = extract_answer(completion, fallback_last_number=self.fallback_last_number)
            if pred is None:
                rewards.append(0.0)
            elif pred == gold_answer:  # canonical strings are unique per value
                rewards.append(1.0)
            else:  # different values; only a non-integer gold can still match within the tolerance
                gold_is_integer = "." not in gold_answer and "/" not in gold_answer
                rewards.append(0.0 if gold_is_integer else float(answers_match(pred, gold_answer)))
        return rewards

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(answer_column={self.answer_column!r}, "
            f"fallback_last_number={self.fallback_last_number!r})"
        )


def make_accuracy_reward(
    answer_column: str = "answer", fallback_last_number: bool = False, name: str | None = None
) -> AccuracyReward:
    """An accuracy reward reading the gold from `answer_column`, optionally with the last-number fallback.

    `name` sets `__name__` (the metric name `rewards/<name>/mean`); by default `"accuracy_reward"`.
    """
    return AccuracyReward(answer_column=answer_column, fallback_last_number=fallback_last_number, name=name)


accuracy_reward = AccuracyReward()
accuracy_reward.__doc__ = (
    "1.0 if `extract_answer(completion)` equals `extract_gold(answer)` numerically, 0.0 otherwise (no marker: 0.0); "
    "None when the gold in column `answer` cannot be parsed."
)

_R1_FORMAT_RE = re.compile(r"<think>(?P<think>.*?)</think>\s*<answer>(?P<answer>.*?)</answer>", re.DOTALL)
_GSM8K_LAST_LINE_RE = re.compile(
    r"####[ \t]*(?:\$[ \t]*)?-?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?(?:/\d+)?[ \t]*%?[ \t]*"
)


def _is_r1_format(text: str) -> bool:
    text = text.strip()
    m = _R1_FORMAT_RE.fullmatch(text)
    if m is None or not m.group("think").strip() or not m.group("answer").strip():
        return False
    return all(text.count(tag) == 1 for tag in ("<think>", "</think>", "<answer>", "</answer>"))


def format_reward(prompts=None, completions=None, completion_ids=None, trainer_state=None, **kwargs) -> list[float]:
    """1.0 for the DeepSeek-R1 template `<think>reasoning</think>\\n<answer>answer</answer>`, else 0.0.

    After stripping surrounding whitespace the completion must be exactly: `<think>`, non-empty reasoning, `</think>`,
    only whitespace, `<answer>`, a non-empty answer, `</answer>`; each of the four tags appears exactly once.
    """
    return [1.0 if _is_r1_format(completion_text(c)) else 0.0 for c in completions]


def _is_gsm8k_format(text: str) -> bool:
    lines = [line.strip() for line in text.strip().split("\n")]
    lines = [line for line in lines if line]
    if len(lines) < 2 or text.count("####") != 1:
        return False
    return _GSM8K_LAST_LINE_RE.fullmatch(lines[-1]) is not None


def gsm8k_format_reward(
    prompts=None, completions=None, completion_ids=None, trainer_state=None, **kwargs
) -> list[float]:
    """1.0 for reasoning followed by a final `#### N` line (GSM8K style), else 0.0.

    Rules: at least one non-empty line of reasoning; `####` appears exactly once, on the last non-empty line, which
    holds only `#### N` where N is a plain number (`72`, `-7`, `1,080`, `0.5`, `3/4`, optional `$` before or `%`
    after); nothing but whitespace after it.
    """
    return [1.0 if _is_gsm8k_format(completion_text(c)) else 0.0 for c in completions]


def _tag_count(text: str) -> float:
    count = 0.0
    if text.count("<think>\n") == 1:
        count += 0.25
    if text.count("\n</think>\n") == 1:
        count += 0.25
    if text.count("\n<answer>\n") == 1:
        count += 0.25
    if text.count("\n</answer>") == 1:
        count += 0.25
    return count


def tag_count_reward(prompts=None, completions=None, completion_ids=None, trainer_state=None, **kwargs) -> list[float]:
    """Partial credit for the R1 tags, 0.25 each (open-r1's `tag_count_reward`), in [0, 1].

    +0.25 for each of these substrings occurring exactly once: `"<think>\\n"`, `"\\n</think>\\n"`, `"\\n<answer>\\n"`,
    `"\\n</answer>"`. A smooth companion of `format_reward` that credits a model for learning the tags one by one.
    """
    return [_tag_count(completion_text(c)) for c in completions]


class SoftOverlongPunishment:
    """DAPO's soft overlong punishment (eq. 13) on `len(completion_ids[i])`; see `soft_overlong_punishment`."""

    __name__ = "soft_overlong_punishment"

    def __init__(self, max_completion_length: int, soft_punish_cache: int):
        if max_completion_length < 1:
            raise ValueError(f"max_completion_length={max_completion_length} must be >= 1.")
        if not 0 < soft_punish_cache <= max_completion_length:
            raise ValueError(
                f"soft_punish_cache={soft_punish_cache} must be in (0, max_completion_length={max_completion_length}]."
            )
        self.max_completion_length = max_completion_length
        self.soft_punish_cache = soft_punish_cache

    def __call__(self, prompts=None, completions=None, completion_ids=None, trainer_state=None, **kwargs):
        if completion_ids is None:
            raise ValueError(f"{self.__name__} needs completion_ids (the completion token ids, without padding).")
        l_max, l_cache = self.max_completion_length, self.soft_punish_cache
        rewards = []
        for ids in completion_ids:
            length = len(ids)
            if length <= l_max - l_cache:
                rewards.append(0.0)
            elif length <= l_max:
                rewards.append((l_max - l_cache - length) / l_cache)
            else:
                rewards.append(-1.0)
        return rewards

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.max_completion_length}, {self.soft_punish_cache})"


def soft_overlong_punishment(max_completion_length: int, soft_punish_cache: int) -> SoftOverlongPunishment:
    """DAPO eq. 13: a reward function penalising long completions by their token count L = `len(completion_ids[i])`.

    0 if L <= Lmax - Lcache; (Lmax - Lcache - L) / Lcache (from 0 down to -1) if Lmax - Lcache < L <= Lmax; -1 beyond.
    `completion_ids` must hold the unpadded ids of each completion.
    """
    return SoftOverlongPunishment(max_completion_length, soft_punish_cache)


# ---------------------------------------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------------------------------------

REWARD_FUNCS: dict[str, Callable] = {
    "accuracy": accuracy_reward,
    "format": format_reward,
    "format_gsm8k": gsm8k_format_reward,
    "tag_count": tag_count_reward,
}
"""Name -> ready reward function. A plain dict: add your own entries."""

REWARD_FACTORIES: dict[str, str] = {
    "code": "grpo_hf.rewards.code:make_code_reward",
    "code_pass_rate": "grpo_hf.rewards.code:make_code_pass_rate_reward",
    "math_accuracy": "grpo_hf.rewards.latex:make_math_accuracy_reward",
}
"""Name -> `"module:factory"`; looking the name up imports the module and calls the factory with no arguments. For
rewards that are built, not just imported: the code rewards check their sandbox when built, `math_accuracy` checks
that math-verify is installed. Call the factories yourself for non-default options."""

_IMPORT_PATH_RE = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")


def is_reward_func_name(name: str) -> bool:
    """True for a registry name (`REWARD_FUNCS`, `REWARD_FACTORIES`) or a `"package.module:function"` import path.

    Anything else may be a reward model path.
    """
    return name in REWARD_FUNCS or name in REWARD_FACTORIES or _IMPORT_PATH_RE.fullmatch(name) is not None


def names_a_reward_model(name: str) -> bool:
    """The one rule for a string in `reward_funcs`: a registry name or a "module:function" path is a reward function;
    otherwise a local path or a Hub id ("org/name") is a reward model. Anything else is looked up in the registry,
    which fails listing the known names."""
    return not is_reward_func_name(name) and (os.path.exists(name) or "/" in name)


def _import_reward(path: str) -> Callable:
    module_name, attr_path = path.split(":", 1)
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"Cannot import module {module_name!r} for reward function {path!r}: {e}") from e
    for attr in attr_path.split("."):
        try:
            obj = getattr(obj, attr)
        except AttributeError as e:
            raise ValueError(f"Reward function {path!r}: {module_name!r} has no attribute {attr_path!r}.") from e
    if not callable(obj):
        raise ValueError(f"Reward function {path!r} is a {type(obj).__name__}, not a callable.")
    return obj


def get_reward_funcs(names: str | Callable | Iterable[str | Callable]) -> list[Callable]:
    """Resolve reward functions: registry names, `"package.module:function"` import paths, or callables (kept as is).

    A name in `REWARD_FUNCS` gives its function; a name in `REWARD_FACTORIES` builds a new reward with its factory
    (which may raise, e.g. when the code sandbox cannot be set up on this machine). Raises ValueError for an unknown
    name, listing the registry and the import-path syntax.
    """
    if isinstance(names, str) or callable(names):
        names = [names]
    funcs = []
    for name in names:
        if callable(name):
            funcs.append(name)
        elif isinstance(name, str) and name in REWARD_FUNCS:
            funcs.append(REWARD_FUNCS[name])
        elif isinstance(name, str) and name in REWARD_FACTORIES:
            funcs.append(_import_reward(REWARD_FACTORIES[name])())
        elif isinstance(name, str) and _IMPORT_PATH_RE.fullmatch(name):
            funcs.append(_import_reward(name))
        else:
            known = sorted({*REWARD_FUNCS, *REWARD_FACTORIES})
            raise ValueError(
                f"Unknown reward function {name!r}. Known names: {', '.join(known)}; or pass a "
                "callable or an import path 'package.module:function'."
            )
    return funcs


def reward_func_name(func: Any) -> str:
    """The stable name used in metrics (`rewards/<name>/mean`).

    `__name__` when set (functions, built-in reward objects, `RewardModel`), the wrapped function of a
    `functools.partial`, the basename of `config._name_or_path` for a bare model, else the class name.
    """
    while isinstance(func, functools.partial):
        func = func.func
    name = getattr(func, "__name__", None)
    if isinstance(name, str) and name:
        return name
    name_or_path = getattr(getattr(func, "config", None), "_name_or_path", None)
    if isinstance(name_or_path, str) and name_or_path:
        return os.path.basename(name_or_path.rstrip("/\\")) or name_or_path
    return type(func).__name__
