"""Nothing silently wrong with numbers: a reward that overflows float32, a non-finite reward
weight, and a NaN loss are each visible, never turned into NaN weights or a logged 0."""

import logging
import math
import re

import pytest
import torch
from conftest import build_tiny_model, make_trainer, tiny_run_args
from datasets import Dataset
from transformers import TrainerCallback

from grpo_hf import GRPOTrainer
from grpo_hf.metrics import check_finite_rewards

FOUR_PROMPTS = {"prompt": ["a", "b", "c", "d"]}


def test_a_reward_too_large_for_float32_stops_training_and_names_the_function(tmp_path, tokenizer):
    def huge(completion_ids, **kwargs):
        return [1e300 if i == 3 else 0.5 for i in range(len(completion_ids))]  # finite in Python, inf in float32

    model = build_tiny_model(tokenizer)
    before = [p.detach().clone() for p in model.parameters()]
    trainer = GRPOTrainer(
        model, huge, tiny_run_args(tmp_path), Dataset.from_dict({"prompt": ["a", "b"]}), processing_class=tokenizer
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
        tiny_run_args(tmp_path, reward_weights=[1.0, weight])


def _index_reward(completion_ids, **kwargs):
    return [float(i) for i in range(len(completion_ids))]


class NaNReference(GRPOTrainer):
    """The reference log-probs of the first rollout are NaN (as from a broken reference model)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        reference_logps = self.experience.reference_logps

        def nan_in_the_first_rollout(batch, routing=None):
            logps = reference_logps(batch, routing)
            return logps * float("nan") if self.num_generate_calls == 1 else logps

        self.experience.reference_logps = nan_in_the_first_rollout


def _weights(trainer):
    return [p.detach().clone() for p in trainer.model.parameters()]


def test_a_nan_loss_stops_training_naming_its_cause_before_the_weights_change(tmp_path, tokenizer):
    trainer = make_trainer(
        tiny_run_args(tmp_path),
        _index_reward,
        Dataset.from_dict(FOUR_PROMPTS),
        tokenizer=tokenizer,
        trainer_cls=NaNReference,
    )
    before = _weights(trainer)
    with pytest.raises(FloatingPointError, match=r"Non-finite loss at optimizer step 1: .*ref_logps \(\d+ values\)"):
        trainer.train()
    assert all(torch.equal(p, q) for p, q in zip(trainer.model.parameters(), before, strict=True))


def test_skip_step_drops_the_update_logs_the_nan_loss_and_goes_on(tmp_path, tokenizer):
    args = tiny_run_args(tmp_path, on_nonfinite="skip_step", max_steps=2, learning_rate=1e-2)
    trainer = make_trainer(
        args, _index_reward, Dataset.from_dict(FOUR_PROMPTS), tokenizer=tokenizer, trainer_cls=NaNReference
    )
    before = _weights(trainer)
    updates = []
    trainer.add_callback(
        type(
            "Spy",
            (TrainerCallback,),
            {
                "on_optimizer_step": lambda self, *a, **k: updates.append(
                    [p.detach().clone() for p in trainer.model.parameters()]
                )
            },
        )()
    )
    trainer.train()
    logged = [row for row in trainer.state.log_history if "loss" in row]
    assert math.isnan(logged[0]["loss"])  # TrainingArguments' default filter would log 0.0
    assert logged[0]["nonfinite/skipped_steps"] == 1 and "nonfinite/skipped_steps" not in logged[1]
    assert math.isfinite(logged[1]["loss"])
    assert all(torch.equal(p, q) for p, q in zip(updates[0], before, strict=True))  # step 1: no update at all
    assert any(not torch.equal(p, q) for p, q in zip(updates[1], before, strict=True))  # step 2 trains
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def _overflowing_rewards(completion_ids, **kwargs):  # each finite in float32, their sum is not
    return [3e38 if i == 2 else 1.0 for i in range(len(completion_ids))]


@pytest.mark.parametrize("policy", ["raise", "skip_step"])
def test_advantages_that_overflow_name_the_reward_functions_and_completion(tmp_path, tokenizer, caplog, policy):
    rewards = [_overflowing_rewards, _overflowing_rewards]
    args = tiny_run_args(tmp_path, on_nonfinite=policy)
    trainer = make_trainer(args, rewards, Dataset.from_dict(FOUR_PROMPTS), tokenizer=tokenizer)
    before = _weights(trainer)
    expected = (
        r"Non-finite advantages at optimizer step 1: .*completion 2 \(group 1\).*_overflowing_rewards: 1 x 3e\+38"
    )
    if policy == "raise":
        with pytest.raises(FloatingPointError, match=expected):
            trainer.train()
    else:
        with caplog.at_level(logging.WARNING, logger="grpo_hf"):
            trainer.train()
        assert any(re.search(expected, r.getMessage()) for r in caplog.records)
        assert trainer.state.log_history[0]["nonfinite/skipped_steps"] == 1
    assert all(torch.equal(p, q) for p, q in zip(trainer.model.parameters(), before, strict=True))


def test_an_infinite_gradient_names_the_parameter(tmp_path, tokenizer):
    trainer = make_trainer(
        tiny_run_args(tmp_path), _index_reward, Dataset.from_dict(FOUR_PROMPTS), tokenizer=tokenizer
    )
    name, param = next((n, p) for n, p in trainer.model.named_parameters() if "layers.1.mlp.up_proj" in n)
    param.register_hook(lambda grad: grad * float("inf"))
    before = _weights(trainer)
    with pytest.raises(
        FloatingPointError, match=rf"Non-finite gradient norm .*non-finite gradients in {re.escape(name)}"
    ):
        trainer.train()
    assert all(torch.equal(p, q) for p, q in zip(trainer.model.parameters(), before, strict=True))


def test_on_nonfinite_is_checked(tmp_path):
    with pytest.raises(ValueError, match="on_nonfinite"):
        tiny_run_args(tmp_path, on_nonfinite="ignore")
