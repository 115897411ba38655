"""Run untrusted Python in a throwaway Linux sandbox: namespaces, a read-only filesystem, rlimits, a clean environment.

One execution = one `Sandbox.run(code, tests)`: a fresh temporary directory, a bootstrap process that sets the
sandbox up, and a fresh interpreter (the *runner*) that executes `code` and then each test string, reporting a
verdict per test on a private pipe. `run_many` runs executions in parallel on `workers` threads.

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
    """CPU time of each process (RLIMIT_CPU, rounded up to whole seconds): SIGXCPU, then SIGKILL a second later."""
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

# The runner: executes the solution, then each test, in a fresh interpreter inside the sandbox. argv[1] is the verdict
# pipe; stdin holds {"token", "code", "tests"}. What it needs later is bound to locals before untrusted code runs.
_RUNNER = r"""# grpo_hf-sandbox-runner
import os, sys


def _run():
    import builtins, json, traceback, types

    write, run, fd = os.write, exec, int(sys.argv[1])
    payload = json.loads(sys.stdin.buffer.read())
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    token, tests = payload["token"], []
    for i, test in enumerate(payload["tests"]):
        try:
            tests.append(compile(test, f"test_{i}.py", "exec"))
        except BaseException:
            traceback.print_exc()
            tests.append(None)
    pristine = dict(builtins.__dict__)
    module = types.ModuleType("solution")
    module.__file__ = "solution.py"
    sys.modules["solution"] = module
    namespace = module.__dict__
    try:
        run(compile(payload.pop("code"), "solution.py", "exec"), namespace)
        ok = True
    except BaseException:
        ok = False
        traceback.print_exc()
    for i, test in enumerate(tests):
        passed = False
        if ok and test is not None:
            namespace["__builtins__"] = dict(pristine)
            try:
                run(test, namespace)
                passed = True
            except BaseException:
                traceback.print_exc()
        write(fd, ("%s %d %s\n" % (token, i, "pass" if passed else "fail")).encode())
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    os._exit(0)


_run()
"""

# The bootstrap: runs as the caller (root or not), sets up namespaces, mounts and limits, forks the runner as PID 1 of
# the new PID namespace and reports to the parent on its own pipe: "error <message>" or "exit <code>"/"signal <n>".
_BOOTSTRAP = r"""# grpo_hf-sandbox-bootstrap
import ctypes, json, os, re, resource, signal, sys

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME, MS_STRICTATIME = (
    1024, 2048, 4096, 16384, 1 << 18, 1 << 21, 1 << 24)
MOUNT_FLAGS = {"ro": MS_RDONLY, "nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
               "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME, "strictatime": MS_STRICTATIME}
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 1, 4, 38
PRIVATE_MOUNTS = ("/tmp", "/var/tmp", "/dev/shm")

cfg = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]


class SetupError(Exception):
    pass


def check(result, what):
    if result != 0:
        raise SetupError(f"{what}: {os.strerror(ctypes.get_errno())}")


def mount(source, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()
    check(libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)), f"mount {fstype or source} on {target}")


def write_file(path, text):
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    except OSError as e:
        raise SetupError(f"write {path}: {e.strerror}") from None
    finally:
        os.close(fd)


def map_own_ids():
    uid, gid = os.getuid(), os.getgid()
    write_file("/proc/self/uid_map", f"{uid} {uid} 1\n")
    write_file("/proc/self/setgroups", "deny")
    write_file("/proc/self/gid_map", f"{gid} {gid} 1\n")


def under(path, roots):
    return any(path == root or path.startswith(root.rstrip("/") + "/") for root in roots)


def remount_read_only(skip):
    with open("/proc/self/mountinfo") as f:
        entries = [line.split() for line in f]
    for entry in entries:
        target = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), entry[4])
        if under(target, skip):
            continue
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        for option in entry[5].split(","):
            flags |= MOUNT_FLAGS.get(option, 0)
        try:
            mount(None, target, None, flags)
        except SetupError:
            if not under(target, ("/proc", "/sys")):  # /proc is replaced below; /sys is writable by root only
                raise


def can_enter(path, uid, gid):
    st = os.stat(path)
    bit = 0o100 if st.st_uid == uid else 0o010 if st.st_gid == gid else 0o001
    return bool(st.st_mode & bit)


def blocked_ancestors(paths, uid, gid):
    # The first directory on the way to each path that uid cannot pass through (e.g. /root, mode 0700).
    found = set()
    for path in paths:
        parts = path.strip("/").split("/")
        for k in range(1, len(parts)):
            ancestor = "/" + "/".join(parts[:k])
            if not can_enter(ancestor, uid, gid):
                found.add(ancestor)
                break
    return found


def hide(roots, needed):
    # Cover each root with an empty read-only tmpfs in which only the needed paths below it come back, read-only.
    cover(roots, needed, "size=64k,mode=0755", read_only=True)


def cover(roots, needed, data, read_only):
    # Mount a fresh tmpfs (options `data`) on each root; the needed paths below it (the interpreter may live under
    # /tmp or a home directory) are bind-mounted back into it, read-only.
    roots = [r for r in roots if r != "/" and not any(r != q and under(r, [q]) for q in roots)]
    for k, root in enumerate(sorted(roots)):
        if not os.path.isdir(root) or any(under(root, [path]) for path in needed):
            continue  # the root itself is needed
        inner = [path for path in needed if under(path, [root]) and os.path.isdir(path)]
        inner = [path for path in inner if not any(q != path and under(path, [q]) for q in inner)]
        stages = []
        for j, path in enumerate(inner):
            stage = f"./.grpo_hf_stage_{k}_{j}"  # relative: the work directory is reached through the cwd only
            os.mkdir(stage)
            mount(path, stage, None, MS_BIND | MS_REC)
            stages.append((stage, path))
        mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, data)
        for stage, path in stages:
            os.makedirs(path, mode=0o755, exist_ok=True)
            mount(stage, path, None, MS_BIND | MS_REC)
            mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
            check(libc.umount2(stage.encode(), 2), f"umount {stage}")  # MNT_DETACH
            os.rmdir(stage)
        if read_only:
            mount(None, root, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def set_limit(name, value):
    resource.setrlimit(getattr(resource, name), (value, value))


def setup_runner(workdir, root, report_w):
    limits = cfg["limits"]
    os.setsid()
    check(libc.unshare(CLONE_NEWNS), "unshare(mount namespace)")
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    mount(workdir, workdir, None, MS_BIND | MS_REC)
    os.chdir(workdir)
    tmpfs = f"size={limits['file_size_bytes']},nr_inodes=4096,mode=1777"
    covered = [path for path in PRIVATE_MOUNTS if os.path.isdir(path) and not os.path.islink(path)]
    cover(covered, cfg["needed"], tmpfs, read_only=False)
    remount_read_only([*covered, workdir])
    # The caller's home (tokens, keys) and, as root, the directories the sandbox uid could not pass through on the way
    # to the interpreter are hidden; the interpreter's own directories come back read-only.
    roots = set(cfg["hide"]) | (blocked_ancestors(cfg["needed"], cfg["uid"], cfg["gid"]) if root else set())
    hide([r for r in roots if not under(r, covered)], cfg["needed"])
    try:
        mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    except SetupError:  # a procfs cannot be mounted here (e.g. a container masks /proc): hide the host's instead
        mount("tmpfs", "/proc", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY, "size=4k")
    cpu = limits["cpu_seconds"]
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    set_limit("RLIMIT_AS", limits["memory_bytes"])
    set_limit("RLIMIT_FSIZE", limits["file_size_bytes"])
    set_limit("RLIMIT_NOFILE", limits["max_open_files"])
    set_limit("RLIMIT_CORE", 0)
    if root:  # drop to the sandbox uid, then give it a user namespace of its own (so its process count is its own)
        uid, gid = cfg["uid"], cfg["gid"]
        os.chown(".", uid, gid)
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
        check(libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0), "prctl(PR_SET_DUMPABLE)")
        check(libc.unshare(CLONE_NEWUSER), "unshare(CLONE_NEWUSER) as an unprivileged uid")
        map_own_ids()
    set_limit("RLIMIT_NPROC", limits["max_processes"])
    os.nice(10)
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    check(libc.prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")
    os.write(report_w, b"ok")  # fails (EPIPE) if the bootstrap has already died: then the runner never starts


state = {"runner": None, "orphan": False}


def on_parent_death(*_):  # the trainer died: end the execution; main() then removes the work directory
    state["orphan"] = True
    if state["runner"] is not None:
        os.kill(state["runner"], 9)


def remove_workdir(workdir):
    import shutil

    shutil.rmtree(workdir, ignore_errors=True)


def main():
    status_fd, result_fd, workdir = cfg["status_fd"], cfg["result_fd"], cfg["workdir"]
    root = os.geteuid() == 0
    signal.signal(signal.SIGTERM, on_parent_death)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != cfg["parent_pid"]:
        on_parent_death()
    if state["orphan"]:
        remove_workdir(workdir)
        return 0
    try:  # the runner gets its own mount namespace (below): this process keeps the host's view, to clean up
        flags = CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
        if root:
            check(libc.unshare(flags), "unshare(pid, net, ipc, uts namespaces)")
        else:
            check(libc.unshare(flags | CLONE_NEWUSER), "unshare(user, pid, net, ipc, uts namespaces)")
            map_own_ids()
    except SetupError as e:
        os.write(status_fd, f"error {e}".encode())
        return 0
    report_r, report_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # PID 1 of the new namespace
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.close(report_r)
        os.close(status_fd)
        try:
            setup_runner(workdir, root, report_w)
            argv = [cfg["python"], "-I", "-B", "-c", cfg["runner"], str(result_fd)]
            os.execve(cfg["python"], argv, cfg["env"])
        except BaseException as e:
            message = str(e) if isinstance(e, SetupError) else f"{type(e).__name__}: {e}"
            try:
                os.write(report_w, f" {message}".encode())
            except OSError:
                pass
        os._exit(125)
    state["runner"] = pid
    if state["orphan"]:
        os.kill(pid, 9)
    os.close(report_w)
    os.close(result_fd)
    signal.signal(signal.SIGALRM, lambda *_: os.kill(pid, 9))  # the wall clock, should the parent not enforce it
    signal.alarm(cfg["alarm_seconds"])
    report = b""
    while True:
        chunk = os.read(report_r, 4096)
        if not chunk:
            break
        report += chunk
    _, status = os.waitpid(pid, 0)
    if state["orphan"]:
        remove_workdir(workdir)
        return 0
    if report != b"ok":
        os.write(status_fd, b"error " + report[2:] if report.startswith(b"ok") else b"error " + report)
    elif os.WIFSIGNALED(status):
        os.write(status_fd, f"signal {os.WTERMSIG(status)}".encode())
    else:
        os.write(status_fd, f"exit {os.WEXITSTATUS(status)}".encode())
    return 0


sys.exit(main())
"""

# The probe (trusted code) checks the confinement from inside; {prefix}, {home} and {env} are filled in by `check`.
_PROBE_TEST = """
import os, socket
assert os.getpid() == 1, "not PID 1 of a new PID namespace"
assert os.geteuid() != 0, "running as root"
assert [name for _, name in socket.if_nameindex()] == ["lo"], "network interfaces visible"
try:
    socket.create_connection(("127.0.0.1", 9), timeout=1).close()
    raise AssertionError("a connection could be opened")
except OSError:
    pass
for path in ("/etc/grpo_hf_sandbox_probe", os.path.join({prefix!r}, "grpo_hf_sandbox_probe")):
    try:
        open(path, "w").close()
        raise AssertionError(f"could write {{path}}")
    except OSError:
        pass
open("inside.txt", "w").write("ok")
assert open("inside.txt").read() == "ok"
assert sorted(os.environ) == {env!r}, f"inherited environment: {{sorted(os.environ)}}"
assert {home!r} == "" or not os.path.isdir({home!r}) or os.listdir({home!r}) == [] or {home!r} == "/", "home visible"
"""


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
        probe = _PROBE_TEST.format(prefix=prefix, home=home, env=sorted(_ENV))
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
            "runner": _RUNNER,
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
                    [self.python, "-I", "-S", "-B", "-c", _BOOTSTRAP, json.dumps(cfg)],
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
        exit_code = None
        if report.startswith(b"exit "):
            exit_code = int(report[5:])
        elif report.startswith(b"signal "):
            exit_code = -int(report[7:])
        status = "timeout" if timed_out else ("exited" if exit_code is not None and exit_code >= 0 else "killed")
        return ExecutionResult(passed, status, exit_code, time.monotonic() - start, text)

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
    """The directories `python` needs: its own, its prefixes and its `sys.path` (asked from the interpreter itself)."""
    script = (
        "import json, os, sys; print(json.dumps([os.path.dirname(os.path.realpath(sys.executable)), sys.prefix, "
        "sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, *[p for p in sys.path if os.path.isdir(p)]]))"
    )
    try:
        found = subprocess.run([python, "-I", "-c", script], capture_output=True, text=True, env=_ENV, timeout=60)
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
