"""Run untrusted Python in a throwaway Linux sandbox: namespaces, a read-only filesystem, rlimits, a clean environment.

One execution = one `Sandbox.run(code, tests)`: a fresh temporary directory, a bootstrap process that sets the
sandbox up (`sandbox_bootstrap.py`), and a fresh interpreter (the *runner*, `sandbox_runner.py`) that executes `code`
and then each test string, reporting a verdict per test on a private pipe. `run_many` runs executions in parallel on
`workers` threads. `Sandbox.check` runs `sandbox_probe.py`'s checks inside a sandbox before any code.

How an execution is confined (the bootstrap does this before any untrusted code runs):

1. **Namespaces** (`unshare`): new mount, PID, network, IPC and UTS namespaces, and a user namespace of its own. The
   network namespace has only a loopback device that is down, so no connection can be opened. The runner is PID 1
   of its PID namespace: it sees no process outside it, and when it exits the kernel kills every process left in it
   (a daemon cannot outlive the execution). As root, the bootstrap drops to an unprivileged uid (65534, "nobody")
   before creating the user namespace; otherwise it maps the caller's own uid. The runner holds no capabilities.
2. **Filesystem**: every mount is remounted read-only in the sandbox's mount namespace, except its work directory
   (a bind mount of a fresh host temporary directory, removed afterwards) and private size-limited tmpfs mounts on
   `/tmp`, `/var/tmp` and `/dev/shm` (discarded with the namespace); `/proc` is a new procfs showing only the
   sandbox's processes. The caller's home directory (tokens, keys) and, as root, any directory the sandbox uid cannot
   pass through on the way to the interpreter (e.g. `/root`) are covered by an empty tmpfs into which only the
   interpreter's own directories are bind-mounted back, read-only.
3. **Limits** (`setrlimit`): CPU time, address space, file size, open files, core dumps off, and the number of
   processes, counted per execution (the count lives in the execution's own user namespace). The parent kills the
   whole execution after `wall_seconds`. Sandbox processes run at nice +10 with `no_new_privs`.
4. **Environment**: a fixed, minimal set of variables (PATH, HOME, LANG, thread counts); nothing is inherited. The
   interpreter runs with `-I` (isolated mode) and `-B`; stdin is empty.
5. **Verdict**: the runner writes `<token> <i> pass|fail` on a pipe after test `i` returns or raises, where the
   token is a random value sent with the code on stdin. Exit codes and printed text mean nothing, so `sys.exit(0)`,
   `os._exit(0)` or printing "all tests passed" before the tests cannot pass them. Tests run with a copy of the
   builtins taken before the solution ran, so patching `builtins` at import time does not reach them.

What it does not defend against: a kernel exploit (the sandbox shares the host kernel; use a VM-backed sandbox such as
gVisor, Firecracker or a separate machine for code you must assume is actively malicious); reads of files the
sandbox uid may read outside the hidden home (the rest of the filesystem is read-only, not hidden); code that
searches the interpreter's memory or frames for the verdict token, or that games the tests themselves (e.g. returns
an object whose `__eq__` is always true). The limits keep one execution from exhausting the machine, but many
parallel executions still share its CPU cores.

Linux only. `Sandbox()` checks at construction that the sandbox can be set up here and raises
`SandboxUnavailableError` saying which step failed; it never falls back to running code unconfined.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import math
import os
import secrets
import select
import shutil
import subprocess
import sys
import tempfile
import time

logger = logging.getLogger(__name__)

__all__ = ["ExecutionResult", "Sandbox", "SandboxError", "SandboxLimits", "SandboxUnavailableError"]


class SandboxError(RuntimeError):
    """The sandbox could not be set up for an execution (an error of the platform, not of the code)."""


class SandboxUnavailableError(SandboxError):
    """The sandbox cannot be set up on this machine (raised when a `Sandbox` is built)."""


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """Per-execution limits. An execution that exceeds one is stopped; tests it had not reported count as failed."""

    cpu_seconds: float = 5.0
    """CPU time of each process (RLIMIT_CPU, rounded up to whole seconds): SIGXCPU, then SIGKILL a second later. The
    runner, PID 1 of its namespace, ignores SIGXCPU, so the code's own process is killed one second past the limit."""
    wall_seconds: float = 10.0
    """Wall-clock time of the whole execution, interpreter start-up included; then every process is killed."""
    memory_mb: int = 1024
    """Address space of each process (RLIMIT_AS): larger allocations fail with MemoryError."""
    max_processes: int = 16
    """Processes and threads in the execution, the runner included (RLIMIT_NPROC; as a non-root user, the bootstrap
    too)."""
    file_size_mb: int = 16
    """Largest file a process may write (RLIMIT_FSIZE), also the size of each private tmpfs."""
    max_open_files: int = 64
    """Open file descriptors per process (RLIMIT_NOFILE)."""

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"SandboxLimits.{field.name}={value!r} must be a positive number.")
        if self.max_processes < 3:
            raise ValueError(f"SandboxLimits.max_processes={self.max_processes} must be >= 3 (bootstrap and runner).")


@dataclasses.dataclass
class ExecutionResult:
    """The outcome of one execution."""

    passed: list[bool]
    """One verdict per test string; a test that did not report (the execution was stopped first) is False."""
    status: str
    """`"exited"` (the runner exited by itself), `"timeout"` (killed at `wall_seconds`), or `"killed"`."""
    exit_code: int | None
    """The runner's exit code, or -N when a signal N (e.g. SIGXCPU, SIGKILL) ended it; None if unknown."""
    wall_seconds: float
    output: str
    """The start of the execution's stdout and stderr (at most 4 KiB), for debugging."""
    cpu_seconds: float | None = None
    """CPU time (user + system) the execution's processes used: the runner's and that of the processes reaped in its
    PID namespace (all of them once it ends). None when it was killed at `wall_seconds` (nobody was left to count)."""

    @property
    def all_passed(self) -> bool:
        return bool(self.passed) and all(self.passed)

    @property
    def pass_rate(self) -> float:
        return sum(self.passed) / len(self.passed) if self.passed else 0.0


_OUTPUT_BYTES = 4096
_VERDICT_BYTES = 1 << 20  # verdict lines kept per execution; more is read and dropped
_NOBODY = 65534
_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": "/tmp",
    "TMPDIR": "/tmp",
    "LANG": "C.UTF-8",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}

# The programs, run by path with the sandbox's interpreter, except the runner, whose source the bootstrap execs with
# `-c` inside the sandbox (`sandbox_runner.py` says why). Each imports only the standard library.
_HERE = os.path.dirname(os.path.abspath(__file__))
_BOOTSTRAP = os.path.join(_HERE, "sandbox_bootstrap.py")
_RUNNER = os.path.join(_HERE, "sandbox_runner.py")
_PROBE = os.path.join(_HERE, "sandbox_probe.py")


class Sandbox:
    """Executes Python code with tests in a confined, throwaway Linux sandbox (see the module docstring).

    Args:
        limits: per-execution `SandboxLimits` (default: 5 s CPU, 10 s wall, 1 GiB address space, 16 processes,
            16 MiB files, 64 open files).
        workers: executions run in parallel by `run_many` (default: the CPU cores this process may use).
        python: the interpreter that runs the code (default: this one, `sys.executable`). It and its packages must be
            readable by the sandbox uid.
        uid, gid: when running as root, the unprivileged ids the code runs as (default 65534, "nobody").
        check: run a probe execution now and raise `SandboxUnavailableError` if the sandbox cannot be set up.
    """

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        *,
        workers: int | None = None,
        python: str | None = None,
        uid: int = _NOBODY,
        gid: int = _NOBODY,
        check: bool = True,
    ):
        if not sys.platform.startswith("linux"):
            raise SandboxUnavailableError(
                f"The code sandbox needs Linux namespaces; this is {sys.platform}. Run the code reward on Linux, or "
                "in a Linux container or VM."
            )
        self.limits = limits if limits is not None else SandboxLimits()
        if workers is None:
            workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        if workers < 1:
            raise ValueError(f"workers={workers} must be >= 1.")
        self.workers = workers
        self.python = os.path.abspath(python or sys.executable)
        self.uid, self.gid = uid, gid
        self._needed = _interpreter_dirs(self.python)
        with open(_RUNNER, encoding="utf-8") as f:
            self._runner = f.read()
        home = os.path.expanduser("~")
        self._hide = [home] if os.path.isabs(home) and home != "/" else []
        if check:
            self.check()

    def __repr__(self) -> str:
        return f"Sandbox({self.limits}, workers={self.workers}, python={self.python!r})"

    def check(self) -> None:
        """Run a probe execution: the sandbox must set up, isolate the network, hide the environment and stop writes
        outside its directory. Raises `SandboxUnavailableError` naming the step that failed and what to change."""
        prefix = os.path.dirname(os.path.dirname(self.python))
        home = self._hide[0] if self._hide else ""
        if any(path == home or path.startswith(home.rstrip("/") + "/") for path in self._needed):
            home = ""  # the interpreter lives in it: its directories come back, so the home is not empty
        with open(_PROBE, encoding="utf-8") as f:
            probe = f"{f.read()}\ncheck_confinement({prefix!r}, {home!r}, {sorted(_ENV)!r})\n"
        try:
            result = self._run("", [probe])
        except SandboxError as e:
            who = f"uid {self.uid}" if os.geteuid() == 0 else f"uid {os.geteuid()}"
            raise SandboxUnavailableError(
                f"The code sandbox cannot be set up on this machine: {e}. It needs Linux user, mount, PID and network "
                "namespaces (kernel.unprivileged_userns_clone=1; on Ubuntu 24.04+ also "
                "kernel.apparmor_restrict_unprivileged_userns=0, or run as root), and the interpreter "
                f"{self.python!r} with its packages readable by {who}."
            ) from e
        if not result.all_passed:
            raise SandboxUnavailableError(
                f"The code sandbox was set up but its probe failed ({result.status}, exit code {result.exit_code}):\n"
                f"{result.output}"
            )

    def run(self, code: str, tests: list[str]) -> ExecutionResult:
        """Execute `code`, then each string of `tests` in the same namespace; one verdict per test."""
        return self._run(code, list(tests))

    def run_many(self, jobs: list[tuple[str, list[str]]]) -> list[ExecutionResult]:
        """`run` for each `(code, tests)`, at most `workers` at a time; results in the order of `jobs`."""
        jobs = list(jobs)
        if self.workers == 1 or len(jobs) <= 1:
            return [self.run(code, tests) for code, tests in jobs]
        with concurrent.futures.ThreadPoolExecutor(min(self.workers, len(jobs)), "grpo_hf-sandbox") as pool:
            return list(pool.map(lambda job: self.run(*job), jobs))

    def _config(self, workdir: str, status_fd: int, result_fd: int) -> dict:
        limits = self.limits
        return {
            "workdir": workdir,
            "status_fd": status_fd,
            "result_fd": result_fd,
            "python": self.python,
            "runner": self._runner,
            "env": dict(_ENV),
            "parent_pid": os.getpid(),
            "alarm_seconds": math.ceil(limits.wall_seconds) + 5,
            "uid": self.uid,
            "gid": self.gid,
            "needed": self._needed,
            "hide": self._hide,
            "limits": {
                "cpu_seconds": max(1, math.ceil(limits.cpu_seconds)),
                "memory_bytes": int(limits.memory_mb * 2**20),
                "file_size_bytes": int(limits.file_size_mb * 2**20),
                "max_processes": int(limits.max_processes),
                "max_open_files": int(limits.max_open_files),
            },
        }

    def _run(self, code: str, tests: list[str]) -> ExecutionResult:
        if not all(isinstance(t, str) for t in tests) or not isinstance(code, str):
            raise TypeError("Sandbox.run takes the code as a string and the tests as a list of strings.")
        token = secrets.token_hex(16)
        start = time.monotonic()
        workdir = tempfile.mkdtemp(prefix="grpo_hf_sandbox_")
        status_r, status_w = os.pipe()
        result_r, result_w = os.pipe()
        try:
            with tempfile.TemporaryFile() as payload, tempfile.TemporaryFile() as output:
                payload.write(json.dumps({"token": token, "code": code, "tests": tests}).encode())
                payload.seek(0)
                cfg = self._config(workdir, status_w, result_w)
                proc = subprocess.Popen(
                    [self.python, "-I", "-S", "-B", _BOOTSTRAP, json.dumps(cfg)],
                    stdin=payload,
                    stdout=output,
                    stderr=output,
                    pass_fds=(status_w, result_w),
                    env=dict(_ENV),
                    cwd=workdir,
                    start_new_session=True,
                )
                os.close(status_w)
                os.close(result_w)
                status_w = result_w = -1
                verdicts, timed_out = self._collect(proc, result_r, start + self.limits.wall_seconds)
                report = _read_all(status_r)
                output.seek(0)
                text = output.read(_OUTPUT_BYTES).decode("utf-8", "replace")
        finally:
            for fd in (status_r, status_w, result_r, result_w):
                if fd >= 0:
                    os.close(fd)
            _remove_tree(workdir)
        if report.startswith(b"error"):
            raise SandboxError(f"sandbox setup failed: {report[6:].decode('utf-8', 'replace').strip()}")
        passed = _parse_verdicts(verdicts, token, len(tests))
        exit_code, cpu = _parse_report(report)
        status = "timeout" if timed_out else ("exited" if exit_code is not None and exit_code >= 0 else "killed")
        return ExecutionResult(passed, status, exit_code, time.monotonic() - start, text, cpu)

    @staticmethod
    def _collect(proc: subprocess.Popen, result_r: int, deadline: float) -> tuple[bytes, bool]:
        """Read verdicts until every sandbox process is gone or the deadline passes (then kill them all)."""
        data = bytearray()
        timed_out = False
        eof = False
        while not eof:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            if select.select([result_r], [], [], remaining)[0]:
                chunk = os.read(result_r, 65536)
                eof = not chunk
                if len(data) < _VERDICT_BYTES:
                    data += chunk
        if not timed_out:
            try:  # the pipe is closed; the bootstrap exits once the runner's namespace is empty
                proc.wait(max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                timed_out = True
        if timed_out:
            proc.kill()  # the runner dies with it (PDEATHSIG), and the kernel empties its PID namespace
            proc.wait()
            drain_until = time.monotonic() + 2.0  # wait until no sandbox process holds the pipe any more
            while not eof and select.select([result_r], [], [], max(drain_until - time.monotonic(), 0))[0]:
                eof = not os.read(result_r, 65536)
        return bytes(data), timed_out


def _interpreter_dirs(python: str) -> list[str]:
    """The directories `python` needs: its own, its prefixes and its `sys.path` (asked from the interpreter itself:
    `sandbox_probe.interpreter_dirs`)."""
    try:
        found = subprocess.run([python, "-I", _PROBE], capture_output=True, text=True, env=_ENV, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SandboxUnavailableError(f"The sandbox interpreter {python!r} cannot be run: {e}") from e
    if found.returncode != 0:
        raise SandboxUnavailableError(f"The sandbox interpreter {python!r} failed: {found.stderr.strip()[-500:]}")
    dirs = {os.path.dirname(python), *json.loads(found.stdout)}
    return sorted({os.path.abspath(d) for d in dirs if d})


def _read_all(fd: int) -> bytes:
    chunks = []
    while True:
        chunk = os.read(fd, 4096)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def _parse_report(report: bytes) -> tuple[int | None, float | None]:
    """The bootstrap's `exit <code> <cpu>` or `signal <n> <cpu>`: the exit code (-n for a signal) and the CPU seconds;
    (None, None) when it reported nothing (it was killed)."""
    parts = report.split()
    if len(parts) != 3 or parts[0] not in (b"exit", b"signal"):
        return None, None
    code = int(parts[1])
    return (code if parts[0] == b"exit" else -code), float(parts[2])


def _parse_verdicts(data: bytes, token: str, n: int) -> list[bool]:
    passed = [False] * n
    prefix = token.encode() + b" "
    for line in data.split(b"\n"):
        if not line.startswith(prefix):
            continue
        parts = line[len(prefix) :].split(b" ")
        if len(parts) == 2 and parts[0].isdigit() and int(parts[0]) < n:
            passed[int(parts[0])] = parts[1] == b"pass"
    return passed


def _remove_tree(path: str) -> None:
    def retry(func, target, _exc_info):  # e.g. a directory the code made read-only
        os.chmod(os.path.dirname(target), 0o700)
        os.chmod(target, 0o700)
        func(target)

    try:
        shutil.rmtree(path, onerror=retry)
    except OSError as e:
        logger.warning("Could not remove the sandbox directory %s: %s", path, e)
