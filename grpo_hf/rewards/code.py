"""Code rewards: run the completion's Python against the row's tests in a sandbox (`grpo_hf.rewards.sandbox`).

The program is the last fenced Python block of the completion (a block opened with ```python, ```py, ```python3 or a
bare ```), or the whole completion when it has none; a block left open at the end of the completion runs to the
end. The tests come from a dataset column (`tests` by default): a string of Python with asserts, or a list of such
strings. The program runs first, as module `solution` (so an `if __name__ == "__main__":` block does not run; stdin is
empty), then each test string in the same namespace; a test passes when it runs to the end without raising.

- `code` (`make_code_reward`): 1.0 when every test string passes within the sandbox limits, else 0.0.
- `code_pass_rate` (`make_code_pass_rate_reward`): the fraction of test strings that pass.

A row whose tests are None or empty gets None (not applicable). Executions run in parallel, `workers` at a time.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from grpo_hf.rewards.answers import completion_text
from grpo_hf.rewards.sandbox import Sandbox, SandboxLimits

__all__ = ["CodeReward", "extract_code", "make_code_pass_rate_reward", "make_code_reward"]

_FENCE_RE = re.compile(r"^[ \t]*```[ \t]*([\w+-]*)[^\n`]*$")
_PYTHON_FENCES = {"", "python", "py", "python3", "py3"}


def extract_code(completion: Any) -> str:
    """The last fenced Python block of a completion (string or chat messages), else the whole completion."""
    text = completion_text(completion)
    blocks = []
    language, lines = None, []
    for line in text.split("\n"):
        m = _FENCE_RE.match(line)
        if language is None:
            if m is not None:
                language, lines = m.group(1).lower(), []
        elif m is not None and m.group(1) == "":  # a closing fence
            blocks.append((language, "\n".join(lines)))
            language = None
        else:
            lines.append(line)
    if language is not None:  # left open (e.g. the completion was truncated)
        blocks.append((language, "\n".join(lines)))
    python = [code for language, code in blocks if language in _PYTHON_FENCES]
    return python[-1] if python else text


def _as_tests(value: Any) -> list[str] | None:
    if value is None:
        return None
    if isinstance(value, str):
        return [value] if value.strip() else None
    if isinstance(value, Sequence) and all(isinstance(t, str) for t in value):
        return list(value) or None
    raise TypeError(f"Code tests must be a string or a list of strings, got {type(value).__name__}.")


class CodeReward:
    """Runs each completion's code with its row's tests in a `Sandbox`; see `make_code_reward`."""

    def __init__(
        self,
        tests_column: str = "tests",
        *,
        pass_rate: bool = False,
        limits: SandboxLimits | None = None,
        workers: int | None = None,
        sandbox: Sandbox | None = None,
        name: str | None = None,
    ):
        if sandbox is not None and (limits is not None or workers is not None):
            raise ValueError("Pass either a sandbox or its limits/workers, not both.")
        self.tests_column = tests_column
        self.pass_rate = pass_rate
        self.sandbox = sandbox if sandbox is not None else Sandbox(limits, workers=workers)
        self.__name__ = name or ("code_pass_rate_reward" if pass_rate else "code_reward")

    def __call__(self, prompts=None, completions=None, completion_ids=None, trainer_state=None, **kwargs):
        if self.tests_column not in kwargs:
            raise KeyError(
                f"{self.__name__} needs the tests in the dataset column {self.tests_column!r}, but the reward "
                f"function received only the columns {sorted(kwargs)}. Add that column, or use "
                "make_code_reward(tests_column=...) to read another one."
            )
        rewards: list[float | None] = [None] * len(completions)
        jobs, rows = [], []
        for i, (completion, tests) in enumerate(zip(completions, kwargs[self.tests_column], strict=True)):
            tests = _as_tests(tests)
            if tests is not None:
                jobs.append((extract_code(completion), tests))
                rows.append(i)
        for i, result in zip(rows, self.sandbox.run_many(jobs), strict=True):
            rewards[i] = result.pass_rate if self.pass_rate else float(result.all_passed)
        return rewards

    def __repr__(self) -> str:
        return f"{type(self).__name__}(tests_column={self.tests_column!r}, pass_rate={self.pass_rate}, {self.sandbox})"


def make_code_reward(
    tests_column: str = "tests",
    *,
    limits: SandboxLimits | None = None,
    workers: int | None = None,
    name: str | None = None,
) -> CodeReward:
    """Registry name `code`: 1.0 if the completion's code passes every test string of its row, else 0.0.

    `tests_column` names the dataset column with the tests (a string, or a list of strings that must all pass);
    `limits` and `workers` configure the `Sandbox`, which is checked now (`SandboxUnavailableError` if it cannot be
    set up on this machine); `name` sets the metric name (default `code_reward`).
    """
    return CodeReward(tests_column, limits=limits, workers=workers, name=name)


def make_code_pass_rate_reward(
    tests_column: str = "tests",
    *,
    limits: SandboxLimits | None = None,
    workers: int | None = None,
    name: str | None = None,
) -> CodeReward:
    """Registry name `code_pass_rate`: the fraction of the row's test strings that the completion's code passes.

    Same arguments as `make_code_reward`; the metric name defaults to `code_pass_rate_reward`.
    """
    return CodeReward(tests_column, pass_rate=True, limits=limits, workers=workers, name=name)
