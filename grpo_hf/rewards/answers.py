r"""Answer parsing for the accuracy reward: the final answer of a completion and the gold answer, as exact numbers.

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

Only the standard library: no sympy in the hot path (`grpo_hf.rewards.latex` compares LaTeX answers with math-verify,
in a worker process).
"""

from __future__ import annotations

import functools
import math
import numbers
import re
from collections.abc import Iterable, Mapping
from fractions import Fraction
from typing import Any

__all__ = ["answers_match", "completion_text", "extract_answer", "extract_gold", "parse_number"]

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
