"""Behaviours a TRL user relies on when porting a script: inputs TRL's GRPOTrainer accepts are accepted."""

import re

import pytest
import torch
from conftest import build_tiny_model, tiny_run_args
from datasets import Dataset, DatasetDict

from grpo_hf import GRPOTrainer

_args = tiny_run_args


def _reward(completion_ids, **kwargs):
    return [float(len(ids)) + 0.1 * i for i, ids in enumerate(completion_ids)]


DATASET = Dataset.from_dict({"prompt": ["a", "b", "c", "d"]})


def test_a_peft_model_is_accepted_as_the_model(tmp_path, tokenizer):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(build_tiny_model(tokenizer), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    base = {n: p.detach().clone() for n, p in model.named_parameters() if "lora" not in n}
    lora = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_B" in n}
    trainer = GRPOTrainer(model, _reward, _args(tmp_path, learning_rate=1e-2), DATASET, processing_class=tokenizer)
    assert trainer.ref_model is None  # the reference is the model with its adapters switched off
    trainer.train()
    params = dict(model.named_parameters())
    assert all(torch.equal(params[n], value) for n, value in base.items())
    assert any(not torch.equal(params[n], value) for n, value in lora.items())


def test_a_peft_model_with_a_peft_config_is_a_clear_error(tmp_path, tokenizer):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(build_tiny_model(tokenizer), LoraConfig(r=4, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match="already a PeftModel"):
        GRPOTrainer(model, _reward, _args(tmp_path), DATASET, processing_class=tokenizer, peft_config=LoraConfig(r=4))


def test_a_dict_of_eval_datasets_is_checked_split_by_split_and_evaluated(tmp_path, tokenizer):
    evals = DatasetDict(
        {"easy": Dataset.from_dict({"prompt": ["x", "y"]}), "hard": Dataset.from_dict({"prompt": ["z"]})}
    )
    trainer = GRPOTrainer(
        build_tiny_model(tokenizer), _reward, _args(tmp_path), DATASET, evals, processing_class=tokenizer
    )
    metrics = trainer.evaluate()
    assert "eval_easy_reward" in metrics and "eval_hard_reward" in metrics
    with pytest.raises(ValueError, match=r"eval_dataset\['bad'\] has no 'prompt' column"):
        GRPOTrainer(
            build_tiny_model(tokenizer),
            _reward,
            _args(tmp_path),
            DATASET,
            {"bad": Dataset.from_dict({"question": ["q"]})},
            processing_class=tokenizer,
        )


def test_a_missing_train_dataset_fails_at_construction(tmp_path, tokenizer):
    with pytest.raises(ValueError, match="`train_dataset` is required"):
        GRPOTrainer(build_tiny_model(tokenizer), _reward, _args(tmp_path), processing_class=tokenizer)


def test_evaluate_reports_the_grpo_loss_of_the_eval_completions(tmp_path, tokenizer):
    """TRL's trainer.evaluate() reports eval_loss: here the GRPO loss of the sampled eval completions, on-policy."""
    evals = Dataset.from_dict({"prompt": ["x", "y"]})
    args = _args(
        tmp_path, per_device_eval_batch_size=4, num_generations_eval=2, beta=0.5, learning_rate=0.05, max_steps=2
    )
    trainer = GRPOTrainer(build_tiny_model(tokenizer), _reward, args, DATASET, evals, processing_class=tokenizer)
    # Before training the policy is its reference (KL 0) and on-policy ratios are 1: the loss is minus the mean
    # advantage, and advantages sum to 0 within each group.
    before = trainer.evaluate()
    assert before["eval_loss"] == pytest.approx(0.0, abs=1e-5) and "eval_reward" in before
    trainer.train()  # the policy moves away from its reference: beta x KL > 0 enters the loss
    after = trainer.evaluate()
    assert after["eval_loss"] > 1e-4


def test_trl_mask_methods_follow_their_formulas(tmp_path, tokenizer):
    """`get_high_entropy_mask` (threshold = the quantile, as TRL passes 1 - top_entropy_quantile) and the static
    `get_off_policy_mask` compute what TRL's methods of the same names do, written out here as loops."""
    trainer = GRPOTrainer(build_tiny_model(tokenizer), _reward, _args(tmp_path), DATASET, processing_class=tokenizer)
    entropies = torch.tensor([[0.1, 0.9, 0.4, 0.7], [0.3, 0.8, 0.2, 5.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    for threshold in (0.0, 0.5, 0.8, 1.0):
        tau = torch.quantile(entropies[mask.bool()], threshold)
        rows = zip(entropies.tolist(), mask.tolist(), strict=True)
        expected = [[bool(m) and e >= tau for e, m in zip(er, mr, strict=True)] for er, mr in rows]
        assert trainer.get_high_entropy_mask(entropies, mask, threshold).tolist() == expected

    advantages = torch.tensor([[1.0], [-1.0], [-1.0], [-1.0]])
    sampling = torch.zeros(4, 3)
    logps = torch.tensor([[-2.0] * 3, [-0.5] * 3, [-2.0] * 3, [-2.0, float("nan"), -2.0]])
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 1], [1, 1, 0], [1, 1, 1]])
    expected = []
    for a, lp, s, m in zip(advantages, logps, sampling, mask, strict=True):
        kl = [float(sv - lv) if lv == lv else 0.0 for sv, lv in zip(s, lp, strict=True)]
        mean_kl = sum(k * float(w) for k, w in zip(kl, m, strict=True)) / max(float(m.sum()), 1.0)
        expected.append([1.0 if (a.item() >= 0 or mean_kl <= 1.0) else 0.0])
    assert GRPOTrainer.get_off_policy_mask(advantages, logps, sampling, mask, 1.0).tolist() == expected


def test_a_completion_without_any_reward_is_reported_with_trl_warning(tmp_path, tokenizer, caplog):
    def none_for_the_first(completions, **kwargs):
        return [None] + [1.0] * (len(completions) - 1)

    trainer = GRPOTrainer(
        build_tiny_model(tokenizer), none_for_the_first, _args(tmp_path), DATASET, processing_class=tokenizer
    )
    with caplog.at_level("WARNING", logger="grpo_hf"):
        trainer.train()
    expected = r"All reward functions returned None for the following kwargs: \{'prompt': '[abcd]', 'completion': "
    assert re.search(expected, caplog.text)
    assert trainer.entropy_coef == 0.0  # TRL's attribute, here at its default
