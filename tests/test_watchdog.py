"""The heartbeat's watchdog (grpo_hf.parallel.PeerWatch, Heartbeat.watching) with a fake store and clock: a training
peer silent for longer than fault_timeout is named, not before; a peer that left train (the normal end) or has not
started is never dead; a store that stops answering for longer than the bound is named as the main node. The
two-machine kill tests are in tests/test_nodes.py."""

import threading
import time

import pytest

from grpo_hf import parallel
from grpo_hf.parallel import PeerWatch

WHERE = "the launcher's store at 10.0.0.1:29500 (on the main node, machine rank 0)"


class FakeStore:
    """TCPStore's add / multi_get / get / set on a dict; `down` makes every call raise as a lost connection does."""

    def __init__(self):
        self.values: dict[str, bytes] = {}
        self.down = False

    def _up(self):
        if self.down:
            raise RuntimeError("Connection reset by peer")

    def add(self, key: str, amount: int) -> int:
        self._up()
        value = int(self.values.get(key, b"0")) + amount
        self.values[key] = str(value).encode()
        return value

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self._up()
        return [self.values[key] for key in keys]  # a missing key would block a real store: KeyError here

    def get(self, key: str) -> bytes:
        self._up()
        return self.values[key]

    def set(self, key: str, value: str) -> None:
        self._up()
        self.values[key] = value.encode()


def three_processes() -> FakeStore:
    store = FakeStore()
    for rank in range(3):
        store.set(f"grpo_hf/who/{rank}", f"node {rank} (gpu-{rank}), pid {100 + rank}")
        store.add(f"grpo_hf/training/{rank}", 1)
        store.add(f"grpo_hf/beat/{rank}", 1)
    return store


def test_a_silent_training_peer_is_named_after_the_bound_not_before():
    store, watch = three_processes(), PeerWatch(0, 3, bound=120, where=WHERE)
    for now in range(0, 121, 10):  # process 2 beats, process 1 is silent from t=0
        store.add("grpo_hf/beat/2", 1)
        assert watch.check(store, float(now)) == "", now
    store.add("grpo_hf/beat/2", 1)
    problem = watch.check(store, 130.0)
    assert problem.startswith("process 1 on node 1 (gpu-1), pid 101: no heartbeat for 130 s (fault_timeout=120 s)")
    assert "process 2" not in problem


def test_a_beat_restarts_the_count_and_a_peer_that_left_train_is_never_dead():
    store, watch = three_processes(), PeerWatch(0, 3, bound=120, where=WHERE)
    assert watch.check(store, 0.0) == ""
    store.add("grpo_hf/beat/1", 1)  # process 1 beat once, late
    store.add("grpo_hf/beat/2", 1)
    assert watch.check(store, 100.0) == ""
    store.add("grpo_hf/training/2", -1)  # process 2 ended train cleanly, and then exits: no more beats
    assert watch.check(store, 215.0) == ""  # process 1: 115 s since its beat was seen
    problem = watch.check(store, 1000.0)
    assert "process 1 on node 1" in problem and "process 2" not in problem


def test_a_peer_that_has_not_started_is_not_judged():
    store, watch = three_processes(), PeerWatch(0, 3, bound=120, where=WHERE)
    store.values.pop("grpo_hf/training/1"), store.values.pop("grpo_hf/beat/1")  # process 1 not started yet
    store.add("grpo_hf/beat/2", 1)
    assert watch.check(store, 0.0) == ""
    problem = watch.check(store, 500.0)
    assert problem.startswith("process 2 on node 2") and "process 1" not in problem


def test_a_store_that_stops_answering_is_the_main_node_gone():
    store, watch = three_processes(), PeerWatch(1, 3, bound=120, where=WHERE)
    assert watch.check(store, 0.0) == ""
    store.down = True
    assert watch.check(store, 10.0) == "" and watch.check(store, 130.0) == ""  # 120 s since it first failed
    problem = watch.check(store, 131.0)
    assert problem.startswith(f"{WHERE} has not answered for 121 s (RuntimeError): the main node is gone")
    store.down = False  # it answers again: the count starts over
    assert watch.check(store, 140.0) == ""


def test_the_heartbeat_thread_watches_only_inside_watching_and_ends_the_process(monkeypatch):
    """Heartbeat's thread (with a fake store, a 0.01 s period and a 0.05 s bound): outside `watching` a silent peer
    ends nothing; inside it the process ends through end_this_process with the line naming the peer; after the block
    this process's training count is back to 0, so the others do not judge it."""
    store = three_processes()
    ended = threading.Event()
    problems: list[str] = []

    def end(problem):
        problems.append(problem)
        ended.set()

    monkeypatch.setattr(parallel.Heartbeat, "_connect", lambda self: store)
    monkeypatch.setattr(parallel, "end_this_process", end)
    store.values["grpo_hf/training/0"] = b"0"
    heartbeat = parallel.Heartbeat(0, 3, "10.0.0.1", 29500, period=0.01)
    time.sleep(0.3)
    assert not problems  # peers 1 and 2 silent, but nobody watches
    with heartbeat.watching(0.05):
        assert store.values["grpo_hf/training/0"] == b"1"
        assert ended.wait(10)
    heartbeat.close()
    assert store.values["grpo_hf/training/0"] == b"0"
    assert problems[0].startswith("process 1 on node 1 (gpu-1), pid 101; process 2 on node 2 (gpu-2), pid 102: ")
    assert int(store.values["grpo_hf/beat/0"]) > 1  # it beat all along


def test_fault_timeout_is_checked():
    from grpo_hf import GRPOConfig

    for value in (0, 5):
        with pytest.raises(ValueError, match=f"fault_timeout={value} must be >= 10 seconds"):
            GRPOConfig(output_dir="/tmp/x", use_cpu=True, fault_timeout=value)
    assert GRPOConfig(output_dir="/tmp/x", use_cpu=True, fault_timeout=None).fault_timeout is None


def test_a_failing_watchdog_keeps_beating(monkeypatch, caplog):
    """An error inside the watch is logged and the beats go on: a thread that died would look dead to the others."""
    store = three_processes()
    monkeypatch.setattr(parallel.Heartbeat, "_connect", lambda self: store)
    monkeypatch.setattr(PeerWatch, "check", lambda self, store, now: 1 / 0)
    heartbeat = parallel.Heartbeat(0, 3, "10.0.0.1", 29500, period=0.01)
    with caplog.at_level("WARNING", logger="grpo_hf"), heartbeat.watching(10):
        time.sleep(0.2)
        before = int(store.values["grpo_hf/beat/0"])
        time.sleep(0.2)
        assert int(store.values["grpo_hf/beat/0"]) > before
    heartbeat.close()
    assert "The heartbeat's watchdog failed (ZeroDivisionError" in caplog.text
