"""One event loop per process, in a daemon thread, for the library's async callables (reward functions, tools).

Async reward functions and tools run on it, so they work from any thread whether or not a loop runs there, and
clients bound to the loop (HTTP sessions) survive between steps and between trainers. A forked process makes its
own. A leaf module: it imports nothing of grpo_hf, and every layer may use it.
"""

from __future__ import annotations

import asyncio
import os
import threading

_LOCK = threading.Lock()
_LOOP: asyncio.AbstractEventLoop | None = None
_PID: int | None = None


def event_loop() -> asyncio.AbstractEventLoop:
    """The process's background loop, started on first use."""
    global _LOOP, _PID
    with _LOCK:
        if _LOOP is None or _PID != os.getpid() or _LOOP.is_closed():
            _LOOP, _PID = asyncio.new_event_loop(), os.getpid()
            threading.Thread(target=_LOOP.run_forever, name="grpo_hf-async-loop", daemon=True).start()
        return _LOOP
