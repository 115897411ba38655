"""Nothing silently wrong with numbers (issue 14, first part): a reward that overflows float32, a non-finite reward
weight, and a NaN loss are each visible, never turned into NaN weights or a logged 0."""

import math

import pytest
import torch
from conftest import build_tiny_model
from datasets import Dataset

from grpo_hf import GRPOConfig, GRPOTrainer
from grpo_hf.core import check_finite_rewards


def _args(tmp_path, **overrides):
    settings = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=4,
        max_steps=1,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
    )
    return GRPOConfig(**{**settings, **overrides})


def test_a_reward_too_large_for_float32_stops_training_and_names_the_function(tmp_path, tokenizer):
    def huge(completion_ids, **kwargs):
        return [1e300 if i == 3 else 0.5 for i in range(len(completion_ids))]  # finite in Python, inf in float32

    model = build_tiny_model(tokenizer)
    before = [p.detach().clone() for p in model.parameters()]
    trainer = GRPOTrainer(
        model, huge, _args(tmp_path), Dataset.from_dict({"prompt": ["a", "b"]}), processing_class=tokenizer
    )
    with pytest.raises(ValueError, match=r"Reward function 'huge' returned inf .*completion 3"):
        trainer.train()
    assert all(
        torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True)
    )  # no NaN reached the weights


def test_check_finite_rewards_allows_none_as_nan_and_rejects_inf():
    check_finite_rewards(torch.tensor([[0.5, float("nan")], [1.0, 2.0]]), ["a", "b"])
    with pytest.raises(ValueError, match=r"'b' returned -inf .* completion 1"):
        check_finite_rewards(torch.tensor([[0.5, 1.0], [1.0, -math.inf]]), ["a", "b"])


@pytest.mark.parametrize("weight", [math.inf, math.nan])
def test_a_non_finite_reward_weight_is_an_error_at_construction(tmp_path, weight):
    with pytest.raises(ValueError, match="reward_weights=.*non-finite"):
        _args(tmp_path, reward_weights=[1.0, weight])


def test_a_nan_loss_is_logged_as_nan_not_zero(tmp_path, tokenizer):
    class NaNLoss(GRPOTrainer):
        def compute_loss(self, *args, **kwargs):
            return super().compute_loss(*args, **kwargs) * float("nan")

    reward = lambda completion_ids, **kw: [float(i) for i in range(len(completion_ids))]  # noqa: E731
    dataset = Dataset.from_dict({"prompt": ["a", "b"]})
    trainer = NaNLoss(build_tiny_model(tokenizer), reward, _args(tmp_path), dataset, processing_class=tokenizer)
    trainer.train()
    logged = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    assert len(logged) == 1 and math.isnan(logged[0])  # TrainingArguments' default filter would log 0.0
