"""The shared-prompt training forward on the families people train now: hybrids (Gated DeltaNet, convolution, Mamba),
sliding windows, MoE with the router loss on. Each gives the padded forward's log-probs, gradients and load-balancing
loss, with prompts and completions longer than the sliding window (`grpo_hf.cache_layers`, `grpo_hf.logprobs`)."""

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, LlamaConfig

from grpo_hf.cache_layers import REPEATABLE, cache_layer_classes, unrepeatable_layers
from grpo_hf.logprobs import completion_logps, shared_prefix_blocker
from grpo_hf.rollout import MicroBatch

VOCAB, WINDOW = 64, 4  # prompts of 2, 7 and 10 tokens and completions of up to 12: past the window
ATTENTION = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8)
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    max_position_embeddings=256,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=None,
)
GATED_DELTANET = dict(
    layer_types=["linear_attention", "full_attention"],
    linear_num_key_heads=2,
    linear_num_value_heads=2,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
)
MAMBA = dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=8)
SLIDING = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=WINDOW)
EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
LOCAL_EXPERTS = dict(num_local_experts=4, num_experts_per_tok=2)

CONFIGS = {  # family -> (config class, its arguments beyond COMMON)
    "qwen3_5": ("Qwen3_5TextConfig", {**ATTENTION, **GATED_DELTANET}),
    "qwen3_next": (
        "Qwen3NextConfig",
        {**ATTENTION, **GATED_DELTANET, **EXPERTS, "shared_expert_intermediate_size": 32},
    ),
    "gemma3": ("Gemma3TextConfig", {**ATTENTION, **SLIDING}),
    "gemma4": ("Gemma4TextConfig", {**ATTENTION, **SLIDING}),
    "gpt_oss": ("GptOssConfig", {**ATTENTION, **SLIDING, **LOCAL_EXPERTS}),
    "lfm2": ("Lfm2Config", {**ATTENTION, "layer_types": ["conv", "full_attention"], "conv_L_cache": 3}),
    "qwen3_moe": ("Qwen3MoeConfig", {**ATTENTION, **EXPERTS}),
    "mixtral": ("MixtralConfig", {**ATTENTION, **LOCAL_EXPERTS}),
    "granitemoehybrid": (
        "GraniteMoeHybridConfig",
        {**ATTENTION, **MAMBA, **LOCAL_EXPERTS, "layer_types": ["mamba", "attention"], "shared_intermediate_size": 32},
    ),
    "falcon_h1": ("FalconH1Config", {**ATTENTION, **MAMBA, "mamba_d_ssm": 64}),
}
MOE = ["qwen3_moe", "gpt_oss", "mixtral", "qwen3_next", "granitemoehybrid"]


def build(family: str, seed: int = 0):
    name, kwargs = CONFIGS[family]
    config_class = getattr(transformers, name, None)
    if config_class is None:
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config_class(**COMMON, **kwargs)).float()


def make_batch() -> MicroBatch:
    """Three groups of three rows: prompts of 7, 10 and 2 tokens (left-padded to 10), completions of 1 to 12 tokens
    (right-padded), split into two length buckets in some groups."""
    generator = torch.Generator().manual_seed(0)
    prompt_ids = torch.zeros(9, 10, dtype=torch.long)  # [N, P]
    for group, length in enumerate((7, 10, 2)):
        prompt_ids[3 * group : 3 * group + 3, 10 - length :] = torch.randint(3, VOCAB, (length,), generator=generator)
    prompt_mask = (prompt_ids != 0).long()
    completion_ids = torch.randint(3, VOCAB, (9, 12), generator=generator)  # [N, T]
    lengths = torch.tensor([11, 5, 12, 12, 2, 9, 1, 12, 3])
    completion_mask = (torch.arange(12) < lengths[:, None]).long()  # [N, T]
    completion_ids = completion_ids * completion_mask
    return MicroBatch(prompt_ids, prompt_mask, completion_ids, completion_mask, advantages=torch.zeros(9))


def logps_grads_aux(model, batch, share: bool, router: bool):
    """Masked log-probs [N, T], every parameter's gradient of their sum (plus the load-balancing loss with `router`),
    and the load-balancing loss (or None)."""
    mask = batch.completion_mask
    aux = [] if router else None
    logps, _ = completion_logps(model, batch, share_prefix=share, **({"router_aux": aux} if router else {}))
    loss = (logps * mask).sum() + (aux[0] if router else 0.0)
    model.zero_grad()
    loss.backward()
    grads = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in model.parameters()]
    return (logps * mask).detach(), grads, (aux[0].detach() if router else None)


@pytest.mark.kernel_paths
@pytest.mark.parametrize("family", list(CONFIGS))
def test_the_shared_prefix_gives_the_padded_log_probs_and_gradients(family):
    model = build(family)
    router = family in MOE
    assert (
        shared_prefix_blocker(
            model, model, share_prompt_prefix=True, router_aux_loss_coef=0.01 if router else 0.0, sharded=False
        )
        is None
    )
    batch = make_batch()
    shared, shared_grads, shared_aux = logps_grads_aux(model, batch, share=True, router=router)
    padded, padded_grads, padded_aux = logps_grads_aux(model, batch, share=False, router=router)
    torch.testing.assert_close(shared, padded, rtol=1e-5, atol=1e-5)
    # Relative to the largest gradient: Gemma's embedding scale makes gradients of ~50. Gemma 4's differ by up to
    # 6.5e-6 of it, rounding: in float64 the two paths differ by 2e-7 of it, the float32 of its norms, which
    # upcast to float32 whatever the dtype (log-probs equal to the bit).
    atol = (1e-5 if family == "gemma4" else 1e-6) * max(1.0, max(g.abs().max().item() for g in padded_grads))
    for got, want in zip(shared_grads, padded_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=atol)
    if router:  # the same load-balancing loss: each prompt token counted once per row, as the padded forward counts
        assert padded_aux > 1.0
        torch.testing.assert_close(shared_aux, padded_aux, rtol=1e-6, atol=0.0)


@pytest.mark.parametrize("family", ["qwen3_5", "gemma3", "lfm2", "falcon_h1"])
def test_the_prompt_cache_is_left_as_the_model_made_it(family):
    """The cache repeated to a bucket's rows is a copy: a second bucket starts from the same prompt state."""
    model = build(family)
    batch = make_batch()
    group, mask = batch.rows(0, 3), batch.completion_mask[:3]
    once = completion_logps(model, group, share_prefix=True)[0].detach()  # two buckets: rows [1] and [0, 2]
    alone = torch.cat([completion_logps(model, group.rows(i, i + 1), share_prefix=True)[0] for i in range(3)])
    torch.testing.assert_close(once * mask, alone.detach() * mask, rtol=1e-5, atol=1e-5)


def test_the_cache_layers_of_each_family_are_repeatable():
    for family, (name, kwargs) in CONFIGS.items():
        config_class = getattr(transformers, name, None)
        if config_class is not None:
            classes = cache_layer_classes(config_class(**COMMON, **kwargs))
            assert classes and all(cls in REPEATABLE for cls in classes), family


def test_a_layer_the_shared_prefix_cannot_repeat_is_named():
    config = LlamaConfig(**COMMON, **ATTENTION, layer_types=["full_attention", "indexed_attention"])
    assert unrepeatable_layers(config) == "DynamicIndexedLayer (layers 1)"
