"""Pins of grpo_hf's direct dependencies at the lowest versions pyproject.toml allows (`make test-lowest`).

    python requirements/lowest.py > requirements/lowest.txt   # "transformers==5.19.0", one a line

Each `name>=X` of `[project] dependencies` becomes `name==X`, for pip's `-c`. torch is left out: this machine's
package index serves one CPU build of it (`TORCH_SPEC`), and every other release is a CUDA build of several GB, so
its bound is checked where those run (a GPU machine: `make test-lowest TORCH_SPEC=torch==X`).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import tomllib

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"
SKIPPED = {"torch"}
LOWER = re.compile(r"^([A-Za-z0-9_.-]+)\s*(?:\[[^]]*\])?\s*.*?>=\s*([^,;\s]+)")


def lowest_pins(pyproject: Path = PYPROJECT) -> list[str]:
    """`name==lower bound` for each direct dependency with a `>=` bound, torch left out; an unbounded one fails."""
    pins = []
    for requirement in tomllib.loads(pyproject.read_text())["project"]["dependencies"]:
        match = LOWER.match(requirement)
        if match is None:
            raise SystemExit(f"{requirement!r} in {pyproject} has no lower bound (name>=version): give it one")
        name, bound = match.groups()
        if name.lower() not in SKIPPED:
            pins.append(f"{name}=={bound}")
    return pins


if __name__ == "__main__":
    sys.stdout.write("".join(f"{pin}\n" for pin in lowest_pins()))
