"""Reruns the tests marked `kernel_paths` under each other set of fp32 CPU kernels this machine can run.

Those tests check that two ways of computing the same log-probs and gradients agree: the shared prompt prefix against
the padded forward, the per-group backward against one backward, each vision-language family's rows against a plain
forward of each row alone. ATen picks its CPU kernels at start-up (`ATEN_CPU_CAPABILITY`: `default`, `avx2`,
`avx512`), and their sums round differently, so a comparison can hold under one set and not under another (issue 44: a
tiny Gemma 3 whose zero-initialised projector made one gradient entry a cancelling sum of terms ~1e4, see
`tiny_vlm.tiny_gemma3`). `make test` runs the suite under the machine's own kernels, then this script, which reruns the
marked tests under `default` and `avx2` (where the CPU has AVX2), leaving out the set the first run used: a
kernel-dependent difference then fails on every x86 machine, not only on those whose own kernels show it.

    python tests/kernel_paths.py [pytest options, e.g. -x]

Exits non-zero if a rerun fails, or collects no test (pytest's exit 5 would mean the marker lost its tests).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent
CAPABILITIES = ("default", "avx2")  # every CPU runs `default`; `avx2` needs AVX2 (AVX-512 CPUs have it)
SELECTION = "kernel_paths and not benchmark and not vllm"
NO_TESTS_COLLECTED = 5


def native_capability() -> str:
    """The kernel set ATen picks on this machine with no `ATEN_CPU_CAPABILITY` set, lower case (`avx512`, `avx2`,
    `default`, or a non-x86 name such as `sve256`)."""
    env = {key: value for key, value in os.environ.items() if key != "ATEN_CPU_CAPABILITY"}
    probe = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    result = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    return result.stdout.strip().lower()


def reruns(native: str, current: str) -> list[str]:
    """The kernel sets to rerun on a CPU whose own is `native`, after a first run under `current`. ATen does not check
    that the CPU has the instructions of the set it is told to use, so `avx2` only where the CPU's own set includes
    them."""
    supported = {"default", "avx2"} if native in ("avx2", "avx512") else {"default"}
    return [capability for capability in CAPABILITIES if capability in supported and capability != current]


def marked_modules() -> list[str]:
    """The test modules that mark tests `kernel_paths`: collecting only these keeps each rerun to seconds."""
    return [str(path) for path in sorted(TESTS.glob("test_*.py")) if "pytest.mark.kernel_paths" in path.read_text()]


def main(pytest_args: list[str]) -> int:
    modules = marked_modules()
    if not modules:
        print(f"no module under {TESTS} marks a test @pytest.mark.kernel_paths: mark the path-equivalence tests")
        return 1
    native = native_capability()
    current = os.environ.get("ATEN_CPU_CAPABILITY", native).lower()
    for capability in reruns(native, current):
        env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", SELECTION, *modules]
        print(f"kernel_paths tests under ATEN_CPU_CAPABILITY={capability} (this CPU's own: {native})", flush=True)
        start = time.perf_counter()
        code = subprocess.run([*command, *pytest_args], env=env).returncode
        print(f"ATEN_CPU_CAPABILITY={capability}: exit {code} in {time.perf_counter() - start:.1f} s", flush=True)
        if code == NO_TESTS_COLLECTED:
            print(f"no test matched -m '{SELECTION}': mark the path-equivalence tests @pytest.mark.kernel_paths")
        if code != 0:
            return code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
