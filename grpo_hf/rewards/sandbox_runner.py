"""The sandbox's runner: inside the sandbox, runs the solution, then each test, and reports one verdict per test.

The bootstrap (`sandbox_bootstrap.py`) starts it once the sandbox is set up, as `python -I -B -c SOURCE FD` with this
file's source: the sandbox's interpreter may be another one than the trainer's, without grpo_hf installed, and the
sandbox hides what the interpreter does not need, so the runner travels as text rather than as an importable module.
It imports only the standard library.

`FD` is the verdict pipe; stdin holds the JSON `{"token", "code", "tests"}` and is then replaced by an empty one. The
tests are compiled first; the solution runs as the module `solution`; each test runs in the solution's namespace with
a copy of the builtins taken before the solution ran, and after test i the runner writes `<token> <i> pass|fail` on
the pipe. What it needs once untrusted code has started (`os.write`, `exec`, the pipe, the token, the compiled tests,
the pristine builtins) is bound to locals before the solution runs.
"""

from __future__ import annotations  # the sandbox's interpreter may be older than grpo_hf's

import os
import sys


def run_tests(code: str, tests: list[str], token: str, fd: int) -> None:
    """Run `code` as the module `solution`, then each of `tests` in its namespace; `<token> <i> pass|fail` on `fd`.

    A test passes when it returns; it fails when it raises, does not compile, or the solution raised."""
    import builtins
    import traceback
    import types

    write, run = os.write, exec
    compiled = []
    for i, test in enumerate(tests):
        try:
            compiled.append(compile(test, f"test_{i}.py", "exec"))
        except BaseException:
            traceback.print_exc()
            compiled.append(None)
    pristine = dict(builtins.__dict__)
    module = types.ModuleType("solution")
    module.__file__ = "solution.py"
    sys.modules["solution"] = module
    namespace = module.__dict__
    try:
        run(compile(code, "solution.py", "exec"), namespace)
        ok = True
    except BaseException:
        ok = False
        traceback.print_exc()
    for i, test in enumerate(compiled):
        passed = False
        if ok and test is not None:
            namespace["__builtins__"] = dict(pristine)
            try:
                run(test, namespace)
                passed = True
            except BaseException:
                traceback.print_exc()
        write(fd, f"{token} {i} {'pass' if passed else 'fail'}\n".encode())


def main() -> None:
    """Read the payload from stdin, run it (`run_tests`) with the verdict pipe argv[1], and exit at once (status 0)."""
    import json

    fd = int(sys.argv[1])
    payload = json.loads(sys.stdin.buffer.read())
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    run_tests(payload.pop("code"), payload["tests"], payload["token"], fd)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    os._exit(0)


if __name__ == "__main__":
    main()
