"""Behaviours a TRL user relies on when porting a script (issue 13): inputs TRL's GRPOTrainer accepts are accepted."""

import pytest
import torch
from conftest import build_tiny_model
from datasets import Dataset, DatasetDict

from grpo_hf import GRPOConfig, GRPOTrainer


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
    with pytest.raises(ValueError, match="train_dataset is required"):
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
