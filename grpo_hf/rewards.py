r"""Reward functions for GRPO: a math-answer verifier, format checkers, a registry, and the calling machinery.

Every reward function has TRL's signature (DESIGN.md §4)::

    fn(prompts, completions, completion_ids=None, trainer_state=None, **columns) -> list[float | None]

`prompts`/`completions` are strings, or lists of chat messages when the dataset is conversational; every other
dataset column arrives as a keyword argument holding one value per completion. `None` means "not applicable".

Answer extraction (`extract_answer`) — the rules, exactly:

1. **Markers.** A final answer is introduced by one of: `#### N` (GSM8K), `\boxed{...}` / `\fbox{...}` (balanced
   braces, nesting allowed), `<answer>...</answer>`, or an answer phrase: "answer is", "answer:", with any prefix
   such as "The final answer is" / "**Final Answer:**". A phrase or `####` counts as a marker only when a number
   follows directly (after whitespace, `:`, `*`, `$`, `\(`, currency signs), so markdown headings such as
   `#### Step 1` and sentences such as "the answer is the sum of 3 and 4" are not markers. `\boxed{` needs its closing
   brace and `<answer>` its `</answer>`.
2. **The last marker wins** (by start position, so a marker nested inside another wins over the outer one). Text
   after it does not change the answer, with one refinement: a model that answers and then continues with a made-up
   new turn is cut at that turn. The *answer region* ends at the first new-turn header (a line starting with
   `Question:`, `Q:`, `Problem:`, `Human:`, `User:`, `Assistant:`, `Instruction:`, or a chat special token such as
   `<|im_end|>`, `<|endoftext|>`, `</s>`) that comes after the first marker; markers after that point are ignored,
   so a made-up "Question: ... #### 12" never overrides (or supplies) the answer.
3. **The number.** Inside `\boxed{}` / `<answer>`, the content (after the last `=`, so `x = 5` and `9*2=18` read as
   5 and 18) must hold exactly one number, not part of an arithmetic expression (`2^3`, `x+2` -> None); words
   around it are ignored (`18 dollars`, `Janet makes $18`). After `####` or an answer phrase, the number that follows
   directly is the answer; if it starts an arithmetic expression (`#### 9 * 2 = 18`), the single number after the last
   `=` in the same sentence is the answer instead (None if there is none).
4. **Normalisation.** Thousands separators (`1,080`, `1{,}080`, `1\,080`), currency (`$ \$ € £ ¥ ₹`), percent
   (`50%` -> 50, not 0.5), trailing unit words, `72.00` -> 72, `.5` -> 0.5, simple fractions `a/b` and
   `\frac{a}{b}` / `\dfrac` / `\tfrac`, negatives (`-7`,
   unicode minus), scientific notation (`1e6`), and LaTeX wrappers (`$...$`, `\(...\)`, `\text{}`, `\mathrm{}`,
   `\textbf{}`, `\boxed{}`, `\left`/`\right`, thin spaces). Mixed numbers (`2 1/2`), number words and expressions
   are not evaluated (no sympy in the hot path). The canonical string is one per value: an integer (`"1080"`,
   `"-7"`), else a decimal when the value has a finite one (`"0.75"` for `3/4`, `72.50` -> `"72.5"`), else the
   fraction in lowest terms (`"1/3"`).
5. **No marker** -> None (reward 0.0). `fallback_last_number=True` opts into the last number anywhere in the text.

Numeric equality (`answers_match`): both sides are parsed to exact `fractions.Fraction`s. If the gold is an integer
the prediction must equal it exactly (`72.00` == `72`, `71.9999` != `72`); otherwise they match when
`|pred - gold| <= 1e-6 * max(|pred|, |gold|)` (so `3/4` == `0.75`, `0.33` != `1/3`).

Built-in rewards: `accuracy_reward`, `format_reward` (DeepSeek-R1 `<think>/<answer>`), `gsm8k_format_reward`
(`#### N` last line), `tag_count_reward` (open-r1's 0.25-per-tag partial credit) and `soft_overlong_punishment`
(DAPO eq. 13). `compute_rewards` calls a list of them and enforces the error policy (wrong length -> ValueError,
NaN -> None with a warning, async functions run concurrently, exceptions raise or are skipped, per-call timeout).

This module imports only the standard library: no torch, no transformers, no sympy.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import inspect
import logging
import math
import numbers
import os
import re
import threading
import warnings
from collections.abc import Callable, Iterable, Mapping
from fractions import Fraction
from typing import Any

logger = logging.getLogger(__name__)

__all__ = [
    "REWARD_FUNCS",
    "AccuracyReward",
    "SoftOverlongPunishment",
    "accuracy_reward",
    "answers_match",
    "completion_text",
    "compute_rewards",
    "extract_answer",
    "extract_gold",
    "format_reward",
    "get_reward_funcs",
    "gsm8k_format_reward",
    "is_reward_func_name",
    "make_accuracy_reward",
    "parse_number",
    "reward_func_name",
    "soft_overlong_punishment",
    "tag_count_reward",
]

# ---------------------------------------------------------------------------------------------------------------------
# Text helpers
# ---------------------------------------------------------------------------------------------------------------------


def completion_text(completion: Any) -> str:
    """The text of a prompt or completion: a string as is, or the contents of chat messages joined by newlines.

    Accepts `"text"`, one message `{"role": ..., "content": ...}`, a list of messages, and message contents given as a
    list of parts (`[{"type": "text", "text": ...}]`). `None` gives `""`.
    """
    if isinstance(completion, str):
        return completion
    if completion is None:
        return ""
    if isinstance(completion, Mapping):
        return _content_text(completion.get("content"))
    if isinstance(completion, Iterable):
        return "\n".join(completion_text(message) for message in completion)
    return str(completion)


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Iterable) and not isinstance(content, Mapping):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, Mapping) and isinstance(part.get("text"), str):
                parts.append(part["text"])
        return "".join(parts)
    return str(content)


# ---------------------------------------------------------------------------------------------------------------------
# Numbers
# ---------------------------------------------------------------------------------------------------------------------

# One number token on *cleaned* text: optional sign, optional currency, digits with optional comma groups, decimals,
# exponent, `a/b` fraction, percent. Not preceded by a word character, `.` or `^` (so `x2`, the `5` of `1.5`, and
# exponents are not numbers).
_NUMBER = (
    r"(?<![\w.^])(?P<sign>[-+])?(?:[$€£¥₹][ \t]*)?(?=\.?\d)"
    r"(?P<int>\d{1,3}(?:,\d{3})+(?!\d)|\d+)?(?P<frac>\.\d+)?(?P<exp>[eE][-+]?\d+(?![\w.]))?"
    r"(?:/(?P<den>\d+)(?!\d|\.\d))?[ \t]*%?"
)
_NUMBER_RE = re.compile(_NUMBER)
# Lead-in allowed between a marker and its number: spaces, `:`, markdown emphasis, quotes, math delimiters.
_LEAD_RE = re.compile(r"[\s:*_\"'`(\[]*")
# An arithmetic operator right after a number (`/` only before a digit: `km/h` and `$5/hour` are units).
_OPERATOR_AFTER_RE = re.compile(r"[ \t]*(?:[*^+×÷·]|/[ \t]*[\d(]|[-xX][ \t]*\d)")
_OPERATOR_BEFORE_RE = re.compile(r"(?:[*/^+×÷·]|[\w)][ \t]*-)[ \t]*$")
_SENTENCE_END_RE = re.compile(r"\.(?:\s|$)|[;!?\n]")
_RAW_NUMBER_RE = re.compile(
    r"(?<![\w.])(?P<sign>[-−])?\$?(?P<int>\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?P<frac>\.\d+)?(?:/(?P<den>\d+)(?!\d|\.\d))?"
)

# LaTeX and unicode clean-up, applied only to short windows (marker contents), never to a whole completion.
_FRAC_RE = re.compile(r"\\[dt]?frac\s*\{\s*(-?[\d.,]+)\s*\}\s*\{\s*([\d.,]+)\s*\}")
_FRAC_BARE_RE = re.compile(r"\\[dt]?frac\s*(\d)\s*(\d)")
_LATEX_SPACE_RE = re.compile(r"\\[,!;:>]|\\left|\\right|\\displaystyle|~")
_LATEX_CMD_RE = re.compile(r"\\([a-zA-Z]+)\s*")
_LATEX_SUBST = {
    "times": "*",
    "cdot": "*",
    "ast": "*",
    "div": "/",
    "approx": "=",
    "simeq": "=",
    "approxeq": "=",
    "equiv": "=",
    "neq": " ≠ ",
    "pm": " ± ",
    "quad": " ",
    "qquad": " ",
}
_CLEAN_TABLE = str.maketrans(
    {"$": None, "{": None, "}": None, "−": "-", "–": "-", "×": "*", "÷": "/", "≈": "=", "\u202f": None, "\u00a0": " "}
)
_ESCAPES = (("\\$", "$"), ("\\%", "%"), ("\\(", " "), ("\\)", " "), ("\\[", " "), ("\\]", " "), ("\\ ", " "))


def _clean(s: str) -> str:
    """Strip LaTeX wrappers and normalise unicode in a short string (a marker's content)."""
    if "\\" in s:
        for old, new in _ESCAPES:
            s = s.replace(old, new)
        s = _FRAC_RE.sub(r"\1/\2", s)
        s = _FRAC_BARE_RE.sub(r"\1/\2", s)
        s = _LATEX_SPACE_RE.sub("", s)
        s = _LATEX_CMD_RE.sub(lambda m: _LATEX_SUBST.get(m.group(1), " "), s)
    s = s.translate(_CLEAN_TABLE)
    return s.replace("**", " ")


def _match_value(m: re.Match) -> int | Fraction | None:
    """The exact value of a `_NUMBER_RE`/`_RAW_NUMBER_RE` match, or None when it holds no digits (or x/0)."""
    int_part, frac_part = m.group("int"), m.group("frac")
    if int_part is None and frac_part is None:
        return None
    den = m.group("den")
    if den is not None and frac_part is not None:
        return None  # `1.5/3`: not a simple fraction
    exp = m.groupdict().get("exp")
    if frac_part is None and exp is None:
        value: int | Fraction = int(int_part.replace(",", ""))  # the common case; Fraction(str) is ~10x slower
    else:
        value = Fraction((int_part or "0").replace(",", "") + (frac_part or "") + (exp or ""))
    if den is not None:
        if int(den) == 0:
            return None
        value = Fraction(value, int(den))
    return -value if m.group("sign") in ("-", "−") else value


def _numbers(s: str) -> list[tuple[int | Fraction, re.Match]]:
    out = []
    for m in _NUMBER_RE.finditer(s):
        value = _match_value(m)
        if value is not None:
            out.append((value, m))
    return out


def _format_number(value: int | Fraction) -> str:
    """Canonical string: `"72"`, `"-7"`; `"0.75"` when the value has a finite decimal form; else `"1/3"`."""
    if value.denominator == 1:
        return str(value.numerator)
    den = value.denominator
    while den % 2 == 0:
        den //= 2
    while den % 5 == 0:
        den //= 5
    if den == 1 and value.denominator <= 10**12:  # a terminating decimal
        digits = max(_power_of_ten_exponent(value.denominator), 1)
        text = f"{abs(value.numerator) * 10**digits // value.denominator:0{digits + 1}d}"
        text = f"{text[:-digits]}.{text[-digits:]}".rstrip("0").rstrip(".")
        return "-" + text if value < 0 else text
    return f"{value.numerator}/{value.denominator}"


def _power_of_ten_exponent(den: int) -> int:
    """Smallest k with den | 10**k (den has only the prime factors 2 and 5)."""
    k = 0
    while (10**k) % den:
        k += 1
    return k


def _single_number(content: str) -> int | Fraction | None:
    """The one number in a bounded answer (`\\boxed{}`, `<answer>`), read after its last `=`; None if 0 or 2+."""
    content = _clean(content)
    if "=" in content:
        content = content.rsplit("=", 1)[1]
    found = _numbers(content)
    if len(found) != 1:
        return None
    _, m = found[0]
    if _OPERATOR_AFTER_RE.match(content, m.end()) or _OPERATOR_BEFORE_RE.search(content, 0, m.start()):
        return None  # part of an expression such as 2^3 or x + 2: not evaluated
    return found[0][0]


def _direct_number(window: str) -> tuple[bool, int | Fraction | None]:
    """For `####` and answer phrases: (is_marker, value) for the number directly at the start of `window`."""
    window = _clean(window)
    start = _LEAD_RE.match(window).end()
    m = _NUMBER_RE.match(window, start)
    value = _match_value(m) if m is not None and m.start() == start else None
    if value is None:
        return False, None
    if _OPERATOR_AFTER_RE.match(window, m.end()) is None:
        return True, value
    # `9 * 2 = 18`: the result after the last `=` in the same sentence.
    end = _SENTENCE_END_RE.search(window, m.end())
    sentence = window[start : end.start() if end else len(window)]
    if "=" not in sentence:
        return True, None
    found = _numbers(sentence.rsplit("=", 1)[1])
    return True, (found[0][0] if len(found) == 1 else None)


def parse_number(value: Any) -> Fraction | None:
    """Parse a number (int, float, Fraction, or a string like `"$1,080.00"`, `"3/4"`, `"\\frac{3}{4}"`) exactly.

    Strings must hold exactly one number (words around it are ignored). Returns None for anything else, including
    NaN/inf and bools.
    """
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, Fraction):
        return value
    if isinstance(value, numbers.Integral):
        return Fraction(int(value))
    if isinstance(value, numbers.Real):
        value = float(value)
        return Fraction(repr(value)) if math.isfinite(value) else None
    if not isinstance(value, str):
        return None
    text = value.strip()
    if text.isdecimal() or (text[:1] == "-" and text[1:].isdecimal()):
        return Fraction(int(text))  # fast path for canonical integers
    try:
        return Fraction(text)  # canonical "-0.5", "1/3"
    except (ValueError, ZeroDivisionError):
        pass
    value = _single_number(text)
    return None if value is None else Fraction(value)


def answers_match(pred: Any, gold: Any, *, rel_tol: float = 1e-6) -> bool:
    """Numeric equality of two answers (canonical strings or numbers).

    Exact when the gold is an integer; otherwise `|pred - gold| <= rel_tol * max(|pred|, |gold|)`. None on either side
    never matches.
    """
    p, g = parse_number(pred), parse_number(gold)
    if p is None or g is None:
        return False
    if g.denominator == 1 or p == g:
        return p == g
    return abs(p - g) <= Fraction(rel_tol) * max(abs(p), abs(g))


# ---------------------------------------------------------------------------------------------------------------------
# Answer extraction
# ---------------------------------------------------------------------------------------------------------------------

# Markers are found with `str.find` (a regex alternation scanning every position is ~20x slower) and then checked.
_BOXED_OPEN_RE = re.compile(r"[ \t]*\{")
_PHRASE_IS_RE = re.compile(r"answer\**[ \t]*is\b", re.IGNORECASE)
_PHRASE_COLON_RE = re.compile(r"answer\**[ \t]*:", re.IGNORECASE)
_LINE_PREFIX_RE = re.compile(r"[ \t]*[#*>-]*[ \t]*(?:the[ \t]+)?(?:final[ \t]+)?", re.IGNORECASE)
_ANSWER_CLOSE_RE = re.compile(r"</answer\s*>", re.IGNORECASE)
_CONTINUATION_RE = re.compile(
    r"\n[ \t]*(?:[#*>]+[ \t]*)?(?:question|problem|q|human|user|assistant|instruction)[ \t]*\d*[ \t]*\**[ \t]*:"
    r"|<\|(?:im_start|im_end|endoftext|end_of_text|eot_id|end|user|assistant|system)\|>|</s>",
    re.IGNORECASE,
)
_PHRASE_WINDOW = 160  # characters read after an answer phrase


def _closing_brace(text: str, start: int, limit: int) -> int:
    """Index of the `}` closing the brace opened just before `start`, or -1."""
    depth = 1
    i = start
    while True:
        open_i = text.find("{", i, limit)
        close_i = text.find("}", i, limit)
        if close_i < 0:
            return -1
        if 0 <= open_i < close_i:
            depth += 1
            i = open_i + 1
        else:
            depth -= 1
            if depth == 0:
                return close_i
            i = close_i + 1


def _find_all(text: str, needle: str) -> Iterable[int]:
    i = text.find(needle)
    while i >= 0:
        yield i
        i = text.find(needle, i + 1)


def _markers(text: str) -> list[tuple[int, str, int]]:
    """Every syntactic marker token as (start, kind, end of the token), sorted by start."""
    found = []
    for i in _find_all(text, "####"):
        if (i == 0 or text[i - 1] != "#") and not text.startswith("#", i + 4):
            found.append((i, "hash", i + 4))
    for needle in ("\\boxed", "\\fbox"):
        for i in _find_all(text, needle):
            m = _BOXED_OPEN_RE.match(text, i + len(needle))
            if m is not None:
                found.append((i, "boxed", m.end()))
    for i in _find_all(text, "<answer>"):
        found.append((i, "tag", i + 8))
    for needle in ("answer", "Answer", "ANSWER"):
        for i in _find_all(text, needle):
            if i > 0 and (text[i - 1].isalnum() or text[i - 1] == "_"):
                continue
            m = _PHRASE_IS_RE.match(text, i)
            if m is None:
                m = _PHRASE_COLON_RE.match(text, i)
                if m is None or not _LINE_PREFIX_RE.fullmatch(text, text.rfind("\n", 0, i) + 1, i):
                    continue
            found.append((i, "phrase", m.end()))
    found.sort()
    return found


def _read_marker(text: str, kind: str, start: int, limit: int) -> tuple[int, int | Fraction | None] | None:
    """(where the answer region may end, value) if the marker token ending at `start` is complete in `text[:limit]`.

    None if it is not a complete marker. The first position is the end of a bounded marker's content, or the end of a
    `####`/phrase marker itself (its number follows directly, so no new-turn header can come before it).
    """
    if kind == "boxed":
        close = _closing_brace(text, start, limit)
        return None if close < 0 else (close + 1, _single_number(text[start:close]))
    if kind == "tag":
        close = _ANSWER_CLOSE_RE.search(text, start, limit)
        return None if close is None else (close.end(), _single_number(text[start : close.start()]))
    # `####` reads the rest of its line; a phrase reads a window (which may wrap onto the next line).
    if kind == "hash":
        end = text.find("\n", start, limit)
        end = limit if end < 0 else end
    else:
        end = min(start + _PHRASE_WINDOW, limit)
    is_marker, value = _direct_number(text[start:end])
    return (start, value) if is_marker else None


def _extract(text: str) -> tuple[bool, int | Fraction | None, int]:
    """(found a marker, its value, end of the answer region)."""
    markers = _markers(text)
    limit = len(text)
    first = None
    reads = {}
    for start, kind, token_end in markers:
        first = reads[start] = _read_marker(text, kind, token_end, limit)
        if first is not None:
            break
    if first is None:
        return False, None, limit
    cut = _CONTINUATION_RE.search(text, first[0])
    if cut is not None:
        limit = cut.start()
        reads = {}  # contents were read up to the end of the text: read again within the answer region
    for start, kind, token_end in reversed(markers):
        if start >= limit:
            continue
        read = reads[start] if start in reads else _read_marker(text, kind, token_end, limit)
        if read is not None:
            return True, read[1], limit
    return False, None, limit  # unreachable: the first marker lies inside the region


def _last_number(text: str) -> int | Fraction | None:
    value = None
    for m in _RAW_NUMBER_RE.finditer(text):
        value = _match_value(m)
    return value


def extract_answer(text: Any, *, fallback_last_number: bool = False) -> str | None:
    """The final answer in a model completion, as a canonical number string (`"1080"`, `"-7"`, `"0.75"`, `"1/3"`).

    See the module docstring for the exact rules: the last complete final-answer marker (`####`, `\\boxed{}`,
    `<answer>`, "the answer is") in the answer region wins. Returns None when there is no marker, or when the winning
    marker does not hold a single number; with `fallback_last_number=True`, a text with no marker at all gives its
    last number instead. Accepts chat messages as well as strings.
    """
    if not isinstance(text, str):
        text = completion_text(text)
    found, value, _ = _extract(text)
    if not found and fallback_last_number:
        value = _last_number(text)
    return None if value is None else _format_number(value)


@functools.lru_cache(maxsize=8192)
def _gold_from_str(gold: str) -> str | None:
    if "####" in gold:
        # GSM8K solution: the number on the last `####` line (the `<<...>>` annotations come before it).
        line = gold[gold.rindex("####") + 4 :].split("\n", 1)[0]
        _, value = _direct_number(line)
        return None if value is None else _format_number(value)
    found, value, _ = _extract(gold)
    if not found:
        value = parse_number(gold)  # a bare number, possibly with units/currency/LaTeX
    return None if value is None else _format_number(value)


def extract_gold(gold: Any) -> str | None:
    """The canonical gold answer from a dataset value.

    Accepts a number (`72`, `0.5`), a bare-number string (`"72"`, `"$1,080"`, `"\\frac{3}{4}"`), a full GSM8K solution
    (reasoning with `<<...>>` calculator annotations and a final `#### N` line: the last `####` line is read), or any
    text with a final-answer marker. Returns None when no number can be read.
    """
    if isinstance(gold, str):
        return _gold_from_str(gold)
    value = parse_number(gold)
    return None if value is None else _format_number(value)


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

_IMPORT_PATH_RE = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")


def is_reward_func_name(name: str) -> bool:
    """True for a registry name or a `"package.module:function"` import path (anything else may be a model path)."""
    return name in REWARD_FUNCS or _IMPORT_PATH_RE.fullmatch(name) is not None


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

    Raises ValueError for an unknown name, listing the registry and the import-path syntax.
    """
    if isinstance(names, str) or callable(names):
        names = [names]
    funcs = []
    for name in names:
        if callable(name):
            funcs.append(name)
        elif isinstance(name, str) and name in REWARD_FUNCS:
            funcs.append(REWARD_FUNCS[name])
        elif isinstance(name, str) and _IMPORT_PATH_RE.fullmatch(name):
            funcs.append(_import_reward(name))
        else:
            raise ValueError(
                f"Unknown reward function {name!r}. Known names: {', '.join(sorted(REWARD_FUNCS))}; or pass a "
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


# ---------------------------------------------------------------------------------------------------------------------
# Calling reward functions: validation, async, timeouts, error policy
# ---------------------------------------------------------------------------------------------------------------------

_RESERVED = ("prompts", "completions", "completion_ids", "trainer_state")
_ERROR_POLICIES = ("raise", "skip")


class _RewardTimeout(Exception):
    pass


class _Outcome:
    """Either `value` (the raw return) or `error` (the exception, possibly a `_RewardTimeout`)."""

    __slots__ = ("value", "error")

    def __init__(self, value: Any = None, error: BaseException | None = None):
        self.value = value
        self.error = error


def _is_async(func: Any) -> bool:
    while isinstance(func, functools.partial):
        func = func.func
    return inspect.iscoroutinefunction(func) or (callable(func) and inspect.iscoroutinefunction(func.__call__))


# A persistent event loop in a daemon thread runs the async reward functions, so they work from any thread, with or
# without a running loop there, and clients bound to the loop (e.g. aiohttp sessions) survive between steps.
_LOOP_LOCK = threading.Lock()
_LOOP: asyncio.AbstractEventLoop | None = None
_LOOP_PID: int | None = None


def _event_loop() -> asyncio.AbstractEventLoop:
    global _LOOP, _LOOP_PID
    with _LOOP_LOCK:
        if _LOOP is None or _LOOP_PID != os.getpid() or _LOOP.is_closed():  # new process after fork: new loop
            _LOOP = asyncio.new_event_loop()
            _LOOP_PID = os.getpid()
            threading.Thread(target=_LOOP.run_forever, name="grpo_hf-reward-loop", daemon=True).start()
        return _LOOP


def _run_coroutine(coro) -> Any:
    return asyncio.run_coroutine_threadsafe(coro, _event_loop()).result()


async def _await_with_timeout(awaitable, timeout: float | None) -> Any:
    if timeout is None:
        return await awaitable
    try:
        return await asyncio.wait_for(awaitable, timeout)
    except asyncio.TimeoutError as e:
        raise _RewardTimeout() from e


async def _async_outcome(func: Callable, kwargs: dict, timeout: float | None) -> _Outcome:
    try:
        return _Outcome(await _await_with_timeout(func(**kwargs), timeout))
    except Exception as e:
        return _Outcome(error=e)


async def _gather_outcomes(calls: list[tuple[Callable, dict]], timeout: float | None) -> list[_Outcome]:
    return list(await asyncio.gather(*(_async_outcome(f, kw, timeout) for f, kw in calls)))


def _sync_outcome(func: Callable, kwargs: dict, timeout: float | None) -> _Outcome:
    """Call a sync function; with a timeout, in a daemon thread (a call that times out is left running there)."""
    if timeout is None:
        try:
            value = func(**kwargs)
            if inspect.isawaitable(value):
                value = _run_coroutine(_await_with_timeout(value, None))
            return _Outcome(value)
        except Exception as e:
            return _Outcome(error=e)
    box: dict[str, Any] = {}

    def target():
        try:
            box["value"] = func(**kwargs)
        except BaseException as e:  # carried to the caller's thread
            box["error"] = e

    thread = threading.Thread(target=target, name=f"grpo_hf-reward-{reward_func_name(func)}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        return _Outcome(error=_RewardTimeout())
    if "error" in box:
        if not isinstance(box["error"], Exception):
            raise box["error"]
        return _Outcome(error=box["error"])
    value = box["value"]
    if inspect.isawaitable(value):
        try:
            value = _run_coroutine(_await_with_timeout(value, timeout))
        except Exception as e:
            return _Outcome(error=e)
    return _Outcome(value)


def _sync_per_sample(func: Callable, kwargs: dict, n: int, timeout: float | None) -> Iterable[_Outcome]:
    """One call per sample, lazily (the "raise" policy stops at the first failure)."""
    return (_sync_outcome(func, _slice_kwargs(kwargs, i), timeout) for i in range(n))


def _async_per_sample(func: Callable, kwargs: dict, n: int, timeout: float | None) -> list[_Outcome]:
    """One call per sample, all concurrently."""
    return _run_coroutine(_gather_outcomes([(func, _slice_kwargs(kwargs, i)) for i in range(n)], timeout))


def _slice_kwargs(kwargs: dict, i: int) -> dict:
    return {k: (v if k == "trainer_state" or v is None else v[i : i + 1]) for k, v in kwargs.items()}


def _short(value: Any, limit: int = 300) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit // 2]} ... {text[-limit // 2 :]}"


def _describe_sample(kwargs: dict, i: int) -> str:
    parts = [f"prompt={_short(kwargs['prompts'][i])}", f"completion={_short(kwargs['completions'][i])}"]
    parts += [f"{k}={_short(v[i], 120)}" for k, v in kwargs.items() if k not in _RESERVED and v is not None]
    return ", ".join(parts)


def _to_floats(name: str, values: Any, n: int) -> list[float | None]:
    """Validate one function's return: a sequence of `n` numbers or None; NaN/inf become None with a warning."""
    if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Iterable):
        raise TypeError(
            f"Reward function {name!r} returned a {type(values).__name__}; it must return a list with one float (or "
            "None) per completion."
        )
    if not hasattr(values, "__len__"):
        values = list(values)
    if len(values) != n:
        raise ValueError(f"Reward function {name!r} returned {len(values)} rewards for {n} completions.")
    out: list[float | None] = []
    non_finite = 0
    for i, v in enumerate(values):
        if v is None:
            out.append(None)
            continue
        try:
            x = float(v)
        except (TypeError, ValueError) as e:
            raise TypeError(
                f"Reward function {name!r} returned {_short(v, 80)} ({type(v).__name__}) for completion {i}; "
                "expected a float or None."
            ) from e
        if math.isfinite(x):
            out.append(x)
        else:
            non_finite += 1
            out.append(None)
    if non_finite:
        warnings.warn(
            f"Reward function {name!r} returned NaN/inf for {non_finite} of {n} completions; they are scored None "
            "(no reward from this function).",
            RuntimeWarning,
            stacklevel=4,
        )
    return out


def _failure_message(name: str, error: BaseException, where: str, timeout: float | None) -> str:
    if isinstance(error, _RewardTimeout):
        return (
            f"Reward function {name!r} did not return within {timeout} s (config field `reward_timeout`) {where}. "
            "Make it faster, raise `reward_timeout`, or set `reward_error_policy='skip'` to score such calls None."
        )
    return (
        f"Reward function {name!r} raised {type(error).__name__}: {error} {where}. "
        "Set `reward_error_policy='skip'` to score failing samples None instead of stopping."
    )


def _resolve(
    name: str,
    batch: _Outcome,
    per_sample: Callable[[], Iterable[_Outcome]],
    kwargs: dict,
    n: int,
    timeout: float | None,
    error_policy: str,
) -> tuple[list[float | None], int]:
    """Turn one function's batch outcome into n rewards and an error count, retrying per sample after an exception."""
    if batch.error is None:
        return _to_floats(name, batch.value, n), 0
    error = batch.error
    if isinstance(error, _RewardTimeout):
        if error_policy == "raise":
            raise RuntimeError(_failure_message(name, error, f"on a batch of {n} completions", timeout))
        logger.warning("Reward function %r timed out after %s s on %d completions; scored None.", name, timeout, n)
        return [None] * n, n
    # An exception: retry sample by sample to find (raise) or isolate (skip) the bad ones.
    rewards: list[float | None] = []
    failed = 0
    first_error: tuple[int, BaseException] | None = None
    for i, outcome in enumerate(per_sample()):
        if outcome.error is not None:
            if error_policy == "raise":
                where = f"on sample {i} of {n} ({_describe_sample(kwargs, i)})"
                raise RuntimeError(_failure_message(name, outcome.error, where, timeout)) from outcome.error
            failed += 1
            first_error = first_error or (i, outcome.error)
            rewards.append(None)
        else:
            rewards.extend(_to_floats(name, outcome.value, 1))
    if error_policy == "raise":  # every sample passes alone: the batch as a whole is the problem
        where = f"on the batch of {n} completions (each sample passes alone; sample 0: {_describe_sample(kwargs, 0)})"
        raise RuntimeError(_failure_message(name, error, where, timeout)) from error
    if failed:
        i, e = first_error
        logger.warning(
            "Reward function %r failed on %d of %d completions (first: sample %d, %s: %s); scored None.",
            name, failed, n, i, type(e).__name__, e,
        )  # fmt: skip
    else:
        logger.warning(
            "Reward function %r raised %s: %s on the batch but not on any single sample; used per-sample calls.",
            name, type(error).__name__, error,
        )  # fmt: skip
    return rewards, failed


def compute_rewards(
    reward_funcs: list[Callable],
    prompts: list,
    completions: list,
    completion_ids: list | None = None,
    *,
    columns: dict[str, list] | None = None,
    trainer_state: Any = None,
    timeout: float | None = None,
    error_policy: str = "raise",
) -> tuple[list[list[float]], dict[str, int]]:
    """Call every reward function on the batch; return an `[N][R]` matrix (NaN = None) and error counts per name.

    Each function is called once with keyword arguments `prompts`, `completions`, `completion_ids`, `trainer_state`
    and one keyword per entry of `columns`. Sync functions run one after another in this thread (in a worker thread
    when `timeout` is set); `async def` functions then run concurrently on a background event loop.

    - A result that is not a list of N floats/None raises (ValueError for a wrong length, naming the function and
      both lengths) under every policy: that is a bug in the function, not a bad sample.
    - NaN/inf in a result is scored None, with a `RuntimeWarning`.
    - An exception: the function is called again sample by sample. `error_policy="raise"` raises a RuntimeError naming
      the function and the first failing sample (or, if no sample fails alone, the batch and its first sample);
      `"skip"` scores the failing samples None and counts them.
    - `timeout` (seconds, per call): a call that takes longer raises under `"raise"` (naming the config field
      `reward_timeout`); under `"skip"` the whole batch is scored None for that function and counted. A timed-out
      sync call keeps running in its daemon thread; a timed-out async call is cancelled.

    Error counts are keyed by `reward_func_name` (functions sharing a name share a count).
    """
    if error_policy not in _ERROR_POLICIES:
        raise ValueError(f"error_policy={error_policy!r} must be one of {_ERROR_POLICIES}.")
    if timeout is not None and not timeout > 0:
        raise ValueError(f"timeout={timeout} must be > 0 seconds (or None for no limit).")
    n = len(completions)
    columns = dict(columns or {})
    lengths = {
        "prompts": len(prompts),
        **({"completion_ids": len(completion_ids)} if completion_ids is not None else {}),
    }
    for key, value in columns.items():
        if key in _RESERVED:
            raise ValueError(f"Column {key!r} clashes with a reward-function argument; rename it.")
        lengths[key] = len(value)
    wrong = {k: v for k, v in lengths.items() if v != n}
    if wrong:
        raise ValueError(f"compute_rewards got {n} completions but lengths {wrong}.")

    kwargs = {
        "prompts": prompts,
        "completions": completions,
        "completion_ids": completion_ids,
        "trainer_state": trainer_state,
        **columns,
    }
    names = [reward_func_name(f) for f in reward_funcs]
    rewards = [[math.nan] * len(reward_funcs) for _ in range(n)]
    errors = dict.fromkeys(names, 0)

    def store(j: int, column: list[float | None], failed: int) -> None:
        errors[names[j]] += failed
        for i, r in enumerate(column):
            if r is not None:
                rewards[i][j] = r

    is_async = [_is_async(f) for f in reward_funcs]
    for j, func in enumerate(reward_funcs):
        if not is_async[j]:
            batch = _sync_outcome(func, kwargs, timeout)
            per_sample = functools.partial(_sync_per_sample, func, kwargs, n, timeout)
            store(j, *_resolve(names[j], batch, per_sample, kwargs, n, timeout, error_policy))
    async_idx = [j for j in range(len(reward_funcs)) if is_async[j]]
    if async_idx:
        outcomes = _run_coroutine(_gather_outcomes([(reward_funcs[j], kwargs) for j in async_idx], timeout))
        for j, batch in zip(async_idx, outcomes, strict=True):
            per_sample = functools.partial(_async_per_sample, reward_funcs[j], kwargs, n, timeout)
            store(j, *_resolve(names[j], batch, per_sample, kwargs, n, timeout, error_policy))
    return rewards, errors
