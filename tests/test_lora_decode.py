"""LoRA decoding on merged copies (`grpo_hf.rollout.lora_decode`): the same logits and tokens as PEFT's layers, without
running the adapters; refreshed in place after an optimizer step; the base weights untouched; fallbacks logged.

CPU only, tiny llamas in fp32 (bf16 where the rounding is the point). The decode step's compile is checked with
`backend="eager"`, `fullgraph=True` (a graph break or a recompile fails it); the CUDA-graph capture needs a GPU.
"""

import pytest
import torch
from conftest import build_tiny_model
from transformers import GenerationConfig

from grpo_hf.peft_utils import merged_lora_weight
from grpo_hf.rollout.weights import named_weights

peft = pytest.importorskip("peft")

PROMPTS = ["Hello there"] * 2 + ["A much longer prompt, with more tokens"] * 3 + ["Why?"]


def _lora(tokenizer, seed=1, dtype=torch.float32, **config):
    """A tiny llama with random (non-zero) adapters on q_proj and v_proj, in eval mode."""
    model = build_tiny_model(tokenizer, seed=seed).to(dtype)
    torch.manual_seed(seed)
    settings = dict(r=4, lora_alpha=32, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return peft.get_peft_model(model, peft.LoraConfig(**{**settings, **config})).eval()


def _lora_modules(model, name="lora_A"):
    return [m for n, m in model.named_modules() if n.endswith(f".{name}.default")]


def _count_calls(modules) -> list[int]:
    calls = [0]
    for module in modules:
        module.register_forward_hook(lambda *args: calls.__setitem__(0, calls[0] + 1))
    return calls


def _sampling_config(tokenizer, **settings) -> GenerationConfig:
    settings = {"max_new_tokens": 8, "do_sample": True, "top_k": None, **settings}
    return GenerationConfig(pad_token_id=tokenizer.pad_token_id, eos_token_id=[tokenizer.eos_token_id], **settings)


def _naive_merged(layer, adapters=("default",)) -> torch.Tensor:
    """W + sum of scale * B A, in float64, from the formula."""
    weight = layer.base_layer.weight.double()
    for name in adapters:
        A, B = layer.lora_A[name].weight.double(), layer.lora_B[name].weight.double()
        weight = weight + layer.scaling[name] * (B @ A)
    return weight


# ---- the merged weight --------------------------------------------------------------------------------------------
def test_merged_weight_is_w_plus_the_adapters_deltas(tokenizer):
    """fp32: W + scale B A to fp32 precision, the sum over two active adapters; the layer and W are unchanged."""
    lora = _lora(tokenizer)
    lora.add_adapter("other", peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"], init_lora_weights=False))
    lora.base_model.set_adapter(["default", "other"])
    layer = lora.base_model.model.model.layers[0].self_attn.q_proj
    before = layer.base_layer.weight.clone()
    merged = merged_lora_weight(layer, ["default", "other"])
    expected = _naive_merged(layer, ("default", "other"))
    assert not torch.allclose(expected, _naive_merged(layer), atol=1e-3)  # the second adapter counts
    torch.testing.assert_close(merged.double(), expected, rtol=0, atol=1e-6)
    assert merged.dtype == torch.float32 and torch.equal(layer.base_layer.weight, before)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # a rollout under the trainer's autocast: B A stays fp32
        assert torch.equal(merged_lora_weight(layer, ["default", "other"]), merged)


def test_bf16_merged_weight_is_rounded_once(tokenizer):
    """bf16 W, fp32 adapters: the copy is the exact sum rounded once to bf16 (within half a bf16 spacing), in bf16."""
    lora = _lora(tokenizer, dtype=torch.bfloat16)
    layer = lora.base_model.model.model.layers[0].self_attn.v_proj
    assert layer.lora_B["default"].weight.dtype == torch.float32  # PEFT's default: fp32 adapters on a bf16 model
    merged = merged_lora_weight(layer, ["default"], out=torch.empty_like(layer.base_layer.weight))
    exact = _naive_merged(layer)
    spacing = torch.finfo(torch.bfloat16).eps * torch.exp2(torch.floor(torch.log2(exact.abs())))  # bf16 ulp
    assert merged.dtype == torch.bfloat16
    assert bool(((merged.double() - exact).abs() <= spacing / 2 * (1 + 1e-6)).all())


def test_vllm_push_merges_with_the_same_function(tokenizer):
    """`named_weights` (vLLM's push) yields W + scale B A under the checkpoint names; the model stays unmerged."""
    lora = _lora(tokenizer)
    weights = dict(named_weights(lora))
    layer = lora.base_model.model.model.layers[1].self_attn.q_proj
    torch.testing.assert_close(weights["model.layers.1.self_attn.q_proj.weight"].double(), _naive_merged(layer))
    assert not any("lora_" in name or "base_layer" in name for name in weights)
    assert not layer.merged
