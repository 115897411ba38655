"""The sandbox's bootstrap: sets up one execution's namespaces, mounts and limits, then starts the runner inside.

`Sandbox` runs it by path for each execution, as `python -I -S -B sandbox_bootstrap.py CONFIG` (CONFIG: the JSON of
`Sandbox._config`), with the caller's rights (root or not), in the execution's fresh work directory. It imports only
the standard library. In order:

1. It asks to be sent SIGTERM when the trainer dies (and then kills the runner and removes the work directory).
2. `unshare_namespaces`: new PID, network, IPC and UTS namespaces; not as root, a user namespace too, mapping the
   caller's own uid and gid.
3. It forks the runner's process, PID 1 of the new PID namespace, which (`setup_runner`) takes a mount namespace of
   its own, covers `/tmp`, `/var/tmp` and `/dev/shm` with private size-limited tmpfs mounts, remounts everything else
   read-only except the work directory, hides the caller's home (and, as root, the directories the sandbox uid cannot
   pass through on the way to the interpreter) under empty tmpfs mounts into which only the interpreter's directories
   come back read-only, mounts a new `/proc`, sets the rlimits, drops to the sandbox uid in a user namespace of its own
   (as root), sets nice +10, `no_new_privs` and a parent-death signal, and only then execs the runner
   (`sandbox_runner.py`, its source sent in CONFIG) with the fixed environment of CONFIG.
4. It waits for the runner (killing it at `alarm_seconds`, should the parent not) and reports on its status pipe:
   `error <message>` when a setup step failed, else `exit <code> <cpu>` or `signal <n> <cpu>`, where `<cpu>` is the
   CPU seconds (user + system) of the runner and of the processes reaped in its PID namespace.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import resource
import signal
import sys

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME, MS_STRICTATIME = (
    1024, 2048, 4096, 16384, 1 << 18, 1 << 21, 1 << 24
)  # fmt: skip
MOUNT_FLAGS = {
    "ro": MS_RDONLY,
    "nosuid": MS_NOSUID,
    "nodev": MS_NODEV,
    "noexec": MS_NOEXEC,
    "noatime": MS_NOATIME,
    "nodiratime": MS_NODIRATIME,
    "relatime": MS_RELATIME,
    "strictatime": MS_STRICTATIME,
}
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 1, 4, 38
PRIVATE_MOUNTS = ("/tmp", "/var/tmp", "/dev/shm")

libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]


class SetupError(Exception):
    """A step of the sandbox's setup failed (reported to the parent as `error <message>`)."""


def check(result: int, what: str) -> None:
    if result != 0:
        raise SetupError(f"{what}: {os.strerror(ctypes.get_errno())}")


def _encode(text: str | None) -> bytes | None:
    return None if text is None else text.encode()


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    result = libc.mount(_encode(source), _encode(target), _encode(fstype), flags, _encode(data))
    check(result, f"mount {fstype or source} on {target}")


def write_file(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    except OSError as e:
        raise SetupError(f"write {path}: {e.strerror}") from None
    finally:
        os.close(fd)


def map_own_ids() -> None:
    uid, gid = os.getuid(), os.getgid()
    write_file("/proc/self/uid_map", f"{uid} {uid} 1\n")
    write_file("/proc/self/setgroups", "deny")
    write_file("/proc/self/gid_map", f"{gid} {gid} 1\n")


def under(path: str, roots) -> bool:
    """Whether `path` is one of `roots` or below one of them."""
    return any(path == root or path.startswith(root.rstrip("/") + "/") for root in roots)


def mount_point(field: str) -> str:
    r"""A mount point as /proc/self/mountinfo writes it, with its octal escapes (`\040` for a space) decoded."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def remount_read_only(skip: list[str]) -> None:
    with open("/proc/self/mountinfo") as f:
        entries = [line.split() for line in f]
    for entry in entries:
        target = mount_point(entry[4])
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


def can_enter(path: str, uid: int, gid: int) -> bool:
    st = os.stat(path)
    bit = 0o100 if st.st_uid == uid else 0o010 if st.st_gid == gid else 0o001
    return bool(st.st_mode & bit)


def blocked_ancestors(paths: list[str], uid: int, gid: int) -> set[str]:
    """The first directory on the way to each path that uid cannot pass through (e.g. /root, mode 0700)."""
    found = set()
    for path in paths:
        parts = path.strip("/").split("/")
        for k in range(1, len(parts)):
            ancestor = "/" + "/".join(parts[:k])
            if not can_enter(ancestor, uid, gid):
                found.add(ancestor)
                break
    return found


def hide(roots: list[str], needed: list[str]) -> None:
    """Cover each root with an empty read-only tmpfs in which only the needed paths below it come back, read-only."""
    cover(roots, needed, "size=64k,mode=0755", read_only=True)


def cover(roots: list[str], needed: list[str], data: str, read_only: bool) -> None:
    """Mount a fresh tmpfs (options `data`) on each root; the needed paths below it (the interpreter may live under
    /tmp or a home directory) are bind-mounted back into it, read-only."""
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


def set_limit(name: str, value: int) -> None:
    resource.setrlimit(getattr(resource, name), (value, value))


def setup_runner(cfg: dict, root: bool, report_w: int) -> None:
    """In the runner's process: its mounts, limits and (as root) uid; then "ok" on `report_w`."""
    limits, workdir = cfg["limits"], cfg["workdir"]
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


def unshare_namespaces(root: bool) -> None:
    """New PID, network, IPC and UTS namespaces for the runner to come; not as root, a user namespace too."""
    flags = CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
    if root:
        check(libc.unshare(flags), "unshare(pid, net, ipc, uts namespaces)")
    else:
        check(libc.unshare(flags | CLONE_NEWUSER), "unshare(user, pid, net, ipc, uts namespaces)")
        map_own_ids()


def exec_runner(cfg: dict, root: bool, report_w: int) -> None:
    """In the forked runner's process (PID 1 of the new namespace): set up, then exec the runner; never returns. On a
    failure, the message goes to `report_w` and the process exits with 125."""
    try:
        setup_runner(cfg, root, report_w)
        argv = [cfg["python"], "-I", "-B", "-c", cfg["runner"], str(cfg["result_fd"])]
        os.execve(cfg["python"], argv, cfg["env"])
    except BaseException as e:
        message = str(e) if isinstance(e, SetupError) else f"{type(e).__name__}: {e}"
        try:
            os.write(report_w, f" {message}".encode())
        except OSError:
            pass
    os._exit(125)


state = {"runner": None, "orphan": False}


def on_parent_death(*_) -> None:  # the trainer died: end the execution; main() then removes the work directory
    state["orphan"] = True
    if state["runner"] is not None:
        os.kill(state["runner"], 9)


def remove_workdir(workdir: str) -> None:
    import shutil

    shutil.rmtree(workdir, ignore_errors=True)


def main(cfg: dict) -> int:
    """One execution, as the module docstring says; always returns 0 (what happened is on the status pipe)."""
    status_fd, result_fd, workdir = cfg["status_fd"], cfg["result_fd"], cfg["workdir"]
    root = os.geteuid() == 0
    signal.signal(signal.SIGTERM, on_parent_death)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != cfg["parent_pid"]:
        on_parent_death()
    if state["orphan"]:
        remove_workdir(workdir)
        return 0
    try:  # the runner gets its own mount namespace (setup_runner): this process keeps the host's view, to clean up
        unshare_namespaces(root)
    except SetupError as e:
        os.write(status_fd, f"error {e}".encode())
        return 0
    report_r, report_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # PID 1 of the new namespace
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.close(report_r)
        os.close(status_fd)
        exec_runner(cfg, root, report_w)
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
    _, status, usage = os.wait4(pid, 0)
    if state["orphan"]:
        remove_workdir(workdir)
        return 0
    cpu = usage.ru_utime + usage.ru_stime  # the runner's, and that of every process it or its namespace's end reaped
    if report != b"ok":
        os.write(status_fd, b"error " + report[2:] if report.startswith(b"ok") else b"error " + report)
    elif os.WIFSIGNALED(status):
        os.write(status_fd, f"signal {os.WTERMSIG(status)} {cpu:.3f}".encode())
    else:
        os.write(status_fd, f"exit {os.WEXITSTATUS(status)} {cpu:.3f}".encode())
    return 0


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
