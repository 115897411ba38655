"""A catalogue of bad inputs: each row is one kind of input and what must happen to it.

A row is `Case(id, change, expected)`. `change(setup)` edits the default arguments of a tiny, valid run (`Setup`:
model, tokenizer, reward functions, config fields, datasets, other trainer arguments); `expected` is one of

- `raises(ExceptionType, regex)`: building the config or the trainer raises exactly that class, with a message that
  matches `regex` (which names the field, argument or dataset row); `raises(..., when="train")`: the trainer builds and
  the first training step raises it (for what only a rollout can show: a reward function's return values);
- `runs()`: one training step completes with a finite loss (`check` may assert more);
- `builds()`: the trainer builds (for accepted inputs whose check runs at construction; nothing is trained);
- `warns(regex)`: building the config and the trainer logs a warning that matches `regex`; `warns(..., when="train")`:
  one training step runs and logs it (an input that is accepted but would train on nothing, silently).

A new kind of bad input is one more row. Every trainer here is tiny (one layer of width 16, two completions of two
tokens), so construction rows take milliseconds and run rows about a second.
"""

from __future__ import annotations

import asyncio
import decimal
import fractions
import math
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import build_tiny_model, build_tiny_tokenizer
from datasets import Dataset, DatasetDict
from transformers import LlamaForSequenceClassification, T5Config, T5ForConditionalGeneration, TrainingArguments

from grpo_hf import GRPOConfig, GRPOTrainer


# ---- the default run and the ways to change it ------------------------------------------------------------------
def length_reward(completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]


@dataclass
class Setup:
    """Everything `GRPOTrainer(...)` takes, valid by default; a row's `change` edits it."""

    tmp_path: Path
    tokenizer: Any = field(default_factory=build_tiny_tokenizer)
    model: Any = None
    reward_funcs: Any = length_reward
    config: dict = field(default_factory=dict)
    train_dataset: Any = None
    eval_dataset: Any = None
    processing_class: Any = None
    kwargs: dict = field(default_factory=dict)  # reward_processing_classes, peft_config
    make_args: Callable = GRPOConfig

    def __post_init__(self):
        self.model = build_tiny_model(self.tokenizer, hidden_size=16, num_layers=1)
        self.processing_class = self.tokenizer
        self.train_dataset = Dataset.from_dict({"prompt": ["2 + 2 =", "3 + 4 ="], "answer": ["4", "7"]})
        self.config = dict(
            output_dir=str(self.tmp_path / "out"),
            per_device_train_batch_size=2,
            num_generations=2,
            max_completion_length=2,
            max_prompt_length=16,
            max_steps=1,
            beta=0.0,
            learning_rate=1e-3,
            logging_steps=1,
            use_cpu=True,
            report_to="none",
            save_strategy="no",
            disable_tqdm=True,
            seed=0,
        )

    def build(self) -> GRPOTrainer:
        args = self.make_args(**self.config)
        return GRPOTrainer(
            self.model,
            self.reward_funcs,
            args,
            self.train_dataset,
            self.eval_dataset,
            processing_class=self.processing_class,
            **self.kwargs,
        )


Change = Callable[[Setup], Any]


def config(**fields) -> Change:
    return lambda s: s.config.update(fields)


def attr(name: str, make: Callable[[Setup], Any]) -> Change:
    """Set `setup.<name>` to `make(setup)` (built when the row runs, not when the file is collected)."""
    return lambda s: setattr(s, name, make(s))


def train(make: Callable[[Setup], Any]) -> Change:
    return attr("train_dataset", make)


def prompts(*values) -> Change:
    """The train dataset's prompts (an Arrow column: one type for every row)."""
    return train(lambda s: Dataset.from_dict({"prompt": list(values)}))


def chat(*messages: dict) -> Change:
    """Two rows whose prompt is the conversation `messages`."""
    return prompts(list(messages), list(messages))


def evals(make: Callable[[Setup], Any]) -> Change:
    return attr("eval_dataset", make)


def rewards(*funcs) -> Change:
    return lambda s: setattr(s, "reward_funcs", list(funcs))


def returning(name: str, value: Callable[[int], Any]) -> Callable:
    """A reward function called `name` that returns `value(n)` for n completions."""

    def reward(completions, **kwargs):
        return value(len(completions))

    reward.__name__ = name
    return reward


def each(value) -> Callable[[int], list]:
    return lambda n: [value] * n


def trainer_kwargs(**kwargs) -> Change:
    return lambda s: s.kwargs.update(kwargs)


def tokenizer(**attributes) -> Change:
    def change(s):
        for name, value in attributes.items():
            setattr(s.tokenizer, name, value)

    return change


def both(*changes: Change) -> Change:
    return lambda s: [change(s) for change in changes]


@dataclass(frozen=True)
class Expect:
    kind: str  # "raises" | "runs" | "builds" | "warns"
    error: type[BaseException] | None = None
    match: str = ""
    when: str = "build"
    check: Callable | None = None


def raises(error: type[BaseException], match: str, when: str = "build") -> Expect:
    return Expect("raises", error, match, when)


def runs(check: Callable | None = None) -> Expect:
    return Expect("runs", check=check)


def builds(check: Callable | None = None) -> Expect:
    return Expect("builds", check=check)


def warns(match: str, when: str = "build") -> Expect:
    return Expect("warns", match=match, when=when)


@dataclass(frozen=True)
class Case:
    id: str
    change: Change
    expected: Expect
    marks: tuple = ()


# ---- things the rows build ------------------------------------------------------------------------------------
class Rows(torch.utils.data.Dataset):
    """A map-style dataset of Python rows: holds what an Arrow column cannot (mixed types)."""

    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, index):
        return self.rows[index]


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        yield {"prompt": "2 + 2 ="}


def stream(s):
    return Dataset.from_dict({"prompt": ["a", "b"]}).to_iterable_dataset()


def seq_cls_model(s):
    model = build_tiny_model(s.tokenizer, hidden_size=16, num_layers=1)
    model.config.num_labels = 1
    return LlamaForSequenceClassification(model.config)


def small_vocab_model(s):
    model = build_tiny_model(s.tokenizer, hidden_size=16, num_layers=1)
    model.resize_token_embeddings(100)
    return model


def frozen_model(s):
    return s.model.requires_grad_(False)


def t5_model(s):
    return T5ForConditionalGeneration(T5Config(vocab_size=300, d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8))


def short_positions(s, positions=24):
    s.model.config.max_position_embeddings = positions
    return s.model


def lora(r=2):
    from peft import LoraConfig

    return LoraConfig(r=r, lora_alpha=4, target_modules=["q_proj", "v_proj"])


def peft_model(s):
    from peft import get_peft_model

    return get_peft_model(s.model, lora())


def a_file(s):
    path = s.tmp_path / "a_file"
    path.write_text("not a directory")
    return str(path)


def no_eos_anywhere(s):
    s.tokenizer.eos_token = None
    s.model.generation_config.eos_token_id = None


def raising_template(s):
    s.tokenizer.chat_template = "{{ raise_exception('no system messages') if messages[0]['role'] == 'system' }}x"


def no_kwargs(prompts, completions):
    return [0.0] * len(completions)


def needs_solution(prompts, completions, solution, **kwargs):
    return [0.0] * len(completions)


def positional_only(prompts, /, completions, **kwargs):
    return [0.0] * len(completions)


def every_argument(prompts, completions, completion_ids, trainer_state, answer):
    return [float(len(ids)) for ids in completion_ids]


def boom(completions, **kwargs):
    raise ZeroDivisionError("division by zero")


def slow(completions, **kwargs):
    time.sleep(0.3)
    return [0.0] * len(completions)


async def async_reward(completion_ids, **kwargs):
    await asyncio.sleep(0)
    return [float(len(ids)) for ids in completion_ids]


async def async_words(completions, **kwargs):
    return ["high"] * len(completions)


def loss_is_finite(trainer) -> None:
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert trainer.state.global_step == 1 and len(losses) == 1 and math.isfinite(losses[0])


def truncated_some(trainer) -> None:
    assert [log["prompts/num_truncated"] for log in trainer.state.log_history if "loss" in log] == [2.0]


LONG = "word " * 40  # 200 byte tokens
PROMPT_RULE = r"'prompt' {}\. A prompt is a non-empty string"
is_root = hasattr(os, "geteuid") and os.geteuid() == 0

# ---- the catalogue ----------------------------------------------------------------------------------------------
DATASETS = [
    Case("train_dataset None", train(lambda s: None), raises(ValueError, r"`train_dataset` is required")),
    Case(
        "list of dicts",
        train(lambda s: [{"prompt": "a"}, {"prompt": "b"}]),
        raises(TypeError, r"train_dataset is a plain Python list; .*Dataset\.from_list"),
    ),
    Case("list of str", train(lambda s: ["a", "b"]), raises(TypeError, r"train_dataset.*Dataset\.from_dict")),
    Case(
        "dict of columns",
        train(lambda s: {"prompt": ["a", "b"]}),
        raises(TypeError, r"train_dataset is a dict.*Dataset\.from_dict"),
    ),
    Case(
        "pandas DataFrame",
        train(lambda s: Dataset.from_dict({"prompt": ["a", "b"]}).to_pandas()),
        raises(TypeError, r"train_dataset is a DataFrame.*Dataset\.from_pandas"),
    ),
    Case(
        "DatasetDict",
        train(lambda s: DatasetDict({"train": s.train_dataset})),
        raises(TypeError, r"train_dataset is a DatasetDict with splits \['train'\].*dataset\['train'\]"),
    ),
    Case("datasets IterableDataset", train(stream), runs()),
    Case(
        "IterableDataset without max_steps",
        both(train(stream), config(max_steps=-1)),
        raises(ValueError, r"train_dataset is a stream \(IterableDataset\): it has no length.*Set max_steps"),
    ),
    Case(
        "torch IterableDataset",
        train(lambda s: Stream()),
        raises(ValueError, r"train_dataset is a Stream without a length\. Pass a datasets\.Dataset, or for a stream"),
    ),
    Case(
        "IterableDataset with dynamic_sampling",
        both(train(stream), config(dynamic_sampling=True)),
        raises(ValueError, r"dynamic_sampling draws extra prompts from train_dataset by index"),
    ),
    Case(
        "no prompt column",
        train(lambda s: Dataset.from_dict({"question": ["a", "b"]})),
        raises(ValueError, r"train_dataset has no 'prompt' column \(found: \['question'\]\)"),
    ),
    Case("empty dataset", prompts(), raises(ValueError, r"train_dataset is empty")),
    Case(
        "fewer prompts than a generation batch",
        both(prompts("a"), config(per_device_train_batch_size=4)),
        raises(ValueError, r"train_dataset has 1 prompts but one generation batch takes 2"),
    ),
    Case(
        "column named completions",
        train(lambda s: Dataset.from_dict({"prompt": ["a", "b"], "completions": ["x", "y"]})),
        raises(ValueError, r"train_dataset has a column named 'completions'.*rename_column"),
    ),
    Case(
        "column named trainer_state",
        train(lambda s: Dataset.from_dict({"prompt": ["a", "b"], "trainer_state": [1, 2]})),
        raises(ValueError, r"column named 'trainer_state'"),
    ),
    Case(
        "clashing column dropped by remove_unused_columns",
        both(
            train(lambda s: Dataset.from_dict({"prompt": ["a", "b"], "completions": ["x", "y"]})),
            config(remove_unused_columns=True),
        ),
        builds(),
    ),
    Case(
        "rows that are not dicts",
        train(lambda s: Rows(["a", "b"])),
        raises(TypeError, r"train_dataset row 0 is a str"),
    ),
    Case("map-style torch Dataset of dicts", train(lambda s: Rows([{"prompt": "a"}, {"prompt": "b"}])), runs()),
    Case(
        "rows selected from a Dataset",
        train(lambda s: Dataset.from_dict({"prompt": ["a", "", "b"]}).select([2, 1])),
        raises(ValueError, r"train_dataset row 1: 'prompt' is empty"),  # the row of the dataset as given
    ),
    Case(
        "eval_dataset list", evals(lambda s: [{"prompt": "a"}]), raises(TypeError, r"eval_dataset is a plain Python")
    ),
    Case(
        "eval_dataset dict of columns",
        evals(lambda s: {"prompt": ["a", "b"]}),
        raises(TypeError, r"eval_dataset is a dict of columns"),
    ),
    Case(
        "eval_dataset split empty",
        evals(lambda s: {"dev": s.train_dataset, "test": Dataset.from_dict({"prompt": []})}),
        raises(ValueError, r"eval_dataset\['test'\] is empty"),
    ),
    Case(
        "eval_dataset no prompt column",
        evals(lambda s: Dataset.from_dict({"text": ["a"]})),
        raises(ValueError, r"eval_dataset has no 'prompt' column"),
    ),
    Case("eval_dataset stream", evals(stream), builds()),
    Case(
        "eval_dataset stream, bad row",
        evals(lambda s: Dataset.from_dict({"prompt": ["a", " "]}).to_iterable_dataset()),
        raises(ValueError, r"eval_dataset row 1: 'prompt' is empty"),
    ),
    Case(
        "eval_dataset bad row",
        evals(lambda s: Dataset.from_dict({"prompt": ["a", " "]})),
        raises(ValueError, r"eval_dataset row 1: 'prompt' is empty"),
    ),
    Case(
        "eval_dataset smaller than a generation batch",
        evals(lambda s: Dataset.from_dict({"prompt": ["a"]})),
        builds(),
    ),
    Case(
        "eval_strategy without eval_dataset",
        config(eval_strategy="steps", eval_steps=1),
        raises(ValueError, r"eval_dataset"),
    ),
]

PROMPTS = [
    Case(
        "empty prompt",
        prompts("a", ""),
        raises(ValueError, r"train_dataset row 1: " + PROMPT_RULE.format(r"is empty \(or only whitespace\)")),
    ),
    Case("whitespace prompt", prompts("a", " \n"), raises(ValueError, r"train_dataset row 1: 'prompt' is empty")),
    Case("None prompt", prompts("a", None), raises(ValueError, r"train_dataset row 1: 'prompt' is missing \(None\)")),
    Case("int prompts", prompts(1, 2), raises(TypeError, r"train_dataset row 0: 'prompt' is an int")),
    Case("float prompts", prompts(0.5, 1.5), raises(TypeError, r"row 0: 'prompt' is a float")),
    Case("bytes prompts", prompts(b"a", b"b"), raises(TypeError, r"row 0: 'prompt' is a bytes")),
    Case("list of strings", prompts(["a", "b"], ["c"]), raises(TypeError, r"row 0: 'prompt' is a list whose item 0")),
    Case(
        "chat and plain mixed",
        train(lambda s: Rows([{"prompt": "a"}, {"prompt": [{"role": "user", "content": "b"}]}])),
        raises(ValueError, r"train_dataset mixes chat prompts \(row 1 .*plain prompts \(row 0"),
    ),
    Case(
        "too long, max_prompt_length None",
        both(prompts("a", LONG), config(max_prompt_length=None), attr("model", short_positions)),
        raises(ValueError, r"train_dataset row 1: the prompt has 200 tokens; with max_prompt_length=None"),
    ),
    Case(
        "too long, max_prompt_length + max_completion_length > positions",
        both(prompts("a", LONG), config(max_prompt_length=64), attr("model", short_positions)),
        raises(ValueError, r"row 1: .*max_prompt_length=64 .*Set max_prompt_length <= 22"),
    ),
    Case(
        "max_prompt_length too large but every prompt fits",
        both(config(max_prompt_length=64), attr("model", short_positions)),
        builds(),
    ),
    Case(
        "long prompts are left-truncated", both(prompts(LONG, LONG), config(max_prompt_length=4)), runs(truncated_some)
    ),
    Case(
        "max_completion_length over the model's positions",
        both(config(max_completion_length=24), attr("model", short_positions)),
        raises(ValueError, r"max_completion_length=24 leaves no room for a prompt"),
    ),
    Case("unicode prompts", prompts("¿2 + 2? 🙂", "二加二"), runs()),
]

MESSAGES = [
    Case(
        "one message, not a list",
        prompts({"role": "user", "content": "a"}, {"role": "user", "content": "b"}),
        raises(TypeError, r"row 0: 'prompt' is a single message \(a dict\).*wrap it in a list"),
    ),
    Case(
        "empty list of messages",
        prompts([], [{"role": "user", "content": "b"}]),
        raises(ValueError, r"row 0: 'prompt' is an empty list of messages"),
    ),
    Case(
        "message without role",
        prompts([{"content": "a"}], [{"role": "user", "content": "b"}]),
        raises(ValueError, r"row 0: 'prompt' message 0 has role None"),
    ),
    Case("unknown role", chat({"role": "bot", "content": "a"}), raises(ValueError, r"message 0 has role 'bot'")),
    Case(
        "role in the wrong case",
        chat({"role": "system", "content": "s"}, {"role": "User", "content": "a"}),
        raises(ValueError, r"row 0: 'prompt' message 1 has role 'User'"),
    ),
    Case(
        "message without content",
        prompts([{"role": "user"}], [{"role": "user", "content": "b"}]),
        raises(TypeError, r"row 0: 'prompt' message 0 \(user\) has content of type NoneType"),
    ),
    Case("int content", chat({"role": "user", "content": 5}), raises(TypeError, r"content of type int, not a string")),
    Case(
        "content as a list of parts (TRL's format, also for text)",
        both(chat({"role": "user", "content": [{"type": "text", "text": "a"}]}), config(max_prompt_length=None)),
        builds(),
    ),
    Case(
        "every message empty",
        chat({"role": "system", "content": ""}, {"role": "user", "content": " "}),
        raises(ValueError, r"row 0: 'prompt' has no message with any content"),
    ),
    Case(
        "chat prompts, tokenizer without a chat template",
        both(chat({"role": "user", "content": "a"}), tokenizer(chat_template=None)),
        raises(ValueError, r"train_dataset holds chat prompts .*no chat_template"),
    ),
    Case(
        "chat template fails on a row",
        both(
            chat({"role": "system", "content": "s"}, {"role": "user", "content": "a"}),
            config(max_prompt_length=None),
            raising_template,
        ),
        raises(ValueError, r"train_dataset row \d: the chat template fails on this prompt: no system messages"),
    ),
    Case(
        "system + user chat",
        both(
            chat({"role": "system", "content": "s"}, {"role": "user", "content": "a"}), config(max_prompt_length=None)
        ),
        runs(),
    ),
    Case(
        "system + user chat over max_prompt_length: never cut into the system message",
        chat({"role": "system", "content": "s"}, {"role": "user", "content": "a"}),
        raises(
            ValueError,
            r"row 0: its system messages and last user turn alone are \d+ tokens, over max_prompt_length=16",
        ),
    ),
    Case(
        "extra keys and a tool message",
        both(
            chat({"role": "user", "content": "a", "name": "x"}, {"role": "tool", "content": "4", "name": None}),
            config(max_prompt_length=None),
        ),
        builds(),
    ),
]

REWARDS = [
    Case("reward_funcs empty", rewards(), raises(ValueError, r"No reward source provided: reward_funcs is empty")),
    Case(
        "reward_funcs None (TRL's default)",
        attr("reward_funcs", lambda s: None),
        raises(ValueError, r"No reward source provided"),
    ),
    Case(
        "reward_funcs [None]",
        attr("reward_funcs", lambda s: [None]),
        raises(TypeError, r"reward_funcs\[0\] is a NoneType"),
    ),
    Case("reward_funcs int", rewards(length_reward, 42), raises(TypeError, r"reward_funcs\[1\] is a int")),
    Case("unknown reward name", rewards("acuracy"), raises(ValueError, r"'acuracy'.*accuracy")),
    Case("import path, no module", rewards("no_such_module:f"), raises(ValueError, r"Cannot import module")),
    Case("import path, not callable", rewards("os:sep"), raises(ValueError, r"'os:sep' is a str, not a callable")),
    Case(
        "missing reward model path",
        rewards("./no/such/reward_model"),
        raises(FileNotFoundError, r"reward model path './no/such/reward_model' does not exist"),
    ),
    Case(
        "reward model built in memory, no tokenizer",
        attr("reward_funcs", lambda s: [seq_cls_model(s)]),
        raises(ValueError, r"reward_processing_classes"),
    ),
    Case(
        "reward model with its tokenizer",
        both(
            attr("reward_funcs", lambda s: [seq_cls_model(s)]),
            attr("kwargs", lambda s: {"reward_processing_classes": [s.tokenizer]}),
        ),
        runs(),
    ),
    Case(
        "reward_processing_classes count",
        both(rewards(length_reward), attr("kwargs", lambda s: {"reward_processing_classes": [None, None]})),
        raises(ValueError, r"reward processing classes \(2\) must match the number of reward functions \(1\)"),
    ),
    Case(
        "reward without **kwargs",
        rewards(no_kwargs),
        raises(TypeError, r"'no_kwargs' would be called with keyword arguments it does not accept.*\*\*kwargs"),
    ),
    Case(
        "reward needs a missing column",
        rewards(needs_solution),
        raises(TypeError, r"'needs_solution' requires the argument 'solution'.*nor a column of train_dataset"),
    ),
    Case(
        "reward needs a column the eval dataset lacks",
        both(rewards(every_argument), evals(lambda s: Dataset.from_dict({"prompt": ["a"]}))),
        raises(TypeError, r"'every_argument' requires the argument 'answer'.*eval_dataset"),
    ),
    Case(
        "positional-only argument",
        rewards(positional_only),
        raises(TypeError, r"'positional_only' takes 'prompts' positional-only"),
    ),
    Case("every argument named, no **kwargs", rewards(every_argument), runs()),
    Case(
        "returns a scalar",
        rewards(returning("scalar", lambda n: 1.0)),
        raises(TypeError, r"'scalar' returned a float", "train"),
    ),
    Case(
        "returns too few",
        rewards(returning("short", lambda n: [1.0])),
        raises(ValueError, r"'short' returned 1 rewards for 2 completions", "train"),
    ),
    Case(
        "returns words",
        rewards(returning("words", each("high"))),
        raises(TypeError, r"'words' returned 'high' \(str\) for completion 0", "train"),
    ),
    Case(
        "returns numeric strings",
        rewards(returning("numeric_str", each("0.5"))),
        raises(TypeError, r"'numeric_str' returned '0.5' \(str\).*even '0.5'", "train"),
    ),
    Case("returns bytes", rewards(returning("raw", each(b"1"))), raises(TypeError, r"'raw' returned b'1'", "train")),
    Case(
        "returns a dict",
        rewards(returning("mapping", lambda n: {0: 1.0})),
        raises(TypeError, r"'mapping' returned a dict", "train"),
    ),
    Case(
        "returns lists",
        rewards(returning("nested", each([1.0]))),
        raises(TypeError, r"'nested' returned \[1.0\] \(list\)", "train"),
    ),
    Case(
        "returns complex",
        rewards(returning("cplx", each(1 + 2j))),
        raises(TypeError, r"'cplx' returned \(1\+2j\)", "train"),
    ),
    Case(
        "returns Decimal",
        rewards(returning("dec", each(decimal.Decimal("0.5")))),
        raises(TypeError, r"'dec' returned Decimal", "train"),
    ),
    Case(
        "returns two-element tensors",
        rewards(returning("pairs", each(torch.tensor([1.0, 2.0])))),
        raises(TypeError, r"'pairs' returned tensor", "train"),
    ),
    Case(
        "returns 1e300",
        rewards(returning("huge", each(1e300))),
        raises(ValueError, r"'huge' returned inf", "train"),
    ),
    Case("returns NaN", rewards(returning("nan", each(math.nan)), length_reward), runs()),
    Case("returns None only", rewards(returning("none", each(None))), runs()),
    Case("returns a numpy array", rewards(returning("array", lambda n: np.linspace(0, 1, n))), runs()),
    Case("returns a torch tensor", rewards(returning("tensor", lambda n: torch.arange(n) / n)), runs()),
    Case(
        "returns numpy scalars, bools, ints, Fractions",
        both(
            config(per_device_train_batch_size=4),  # 4 completions, one of each
            rewards(returning("mixed", lambda n: [np.float32(0.5), np.bool_(True), 1, fractions.Fraction(1, 3)])),
        ),
        runs(),
    ),
    Case("raises", rewards(boom), raises(RuntimeError, r"'boom' raised ZeroDivisionError", "train")),
    Case("raises, skip policy", both(rewards(boom, length_reward), config(reward_error_policy="skip")), runs()),
    Case(
        "too slow",
        both(rewards(slow), config(reward_timeout=0.05)),
        raises(RuntimeError, r"'slow' did not return within 0.05 s.*reward_timeout", "train"),
    ),
    Case("async reward", rewards(async_reward), runs()),
    Case(
        "async reward returns words",
        rewards(async_words),
        raises(TypeError, r"'async_words' returned 'high' \(str\)", "train"),
    ),
]

REWARD_WEIGHTS = [
    Case(
        "one weight for two functions",
        both(rewards(length_reward, "accuracy"), config(reward_weights=[1.0])),
        raises(ValueError, r"reward_weights has 1 entries but there are 2"),
    ),
    Case("inf weight", config(reward_weights=[math.inf]), raises(ValueError, r"reward_weights=.*non-finite")),
    Case("NaN weight", config(reward_weights=[math.nan]), raises(ValueError, r"reward_weights=.*non-finite")),
    Case("string weight", config(reward_weights=["1.0"]), raises(TypeError, r"reward_weights\[0\]='1.0' is a str")),
    Case("bool weight", config(reward_weights=[True]), raises(TypeError, r"reward_weights\[0\]=True is a bool")),
    Case("scalar weights", config(reward_weights=1.0), raises(TypeError, r"reward_weights=1.0 must be a list")),
    Case(
        "negative and zero weights", both(rewards(length_reward, "accuracy"), config(reward_weights=[-1, 0])), runs()
    ),
]

CONFIG = [
    Case(", ".join(f"{key}={value!r}" for key, value in fields.items()), config(**fields), raises(ValueError, name))
    for fields, name in [
        (dict(num_generations=1), r"num_generations=1"),
        (dict(per_device_train_batch_size=3), r"not divisible by num_generations=2"),
        (dict(generation_batch_size=3), r"generation_batch_size=3 must be a multiple"),
        (dict(generation_batch_size=4, steps_per_generation=2), r"generation_batch_size and steps_per_generation"),
        (dict(steps_per_generation=0), r"steps_per_generation=0"),
        (dict(importance_sampling_level="sequence_sum", loss_type="dapo"), r"loss_type='dapo'"),
        (dict(epsilon=0.2, epsilon_high=0.1), r"epsilon_high=0.1"),
        (dict(epsilon=-0.1), r"epsilon=-0.1"),
        (dict(beta=-0.1), r"beta=-0.1"),
        (dict(temperature=0.0), r"temperature=0.0"),
        (dict(temperature=-1.0), r"temperature=-1.0"),
        (dict(top_p=0.0), r"top_p=0.0"),
        (dict(top_p=1.5), r"top_p=1.5"),
        (dict(loss_type="ppo"), r"loss_type='ppo'"),
        (dict(scale_rewards="std"), r"scale_rewards='std'"),
        (dict(importance_sampling_level="sentence"), r"importance_sampling_level='sentence'"),
        (dict(reward_error_policy="ignore"), r"reward_error_policy='ignore'"),
        (dict(on_nonfinite="ignore"), r"on_nonfinite='ignore'"),
        (dict(on_lost_updates="ignore"), r"on_lost_updates='ignore'"),
        (dict(lost_update_check_steps=-1), r"lost_update_check_steps=-1"),
        (dict(lost_update_threshold=1.5), r"lost_update_threshold=1.5"),
        (dict(max_completion_length=0), r"max_completion_length=0"),
        (dict(max_prompt_length=0), r"max_prompt_length=0"),
        (dict(num_iterations=0), r"num_iterations=0"),
        (dict(num_generations_eval=0), r"num_generations_eval=0"),
        (dict(reward_timeout=0), r"reward_timeout=0"),
        (dict(reward_timeout=-1.0), r"reward_timeout=-1.0"),
        (dict(dynamic_sampling_max_rounds=-1), r"dynamic_sampling_max_rounds=-1"),
        (dict(logprob_chunk_size=0), r"logprob_chunk_size=0"),
        (dict(rollout_engine="sglang"), r"rollout_engine='sglang'"),
        (dict(use_vllm=True, vllm_importance_sampling_clip_min=5.0), r"vllm_importance_sampling_clip_min=5.0"),
        (dict(use_model_generate=True, rollout_engine="loop"), r"use_model_generate=True"),
        (dict(auto_find_batch_size=True), r"auto_find_batch_size=True"),
        (dict(loss_type="cispo", epsilon_high=0.0, epsilon=0.0), r"epsilon_high=0.0"),
        (dict(loss_type="sapo", sapo_temperature_neg=0.0), r"sapo_temperature_neg=0.0"),
        (dict(model_init_kwargs="[1, 2]"), r"model_init_kwargs must be a dict"),
        (dict(chat_template_kwargs="{not json"), r"chat_template_kwargs must be a dict or a JSON object"),
    ]
] + [
    Case(
        "args is TrainingArguments",
        attr("make_args", lambda s: lambda **fields: TrainingArguments(output_dir=fields["output_dir"])),
        raises(TypeError, r"args must be a GRPOConfig, got TrainingArguments"),
    ),
    Case("scale_rewards=True (TRL)", config(scale_rewards=True), builds(lambda t: t.args.scale_rewards == "group")),
    Case("temperature=1e-8", config(temperature=1e-8), warns(r"temperature=1e-08 is close to 0.*around 0\.6-1\.0")),
    Case(
        "mask_truncated_completions, every completion truncated",
        config(mask_truncated_completions=True, max_completion_length=1),
        warns(r"reached max_completion_length=1 without an EOS.*trains on nothing", when="train"),
    ),
    Case("beta > 0 builds a reference model", config(beta=0.04), runs(lambda t: t.ref_model is not None)),
]

GENERATION = [
    Case(
        "typo max_new_token",
        config(generation_kwargs={"max_new_token": 4}),
        raises(ValueError, r"generation_kwargs has 'max_new_token'.*Did you mean 'max_new_tokens'\?"),
    ),
    Case(
        "typo temprature",
        config(generation_kwargs={"temprature": 0.7}),
        raises(ValueError, r"'temprature'.*Did you mean 'temperature'\?"),
    ),
    Case(
        "not a generation field",
        config(generation_kwargs={"learning_rate": 1e-5}),
        raises(ValueError, r"generation_kwargs has 'learning_rate', which is not a GenerationConfig field"),
    ),
    Case(
        "temperature overridden",
        config(generation_kwargs={"temperature": 0.0}),
        raises(ValueError, r"generation_kwargs\['temperature'\]=0.0 differs from temperature=1.0"),
    ),
    Case(
        "max_new_tokens overridden",
        config(generation_kwargs={"max_new_tokens": 8}),
        raises(ValueError, r"generation_kwargs\['max_new_tokens'\]=8 differs from max_completion_length=2"),
    ),
    Case(
        "greedy decoding",
        config(generation_kwargs={"do_sample": False}),
        raises(ValueError, r"generation_kwargs\['do_sample'\]=False"),
    ),
    Case(
        "several sequences per row",
        config(generation_kwargs={"num_return_sequences": 2}),
        raises(ValueError, r"generation_kwargs\['num_return_sequences'\]=2.*num_generations"),
    ),
    Case(
        "generation_kwargs not a dict",
        config(generation_kwargs='["top_k", 5]'),
        raises(ValueError, r"generation_kwargs must be a dict"),
    ),
    Case(
        "generation_kwargs bad JSON",
        config(generation_kwargs="{top_k: 5}"),
        raises(ValueError, r"generation_kwargs must be a dict or a JSON object string"),
    ),
    Case("valid generation_kwargs", config(generation_kwargs={"top_k": 5, "temperature": 1.0}), runs()),
]

MODELS = [
    Case(
        "sequence-classification policy",
        attr("model", seq_cls_model),
        raises(TypeError, r"LlamaForSequenceClassification, not a decoder-only causal LM.*reward_funcs"),
    ),
    Case(
        "encoder-decoder policy",
        attr("model", t5_model),
        raises(TypeError, r"T5ForConditionalGeneration, not a decoder-only causal LM"),
    ),
    Case(
        "vocabulary smaller than the tokenizer",
        attr("model", small_vocab_model),
        raises(ValueError, r"vocabulary has 100 token embeddings but the tokenizer has 259 .*resize_token_embeddings"),
    ),
    Case(
        "tokens added to the tokenizer only",
        lambda s: s.tokenizer.add_tokens(["<new>"]),
        raises(ValueError, r"vocabulary has 259 token embeddings but the tokenizer has 260"),
    ),
    Case("vocabulary larger than the tokenizer", lambda s: s.model.resize_token_embeddings(320), builds()),
    Case(
        "every parameter frozen",
        attr("model", frozen_model),
        raises(ValueError, r"Every parameter of the policy is frozen.*peft_config"),
    ),
    Case("frozen, with peft_config", both(attr("model", frozen_model), trainer_kwargs(peft_config=lora())), runs()),
    Case(
        "PeftModel and peft_config",
        both(attr("model", peft_model), trainer_kwargs(peft_config=lora())),
        raises(ValueError, r"already a PeftModel: pass peft_config=None"),
    ),
    Case("model None", attr("model", lambda s: None), raises(TypeError, r"model must be a model id/path")),
    Case(
        "model is a torch module",
        attr("model", lambda s: torch.nn.Linear(2, 2)),
        raises(TypeError, r"model must be .* got Linear"),
    ),
    Case(
        "missing relative path",
        attr("model", lambda s: "./no/such/model"),
        raises(FileNotFoundError, r"model path './no/such/model' does not exist"),
    ),
    Case(
        "missing absolute path",
        attr("model", lambda s: "/no/such/model"),
        raises(FileNotFoundError, r"model path '/no/such/model' does not exist"),
    ),
    Case(
        "missing home path",
        attr("model", lambda s: "~/no/such/model"),
        raises(FileNotFoundError, r"model path '~/no/such/model' does not exist"),
    ),
    Case(
        "missing nested path",
        attr("model", lambda s: "checkpoints/run/final"),
        raises(FileNotFoundError, r"model path 'checkpoints/run/final' does not exist"),
    ),
    Case(
        "model path is a file", attr("model", a_file), raises(NotADirectoryError, r"model path '.*a_file' is a file")
    ),
    Case(
        "model built in memory, no tokenizer",
        attr("processing_class", lambda s: None),
        raises(ValueError, r"pass its tokenizer \(a vision-language model: its processor\) as processing_class"),
    ),
    Case(
        "gradient checkpointing and no dropout switch-off",
        config(gradient_checkpointing=True, disable_dropout=False),
        runs(),
    ),
]

TOKENIZERS = [
    Case("no pad token", tokenizer(pad_token=None), runs(lambda t: t.processing_class.pad_token == "<|im_end|>")),
    Case(
        "right padding side",
        tokenizer(padding_side="right"),
        builds(lambda t: t.processing_class.padding_side == "left"),
    ),
    Case("no EOS, the model's generation config has one", tokenizer(eos_token=None), runs()),
    Case(
        "no pad and no EOS",
        tokenizer(pad_token=None, eos_token=None),
        raises(ValueError, r"tokenizer has neither a pad token nor an EOS token"),
    ),
    Case("no EOS anywhere", no_eos_anywhere, raises(ValueError, r"Neither the model's generation_config nor the")),
    Case(
        "processing_class is a path",
        attr("processing_class", lambda s: "Qwen/Qwen2.5-0.5B-Instruct"),
        raises(TypeError, r"processing_class='Qwen/Qwen2.5-0.5B-Instruct' is a path.*AutoTokenizer"),
    ),
    Case(
        "processing_class is not a tokenizer",
        attr("processing_class", lambda s: 42),
        raises(TypeError, r"processing_class is an int, not a tokenizer"),
    ),
]

OUTPUT_DIRS = [
    Case(
        "output_dir is a file",
        lambda s: s.config.update(output_dir=a_file(s)),
        raises(ValueError, r"output_dir='.*a_file' is not a writable directory"),
    ),
    Case(
        "output_dir under a file",
        lambda s: s.config.update(output_dir=a_file(s) + "/run"),
        raises(ValueError, r"output_dir='.*a_file/run' is not a writable directory"),
    ),
    Case(
        "output_dir unwritable",
        lambda s: (s.tmp_path.joinpath("ro").mkdir(mode=0o500), s.config.update(output_dir=str(s.tmp_path / "ro"))),
        raises(ValueError, r"output_dir='.*ro' is not a writable directory"),
        marks=(pytest.mark.skipif(is_root, reason="root writes to any directory"),),
    ),
    Case(
        "output_dir exists with files",
        lambda s: (s.tmp_path.joinpath("out").mkdir(), s.tmp_path.joinpath("out", "notes.txt").write_text("x")),
        builds(),
    ),
]

CASES = DATASETS + PROMPTS + MESSAGES + REWARDS + REWARD_WEIGHTS + CONFIG + GENERATION + MODELS + TOKENIZERS
CASES += OUTPUT_DIRS


def test_the_catalogue_is_large_and_ids_are_unique():
    assert len(CASES) >= 90
    assert len({case.id for case in CASES}) == len(CASES)


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=c.marks) for c in CASES])
def test_bad_input(case: Case, tmp_path, caplog):
    setup = Setup(tmp_path)
    case.change(setup)
    expected = case.expected
    if expected.kind == "warns":
        with caplog.at_level("WARNING", logger="grpo_hf"):
            trainer = setup.build()
            if expected.when == "train":
                trainer.train()
        assert re.search(expected.match, caplog.text), caplog.text
        return
    if expected.kind == "raises" and expected.when == "build":
        with pytest.raises(Exception) as info:
            setup.build()
    else:
        trainer = setup.build()
        if expected.kind == "builds":
            assert expected.check is None or expected.check(trainer) is not False
            return
        if expected.kind == "runs":
            trainer.train()
            loss_is_finite(trainer)
            assert expected.check is None or expected.check(trainer) is not False
            return
        with pytest.raises(Exception) as info:
            trainer.train()
        assert trainer.state.global_step == 0  # stopped before the weights changed
    assert type(info.value) is expected.error, f"{type(info.value).__name__}: {info.value}"
    assert info.match(expected.match)


def test_large_datasets_are_sampled_and_the_log_says_so(monkeypatch, caplog, tmp_path):
    """Above `MAX_ROWS_SCANNED` rows a random sample is checked; above `MAX_ROWS_TOKENIZED`, the longest prompts are
    tokenized: the too-long row is found among 40, and the log says what was sampled."""
    from grpo_hf import validation

    monkeypatch.setattr(validation, "MAX_ROWS_SCANNED", 30)
    monkeypatch.setattr(validation, "MAX_ROWS_TOKENIZED", 3)
    setup = Setup(tmp_path)
    args = GRPOConfig(**{**setup.config, "max_prompt_length": None})
    rows = ["x" * (i % 7 + 1) for i in range(40)]
    dataset = Dataset.from_dict({"prompt": rows})
    with caplog.at_level("INFO", logger="grpo_hf.validation"):
        assert validation.check_dataset(dataset, "train_dataset", setup.tokenizer, args, 1024) == []
    assert "prompts of 30 random rows of train_dataset's 40" in caplog.text
    assert "the 3 longest prompts (by characters) of the 30 checked" in caplog.text

    monkeypatch.setattr(validation, "MAX_ROWS_SCANNED", 100)
    rows[23] = "y" * 100  # the one row over 24 - 2 positions
    with pytest.raises(ValueError, match=r"train_dataset row 23: the prompt has 100 tokens"):
        validation.check_dataset(Dataset.from_dict({"prompt": rows}), "train_dataset", setup.tokenizer, args, 24)
