"""What `Sandbox` asks before trusting an interpreter and a sandbox: the interpreter's directories, and a probe.

- Run by path, `python -I sandbox_probe.py` prints as JSON the directories that interpreter needs (`interpreter_dirs`:
  its own, its prefixes, its `sys.path`); the sandbox mounts them back, read-only, wherever it hides a directory.
- `check_confinement` is the test of `Sandbox.check`'s probe execution (this file's source followed by a call): from
  inside the sandbox it asserts what the sandbox promises, and raises AssertionError naming what it found instead.

It imports only the standard library.
"""

from __future__ import annotations  # the sandbox's interpreter may be older than grpo_hf's

import json
import os
import socket
import sys


def interpreter_dirs() -> list[str]:
    """The directories this interpreter needs: its own, its prefixes and its `sys.path` entries that exist."""
    return [
        os.path.dirname(os.path.realpath(sys.executable)),
        sys.prefix,
        sys.base_prefix,
        sys.exec_prefix,
        sys.base_exec_prefix,
        *[p for p in sys.path if os.path.isdir(p)],
    ]


def check_confinement(prefix: str, home: str, env: list[str]) -> None:
    """Assert, from inside a sandbox: PID 1 of a new PID namespace, not root, only a loopback device and no
    connection, no write to /etc or to the interpreter's `prefix`, a writable work directory, exactly the variables
    `env`, and the caller's `home` hidden (empty or absent; "" when there is none to check)."""
    assert os.getpid() == 1, "not PID 1 of a new PID namespace"
    assert os.geteuid() != 0, "running as root"
    assert [name for _, name in socket.if_nameindex()] == ["lo"], "network interfaces visible"
    try:
        socket.create_connection(("127.0.0.1", 9), timeout=1).close()
        raise AssertionError("a connection could be opened")
    except OSError:
        pass
    for path in ("/etc/grpo_hf_sandbox_probe", os.path.join(prefix, "grpo_hf_sandbox_probe")):
        try:
            open(path, "w").close()
            raise AssertionError(f"could write {path}")
        except OSError:
            pass
    with open("inside.txt", "w") as f:
        f.write("ok")
    with open("inside.txt") as f:
        assert f.read() == "ok"
    assert sorted(os.environ) == env, f"inherited environment: {sorted(os.environ)}"
    assert home == "" or not os.path.isdir(home) or os.listdir(home) == [] or home == "/", "home visible"


if __name__ == "__main__":
    print(json.dumps(interpreter_dirs()))
