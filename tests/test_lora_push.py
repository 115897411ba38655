"""`rollout.lora_push` without a server: what vLLM's LoRA layers cannot serve is refused with the reason and the fix, a
server without LoRA (or with too small a rank) is refused at connect, the setting is checked, the adapter's tensors are
PEFT's saved ones, and the base weights come unmerged when asked (`weights.named_weights(merge_lora=False)`)."""

import pytest
import torch
from conftest import build_tiny_model, tiny_run_args
from peft import LoraConfig, get_peft_model

from grpo_hf.rollout.lora_push import (
    adapter_push_refusal,
    adapter_state,
    check_adapter_push,
    check_lora_server,
    served_name,
)
from grpo_hf.rollout.weights import named_weights


def _lora(tokenizer, **config):
    torch.manual_seed(0)
    model = build_tiny_model(tokenizer)
    return get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], **config))


@pytest.mark.parametrize(
    ("config", "reason"),
    [
        ({"use_dora": True}, "DoRA"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"lora_bias": True}, "trains biases"),
    ],
)
def test_what_vllm_cannot_serve_is_refused_with_the_fix(tokenizer, config, reason):
    model = _lora(tokenizer, **config)
    assert reason in adapter_push_refusal(model)
    with pytest.raises(ValueError, match="vllm_server_lora_push='merged'"):
        check_adapter_push(model)


def test_a_plain_lora_policy_passes_and_a_model_without_adapter_is_refused(tokenizer):
    assert adapter_push_refusal(_lora(tokenizer)) is None
    assert "no LoRA adapter" in adapter_push_refusal(build_tiny_model(tokenizer))


def test_a_server_without_lora_or_with_a_smaller_rank_is_refused(tokenizer):
    model = _lora(tokenizer)
    with pytest.raises(ValueError, match="without LoRA support: start it with `--enable-lora --max-lora-rank 8`"):
        check_lora_server({"vllm_config": {"lora_config": None}}, model, "http://server")
    with pytest.raises(ValueError, match="LoRA rank is 4, but the vLLM server at http://server takes ranks up to 2"):
        check_lora_server({"vllm_config": {"lora_config": {"max_lora_rank": 2}}}, model, "http://server")
    check_lora_server({"vllm_config": {"lora_config": {"max_lora_rank": 8}}}, model, "http://server")


def test_the_setting_is_checked_and_names_the_served_model():
    with pytest.raises(ValueError, match=r"vllm_server_lora_push='both' is not one of \['merged', 'adapter'\]"):
        tiny_run_args(vllm_server_lora_push="both")
    with pytest.raises(ValueError, match="vllm_mode='colocate' takes the merged weights in memory"):
        tiny_run_args(use_vllm=True, vllm_mode="colocate", vllm_server_lora_push="adapter")
    args = tiny_run_args(use_vllm=True, vllm_mode="server", vllm_server_lora_push="adapter")
    assert served_name(args, "base") == "grpo_hf-policy"
    assert served_name(tiny_run_args(), "base") == "base"


def test_the_adapter_is_peft_s_saved_state_and_the_base_comes_unmerged(tokenizer):
    """The pushed tensors are what `save_pretrained` writes (no adapter name in the keys); with merge_lora=False the
    base weights come as they are, under the checkpoint names (the merged ones differ where B != 0)."""
    from peft.utils import get_peft_model_state_dict

    model = _lora(tokenizer)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0, 0.1)
    state = adapter_state(model)
    expected = get_peft_model_state_dict(model)
    assert state.keys() == expected.keys() and all(torch.equal(state[k], expected[k]) for k in state)
    base = dict(named_weights(model, merge_lora=False))
    merged = dict(named_weights(model))
    name = "model.layers.0.self_attn.q_proj.weight"
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    assert torch.equal(base[name], layer.base_layer.weight) and not torch.equal(merged[name], base[name])
    assert base.keys() == merged.keys()
