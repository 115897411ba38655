r"""MATH-style answers: LaTeX final answers compared by mathematical equivalence with math-verify (Hugging Face).

The numeric `accuracy` reward reads one number; MATH answers are expressions (`\frac{\sqrt3}{2}`, `(-\infty, 3]`,
`x^2+1`, `30^\circ`). `math_accuracy` reads the answer *text* with the same markers and rules as `extract_answer`
(`\boxed{}`/`\fbox{}`, `<answer>`, `####`, "the answer is"; the last marker wins; made-up continuations are cut
off) and asks math-verify whether it equals the gold:

- `\boxed{...}` and `<answer>...</answer>`: their whole content.
- `#### ...`: the rest of the line, when it starts with a number or math (`\`, `$`, `(`, `[`, `-`), not a word (so a
  heading `#### Step 1` is not a marker).
- "answer is" / "answer:": the math span that follows (`$...$`, `\(...\)`, `\[...\]`), or, when a number or math
  starts directly, the text up to the end of the sentence or the first plain word of 2+ letters ("12, as shown").

An answer that leaves a brace open (`\boxed{\frac{1}{2`: the completion was cut off inside it) is no answer, and
scores 0.0 whatever it would parse as. Surrounding `$`/`\(`/`\[` delimiters and a final full stop are removed. The
gold (column `answer` by default) is read the same way when it holds a marker (a full MATH solution with its
`\boxed{}`), else taken whole.

Equivalence is math-verify's `verify(gold, prediction)` on `\boxed{...}`-wrapped answers (fractions = decimals,
`\dfrac` = `\frac`, simplified radicals, intervals, sets, equations `x = 5` against `5`, units and `^\circ` dropped,
percent); identical strings (ignoring spaces) match without asking. sympy can hang on hostile input, and
math-verify's own timeouts use `signal.alarm`, which works only in the main thread, so the comparisons run in a
worker process (`latex_worker.py`): one that takes longer than `timeout` seconds is scored 0.0 and the worker is
restarted. The worker starts on first use and exits with this process; this module itself imports neither sympy nor
math-verify.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from fractions import Fraction
from numbers import Number
from typing import Any

from grpo_hf.rewards.answers import (
    _ANSWER_CLOSE_RE,
    _CONTINUATION_RE,
    _PHRASE_WINDOW,
    _SENTENCE_END_RE,
    _closing_brace,
    _markers,
    completion_text,
)

logger = logging.getLogger(__name__)

__all__ = ["MathAccuracyReward", "extract_latex_answer", "extract_latex_gold", "make_math_accuracy_reward"]

# ---------------------------------------------------------------------------------------------------------------------
# Reading the answer text
# ---------------------------------------------------------------------------------------------------------------------

_LATEX_LEAD_RE = re.compile(r"[\s:*_\"'`]*")
_MATH_SPANS = (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"))
_MATH_START_RE = re.compile(r"[\d.+\-−(\[{\\]")
_PROSE_RE = re.compile(r",?\s+[A-Za-z]{2,}\b")  # a plain word after the math ends it: "12, as shown", "5 meters"


def _unwrap(answer: str) -> str | None:
    """Strip spaces, one pair of math delimiters and a final full stop; None when nothing is left."""
    answer = answer.strip()
    for open_, close in _MATH_SPANS:
        if answer.startswith(open_) and answer.endswith(close) and len(answer) >= len(open_) + len(close):
            answer = answer[len(open_) : len(answer) - len(close)].strip()
            break
    answer = answer.rstrip(" .")
    return answer or None


def _braces_balanced(answer: str) -> bool:
    r"""Whether every `{` of the answer is closed (escaped `\{` `\}` aside): `oxed{rac{1}{2` is an answer the
    model never finished, not `rac{1}{2}`."""
    depth = 0
    for char in answer.replace("\\{", "").replace("\\}", ""):
        depth += (char == "{") - (char == "}")
        if depth < 0:
            return False
    return depth == 0


def _read_latex_marker(text: str, kind: str, start: int, limit: int) -> tuple[int, str | None] | None:
    """Like `answers._read_marker`, returning the answer text instead of a number; a marker whose answer leaves a
    brace open (cut off inside `\boxed{...}`, say) reads as no marker."""
    read = _read_latex_marker_text(text, kind, start, limit)
    return None if read is None or (read[1] is not None and not _braces_balanced(read[1])) else read


def _read_latex_marker_text(text: str, kind: str, start: int, limit: int) -> tuple[int, str | None] | None:
    if kind == "boxed":
        close = _closing_brace(text, start, limit)
        return None if close < 0 else (close + 1, _unwrap(text[start:close]))
    if kind == "tag":
        close = _ANSWER_CLOSE_RE.search(text, start, limit)
        return None if close is None else (close.end(), _unwrap(text[start : close.start()]))
    if kind == "hash":
        end = text.find("\n", start, limit)
        window = text[start : limit if end < 0 else end]
    else:
        window = text[start : min(start + _PHRASE_WINDOW, limit)]
    lead = _LATEX_LEAD_RE.match(window).end()
    for open_, close in _MATH_SPANS:
        if window.startswith(open_, lead):
            end = window.find(close, lead + len(open_))
            if end < 0:
                return None
            answer = _unwrap(window[lead + len(open_) : end])
            return None if answer is None else (start, answer)
    if _MATH_START_RE.match(window, lead) is None:
        return None  # a word follows: `#### Step 1`, "the answer is the sum of ..."
    if kind == "phrase":
        end = _SENTENCE_END_RE.search(window, lead)
        window = window[: end.start() if end else len(window)]
        prose = _PROSE_RE.search(window, lead)
        window = window[: prose.start() if prose else len(window)]
    answer = _unwrap(window[lead:])
    return None if answer is None else (start, answer)


def _extract_latex(text: str) -> tuple[bool, str | None]:
    """(found a marker, its answer text); the same region rules as `answers._extract`."""
    markers = _markers(text)
    limit = len(text)
    first = None
    reads = {}
    for start, kind, token_end in markers:
        first = reads[start] = _read_latex_marker(text, kind, token_end, limit)
        if first is not None:
            break
    if first is None:
        return False, None
    cut = _CONTINUATION_RE.search(text, first[0])
    if cut is not None:
        limit = cut.start()
        reads = {}
    for start, kind, token_end in reversed(markers):
        if start >= limit:
            continue
        read = reads[start] if start in reads else _read_latex_marker(text, kind, token_end, limit)
        if read is not None:
            return True, read[1]
    return False, None


def extract_latex_answer(text: Any) -> str | None:
    r"""The final answer of a completion as LaTeX text (`"\frac{1}{2}"`, `"(-\infty, 3]"`), or None.

    See the module docstring for the markers; None when there is no marker or the winning one is empty.
    """
    if not isinstance(text, str):
        text = completion_text(text)
    return _extract_latex(text)[1]


def extract_latex_gold(gold: Any) -> str | None:
    r"""The gold answer as LaTeX text: the final answer of a solution with a marker (`\boxed{}`), else the whole
    value (numbers as their decimal string). None for None or an empty string."""
    if gold is None or isinstance(gold, bool):
        return None
    if isinstance(gold, Fraction):
        return str(gold)
    if isinstance(gold, Number):
        return repr(gold) if isinstance(gold, float) else str(gold)
    text = completion_text(gold)
    found, answer = _extract_latex(text)
    return answer if found else _unwrap(text)


# ---------------------------------------------------------------------------------------------------------------------
# The math-verify worker
# ---------------------------------------------------------------------------------------------------------------------

_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "latex_worker.py")  # run by path
_STARTUP_TIMEOUT = 120.0  # importing sympy on a loaded machine


def _stop(proc: subprocess.Popen | None) -> None:
    """Kill the watcher and the worker (its own process group), and reap the watcher."""
    if proc is not None and proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            proc.kill()
        proc.wait()


class _MathVerifier:
    """One math-verify worker process, started on first use, killed and restarted after a comparison times out."""

    def __init__(self, memory_bytes: int):
        self.memory_bytes = memory_bytes
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._pid = None
        self._buffer = b""
        self._procs: list[subprocess.Popen] = []  # the live one, for the finalizer
        self._finalizer = weakref.finalize(self, _stop_all, self._procs)

    def _start(self) -> None:
        with tempfile.TemporaryFile() as stderr:
            proc = subprocess.Popen(
                [sys.executable, _WORKER, str(self.memory_bytes)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                start_new_session=True,  # its own process group: `_stop` kills the watcher and the worker together
            )
            self._proc, self._pid, self._buffer = proc, os.getpid(), b""
            self._procs[:] = [proc]
            if self._readline(time.monotonic() + _STARTUP_TIMEOUT) != b"ready":
                self.close()
                stderr.seek(0)
                message = stderr.read().decode("utf-8", "replace").strip()[-2000:]
                raise RuntimeError(f"The math-verify worker did not start:\n{message}")

    def _readline(self, deadline: float) -> bytes | None:
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                return None
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line

    def compare(self, pairs: list[tuple[str, str]], timeout: float) -> tuple[list[bool | None], int]:
        """math-verify's verdict per (gold, prediction): True, False, or None (gold unreadable); and the timeouts."""
        results: list[bool | None] = []
        timeouts = 0
        with self._lock:
            for gold, prediction in pairs:
                if self._proc is None or self._proc.poll() is not None or self._pid != os.getpid():
                    self._start()
                self._proc.stdin.write(json.dumps([gold, prediction]).encode() + b"\n")
                self._proc.stdin.flush()
                line = self._readline(time.monotonic() + timeout)
                if line is None:  # too slow (or the worker died): score 0.0, start a new worker for the next one
                    timeouts += 1
                    self.close()
                    results.append(False)
                else:
                    results.append(json.loads(line))
        return results, timeouts

    def close(self) -> None:
        if self._pid == os.getpid():
            _stop(self._proc)
        self._proc = None
        self._procs.clear()


def _stop_all(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        _stop(proc)


# ---------------------------------------------------------------------------------------------------------------------
# The reward
# ---------------------------------------------------------------------------------------------------------------------


def _squash(answer: str) -> str:
    return "".join(answer.split())


class MathAccuracyReward:
    """1.0 if the completion's LaTeX answer is equivalent to the gold (math-verify), else 0.0; see the module docs.

    None when the gold is missing or math-verify cannot read it. Use `make_math_accuracy_reward` to build one.
    """

    def __init__(
        self, answer_column: str = "answer", *, timeout: float = 5.0, memory_mb: int = 2048, name: str | None = None
    ):
        if importlib.util.find_spec("math_verify") is None:
            raise ImportError(
                "The math_accuracy reward needs math-verify: pip install 'math-verify>=0.7' (or grpo_hf's "
                "dependencies)."
            )
        if not timeout > 0:
            raise ValueError(f"timeout={timeout} must be > 0 seconds.")
        if not memory_mb > 0:
            raise ValueError(f"memory_mb={memory_mb} must be > 0.")
        self.answer_column = answer_column
        self.timeout = timeout
        self.memory_mb = memory_mb
        self.__name__ = name or "math_accuracy_reward"
        self._verifier = _MathVerifier(int(memory_mb * 2**20))

    def __call__(self, prompts=None, completions=None, completion_ids=None, trainer_state=None, **kwargs):
        if self.answer_column not in kwargs:
            raise KeyError(
                f"{self.__name__} needs the gold answers in the dataset column {self.answer_column!r}, but the reward "
                f"function received only the columns {sorted(kwargs)}. Add that column, or use "
                "make_math_accuracy_reward(answer_column=...) to read another one."
            )
        rewards: list[float | None] = []
        pairs, rows = [], []
        for i, (completion, gold) in enumerate(zip(completions, kwargs[self.answer_column], strict=True)):
            gold = extract_latex_gold(gold)
            prediction = extract_latex_answer(completion) if gold is not None else None
            if gold is None:
                rewards.append(None)
            elif prediction is None:
                rewards.append(0.0)
            elif _squash(prediction) == _squash(gold):
                rewards.append(1.0)
            else:
                rewards.append(0.0)
                pairs.append((gold, prediction))
                rows.append(i)
        if pairs:
            verdicts, timeouts = self._verifier.compare(pairs, self.timeout)
            for i, verdict in zip(rows, verdicts, strict=True):
                rewards[i] = None if verdict is None else float(verdict)
            if timeouts:
                logger.warning(
                    "%s: %d of %d comparisons took longer than %s s (timeout) and were scored 0.0.",
                    self.__name__, timeouts, len(pairs), self.timeout,
                )  # fmt: skip
        return rewards

    def close(self) -> None:
        """Stop the worker process now (it is also stopped when this object is garbage-collected or at exit)."""
        self._verifier.close()

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_verifier"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._verifier = _MathVerifier(int(self.memory_mb * 2**20))

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(answer_column={self.answer_column!r}, timeout={self.timeout}, "
            f"memory_mb={self.memory_mb})"
        )


def make_math_accuracy_reward(
    answer_column: str = "answer", *, timeout: float = 5.0, memory_mb: int = 2048, name: str | None = None
) -> MathAccuracyReward:
    """Registry name `math_accuracy`: MATH-style answers compared by mathematical equivalence (math-verify).

    `answer_column` names the gold column (a bare answer or a full solution with `\\boxed{}`); `timeout` bounds each
    comparison in seconds (slower ones score 0.0); `memory_mb` is the worker's address-space limit (a comparison that
    needs more scores 0.0); `name` sets the metric name (default `math_accuracy_reward`).
    """
    return MathAccuracyReward(answer_column, timeout=timeout, memory_mb=memory_mb, name=name)
