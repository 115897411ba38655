"""The math-verify worker: compares LaTeX answers in a process of its own, so that a hanging comparison can be killed.

`latex._MathVerifier` runs it by path, as `python latex_worker.py MEMORY_BYTES` with the trainer's interpreter. It
reads JSON lines `[gold, prediction]` on stdin and answers each with a line `true`, `false` or `null` (math-verify
cannot read the gold) after a first line `ready`. Until math-verify is imported it uses only the standard library.

The process splits in two at start-up, before importing anything heavy: the *watcher* (the process started) kills the
*worker* (its child) as soon as the training process dies, even in the middle of a comparison that holds the GIL, and
the worker dies with the watcher (PR_SET_PDEATHSIG). The worker's address space is limited to MEMORY_BYTES, so a huge
power such as `10^{10^{10}}` fails its comparison, not the machine.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import sys
import time
from collections.abc import Iterable
from typing import TextIO


def split_off_worker() -> None:
    """Fork; the parent becomes the watcher and never returns (it exits when the worker does), the child returns."""
    trainer, watcher = os.getppid(), os.getpid()
    worker = os.fork()
    if worker:
        os.close(0)
        os.close(1)
        while os.waitpid(worker, os.WNOHANG) == (0, 0):
            if os.getppid() != trainer:
                os.kill(worker, 9)
            time.sleep(0.5)
        os._exit(0)
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG, SIGKILL
    except (OSError, AttributeError):
        pass
    if os.getppid() != watcher:
        os._exit(0)


class Judge:
    """math-verify's verdict on one (gold, prediction) pair of LaTeX answers, each read as `\\boxed{...}`."""

    def __init__(self):
        from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

        self._parse, self._verify = parse, verify
        self._config = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]

    def _read(self, answer: str):
        return self._parse("\\boxed{" + answer + "}", extraction_config=self._config, parsing_timeout=None)

    def __call__(self, gold: str, prediction: str) -> bool | None:
        """True or False; None when math-verify cannot read the gold. An error in math-verify (sympy) is False."""
        try:
            parsed_gold = self._read(gold)
            if not parsed_gold:
                return None
            return bool(self._verify(parsed_gold, self._read(prediction), timeout_seconds=None))
        except (Exception, MemoryError, RecursionError):
            return False


def serve(judge: Judge, lines: Iterable[str], out: TextIO) -> None:
    """`ready`, then one JSON verdict per JSON line `[gold, prediction]`, each flushed at once."""
    out.write("ready\n")
    out.flush()
    for line in lines:
        gold, prediction = json.loads(line)
        out.write(json.dumps(judge(gold, prediction)) + "\n")
        out.flush()


def main() -> None:
    # Run by path, Python puts this file's directory (grpo_hf/rewards) first on sys.path, where `code.py` would stand
    # in for the standard library's `code`: it comes off before anything else is imported.
    here = os.path.dirname(os.path.realpath(__file__))
    sys.path[:] = [path for path in sys.path if os.path.realpath(path) != here]
    split_off_worker()
    limit = int(sys.argv[1])
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    logging.disable(logging.WARNING)
    serve(Judge(), sys.stdin, sys.stdout)


if __name__ == "__main__":
    main()
