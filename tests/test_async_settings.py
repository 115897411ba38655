"""Asynchronous GRPO under the settings users bring (`grpo_hf.producer`, docs/async.md): epochs whose micro-steps are
not a multiple of the accumulation steps, every GA x steps_per_generation x num_iterations, streams; threads that end
with `train()`; rewards that see the step their batch trains at; the weights a producer stages and keeps."""

from __future__ import annotations

import itertools
import threading
import time

import pytest
import torch
from conftest import (
    TRAINING,
    build_tiny_model,
    build_tiny_tokenizer,
    make_dataset,
    make_trainer,
    tiny_run_args,
    train_logs,
)
from test_async import comparable

from grpo_hf import AsyncGRPOTrainer
from grpo_hf import producer as producer_module

GRID = dict(rollout_engine="loop", max_steps=5, max_completion_length=2, logging_steps=1)


def grpo_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name.startswith("grpo_hf")]


def train(tmp_path, name, dataset=None, reward=None, trainer_cls=None, **overrides):
    args = tiny_run_args(tmp_path / name, preset={**TRAINING, **GRID, **overrides})
    kwargs = {} if reward is None else {"reward": reward}
    trainer = make_trainer(args, dataset=dataset, trainer_cls=trainer_cls, tokenizer=TOKENIZER, **kwargs)
    trainer.train()
    return trainer


TOKENIZER = build_tiny_tokenizer()


@pytest.fixture
def tiny_model():
    return build_tiny_model(TOKENIZER)


def _grid() -> list[tuple[int, int, int, int, int]]:
    """GA x steps_per_generation x num_iterations x prompts (3 and 5: no epoch a multiple of the batch) x
    max_staleness 0..3, a quarter of the product chosen so that every pair of two settings meets."""
    product = itertools.product([1, 2, 3], [1, 2, 3], [1, 2], [3, 5], [0, 1, 2, 3])
    return [settings for settings in product if sum(settings) % 4 == 0]


@pytest.mark.parametrize("accumulation, per_generation, iterations, prompts, staleness", _grid())
def test_every_setting_trains_to_the_end_within_the_bound(
    tmp_path, accumulation, per_generation, iterations, prompts, staleness
):
    """Epochs of 3 or 5 one-prompt generation batches: the epoch's last optimizer step is shorter than GA whenever
    its micro-steps are not a multiple of it. Every run reaches max_steps, no batch is staler than max_staleness,
    and no thread of the producer outlives `train()`; at 0 (`AsyncGRPOTrainer`) it is the synchronous run."""
    settings = dict(
        gradient_accumulation_steps=accumulation, steps_per_generation=per_generation, num_iterations=iterations
    )
    cls = AsyncGRPOTrainer if staleness == 0 else None
    trainer = train(tmp_path, "async", make_dataset(prompts), trainer_cls=cls, max_staleness=staleness, **settings)
    assert not grpo_threads()
    logs = train_logs(trainer)
    assert trainer.state.global_step == GRID["max_steps"]
    stalenesses = [row["async/staleness_max"] for row in logs if "async/staleness_max" in row]
    assert stalenesses and max(stalenesses) <= staleness
    if staleness == 0:
        synchronous = train(tmp_path, "sync", make_dataset(prompts), **settings)
        for (name, a), (_, b) in zip(
            trainer.model.named_parameters(), synchronous.model.named_parameters(), strict=True
        ):
            assert torch.equal(a, b), name
        assert comparable(logs) == comparable(train_logs(synchronous))


@pytest.mark.parametrize("staleness", [1, 2])
def test_a_stream_with_accumulation_trains_to_max_steps(tmp_path, staleness):
    stream = make_dataset(5).to_iterable_dataset()
    trainer = train(tmp_path, "stream", stream, max_staleness=staleness, gradient_accumulation_steps=2, max_steps=4)
    assert trainer.state.global_step == 4 and not grpo_threads()
    assert max(row["async/staleness_max"] for row in train_logs(trainer)) <= staleness


# ---- what the reward functions see ---------------------------------------------------------------------------------
def step_recording_reward(seen: list, jitter: bool = False):
    import random

    clock = random.Random()

    def reward(completion_ids, trainer_state, **kwargs):
        seen.append(trainer_state.global_step)
        if jitter:
            time.sleep(clock.uniform(0.0, 0.05))
        return [float(sum(ids) % 7) + trainer_state.global_step for ids in completion_ids]  # scheduled by the step

    return reward


@pytest.mark.parametrize("staleness", [1, 2])
def test_rewards_see_the_step_their_batch_trains_at_whatever_the_timing(tmp_path, staleness):
    """A step-scheduled reward: the steps it sees are the synchronous run's, so a seed gives one run at every
    staleness whatever the threads' timing (the live state's step is anywhere in [step - s, step] while the
    producer scores ahead)."""
    synchronous, first, second = [], [], []
    train(tmp_path, "sync", reward=step_recording_reward(synchronous))
    a = train(tmp_path, "a", reward=step_recording_reward(first, jitter=True), max_staleness=staleness)
    b = train(tmp_path, "b", reward=step_recording_reward(second, jitter=True), max_staleness=staleness)
    assert first == second == synchronous == [0, 1, 2, 3, 4]
    for (name, x), (_, y) in zip(a.model.named_parameters(), b.model.named_parameters(), strict=True):
        assert torch.equal(x, y), name


def test_the_state_a_reward_sees_is_a_copy(tmp_path):
    states = []

    def reward(completion_ids, trainer_state, **kwargs):
        states.append(trainer_state)
        return [float(sum(ids) % 7) for ids in completion_ids]

    trainer = train(tmp_path, "copy", reward=reward, max_staleness=1, max_steps=3)
    assert [state.global_step for state in states] == [0, 1, 2]
    assert all(state is not trainer.state and state.max_steps == 3 for state in states)


# ---- the producer's threads end with train() ----------------------------------------------------------------------
def test_nothing_is_sampled_beyond_max_steps_and_no_thread_is_left(tmp_path):
    """The producer samples ahead by max_staleness, but never a batch the run will not train on: the reward runs
    exactly once per trained batch, no thread is alive when `train()` returns, and a seed set afterwards holds."""
    seen = []
    train(tmp_path, "end", reward=step_recording_reward(seen, jitter=True), max_staleness=3, max_steps=3)
    assert seen == [0, 1, 2] and not grpo_threads()
    torch.manual_seed(1234)
    time.sleep(0.3)  # a producer thread left sampling would restore (or draw from) the generator meanwhile
    drawn = torch.rand(4)
    torch.manual_seed(1234)
    assert torch.equal(drawn, torch.rand(4))


class _Boom(Exception):
    pass


def test_an_exception_in_training_stops_the_threads_before_train_returns(tmp_path):
    """The trainer fails at step 2 while the scorer runs a slow reward: `train()` raises once the reward call in
    flight has returned, and no thread of the producer is left."""
    from transformers import TrainerCallback

    calls = {"started": 0, "finished": 0}

    def slow(completion_ids, **kwargs):
        calls["started"] += 1
        time.sleep(0.5)
        calls["finished"] += 1
        return [float(sum(ids) % 7) for ids in completion_ids]

    class FailAt2(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                raise _Boom

    args = tiny_run_args(tmp_path / "boom", preset={**TRAINING, **GRID, "max_staleness": 2})
    trainer = make_trainer(args, reward=slow, tokenizer=TOKENIZER, callbacks=[FailAt2()])
    with pytest.raises(_Boom):
        trainer.train()
    assert not grpo_threads() and calls["started"] == calls["finished"]
    assert trainer.async_rollouts is None


def test_a_reward_that_never_returns_is_named_and_left_to_a_daemon(tmp_path, monkeypatch, caplog):
    from transformers import TrainerCallback

    monkeypatch.setattr(producer_module, "CLOSE_WAIT_SECONDS", 0.2)
    release, hanging = threading.Event(), threading.Event()

    def hangs_on_the_second_batch(completion_ids, trainer_state, **kwargs):
        if trainer_state.global_step >= 1:
            hanging.set()
            release.wait(timeout=30)
        return [float(sum(ids) % 7) for ids in completion_ids]

    class FailAt1(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            hanging.wait(timeout=30)  # the scorer is in the call when training fails
            raise _Boom

    args = tiny_run_args(tmp_path / "hang", preset={**TRAINING, **GRID, "max_staleness": 1})
    trainer = make_trainer(args, reward=hangs_on_the_second_batch, tokenizer=TOKENIZER, callbacks=[FailAt1()])
    try:
        with caplog.at_level("WARNING", logger="grpo_hf.producer"), pytest.raises(_Boom):
            trainer.train()
        left = grpo_threads()
        assert left and all(thread.daemon for thread in left)  # interpreter exit does not wait for them
        (warning,) = [r.getMessage() for r in caplog.records if "still" in r.getMessage()]
        assert "'hangs_on_the_second_batch'" in warning and "reward_timeout" in warning
    finally:
        release.set()
        for thread in grpo_threads():
            thread.join(timeout=10)


# ---- what is submitted, staged and kept ----------------------------------------------------------------------------
def test_each_generation_batch_is_submitted_once(tmp_path, monkeypatch):
    """A slow sampler: the trainer reads ahead while a batch is being sampled; it must not submit that batch again
    (a duplicate would hold a batch of rows until the run ends)."""
    from grpo_hf.rollout.sampler import Sampler

    submitted, original_submit, original_sample = [], producer_module.Producer.submit, Sampler.sample

    def submit(self, k, request):
        submitted.append(k)
        return original_submit(self, k, request)

    def slow_sample(self, *args, **kwargs):
        time.sleep(0.1)
        return original_sample(self, *args, **kwargs)

    monkeypatch.setattr(producer_module.Producer, "submit", submit)
    monkeypatch.setattr(Sampler, "sample", slow_sample)
    train(tmp_path, "once", max_staleness=2, max_steps=5)
    assert submitted == [0, 1, 2, 3, 4]


def test_a_lora_policy_stages_its_adapters_only(tmp_path):
    from peft import LoraConfig

    from grpo_hf.producer import WeightSnapshot

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    args = tiny_run_args(tmp_path / "lora", preset={**TRAINING, **GRID})
    policy = make_trainer(args, tokenizer=TOKENIZER, peft_config=lora).model
    snapshot = WeightSnapshot(policy, version=0)
    snapshot.stage(1)
    (staged, _), trainable = snapshot._staged[1], [p for p in policy.parameters() if p.requires_grad]
    assert len(staged) == len(trainable) + len(list(policy.buffers())) and len(trainable) < len(
        list(policy.parameters())
    )
    assert sum(t.numel() for t in staged) == sum(p.numel() for p in trainable) + sum(
        b.numel() for b in policy.buffers()
    )
    with torch.no_grad():
        for param in trainable:
            param.add_(1.0)
    snapshot.stage(2)
    assert snapshot.load(2) == 2
    copy = dict(snapshot.model.named_parameters())
    for name, param in policy.named_parameters():  # the copy holds version 2: adapters moved, base as it was
        assert torch.equal(copy[name], param), name


def test_staged_versions_stay_until_no_waiting_batch_needs_them(tiny_model):
    """Loading a newer version for a later batch must not drop an older one that a batch admitted earlier (and not
    yet trained on) was sampled by: a checkpoint then keeps it, and the resumed run resamples that batch with it."""
    from grpo_hf.producer import WeightSnapshot

    snapshot = WeightSnapshot(tiny_model, version=0)
    for version in (1, 2):
        snapshot.stage(version)
    assert snapshot.load(2) == 2
    assert sorted(snapshot.versions_from(1)) == [1, 2]  # version 1 still staged for the batch admitted at it
    snapshot.release_before(2)
    assert sorted(snapshot.versions_from(1)) == [2]


def test_a_push_for_a_refill_or_an_evaluation_waits_for_every_process(tiny_model):
    """With a vLLM server and several processes, a refill's or an evaluation's push must not land while another
    process's producer is sampling: the processes meet first."""
    from grpo_hf.producer import ServerWeights

    class Accelerator:
        num_processes, meetings = 2, 0

        def wait_for_everyone(self):
            Accelerator.meetings += 1

    weights = ServerWeights(tiny_model, version=0, accelerator=Accelerator())
    with weights.exclusive():
        assert Accelerator.meetings == 1


def test_the_producers_stream_waits_for_the_copy_made_on_the_trainers(tiny_model, monkeypatch):
    """On a GPU the copy is made on the trainer's stream and first read on the producer's: the producer's stream
    waits for an event recorded after the copy (CUDA stood in for by recorders)."""
    from grpo_hf.producer import WeightSnapshot

    waited = []

    class Stream:
        def wait_event(self, event):
            waited.append(event)

    monkeypatch.setattr(producer_module, "_cuda_event", lambda model: "copied")
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: Stream())
    snapshot = WeightSnapshot(tiny_model, version=0)
    with snapshot.sampling(0):
        pass
    assert waited == ["copied"]


# ---- where reward functions run ------------------------------------------------------------------------------------
def signal_reward(completion_ids, **kwargs):
    """Sets a SIGALRM handler, as math-verify's parse and verify do with their default timeouts: main thread only."""
    import signal

    previous = signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.signal(signal.SIGALRM, previous)
    return [float(sum(ids) % 7) for ids in completion_ids]


@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_a_reward_that_uses_signals_is_scored_on_the_main_thread(tmp_path, caplog, policy):
    """It fails in the scorer thread (signal only works in the main thread), whatever reward_error_policy says; the
    producer then hands every batch to the main thread to score: the run is the one a thread-safe twin gives."""
    from conftest import id_sum_reward

    with caplog.at_level("WARNING", logger="grpo_hf.producer"):
        signals = train(tmp_path, "signal", reward=signal_reward, max_staleness=1, reward_error_policy=policy)
    plain = train(tmp_path, "plain", reward=id_sum_reward, max_staleness=1, reward_error_policy=policy)
    for (name, a), (_, b) in zip(signals.model.named_parameters(), plain.model.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    assert [row["reward"] for row in train_logs(signals)] == [row["reward"] for row in train_logs(plain)]
    (warning,) = [r.getMessage() for r in caplog.records if "main thread from now on" in r.getMessage()]
    assert "'signal_reward'" in warning


def test_sharded_reward_models_are_scored_on_the_main_thread(tmp_path, monkeypatch):
    """Under FSDP or ZeRO-3 a reward model's forward gathers its shards: a collective, which must run on the main
    threads of every process in step, never in the scorer thread (stood in for: the trainer told it is sharded)."""
    threads = []

    class RewardModel(torch.nn.Module):  # a reward function with a `.model`, as grpo_hf wraps reward models
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(1))

    class ModelReward:
        __name__ = "model_reward"

        def __init__(self):
            self.model = RewardModel()

        def __call__(self, completion_ids, **kwargs):
            threads.append(threading.current_thread().name)
            return [float(sum(ids) % 7) for ids in completion_ids]

    args = tiny_run_args(tmp_path / "sharded", preset={**TRAINING, **GRID, "max_staleness": 1, "max_steps": 3})
    trainer = make_trainer(args, reward=ModelReward(), tokenizer=TOKENIZER)
    monkeypatch.setattr(producer_module, "is_zero3", lambda accelerator: True)  # as the producer starts
    trainer.train()
    assert threads == ["MainThread"] * 3


def test_a_checkpoint_that_kept_every_tensor_still_resumes(tmp_path):
    """Checkpoints written before only trainable tensors were staged hold every parameter and buffer of a version:
    a LoRA policy resumes from them with the adapters of that version."""
    from peft import LoraConfig

    from grpo_hf.producer import WeightSnapshot

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    args = tiny_run_args(tmp_path / "old", preset={**TRAINING, **GRID})
    policy = make_trainer(args, tokenizer=TOKENIZER, peft_config=lora).model
    every = [t.detach().clone() for t in (*policy.parameters(), *policy.buffers())]
    for tensor, param in zip(every, policy.parameters(), strict=False):  # version 1: the trainable tensors + 1
        if param.requires_grad:
            tensor.add_(1.0)
    snapshot = WeightSnapshot(policy, version=3, saved={1: every})
    assert snapshot.version == 1
    copy = dict(snapshot.model.named_parameters())
    for (name, _), tensor in zip(policy.named_parameters(), every, strict=False):  # every[n_params:]: buffers
        assert torch.equal(copy[name], tensor), name
