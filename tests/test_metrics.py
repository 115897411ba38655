"""`grpo_hf.metrics.Metrics`: what one log row holds, from the values recorded since the row before.

The multi-process reductions are exercised by the 2-process runs (`tests/test_trainer.py`, `tests/test_streams.py`),
whose logged metrics must equal the 1-process run's.
"""

import logging
import math
from types import SimpleNamespace

import pytest
import torch
from conftest import TRAINING, id_sum_reward, make_trainer, tiny_run_args, train_logs

from grpo_hf.metrics import Metrics, length_metrics, no_signal_warning
from grpo_hf.objective import gathered_clip_extremes

ONE_PROCESS = SimpleNamespace(num_processes=1, device=torch.device("cpu"))  # what Metrics reads of an Accelerator


def test_a_row_holds_each_names_mean_and_clears_what_it_used():
    metrics = Metrics()
    metrics["train"]["reward"] += [0.5, 1.0, 0.0]
    metrics["train"]["kl"].append(0.25)
    metrics["train"]["empty"]  # a name looked up but never given a value is not logged
    metrics["eval"]["reward"].append(3.0)
    assert metrics.pop_means("train", ONE_PROCESS) == {"kl": 0.25, "reward": pytest.approx(0.5)}
    assert metrics.pop_means("train", ONE_PROCESS) == {}  # nothing new since
    assert metrics.last_train == {"kl": 0.25, "reward": pytest.approx(0.5)}  # an empty row does not replace it
    assert metrics.pop_means("eval", ONE_PROCESS) == {"reward": 3.0}
    assert metrics.last_train == {"kl": 0.25, "reward": pytest.approx(0.5)}  # eval rows leave it alone


def test_logged_values_become_one_mean_per_rollout():
    """`log_metric` values: each rollout contributes the mean of its values, and a row averages those means."""
    metrics = Metrics()
    metrics.add_logged(metrics["train"], {"answer_length": [10.0, 20.0, 30.0], "steps": [1.0]}, ONE_PROCESS)
    metrics.add_logged(metrics["train"], {"answer_length": [40.0]}, ONE_PROCESS)
    metrics.add_logged(metrics["train"], {}, ONE_PROCESS)
    assert metrics["train"]["answer_length"] == [20.0, 40.0]
    assert metrics.pop_means("train", ONE_PROCESS) == {"answer_length": 30.0, "steps": 1.0}


def test_the_unlogged_train_values_survive_a_checkpoint():
    saved = Metrics()
    saved["train"]["reward"] += [1.0, 2.0]
    saved["eval"]["reward"].append(9.0)  # evaluation values are not part of the run state
    restored = Metrics()
    restored.load_state(saved.state())
    restored["train"]["reward"].append(3.0)  # still a list that grows, per name
    assert restored.pop_means("train", ONE_PROCESS) == {"reward": 2.0}
    assert restored.pop_means("eval", ONE_PROCESS) == {}


def test_length_metrics_are_trls_with_the_terminated_completions_apart():
    """TRL's completion-length metrics, hand-computed: lengths 3, 8, 5, 8 of which the two 8s hit the limit without
    EOS; the terminated lengths are those of the other two; with none terminated TRL logs 0 for all three."""
    lengths = torch.tensor([3, 8, 5, 8])
    truncated = torch.tensor([False, True, False, True])
    assert length_metrics(lengths, truncated) == {
        "completions/mean_length": 6.0,
        "completions/min_length": 3.0,
        "completions/max_length": 8.0,
        "completions/mean_terminated_length": 4.0,
        "completions/min_terminated_length": 3.0,
        "completions/max_terminated_length": 5.0,
        "completions/clipped_ratio": 0.5,
    }
    none_terminated = length_metrics(torch.tensor([8, 8]), torch.tensor([True, True]))
    assert {k: v for k, v in none_terminated.items() if "terminated" in k} == {
        "completions/mean_terminated_length": 0.0,
        "completions/min_terminated_length": 0.0,
        "completions/max_terminated_length": 0.0,
    }
    assert none_terminated["completions/clipped_ratio"] == 1.0


def test_clip_extremes_are_taken_over_every_process():
    """clip_ratio/low_min and high_max of a micro-step: the smallest / largest over the processes' own (TRL gathers
    the sequences' fractions first: the same numbers), a process without completion tokens (NaN) left out; the
    means are left to the row's average over processes."""
    others = {"clip_ratio/low_min": 0.25, "clip_ratio/high_max": float("nan")}

    def gather(local):  # this process's row, then the other process's
        other = torch.tensor([[others["clip_ratio/low_min"], others["clip_ratio/high_max"]]], dtype=local.dtype)
        return torch.cat([local, other])

    two = SimpleNamespace(num_processes=2, device=torch.device("cpu"), gather=gather)
    mine = {"clip_ratio/low_mean": 0.5, "clip_ratio/low_min": 0.5, "clip_ratio/high_max": 0.125}
    assert gathered_clip_extremes(two, dict(mine)) == {
        "clip_ratio/low_mean": 0.5,
        "clip_ratio/low_min": 0.25,
        "clip_ratio/high_max": 0.125,
    }
    both_nan = gathered_clip_extremes(two, {"clip_ratio/low_min": 0.5, "clip_ratio/high_max": float("nan")})
    assert both_nan["clip_ratio/low_min"] == 0.25 and math.isnan(both_nan["clip_ratio/high_max"])
    assert gathered_clip_extremes(ONE_PROCESS, dict(mine)) == mine
    assert gathered_clip_extremes(two, {"cispo_clip_ratio": 0.5}) == {"cispo_clip_ratio": 0.5}  # no gather at all


def test_a_training_run_logs_trls_extra_clip_and_length_metrics(tmp_path):
    """The keys reach the log rows: here every completion reaches max_completion_length=4 (clipped_ratio 1), so the
    terminated lengths are TRL's 0; the first step is on-policy (ratio 1), so nothing is clipped."""
    trainer = make_trainer(tiny_run_args(tmp_path, max_steps=1))
    trainer.train()
    (row,) = train_logs(trainer)
    assert row["completions/clipped_ratio"] == 1.0 and row["completions/max_length"] == 4.0
    for name in ("mean", "min", "max"):
        assert row[f"completions/{name}_terminated_length"] == 0.0
    assert row["clip_ratio/low_min"] == 0.0 and row["clip_ratio/high_max"] == 0.0


def always_zero(completions, **kwargs):
    """A verifier reading a column that is not there: one value for every completion."""
    return [0.0] * len(completions)


def zero_at_the_first_step(completions, completion_ids, trainer_state, **kwargs):
    """Equal rewards in the first generation batch only (one unlucky batch), then rewards that vary."""
    if trainer_state.global_step == 0:
        return [1.0] * len(completions)
    return id_sum_reward(completion_ids)


@pytest.mark.parametrize(
    ("reward", "warned"), [(always_zero, True), (id_sum_reward, False), (zero_at_the_first_step, False)]
)
def test_a_run_without_learning_signal_is_warned_about_once(tmp_path, caplog, reward, warned):
    """Every group with equal rewards in NO_SIGNAL_BATCHES (2) generation batches in a row: one warning over the 3-step
    run (not one per step), naming the constant reward function and what it means; rewards that vary, or equal in
    one batch only, give none."""
    trainer = make_trainer(tiny_run_args(tmp_path, TRAINING, max_steps=3), reward=reward)
    with caplog.at_level(logging.WARNING, logger="grpo_hf.experience"):
        trainer.train()
    messages = [r.getMessage() for r in caplog.records if "No learning signal" in r.getMessage()]
    assert len(messages) == (1 if warned else 0), messages
    assert [log["frac_reward_zero_std"] for log in train_logs(trainer)] == {
        always_zero: [1.0, 1.0, 1.0],
        id_sum_reward: [0.0, 0.0, 0.0],
        zero_at_the_first_step: [1.0, 0.0, 0.0],
    }[reward]
    if warned:
        assert "in 2 generation batches in a row" in messages[0]
        assert "Constant over the whole last batch: 'always_zero' (0 for every completion)" in messages[0]
        assert "every advantage is 0" in messages[0] and "reads the dataset column it needs" in messages[0]


def test_the_no_signal_warning_names_what_is_constant():
    """Per reward function over the batch [N, R]: one value everywhere (named, with it), None everywhere (named), or
    varying (not named); when none is constant, equal rewards within each group mean rewards of the prompt only."""
    rewards = torch.tensor([[1.0, float("nan"), 0.0], [1.0, float("nan"), 2.0], [1.0, float("nan"), 0.0]])
    message = no_signal_warning(rewards, ["ok_format", "judge", "score"], 3)
    assert "in 3 generation batches in a row" in message
    assert "'ok_format' (1 for every completion), 'judge' (None for every completion)." in message
    assert "'score'" not in message
    by_prompt = no_signal_warning(torch.tensor([[0.0], [0.0], [1.0], [1.0]]), ["per_prompt"], 2)
    assert "'per_prompt'" not in by_prompt and "depend on the prompt" in by_prompt
