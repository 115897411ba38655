"""Asynchronous GRPO (`max_staleness`, `grpo_hf.producer`, docs/async.md): exact at staleness 0, bounded staleness
above it, the decoupled-PPO correction, and the producer's faults."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from conftest import TRAINING, make_trainer, tiny_run_args, train_logs

from grpo_hf import GRPOTrainer
from grpo_hf import producer as producer_module

# Keys whose values depend on the wall clock or exist only with a producer.
_CLOCK = ("train_runtime", "train_samples_per_second", "train_steps_per_second", "async/")


class ProducingGRPOTrainer(GRPOTrainer):
    """The producer thread at max_staleness 0 (as `AsyncGRPOTrainer` runs it), taking turns with the trainer."""

    _produce_always = True


def run(tmp_path, name, trainer_cls=None, reward=None, **overrides):
    settings = {**TRAINING, "max_steps": 4, "rollout_engine": "loop", **overrides}
    args = tiny_run_args(tmp_path / name, preset=settings)
    kwargs = {} if reward is None else {"reward": reward}
    trainer = make_trainer(args, trainer_cls=trainer_cls, **kwargs)
    trainer.train()
    return trainer


def comparable(logs):
    return [{k: v for k, v in row.items() if not any(k.startswith(c) for c in _CLOCK)} for row in logs]


def test_the_producer_at_staleness_0_is_the_synchronous_run_bit_for_bit(tmp_path):
    synchronous = run(tmp_path, "sync")
    produced = run(tmp_path, "async", trainer_cls=ProducingGRPOTrainer)
    for (name, a), (_, b) in zip(synchronous.model.named_parameters(), produced.model.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    assert comparable(train_logs(produced)) == comparable(train_logs(synchronous))
    assert all(row["async/staleness_max"] == 0.0 for row in train_logs(produced))
    assert produced.async_rollouts is None  # stopped with training


def test_staleness_is_bounded_with_a_slow_trainer(tmp_path, monkeypatch):
    """A fast producer and a trainer whose steps take long: the producer runs ahead, but never more than
    max_staleness optimizer steps."""
    from grpo_hf.trainer import GRPOTrainer as Trainer

    original = Trainer.training_step

    def slow_step(self, *args, **kwargs):
        time.sleep(0.2)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "training_step", slow_step)
    trainer = run(tmp_path, "slow_trainer", max_staleness=2, max_steps=6)
    stalenesses = [row["async/staleness_max"] for row in train_logs(trainer)]
    assert max(stalenesses) == 2.0 and all(0 <= s <= 2 for s in stalenesses)


def test_staleness_is_bounded_with_a_slow_producer(tmp_path):
    """A slow reward: the trainer waits for the producer, and the batches come fresh."""

    def slow_reward(completion_ids, **kwargs):
        time.sleep(0.2)
        return [float(sum(ids) % 7) for ids in completion_ids]

    trainer = run(tmp_path, "slow_producer", reward=slow_reward, max_staleness=1)
    logs = train_logs(trainer)
    assert all(row["async/staleness_max"] <= 1.0 for row in logs)
    assert sum(row["async/trainer_wait_fraction"] for row in logs[1:]) > 0


def test_the_rewards_of_one_batch_run_while_the_next_is_sampled(tmp_path, monkeypatch):
    """A reward that waits until the producer has begun sampling the next batch: it does not wait in vain."""
    from grpo_hf.rollout.sampler import Sampler

    original, sampling = Sampler.sample, []
    second_batch_sampling = threading.Event()

    def sample(self, prompts, columns):
        sampling.append(1)
        if len(sampling) == 2:
            second_batch_sampling.set()
        return original(self, prompts, columns)

    monkeypatch.setattr(Sampler, "sample", sample)
    overlapped = []

    def reward(completion_ids, **kwargs):
        if not overlapped:
            overlapped.append(second_batch_sampling.wait(timeout=10))
        return [float(sum(ids) % 7) for ids in completion_ids]

    run(tmp_path, "pipelined", reward=reward, max_staleness=1, max_steps=2)
    assert overlapped == [True]


def test_a_failing_producer_stops_training_with_its_error(tmp_path, monkeypatch):
    """What the producer's sampling raises stops training on the main thread, and the thread is gone."""
    from grpo_hf.rollout.sampler import Sampler

    original, calls = Sampler.sample, []

    def failing(self, prompts, columns):
        calls.append(threading.current_thread().name)
        if len(calls) == 2:
            raise KeyError("the engine's own error")
        return original(self, prompts, columns)

    monkeypatch.setattr(Sampler, "sample", failing)
    with pytest.raises(RuntimeError, match="failed on generation batch 1") as raised:
        run(tmp_path, "fails", max_staleness=1)
    assert isinstance(raised.value.__cause__, KeyError)
    assert set(calls) == {"grpo_hf-producer"}
    assert not [t for t in threading.enumerate() if t.name == "grpo_hf-producer" and t.is_alive()]


def test_a_failing_reward_in_the_producer_is_reported_as_in_the_synchronous_run(tmp_path):
    def reward(completion_ids, **kwargs):
        raise KeyError("the reward's own error")

    with pytest.raises(RuntimeError, match="Reward function 'reward' raised KeyError"):
        run(tmp_path, "reward_fails", reward=reward, max_staleness=1)


def test_a_stalled_producer_is_named_in_a_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(producer_module, "STALL_WARNING_SECONDS", 0.2)
    release = threading.Event()

    def stuck(completion_ids, **kwargs):
        release.wait(timeout=1.0)
        return [float(sum(ids) % 7) for ids in completion_ids]

    with caplog.at_level("WARNING", logger="grpo_hf.producer"):
        run(tmp_path, "stalls", reward=stuck, max_staleness=1, max_steps=1)
    (warning,) = {r.getMessage() for r in caplog.records if "has waited" in r.getMessage()} or {None}
    assert warning is not None and "scoring generation batch 0" in warning


@pytest.mark.parametrize(
    "overrides, words",
    [
        (dict(dynamic_sampling=True), "dynamic_sampling"),
        (dict(max_staleness=-1), "must be an int >= 0"),
    ],
)
def test_what_the_producer_cannot_run_with_is_refused(tmp_path, overrides, words):
    with pytest.raises(ValueError, match=words):
        args = tiny_run_args(tmp_path, preset={**TRAINING, "max_staleness": 1, **overrides})
        make_trainer(args)


def test_two_processes_at_staleness_0_and_1(tmp_path):
    """DDP with 2 processes: the producer at staleness 0 is the synchronous run bit for bit; at 1 it trains, within
    the bound."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "async.pt"
    script = Path(__file__).parent / "distributed" / "async_step.py"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run([*command, str(out)], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    runs = torch.load(out)
    for name, value in runs["sync"]["params"].items():
        assert torch.equal(runs["producer0"]["params"][name], value), name
    assert comparable(runs["producer0"]["logs"]) == comparable(runs["sync"]["logs"])
    stale = runs["stale1"]
    assert max(row["async/staleness_max"] for row in stale["logs"]) <= 1.0
    assert any(not torch.equal(stale["params"][name], value) for name, value in runs["sync"]["params"].items())


# ---- one run per seed, and resume ----------------------------------------------------------------------------------
def test_a_seed_gives_one_run_whatever_the_threads_timing(tmp_path):
    """At max_staleness 2, a reward whose latency is random on each call: which batch the producer is on when the
    trainer steps differs from run to run, the run does not."""
    import random

    clock = random.Random()

    def jittery(completion_ids, **kwargs):
        time.sleep(clock.uniform(0.0, 0.05))
        return [float(sum(ids) % 7) for ids in completion_ids]

    first = run(tmp_path, "first", reward=jittery, max_staleness=2, max_steps=5)
    second = run(tmp_path, "second", reward=jittery, max_staleness=2, max_steps=5)
    for (name, a), (_, b) in zip(first.model.named_parameters(), second.model.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    assert comparable(train_logs(first)) == comparable(train_logs(second))
    assert [row["async/staleness_max"] for row in train_logs(first)] == [0.0, 1.0, 2.0, 2.0, 2.0]


def checkpointed(output_dir, staleness: int):
    from test_resume import CHECKPOINTED, checkpointed_trainer  # noqa: F401  (the resume tests' run)

    trainer = checkpointed_trainer(output_dir, max_staleness=staleness, rollout_engine="loop")
    if staleness == 0:
        trainer.__class__ = ProducingGRPOTrainer
    return trainer


@pytest.mark.parametrize("staleness", [0, 1])
def test_a_resumed_run_repeats_the_unbroken_run_exactly(tmp_path, staleness):
    """Stopped right after checkpoint 2 (what a kill -9 then leaves on disk) and resumed: the same logs and weights
    as the run never stopped, the producer's weights for the batches sampled ahead kept in the checkpoint."""
    import shutil

    unbroken = checkpointed(tmp_path / "unbroken", staleness)
    unbroken.train()
    run_dir = tmp_path / "killed"
    shutil.copytree(tmp_path / "unbroken" / "checkpoint-2", run_dir / "checkpoint-2")
    resumed = checkpointed(run_dir, staleness)
    resumed.train(resume_from_checkpoint=True)
    after = lambda trainer: [row for row in comparable(train_logs(trainer)) if row["step"] > 2]  # noqa: E731
    assert after(resumed) == after(unbroken)
    for (name, a), (_, b) in zip(resumed.model.named_parameters(), unbroken.model.named_parameters(), strict=True):
        assert torch.equal(a, b), name


KILLED_AT_2 = """
import os, signal, sys
sys.path[:0] = [{tests!r}]
from test_async import checkpointed
from transformers import TrainerCallback

class Die(TrainerCallback):
    def on_save(self, args, state, control, **kwargs):
        if state.global_step == 2:
            os.kill(os.getpid(), signal.SIGKILL)

trainer = checkpointed({out!r}, 1)
trainer.add_callback(Die())
trainer.train()
"""


def test_kill_9_at_staleness_1_then_resume_is_the_unbroken_run(tmp_path):
    """SIGKILL right after checkpoint 2 while the producer samples ahead; resume=True repeats the unbroken run."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "run"
    script = KILLED_AT_2.format(tests=str(Path(__file__).parent), out=str(out))
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]
    resumed = checkpointed(out, 1)
    resumed.train(resume_from_checkpoint=True)
    unbroken = checkpointed(tmp_path / "unbroken", 1)
    unbroken.train()
    after = lambda trainer: [row for row in comparable(train_logs(trainer)) if row["step"] > 2]  # noqa: E731
    assert after(resumed) == after(unbroken) and len(after(unbroken)) == 2
    for (name, a), (_, b) in zip(resumed.model.named_parameters(), unbroken.model.named_parameters(), strict=True):
        assert torch.equal(a, b), name
