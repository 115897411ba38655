"""The lifecycle of a trainer and its producer (`grpo_hf.producer`, docs/async.md): a checkpoint resumed at another
`max_staleness`, a second `train()` on the same trainer, a close cut short by Ctrl-C, and the order of the streams when
a checkpoint reads the producer's copy of the weights."""

from __future__ import annotations

import shutil
import threading

import pytest
import torch
from conftest import TRAINING, build_tiny_model, build_tiny_tokenizer, make_trainer, tiny_run_args, train_logs
from test_async import checkpointed, comparable
from test_resume import checkpointed_trainer

from grpo_hf import AsyncGRPOTrainer
from grpo_hf import producer as producer_module


def grpo_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name.startswith("grpo_hf") and thread.is_alive()]


def checkpoint_2_of(tmp_path, staleness: int):
    """A run dir holding only checkpoint 2 of a 4-step run at `staleness` (what a kill right after it leaves)."""
    unbroken = checkpointed(tmp_path / f"written_at_{staleness}", staleness)
    unbroken.train()
    run_dir = tmp_path / "resumed"
    shutil.copytree(tmp_path / f"written_at_{staleness}" / "checkpoint-2", run_dir / "checkpoint-2")
    return run_dir


# ---- a checkpoint resumed at another max_staleness -----------------------------------------------------------------
@pytest.mark.parametrize("written_at", [3, 1])
def test_a_checkpoint_above_staleness_0_resumed_at_0_is_the_synchronous_resume(tmp_path, written_at):
    """Above 0 a checkpoint keeps the producer's weights of the versions the batches sampled ahead are sampled by (at
    3: versions 0 and 1); resumed by AsyncGRPOTrainer at 0 (every batch sampled by the policy's weights), it trains
    to the end and is, bit for bit, GRPOTrainer's synchronous resume from the same checkpoint (which starts no
    producer, and drops the producer weights the checkpoint kept instead of holding them through its run)."""
    run_dir = checkpoint_2_of(tmp_path, staleness=written_at)
    synchronous_dir = tmp_path / "synchronous"
    shutil.copytree(run_dir, synchronous_dir)
    resumed = checkpointed(run_dir, 0)
    assert isinstance(resumed, AsyncGRPOTrainer)
    resumed.train(resume_from_checkpoint=True)
    synchronous = checkpointed_trainer(synchronous_dir, max_staleness=0, rollout_engine="loop")
    synchronous.train(resume_from_checkpoint=True)
    assert synchronous._saved_producer_weights is None
    assert resumed.state.global_step == 4
    after = lambda trainer: [row for row in comparable(train_logs(trainer)) if row["step"] > 2]  # noqa: E731
    assert len(after(resumed)) == 2 and after(resumed) == after(synchronous)
    assert [row["async/staleness_max"] for row in train_logs(resumed) if row["step"] > 2] == [0.0, 0.0]
    for (name, a), (_, b) in zip(resumed.model.named_parameters(), synchronous.model.named_parameters(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("written_at, resumed_at", [(0, 2), (2, 1), (1, 3)])
def test_a_checkpoint_resumes_at_another_staleness_to_the_end_within_the_new_bound(tmp_path, written_at, resumed_at):
    run_dir = checkpoint_2_of(tmp_path, staleness=written_at)
    resumed = checkpointed(run_dir, resumed_at)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 4
    stalenesses = [row["async/staleness_max"] for row in train_logs(resumed) if row["step"] > 2]
    assert len(stalenesses) == 2 and all(0 <= s <= resumed_at for s in stalenesses)
    assert not grpo_threads()


def test_only_the_versions_a_resumed_run_can_sample_by_are_kept():
    """Batches a run resumed at step 5 has yet to train on are admitted at 5 - s or later."""
    from grpo_hf.producer import needed_versions

    saved = {2: ["v2"], 3: ["v3"], 4: ["v4"]}
    assert needed_versions(saved, 5, 3) == saved  # the staleness it was written at
    assert needed_versions(saved, 5, 1) == {4: ["v4"]}
    assert needed_versions(saved, 5, 0) is None  # the copy starts as the policy's own weights
    assert needed_versions(None, 5, 2) is None


# ---- a second train() on one trainer -------------------------------------------------------------------------------
@pytest.mark.parametrize("trainer_cls, staleness", [(None, 0), (AsyncGRPOTrainer, 0), (None, 1)])
def test_a_second_train_samples_afresh(tmp_path, trainer_cls, staleness):
    """3 steps of generation batches of 2 steps: the first train() ends half-way through a rollout. The second
    starts from none of it: it samples at its first step, as the first did, and makes as many rollouts."""
    settings = dict(max_steps=3, steps_per_generation=2, rollout_engine="loop", max_staleness=staleness)
    trainer = make_trainer(tiny_run_args(tmp_path, preset={**TRAINING, **settings}), trainer_cls=trainer_cls)
    rounds = []
    original = trainer.experience.sample_round

    def sample_round(*args, **kwargs):
        rounds.append(1)
        return original(*args, **kwargs)

    trainer.experience.sample_round = sample_round
    trainer.train()
    assert len(rounds) == 2  # at steps 1 and 3
    trainer.train()
    assert len(rounds) == 4 and trainer.state.global_step == 3


# ---- Ctrl-C ---------------------------------------------------------------------------------------------------------
def test_a_close_cut_short_by_ctrl_c_leaves_the_next_train_a_fresh_producer(tmp_path, monkeypatch):
    """Ctrl-C while the trainer waits for a batch (a KeyboardInterrupt in `take`), and again while `train()` waits for
    the producer's threads to stop (in their join): the next `train()` finishes that close and trains with a producer
    of its own."""
    original_take, interrupted = producer_module.Producer.take, []

    def take(self, k):
        if not interrupted:
            interrupted.append(k)
            threads = list(self._threads)

            def interrupted_join(timeout=None):
                for thread in threads:  # once: the next close waits as usual
                    del thread.join
                raise KeyboardInterrupt

            for thread in threads:
                thread.join = interrupted_join
            raise KeyboardInterrupt
        return original_take(self, k)

    monkeypatch.setattr(producer_module.Producer, "take", take)
    settings = dict(max_steps=3, rollout_engine="loop", max_staleness=1)
    trainer = make_trainer(tiny_run_args(tmp_path, preset={**TRAINING, **settings}))
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert interrupted == [0]
    trainer.train()
    assert trainer.state.global_step == 3 and len(train_logs(trainer)) == 3
    assert trainer.async_rollouts is None and not grpo_threads()


# ---- CUDA streams, stood in for -------------------------------------------------------------------------------------
def test_a_checkpoint_reads_the_producers_copy_after_its_load_has_written_it(monkeypatch):
    """On a GPU the producer loads a version into its copy on its own stream, and a checkpoint reads the copy
    (`versions_from`) on the trainer's: the trainer's stream waits for an event recorded after the load's writes
    before reading them. CUDA is stood in for by recorders: each event is named by the order it was recorded in."""
    events, log = iter(range(100)), []

    class Stream:
        def wait_event(self, event):
            log.append(("wait", event))

    monkeypatch.setattr(producer_module, "_cuda_event", lambda model: f"event {next(events)}")
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: Stream())
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda tensor, stream: None)
    tokenizer = build_tiny_tokenizer()
    policy = build_tiny_model(tokenizer)
    snapshot = producer_module.WeightSnapshot(policy, version=0)  # event 0: the copy, made on the trainer's stream
    snapshot.stage(1)  # event 1: version 1 staged on the trainer's stream
    with torch.no_grad():
        for param in policy.parameters():
            param.add_(1.0)
    snapshot.stage(2)  # event 2
    assert snapshot.load(2) == 2  # the producer: waits for events 0 and 2, writes the copy, records event 3
    assert log == [("wait", "event 0"), ("wait", "event 2")]
    original = snapshot._tensors

    def tensors(model):
        if model is snapshot.model:
            log.append(("read the copy", None))
        return original(model)

    monkeypatch.setattr(snapshot, "_tensors", tensors)
    snapshot.release_before(2)
    saved = snapshot.versions_from(2)
    assert log[2:] == [("wait", "event 3"), ("read the copy", None)]
    for tensor, param in zip(saved[2], policy.parameters(), strict=False):  # then the buffers
        assert torch.equal(tensor, param)
