"""Multiplication word problems a 135M model cannot do in its head, the calculator tool that solves them, the reward.

Each problem multiplies two numbers of `digits` digits, one count per factor ("A baker fills 237 trays with 48 rolls
each. How many rolls are there?"); which factor comes first in the text is drawn. The train and held-out splits are
disjoint by construction: a problem's split is a hash of its unordered pair of factors, so no held-out multiplication
is ever trained on, in either order.
"""

from __future__ import annotations

import random
import re
import zlib
from collections.abc import Sequence
from typing import Any

import datasets

SYSTEM_PROMPT = "Solve the problem. End with 'The answer is <number>.'"

_TEMPLATES = [
    ("A baker fills {a} trays with {b} rolls each. How many rolls are there?", "rolls"),
    ("A farm has {a} crates with {b} eggs in each crate. How many eggs are there?", "eggs"),
    ("{name} buys {a} boxes of pencils. Each box holds {b} pencils. How many pencils does {name} buy?", "pencils"),
    ("A theater has {a} rows of {b} seats. How many seats does it have?", "seats"),
    ("{name} reads {b} pages every day for {a} days. How many pages does {name} read?", "pages"),
    ("A school orders {a} packs of {b} markers. How many markers is that?", "markers"),
]
_NAMES = ["Maya", "Omar", "Lena", "Ravi", "Sofia", "Tom", "Aiko", "Diego"]


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a * b


def split_of(a: int, b: int, held_out_percent: int = 20) -> str:
    """'test' or 'train' for the product a x b, the same for b x a."""
    key = f"{min(a, b)}x{max(a, b)}".encode()
    return "test" if zlib.crc32(key) % 100 < held_out_percent else "train"


def make_problems(n: int, split: str, seed: int = 0, digits: Sequence[int] = (2, 2)) -> datasets.Dataset:
    """`n` distinct problems of `split` ('train' or 'test'): columns `question`, `a`, `b`, `answer` (a*b, as text).
    `digits`: the digits of the two factors, e.g. (3, 2); the order they appear in is drawn per problem."""
    if split not in ("train", "test"):
        raise ValueError(f"split={split!r} must be 'train' or 'test'.")
    if len(digits) != 2 or min(digits) < 2:
        raise ValueError(f"digits={list(digits)} must give two factors of at least 2 digits each, e.g. [3, 2].")
    rng = random.Random(f"{seed}-{split}")
    bounds = [(10 ** (d - 1) + 1, 10**d - 1) for d in digits]  # no factor of 10: nothing to do by appending zeros
    rows, seen = [], set()
    while len(rows) < n:
        a, b = (rng.randint(low, high) for low, high in rng.sample(bounds, 2))
        if (a, b) in seen or a % 10 == 0 or b % 10 == 0 or split_of(a, b) != split:
            continue
        seen.add((a, b))
        template, _ = rng.choice(_TEMPLATES)
        question = template.format(a=a, b=b, name=rng.choice(_NAMES))
        rows.append({"question": question, "a": a, "b": b, "answer": str(a * b)})
    return datasets.Dataset.from_list(rows)


def to_conversational(dataset: datasets.Dataset) -> datasets.Dataset:
    """Add the `prompt` column the trainer reads: the system prompt and the question."""

    def prompt(row):
        return {"prompt": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": row["question"]}]}

    return dataset.map(prompt)


def final_number(text: str) -> str | None:
    """The last integer in `text` (thousands separators dropped), or None."""
    numbers = re.findall(r"-?\d[\d,]*", text)
    return numbers[-1].replace(",", "") if numbers else None


def final_answer(completion: list[dict[str, Any]]) -> str | None:
    """The number the episode ends on: the last integer of its last message, if that message is the model's."""
    if not completion or completion[-1].get("role") != "assistant":
        return None
    return final_number(completion[-1].get("content") or "")


def correct_answer(completions: list[list[dict[str, Any]]], answer: list[str], **_) -> list[float]:
    """1.0 when the episode's final answer is the product, else 0.0 (the tool's own reply does not count)."""
    return [float(final_answer(c) == a) for c, a in zip(completions, answer, strict=True)]


def called_tool(completion: list[dict[str, Any]]) -> bool:
    """Whether the episode got at least one tool reply."""
    return any(message.get("role") == "tool" for message in completion)
