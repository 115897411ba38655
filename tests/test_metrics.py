"""`grpo_hf.metrics.Metrics`: what one log row holds, from the values recorded since the row before.

The multi-process reductions are exercised by the 2-process runs (`tests/test_trainer.py`, `tests/test_streams.py`),
whose logged metrics must equal the 1-process run's.
"""

from types import SimpleNamespace

import pytest
import torch

from grpo_hf.metrics import Metrics

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
