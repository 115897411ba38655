"""Asynchronous GRPO (`max_staleness`, `grpo_hf.producer`, docs/async.md): exact at staleness 0, bounded staleness
above it, the decoupled-PPO correction, and the producer's faults."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from conftest import TRAINING, make_trainer, tiny_run_args, torchrun, train_logs

from grpo_hf import AsyncGRPOTrainer
from grpo_hf import producer as producer_module

# Keys whose values depend on the wall clock or exist only with a producer.
_CLOCK = ("train_runtime", "train_samples_per_second", "train_steps_per_second", "async/")


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
    produced = run(tmp_path, "async", trainer_cls=AsyncGRPOTrainer)
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
    warnings = {r.getMessage() for r in caplog.records if "has waited" in r.getMessage()}
    assert any("running 'stuck' on generation batch 0" in warning for warning in warnings), warnings


@pytest.mark.parametrize(
    "overrides, words",
    [
        (dict(max_staleness=-1), "must be an int >= 0"),
        (dict(use_vllm=True, vllm_mode="colocate"), "vLLM in colocate mode shares this process.*vllm_mode='server'"),
    ],
)
def test_what_the_producer_cannot_run_with_is_refused(tmp_path, overrides, words):
    with pytest.raises(ValueError, match=words):
        args = tiny_run_args(tmp_path, preset={**TRAINING, "max_staleness": 1, **overrides})
        make_trainer(args)


def half_flat(prompts, completion_ids, **kwargs):
    """The same reward for every completion of an even question (a group without signal, which dynamic sampling
    drops and refills), a varied one for the others."""
    numbers = [int(prompt.split()[1].rstrip(":")) for prompt in prompts]
    return [1.0 if n % 2 == 0 else float(sum(ids) % 7) for n, ids in zip(numbers, completion_ids, strict=True)]


DYNAMIC = dict(dynamic_sampling=True, dynamic_sampling_max_rounds=3, max_steps=4)


@pytest.mark.parametrize("per_step", [{}, dict(gradient_accumulation_steps=2, steps_per_generation=1)])
def test_dynamic_sampling_through_the_producer_at_staleness_0_is_the_synchronous_run(tmp_path, per_step):
    """Refill rounds run on the main thread while the producer waits; at staleness 0 they draw from torch's generator
    in the synchronous run's order: the same parameters and logs. Also when one optimizer step spans two generation
    batches: batch k + 1's first round is drawn after batch k's refills, as the synchronous run draws it."""
    synchronous = run(tmp_path, "sync", reward=half_flat, **DYNAMIC, **per_step)
    produced = run(tmp_path, "async", trainer_cls=AsyncGRPOTrainer, reward=half_flat, **DYNAMIC, **per_step)
    for (name, a), (_, b) in zip(synchronous.model.named_parameters(), produced.model.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    assert comparable(train_logs(produced)) == comparable(train_logs(synchronous))
    assert sum(row["dynamic_sampling/extra_rounds"] for row in train_logs(produced)) >= 2


def test_dynamic_sampling_refills_above_staleness_0_whatever_the_threads_timing(tmp_path):
    """At max_staleness 1, with a reward of random latency: refills happen (their rows sampled by the policy now, with
    seeds of their own, their rewards never beside the producer's), every batch stays within the bound, and two runs
    are the same run."""
    import random

    clock, running, at_once = random.Random(), [], []

    def jittery(prompts, completion_ids, **kwargs):
        running.append(1)
        at_once.append(len(running))
        time.sleep(clock.uniform(0.0, 0.05))
        running.pop()
        return half_flat(prompts, completion_ids)

    first = run(tmp_path, "first", reward=jittery, max_staleness=1, **DYNAMIC)
    assert max(at_once) == 1  # a refill's rewards never run beside the scorer thread's
    second = run(tmp_path, "second", reward=jittery, max_staleness=1, **DYNAMIC)
    for (name, a), (_, b) in zip(first.model.named_parameters(), second.model.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    logs = train_logs(first)
    assert comparable(train_logs(second)) == comparable(logs)
    assert [row["async/staleness_max"] for row in logs] == [0.0, 1.0, 1.0, 1.0]
    assert sum(row["dynamic_sampling/extra_rounds"] for row in logs) >= 2
    assert all(row["dynamic_sampling/unfilled_groups"] == 0 for row in logs)


def test_two_processes_at_staleness_0_and_1(tmp_path):
    """DDP with 2 processes: the producer at staleness 0 is the synchronous run bit for bit; at 1 it trains, within
    the bound, with dynamic sampling too."""
    out = tmp_path / "async.pt"
    torchrun("async_step.py", out)
    runs = torch.load(out)
    for name, value in runs["sync"]["params"].items():
        assert torch.equal(runs["producer0"]["params"][name], value), name
    assert comparable(runs["producer0"]["logs"]) == comparable(runs["sync"]["logs"])
    stale = runs["stale1"]
    assert max(row["async/staleness_max"] for row in stale["logs"]) <= 1.0
    assert any(not torch.equal(stale["params"][name], value) for name, value in runs["sync"]["params"].items())
    dynamic = runs["dynamic1"]["logs"]  # refills decided from both processes' rewards, sampled on the main threads
    assert max(row["async/staleness_max"] for row in dynamic) <= 1.0
    assert sum(row["dynamic_sampling/extra_rounds"] for row in dynamic) >= 1
    assert all(row["dynamic_sampling/unfilled_groups"] == 0 for row in dynamic)


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
        trainer.__class__ = AsyncGRPOTrainer
    return trainer


@pytest.mark.parametrize("staleness", [0, 1, 2, 4])
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

trainer = checkpointed({out!r}, {staleness})
trainer.add_callback(Die())
trainer.train()
"""


@pytest.mark.parametrize("staleness", [0, 1, 2, 4])
def test_kill_9_then_resume_is_the_unbroken_run(tmp_path, staleness):
    """SIGKILL right after checkpoint 2 while the producer samples ahead; resume=True repeats the unbroken run. The
    checkpoint keeps the weights of every version a batch not yet trained on was admitted at (at 2, batch 2 is
    sampled by version 0 though the producer may have loaded version 1 for batch 3 already)."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "run"
    script = KILLED_AT_2.format(tests=str(Path(__file__).parent), out=str(out), staleness=staleness)
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]
    resumed = checkpointed(out, staleness)
    resumed.train(resume_from_checkpoint=True)
    unbroken = checkpointed(tmp_path / "unbroken", staleness)
    unbroken.train()
    after = lambda trainer: [row for row in comparable(train_logs(trainer)) if row["step"] > 2]  # noqa: E731
    assert after(resumed) == after(unbroken) and len(after(unbroken)) == 2
    for (name, a), (_, b) in zip(resumed.model.named_parameters(), unbroken.model.named_parameters(), strict=True):
        assert torch.equal(a, b), name


# ---- the decoupled correction against its formula ------------------------------------------------------------------
def test_the_loss_of_a_stale_batch_is_decoupled_ppo_in_a_naive_fp64_loop(tmp_path, monkeypatch):
    """Every micro-batch of a run at max_staleness 1: the trainer's loss against a loop over rows and tokens, in fp64,
    of  L = -1/N sum_i 1/|o_i| sum_t w_it min(r_it A_i, clip(r_it, 1 - eps, 1 + eps) A_i),  r = pi_theta / pi_prox,
    w = min(pi_prox / pi_behav, clip_max) (token_truncate); a fresh batch (staleness 0) has no w."""
    import math

    from grpo_hf.objective import Objective

    seen, original = [], Objective.__call__

    def recording(self, logps, batch, *args, **kwargs):
        loss, metrics = original(self, logps, batch, *args, **kwargs)
        seen.append((logps.detach().double(), batch, loss.item()))
        return loss, metrics

    monkeypatch.setattr(Objective, "__call__", recording)
    overrides = dict(
        max_staleness=1,
        loss_type="grpo",
        beta=0.0,
        vllm_importance_sampling_mode="token_truncate",
        vllm_importance_sampling_clip_max=1.05,
        learning_rate=5e-2,
        max_steps=4,
    )
    run(tmp_path, "naive", **overrides)
    eps, stale = 0.2, 0
    for logps, batch, loss in seen:
        prox = logps if batch.old_logps is None else batch.old_logps.double()
        behaviour = None if batch.sampling_logps is None else batch.sampling_logps.double()
        stale += behaviour is not None
        total = 0.0
        for i in range(logps.size(0)):
            A, row, tokens = float(batch.advantages[i]), 0.0, int(batch.completion_mask[i].sum())
            for t in range(logps.size(1)):
                if not batch.completion_mask[i, t]:
                    continue
                r = math.exp(logps[i, t] - prox[i, t])
                w = 1.0 if behaviour is None else min(math.exp(prox[i, t] - behaviour[i, t]), 1.05)
                row += w * min(r * A, min(max(r, 1 - eps), 1 + eps) * A)
            total += row / tokens if tokens else 0.0
        assert loss == pytest.approx(-total / logps.size(0), rel=1e-5, abs=1e-7)
    assert stale == 3  # batches 1, 2, 3 (batch 0 is sampled by the starting weights: staleness 0)
    assert any(batch.sampling_logps is not None and (batch.sampling_logps.exp() > 0).any() for _, batch, _ in seen)


# ---- what trains at max_staleness 1 --------------------------------------------------------------------------------
def test_lora_at_staleness_0_is_the_synchronous_run_and_trains_at_1(tmp_path):
    """The producer's copy of a LoRA policy decodes through its own merged copies of the adapted layers."""
    from peft import LoraConfig

    def lora_run(name, trainer_cls=None, **overrides):
        settings = {**TRAINING, "max_steps": 3, "rollout_engine": "loop", **overrides}
        config = LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        trainer = make_trainer(tiny_run_args(tmp_path / name, settings), trainer_cls=trainer_cls, peft_config=config)
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
        trainer.train()
        return trainer, before

    synchronous, _ = lora_run("sync")
    produced, _ = lora_run("producer", trainer_cls=AsyncGRPOTrainer)
    for (name, a), (_, b) in zip(synchronous.model.named_parameters(), produced.model.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    stale, before = lora_run("stale", max_staleness=1)
    trained = {n for n, p in stale.model.named_parameters() if n in before and not torch.equal(p, before[n])}
    assert trained and all("lora_" in n for n in trained)
    assert max(row["async/staleness_max"] for row in train_logs(stale)) == 1.0


class Counter:
    """An environment whose tool counts its calls (stateful: one instance per episode, reset between)."""

    def reset(self, **row):
        self.count = 0

    def bump(self, by: int) -> str:
        """Add to the counter.

        Args:
            by: How much to add.
        """
        self.count += by
        return str(self.count)


@pytest.mark.parametrize("kind", ["tools", "environments"])
def test_tool_episodes_train_at_staleness_1(tmp_path, kind):
    """Scripted turns that call a tool, then answer: the tools run in the producer's episodes (the rewards in the
    scorer thread with plain tools; with environments the producer scores, the next batch reusing the instances)."""
    import test_tools as tt

    class RecordingScript(tt.ScriptedEngine):
        can_record_logps = True

        def sample(self, model, prompt_ids, prompt_mask):
            ids = super().sample(model, prompt_ids, prompt_mask)
            self.sampling_logps = torch.full(ids.shape, -1.0)  # the script's own odds of its tokens, say
            return ids

    tt.register_engine("scripted_logps", RecordingScript)
    tokenizer = tt.tool_tokenizer()
    name = "add" if kind == "tools" else "bump"
    arguments = {"a": 1, "b": 2} if kind == "tools" else {"by": 2}
    tt.scripted(
        lambda context, row: "Answer: 3<|im_end|>" if "<tool_response>" in context else tt.call(name, **arguments),
        tokenizer,
    )  # noqa: E501
    seen = []

    def reward(completions, **kwargs):
        seen.append([c[-1]["content"] for c in completions])
        if kind == "environments":
            seen.append([env.count for env in kwargs["environments"]])
        return [float(i % 2) for i in range(len(completions))]

    config = tt.args_for(tmp_path, rollout_engine="scripted_logps", max_staleness=1, max_steps=3, learning_rate=1e-2)
    extra = {"tools": [tt.add]} if kind == "tools" else {"environment_factory": Counter}
    trainer = tt.trainer_for(tmp_path, tokenizer, reward_funcs=reward, args=config, **extra)
    trainer.train()
    assert trainer.async_rollouts is None and trainer.state.global_step == 3
    assert all(row["tools/call_frequency"] == 1.0 for row in train_logs(trainer))
    assert max(row["async/staleness_max"] for row in train_logs(trainer)) == 1.0
    if kind == "environments":
        assert all(counts == [2] * len(counts) for counts in seen[1::2])  # each episode's own, reset instance


def test_vision_rows_train_at_staleness_1(tmp_path):
    import test_vision as tv

    trainer = tv.trainer_for(
        tmp_path, tv.dataset("parts"), family="qwen2_vl", max_staleness=1, max_steps=3, learning_rate=1e-2,
        rollout_engine="loop",
    )  # fmt: skip
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.train()
    assert any(not torch.equal(p, before[name]) for name, p in trainer.model.named_parameters())
    assert max(row["async/staleness_max"] for row in train_logs(trainer)) == 1.0


def test_evaluation_pauses_the_producer(tmp_path, monkeypatch):
    """An evaluation during a run at max_staleness 1 samples with the run's own sampler while no producer batch is
    under way, then training goes on."""
    from grpo_hf.rollout.sampler import Sampler

    original, events = Sampler.sample, []

    def sample(self, prompts, columns):
        thread = threading.current_thread().name
        events.append(("start", thread))
        try:
            return original(self, prompts, columns)
        finally:
            events.append(("end", thread))

    monkeypatch.setattr(Sampler, "sample", sample)
    from conftest import make_dataset

    settings = {**TRAINING, "max_steps": 4, "rollout_engine": "loop", "max_staleness": 1}
    args = tiny_run_args(tmp_path, settings, eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=4)
    trainer = make_trainer(args, eval_dataset=make_dataset(2))
    trainer.train()
    assert trainer.state.global_step == 4 and any("eval_loss" in row for row in trainer.state.log_history)
    in_flight = set()
    for kind, thread in events:  # no evaluation sampling while a producer batch is being sampled, and the reverse
        if kind == "start":
            assert not in_flight, (thread, in_flight)
            in_flight.add(thread)
        else:
            in_flight.discard(thread)
    assert {"MainThread", "grpo_hf-producer"} <= {thread for _, thread in events}


def test_the_producers_copy_samples_its_own_weights_when_the_policy_forward_is_patched(tokenizer):
    """TRL's SFTTrainer patches `model.forward` with a closure over the forward it replaced, bound to the model: a
    deep copy would run the policy's weights. The producer's copy drops that patch and runs its own."""
    from conftest import build_tiny_model
    from trl.trainer.utils import add_fused_lm_head

    model = build_tiny_model(tokenizer)
    add_fused_lm_head(model)  # what a warm start with TRL's SFTTrainer leaves on the policy
    snapshot = producer_module.WeightSnapshot(model, version=0)
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        model.lm_head.weight.zero_()  # the policy moves on; the copy holds version 0
        assert torch.all(model(ids).logits == 0) and torch.any(snapshot.model(ids).logits != 0)
