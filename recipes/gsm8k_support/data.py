"""Datasets for the GSM8K recipes: prompt formatting, GSM8K loading, and a built-in offline dataset.

Every dataset here has the GSM8K columns `question` and `answer` (a worked solution ending in
`#### N`, Cobbe et al., 2021). `to_conversational` adds the `prompt` column the trainer reads: a
system message asking for reasoning and then the final answer in one of two formats,

- `"####"`: GSM8K's own convention, the last line is `#### N`;
- `"tags"`: DeepSeek-R1's convention, `<think>...</think>` then `<answer>N</answer>`.

`make_arithmetic_dataset` generates GSM8K-format word problems (one- and two-step additions and
subtractions of small numbers, templated sentences) so the recipe runs with no network. Its train
and test splits are disjoint by construction: each problem's arithmetic (its calculator steps, e.g.
`7+5=12`) is hashed into one split only, so no held-out computation is ever trained on.
"""

from __future__ import annotations

import logging
import os
import random
import re
import zlib
from pathlib import Path
from typing import Literal

import datasets

logger = logging.getLogger(__name__)

AnswerFormat = Literal["####", "tags"]

SYSTEM_PROMPTS: dict[str, str] = {
    "####": (
        "Solve the math problem. Reason step by step, then write the final answer alone on the last line as "
        "'#### <number>', like this:\nTom has 3 + 2 = 5 apples.\n#### 5"
    ),
    "tags": (
        "Solve the math problem. First reason step by step inside <think> </think> tags, then give only the final "
        "number inside <answer> </answer> tags, like this:\n<think>\nTom has 3 + 2 = 5 apples.\n</think>\n"
        "<answer>\n5\n</answer>"
    ),
}

FORMAT_REWARD_NAMES: dict[str, str] = {"####": "format_gsm8k", "tags": "format"}
"""The registry name (`grpo_hf.REWARD_FUNCS`) of the format reward that checks each answer format."""

ARITHMETIC_DATASET = "builtin:arithmetic"
"""Dataset name of the built-in offline problems (`make_arithmetic_dataset`), accepted by `load_problems`."""

REQUIRED_COLUMNS = ("question", "answer")
_LOCAL_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
_OFFLINE_HINT = (
    "If the Hugging Face Hub is unreachable from this machine, pass a local file or directory with "
    "--dataset_path (jsonl/json/parquet with 'question' and 'answer' columns; a directory holds "
    "<split>.jsonl files), or run the offline recipe `python recipes/gsm8k.py --config recipes/gsm8k_cpu.yaml`, "
    "which uses the built-in arithmetic dataset."
)


# ------------------------------------------------------------------------------------------------
# Prompt formatting
# ------------------------------------------------------------------------------------------------


def system_prompt_for(answer_format: str) -> str:
    """The default system prompt for `answer_format` ("####" or "tags")."""
    if answer_format not in SYSTEM_PROMPTS:
        raise ValueError(f"answer_format={answer_format!r} is not one of {list(SYSTEM_PROMPTS)}.")
    return SYSTEM_PROMPTS[answer_format]


# Worked examples for few-shot prompts, given as earlier chat turns. Their names, items and numbers are not
# produced by `make_arithmetic_dataset`, so they never leak held-out problems.
FEW_SHOT_EXAMPLES: dict[str, list[tuple[str, str]]] = {
    "####": [
        (
            "Omar has 3 pens. He buys 2 more pens. How many pens does Omar have now?",
            "Omar has 3 + 2 = 5 pens.\n#### 5",
        ),
        (
            "Sara has 12 stamps. She gives 4 stamps to her aunt. How many stamps does Sara have left?",
            "Sara has 12 - 4 = 8 stamps left.\n#### 8",
        ),
    ],
    "tags": [
        (
            "Omar has 3 pens. He buys 2 more pens. How many pens does Omar have now?",
            "<think>\nOmar has 3 + 2 = 5 pens.\n</think>\n<answer>\n5\n</answer>",
        ),
        (
            "Sara has 12 stamps. She gives 4 stamps to her aunt. How many stamps does Sara have left?",
            "<think>\nSara has 12 - 4 = 8 stamps left.\n</think>\n<answer>\n8\n</answer>",
        ),
    ],
}


def format_prompt(
    question: str, answer_format: str = "####", system_prompt: str | None = None, num_shots: int = 0
) -> list[dict]:
    """Chat messages for one question: the system prompt, `num_shots` worked examples as earlier user/assistant
    turns (at most `len(FEW_SHOT_EXAMPLES[answer_format])`), then the question as the user turn."""
    system = system_prompt if system_prompt is not None else system_prompt_for(answer_format)
    shots = FEW_SHOT_EXAMPLES[answer_format]
    if not 0 <= num_shots <= len(shots):
        raise ValueError(f"num_shots={num_shots} must be between 0 and {len(shots)} (the built-in examples).")
    messages = [{"role": "system", "content": system}]
    for example_question, example_answer in shots[:num_shots]:
        messages += [{"role": "user", "content": example_question}, {"role": "assistant", "content": example_answer}]
    return messages + [{"role": "user", "content": question}]


def to_conversational(
    dataset: datasets.Dataset,
    answer_format: str = "####",
    system_prompt: str | None = None,
    question_column: str = "question",
    num_shots: int = 0,
) -> datasets.Dataset:
    """Add the `prompt` column (a list of chat messages); the other columns are kept for the rewards."""
    check_columns(dataset, (question_column,))
    system = system_prompt if system_prompt is not None else system_prompt_for(answer_format)
    format_prompt("", answer_format, system, num_shots)  # validates the arguments once
    return dataset.map(
        lambda row: {"prompt": format_prompt(row[question_column], answer_format, system, num_shots)},
        desc="Formatting prompts",
    )


def check_columns(dataset: datasets.Dataset, required=REQUIRED_COLUMNS, source: str = "the dataset") -> None:
    """Raise a ValueError naming the missing columns and listing those found."""
    missing = [c for c in required if c not in dataset.column_names]
    if missing:
        raise ValueError(
            f"{source} has no column(s) {missing}; columns found: {dataset.column_names}. "
            f"GSM8K-style data needs {list(required)} ('answer' ends with '#### <number>'). Rename the columns "
            "(e.g. dataset.rename_column) or pick another dataset."
        )


# ------------------------------------------------------------------------------------------------
# GSM8K from the Hub or a local file
# ------------------------------------------------------------------------------------------------


def _load_local(path: Path, split: str) -> datasets.Dataset:
    if path.is_dir():
        candidates = [path / f"{split}{suffix}" for suffix in _LOCAL_SUFFIXES]
        found = [p for p in candidates if p.is_file()]
        if not found:
            raise FileNotFoundError(
                f"{path} is a directory but holds none of {[p.name for p in candidates]} for split {split!r}."
            )
        path = found[0]
    builder = _LOCAL_SUFFIXES.get(path.suffix)
    if builder is None:
        raise ValueError(f"{path}: unsupported file type {path.suffix!r}; use one of {sorted(_LOCAL_SUFFIXES)}.")
    return datasets.load_dataset(builder, data_files=str(path), split="train")


def load_gsm8k(
    name_or_path: str = "openai/gsm8k",
    split: str = "train",
    config: str | None = "main",
    num_examples: int | None = None,
) -> datasets.Dataset:
    """GSM8K-style data with `question` and `answer` columns, from the Hub or a local file/directory.

    A local path may be a jsonl/json/parquet/csv file (loaded whole; `split` is ignored) or a
    directory holding `<split>.jsonl` (or .json/.parquet/.csv). `num_examples` keeps the first N rows.
    """
    path = Path(os.path.expanduser(name_or_path))
    if path.exists():
        dataset = _load_local(path, split)
        source = str(path)
    else:
        try:
            dataset = datasets.load_dataset(name_or_path, config, split=split)
        except (ConnectionError, OSError) as err:  # datasets raises ConnectionError (an OSError) when offline
            raise ConnectionError(
                f"Could not load the dataset {name_or_path!r} from the Hub: {err}\n{_OFFLINE_HINT}"
            ) from err
        source = f"{name_or_path} ({config}, {split})"
    check_columns(dataset, REQUIRED_COLUMNS, source=source)
    if num_examples is not None:
        dataset = dataset.select(range(min(num_examples, len(dataset))))
    logger.info("Loaded %d examples from %s", len(dataset), source)
    return dataset


def load_problems(
    name_or_path: str,
    split: str = "train",
    config: str | None = "main",
    num_examples: int | None = None,
    seed: int = 0,
    max_number: int = 20,
) -> datasets.Dataset:
    """`question`/`answer` problems from `ARITHMETIC_DATASET` (split "train" or "test") or `load_gsm8k`.

    For the built-in data, `num_examples` defaults to 1000 and `seed`/`max_number` apply; any split other
    than "train" draws from the held-out problems.
    """
    if name_or_path == ARITHMETIC_DATASET:
        split = "train" if split == "train" else "test"
        return make_arithmetic_dataset(num_examples or 1000, seed=seed, split=split, max_number=max_number)
    return load_gsm8k(name_or_path, split=split, config=config, num_examples=num_examples)


# ------------------------------------------------------------------------------------------------
# Built-in arithmetic word problems (offline)
# ------------------------------------------------------------------------------------------------

_NAMES = [
    ("Tom", "he"), ("Anna", "she"), ("Ben", "he"), ("Mia", "she"), ("Sam", "he"), ("Lily", "she"),
    ("Jack", "he"), ("Emma", "she"), ("Leo", "he"), ("Zoe", "she"), ("Max", "he"), ("Ava", "she"),
    ("Noah", "he"), ("Ella", "she"), ("Liam", "he"), ("Ruby", "she"),
]  # fmt: skip
_ITEMS = ["apples", "pencils", "stickers", "marbles", "cookies", "books", "coins", "cards", "balloons", "shells"]
_FRIENDS = ["a friend", "a classmate", "a neighbor", "a cousin", "a brother", "a sister"]

# Each template: (question, solution, the answer as a function of the numbers, numbers drawn).
# Numbers are drawn so every intermediate result is a positive integer.
_TEMPLATES = [
    (
        "{name} has {a} {item}. {He} buys {b} more {item}. How many {item} does {name} have now?",
        "{name} has {a} + {b} = <<{a}+{b}={r}>>{r} {item} now.",
        lambda a, b, c: a + b,
        2,
    ),
    (
        "{name} has {a} {item}. {He} gives {b} {item} to {friend}. How many {item} does {name} have left?",
        "{name} has {a} - {b} = <<{a}-{b}={r}>>{r} {item} left.",
        lambda a, b, c: a - b,
        2,
    ),
    (
        "There are {a} {item} in a box. {name} puts {b} more {item} in the box. How many {item} are in the box?",
        "There are {a} + {b} = <<{a}+{b}={r}>>{r} {item} in the box.",
        lambda a, b, c: a + b,
        2,
    ),
    (
        "{name} had {a} {item}. {He} lost {b} of them. How many {item} does {name} have now?",
        "{name} has {a} - {b} = <<{a}-{b}={r}>>{r} {item} now.",
        lambda a, b, c: a - b,
        2,
    ),
    (
        "{name} has {a} {item}. {He} buys {b} more and then gives {c} to {friend}. "
        "How many {item} does {name} have now?",
        "After buying, {name} has {a} + {b} = <<{a}+{b}={s}>>{s} {item}.\n"
        "After giving some away, {name} has {s} - {c} = <<{s}-{c}={r}>>{r} {item}.",
        lambda a, b, c: a + b - c,
        3,
    ),
    (
        "{name} has {a} {item} and {friend} gives {him} {b} more. Then {name} finds {c} more {item}. "
        "How many {item} does {name} have in total?",
        "{name} first has {a} + {b} = <<{a}+{b}={s}>>{s} {item}.\n"
        "Then {name} has {s} + {c} = <<{s}+{c}={r}>>{r} {item}.",
        lambda a, b, c: a + b + c,
        3,
    ),
]
_PRONOUNS = {"he": ("He", "him"), "she": ("She", "her")}
_ANNOTATION_RE = re.compile(r"<<([^>]*)>>")


def _draw_problem(rng: random.Random, max_number: int) -> tuple[str, str, int]:
    """(question, worked solution with calculator annotations, answer)."""
    template_id = rng.randrange(len(_TEMPLATES))
    question_t, solution_t, fn, arity = _TEMPLATES[template_id]
    a = rng.randint(2, max_number)
    b = rng.randint(1, a - 1 if template_id in (1, 3) else max_number)  # a - b stays positive
    c = rng.randint(1, min(max_number, a + b - 1)) if arity == 3 else 0  # a + b - c stays positive
    name, pronoun = rng.choice(_NAMES)
    fields = {
        "name": name,
        "He": _PRONOUNS[pronoun][0],
        "him": _PRONOUNS[pronoun][1],
        "item": rng.choice(_ITEMS),
        "friend": rng.choice(_FRIENDS),
        "a": a,
        "b": b,
        "c": c,
        "s": a + b,
        "r": fn(a, b, c),
    }
    return question_t.format(**fields), solution_t.format(**fields), fields["r"]


def _split_of(solution: str, test_fraction: float) -> str:
    """Which split owns a problem: a fixed hash of its arithmetic (the calculator annotations), whatever the seed."""
    key = "|".join(_ANNOTATION_RE.findall(solution))
    bucket = zlib.crc32(key.encode()) % 1000
    return "test" if bucket < test_fraction * 1000 else "train"


def make_arithmetic_dataset(
    num_examples: int,
    seed: int = 0,
    split: Literal["train", "test"] = "train",
    max_number: int = 20,
    test_fraction: float = 0.2,
) -> datasets.Dataset:
    """Seeded GSM8K-format word problems: columns `question` and `answer` (solution + `#### N`).

    One- and two-step additions/subtractions of numbers up to `max_number`. The same
    (`num_examples`, `seed`, `split`) always gives the same rows; the "train" and "test" splits never
    share a problem's arithmetic (the same operations on the same numbers), whatever the seeds.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split={split!r} must be 'train' or 'test'.")
    rng = random.Random(f"grpo_hf-arithmetic-{seed}-{split}")
    questions, answers, seen = [], [], set()
    misses = 0  # draws in a row that gave nothing new: the split's problems are (nearly) exhausted
    while len(questions) < num_examples:
        misses += 1
        if misses > 10_000:
            raise ValueError(
                f"Could not draw {num_examples} distinct {split} problems with max_number={max_number}; "
                "raise max_number or ask for fewer examples."
            )
        question, solution, result = _draw_problem(rng, max_number)
        if question in seen or _split_of(solution, test_fraction) != split:
            continue
        misses = 0
        seen.add(question)
        questions.append(question)
        answers.append(f"{solution}\n#### {result}")
    return datasets.Dataset.from_dict({"question": questions, "answer": answers})
