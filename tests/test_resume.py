"""Exact resume: a run stopped after any checkpoint (mid-rollout, mid-epoch, epoch 2, accumulation) and resumed
logs the same metrics and ends with the same weights as the run that was never stopped; checkpoints are whole
or absent, even when the process is killed while saving."""

import logging
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import id_sum_reward, make_trainer, tiny_run_args
from datasets import Dataset

from grpo_hf import GRPOTrainer
from grpo_hf.checkpoint import RUN_STATE, STAGING_DIR, resolve_resume

VOLATILE = {"train_runtime", "train_samples_per_second", "train_steps_per_second", "total_flos", "train_loss"}


CHECKPOINTED = dict(
    per_device_train_batch_size=4,
    num_generations=4,
    max_completion_length=6,
    max_steps=4,
    learning_rate=2e-2,
    beta=0.04,
    save_strategy="steps",
    save_steps=1,
    logging_steps=1,
    use_cpu=True,
    disable_tqdm=True,
    seed=0,
)
"""Four logged CPU steps with a checkpoint after each and a KL term."""


def checkpointed_trainer(output_dir, num_prompts: int = 8, stream: bool = False, **overrides) -> GRPOTrainer:
    """`CHECKPOINTED` on `num_prompts` prompts (a `datasets.IterableDataset` with `stream`), tiny model seed 1."""
    dataset = Dataset.from_dict({"prompt": [f"Question {i}: {i} + {i} =" for i in range(num_prompts)]})
    if stream:
        dataset = dataset.to_iterable_dataset()
    return make_trainer(tiny_run_args(output_dir, CHECKPOINTED, **overrides), id_sum_reward, dataset, model_seed=1)


def step_logs(trainer, after: int = 0) -> list[dict]:
    return [
        {k: v for k, v in h.items() if k not in VOLATILE}
        for h in trainer.state.log_history
        if "loss" in h and h["step"] > after
    ]


def assert_same_run(resumed: GRPOTrainer, unbroken: GRPOTrainer, after: int) -> None:
    expected = step_logs(unbroken, after)
    assert expected, "the unbroken run logged no step after the checkpoint"
    assert step_logs(resumed, after) == expected
    for (name, p), q in zip(resumed.model.named_parameters(), unbroken.model.parameters(), strict=True):
        assert torch.equal(p, q), name


RESUME_CASES = {
    "steps_per_generation=2, mid-rollout": (dict(steps_per_generation=2), 8, 1),
    "num_iterations=2, mid-rollout": (dict(num_iterations=2), 8, 1),
    "gradient_accumulation_steps=2": (dict(gradient_accumulation_steps=2, per_device_train_batch_size=2), 8, 1),
    "checkpoint in epoch 2": (dict(max_steps=6), 2, 3),  # 2 prompts of 4 rows: an epoch is 2 steps
    "stream, mid-rollout": (dict(steps_per_generation=2, stream=True), 8, 1),
    "stream, checkpoint in pass 2": (dict(max_steps=6, stream=True), 2, 3),
}


@pytest.mark.parametrize("case", list(RESUME_CASES))
def test_a_resumed_run_repeats_the_unbroken_run_exactly(tmp_path, case):
    overrides, num_prompts, stop_at = RESUME_CASES[case]
    unbroken = checkpointed_trainer(tmp_path / "unbroken", num_prompts, **overrides)
    unbroken.train()
    # What a kill right after checkpoint `stop_at` leaves on disk.
    run = tmp_path / "killed"
    shutil.copytree(tmp_path / "unbroken" / f"checkpoint-{stop_at}", run / f"checkpoint-{stop_at}")
    resumed = checkpointed_trainer(run, num_prompts, **overrides)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == unbroken.state.global_step
    assert_same_run(resumed, unbroken, after=stop_at)
    if case.endswith("mid-rollout"):  # the buffered rollout came back instead of being generated again
        assert resumed.num_generate_calls < unbroken.num_generate_calls


KILLER = """
import os, signal, sys
sys.path[:0] = [{tests!r}]
from test_resume import checkpointed_trainer
from grpo_hf import checkpoint

kill_at = {kill_at!r}
if {while_saving!r}:
    publish = checkpoint.publish
    def publish_then_die(staged, final):
        if final.endswith(f"checkpoint-{{kill_at}}"):
            os.kill(os.getpid(), signal.SIGKILL)  # files written, not yet renamed into place
        publish(staged, final)
    checkpoint.publish = publish_then_die
trainer = checkpointed_trainer({out!r}, max_steps=4, steps_per_generation=2)
if not {while_saving!r}:
    from transformers import TrainerCallback
    class Die(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            if state.global_step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
    trainer.add_callback(Die())
trainer.train()
"""


@pytest.mark.parametrize("while_saving", [False, True], ids=["after a save", "while saving"])
def test_sigkill_then_resume_true_repeats_the_unbroken_run(tmp_path, caplog, while_saving):
    out = tmp_path / "run"
    script = KILLER.format(tests=str(Path(__file__).parent), kill_at=3, while_saving=while_saving, out=str(out))
    # Same thread count as this process (the unbroken run below): reductions then round the same way.
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]
    complete = sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-"))
    assert complete == (
        ["checkpoint-1", "checkpoint-2"] if while_saving else ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    )
    if while_saving:  # the half-published checkpoint sits in the staging directory, not as checkpoint-3
        assert (out / STAGING_DIR / "checkpoint-3" / RUN_STATE.format(rank=0)).is_file()

    resumed = checkpointed_trainer(out, max_steps=4, steps_per_generation=2)
    resumed.train(resume_from_checkpoint=True)
    unbroken = checkpointed_trainer(tmp_path / "unbroken", max_steps=4, steps_per_generation=2)
    unbroken.train()
    assert_same_run(resumed, unbroken, after=2 if while_saving else 3)
    assert not (out / STAGING_DIR).exists()  # the next save replaced the leftover and tidied up


def test_resume_true_skips_an_incomplete_newest_checkpoint_with_a_warning(tmp_path, caplog):
    first = checkpointed_trainer(tmp_path, max_steps=2)
    first.train()
    partial = tmp_path / "checkpoint-7"
    partial.mkdir()
    (partial / "config.json").write_text("{}")
    again = checkpointed_trainer(tmp_path, max_steps=3)
    with caplog.at_level(logging.WARNING, logger="grpo_hf.checkpoint"):
        again.train(resume_from_checkpoint=True)
    assert any("Skipping" in r.getMessage() and "checkpoint-7" in r.getMessage() for r in caplog.records)
    assert again.state.global_step == 3 and step_logs(again, after=2)[0]["step"] == 3


def test_resume_errors_name_the_problem(tmp_path):
    trainer = checkpointed_trainer(tmp_path / "empty", max_steps=1)
    (tmp_path / "half").mkdir()
    with pytest.raises(ValueError, match=r"incomplete \(no trainer_state.json, model weights\)"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "half"))
    with pytest.raises(ValueError, match=r"'nowhere' is not a directory.*true \(also 'last'\)"):
        trainer.train(resume_from_checkpoint="nowhere")


def test_resume_true_true_or_last_is_the_newest_complete_checkpoint_or_a_fresh_start(tmp_path):
    """As HF Trainer's True, and what a command line passes ('true', 'last'): the newest complete checkpoint-N of
    output_dir; none (a first submission of a job) starts the run; a half-written one (.saving/, a checkpoint-N
    without weights) is never picked."""
    out = tmp_path / "run"
    for value in (True, "true", "last", "LAST", " True "):
        assert resolve_resume(value, str(out)) is None  # no output_dir yet: a fresh run
    for value in (None, False, "false", "none", ""):
        assert resolve_resume(value, str(out)) is None
    for step in (1, 2):
        (out / f"checkpoint-{step}").mkdir(parents=True)
        (out / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
        (out / f"checkpoint-{step}" / "model.safetensors").write_text("")
    (out / "checkpoint-3").mkdir()  # being written by another tool: no weights yet
    (out / "checkpoint-3" / "trainer_state.json").write_text("{}")
    (out / STAGING_DIR / "checkpoint-4").mkdir(parents=True)  # grpo_hf's own half-written one
    for value in (True, "true", "last"):
        assert resolve_resume(value, str(out)) == str(out / "checkpoint-2")
    assert resolve_resume(str(out / "checkpoint-1"), str(out)) == str(out / "checkpoint-1")
    config = tiny_run_args(out, CHECKPOINTED, resume_from_checkpoint="last")
    assert config.resume_from_checkpoint is True  # the command line's word, normalised once


def test_resume_true_without_a_checkpoint_trains_from_the_start(tmp_path):
    """The same command starts a run and continues it: `args.resume_from_checkpoint=True` (what `train()` reads when
    given nothing) on an empty output_dir trains from step 0, as the unbroken run does."""
    fresh = checkpointed_trainer(tmp_path / "fresh", max_steps=2, resume_from_checkpoint="true")
    fresh.train()
    unbroken = checkpointed_trainer(tmp_path / "unbroken", max_steps=2)
    unbroken.train()
    assert_same_run(fresh, unbroken, after=0)
    again = checkpointed_trainer(tmp_path / "fresh", max_steps=3, resume_from_checkpoint="true")
    again.train()  # continues from checkpoint-2: one more step, one more rollout
    assert again.state.global_step == 3 and again.num_generate_calls == fresh.num_generate_calls // 2 == 1


def test_an_unwritable_output_dir_fails_at_construction_and_at_train(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match="output_dir=.*a_file/run.* is not a writable directory"):
        checkpointed_trainer(blocker / "run", max_steps=1)
    trainer = checkpointed_trainer(tmp_path / "run", max_steps=1)
    shutil.rmtree(tmp_path / "run")
    (tmp_path / "run").write_text("replaced by a file since")
    with pytest.raises(ValueError, match="is not a writable directory"):
        trainer.train()
    assert trainer.num_generate_calls == 0


STOPPER = """
import os, signal, sys
sys.path[:0] = [{tests!r}]
from test_resume import checkpointed_trainer
from transformers import TrainerCallback

class Preempt(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 2:
            os.kill(os.getpid(), signal.{signal})  # what a scheduler sends before it kills a job

trainer = checkpointed_trainer({out!r}, max_steps=6, save_steps=500, steps_per_generation=2)
trainer.add_callback(Preempt())
trainer.train()
print("global_step", trainer.state.global_step, "stopped_by", trainer.stopped_by)
"""


@pytest.mark.parametrize("signum", ["SIGUSR1", "SIGTERM"])
def test_a_stop_signal_finishes_the_step_saves_and_stops_so_nothing_is_lost(tmp_path, signum):
    """save_steps=500 would leave nothing on disk at step 3: SIGUSR1 (a batch script's notice before the time limit;
    by default it would kill the process) or SIGTERM makes the trainer save and stop cleanly, and say why."""
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}
    script = STOPPER.format(tests=str(Path(__file__).parent), out=str(out), signal=signum)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"global_step 3 stopped_by {signum}" in result.stdout and signum in result.stderr
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-")) == ["checkpoint-3"]

    resumed = checkpointed_trainer(out, max_steps=6, save_steps=500, steps_per_generation=2)
    resumed.train(resume_from_checkpoint=True)
    unbroken = checkpointed_trainer(tmp_path / "unbroken", max_steps=6, save_steps=500, steps_per_generation=2)
    unbroken.train()
    assert_same_run(resumed, unbroken, after=3)
