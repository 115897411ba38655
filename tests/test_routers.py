"""`grpo_hf.routers`: recording and replaying the top-k experts of every MoE family's router, on tiny models built from
config. The weights under replay are checked against a loop over tokens written from each family's formula."""

import math

import pytest
import torch
import transformers
from test_families import ATTENTION, COMMON, CONFIGS, EXPERTS, GATED_DELTANET, build
from transformers import AutoModelForCausalLM

from grpo_hf import routers
from grpo_hf.cache_layers import cache_keyword
from grpo_hf.routers import is_moe, recording, replaying, route_mismatch, route_mismatch_counts, router_sites

OWN_CONFIGS = {  # families test_families does not build
    "qwen2_moe": (  # normalised top-k (Qwen3-MoE tests the default, unnormalised)
        "Qwen2MoeConfig",
        {**ATTENTION, **EXPERTS, "shared_expert_intermediate_size": 32, "norm_topk_prob": True},
    ),
    "qwen3_5_moe": (
        "Qwen3_5MoeTextConfig",
        {**ATTENTION, **GATED_DELTANET, **EXPERTS, "shared_expert_intermediate_size": 32},
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        dict(
            num_attention_heads=4,
            num_key_value_heads=4,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=0,
            n_shared_experts=1,
            moe_intermediate_size=16,
            q_lora_rank=None,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
        ),
    ),
}
MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2], "mrope_interleaved": True}
VL_TEXT = {**COMMON, **ATTENTION, **EXPERTS, "rope_parameters": MROPE}
VISION = dict(
    depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=32, num_position_embeddings=16
)
FAMILIES = [
    "qwen3_moe",
    "qwen2_moe",
    "qwen3_next",
    "qwen3_vl_moe",
    "qwen3_5_moe",
    "mixtral",
    "gpt_oss",
    "deepseek_v3",
    "granitemoehybrid",
]


def make(family: str, seed: int = 0):
    if family in CONFIGS:
        return build(family, seed).eval()
    if family == "qwen3_vl_moe":  # a vision-language model, run on text: the routers are its text decoder's
        torch.manual_seed(seed)
        vision = {**VISION, "deepstack_visual_indexes": [0]}
        config = transformers.Qwen3VLMoeConfig(text_config=VL_TEXT, vision_config=vision)
        return transformers.Qwen3VLMoeForConditionalGeneration(config).float().eval()
    name, kwargs = OWN_CONFIGS[family]
    config_class = getattr(transformers, name, None)
    if config_class is None:
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config_class(**COMMON, **kwargs)).float().eval()
    if family == "deepseek_v3":  # a correction bias that changes choices, as a trained model's does
        for site in router_sites(model):
            site.module.e_score_correction_bias.normal_(0.0, 0.05)
    return model


def ids(batch: int = 3, length: int = 9, seed: int = 0):
    return torch.randint(3, COMMON["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(seed))


def perturbed(family: str):
    """The same model with each router's weight nudged so that some top-k choices flip."""
    model = make(family)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for site in router_sites(model):
            weight = site.module.weight
            weight.add_(torch.randn(weight.shape, generator=generator) * weight.std())
    return model


def record(model, input_ids):
    with recording(model) as recorder, torch.no_grad():
        logits = model(input_ids).logits
    return logits, recorder.pop(input_ids.shape[0])


def seen_by_experts(model):
    """Hooks after grpo_hf's on every router: what each call hands the experts, (logits, weights, indices)."""
    seen, handles = [], []
    for site in router_sites(model):
        layout = routers._check_family(site.family)[1]

        def capture(module, args, outputs, layer=site.layer, layout=layout):
            seen.append((layer, outputs[layout.logits], outputs[layout.weights], outputs[layout.indices]))

        handles.append(site.module.register_forward_hook(capture))
    return seen, handles


def naive_weights(family: str, router, logits, indices):
    """The family's routing weights at `indices` [N, k] from `logits` [N, E], one token at a time, in float64."""
    out = []
    for row, chosen in zip(logits.double().tolist(), indices.tolist(), strict=True):
        if family in ("gpt_oss", "granitemoehybrid"):  # softmax over the chosen logits
            top = [math.exp(row[e]) for e in chosen]
            out.append([t / sum(top) for t in top])
        elif family == "deepseek_v3":  # sigmoid scores, no bias, normalised, scaled
            top = [1.0 / (1.0 + math.exp(-row[e])) for e in chosen]
            norm = sum(top) + 1e-20 if router.norm_topk_prob else 1.0
            out.append([t / norm * router.routed_scaling_factor for t in top])
        else:  # softmax over all experts, at the chosen ones, normalised when the family does
            total = sum(math.exp(v) for v in row)
            top = [math.exp(row[e]) / total for e in chosen]
            normalise = family in ("qwen3_5_moe", "qwen3_vl_moe", "mixtral") or router.norm_topk_prob
            out.append([t / sum(top) for t in top] if normalise else top)
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("family", FAMILIES)
def test_replaying_its_own_routes_gives_the_same_forward(family):
    model, input_ids = make(family), ids()
    logits, routes = record(model, input_ids)
    sites = router_sites(model)
    assert routes.shape == (3, 9, len(sites), sites[0].top_k) and routes.dtype == torch.long
    seen, handles = seen_by_experts(model)
    with replaying(model, routes), recording(model) as live, torch.no_grad():
        replayed = model(input_ids).logits
    torch.testing.assert_close(replayed, logits, rtol=1e-6, atol=1e-6)
    assert torch.equal(live.pop(3), routes)
    assert torch.equal(torch.stack([s[3].view(3, 9, -1) for s in seen], dim=2), routes)
    with replaying(model, routes.to(torch.int16)), torch.no_grad():  # routes kept small (as MicroBatch keeps them)
        torch.testing.assert_close(model(input_ids).logits, logits, rtol=1e-6, atol=1e-6)
    for handle in handles:
        handle.remove()


@pytest.mark.parametrize("family", FAMILIES)
def test_replay_routes_as_recorded_with_the_familys_weights(family):
    input_ids = ids()
    _, routes = record(perturbed(family), input_ids)  # the "rollout": a router that chooses differently
    model = make(family)
    _, own = record(model, input_ids)
    assert (routes.sort(-1).values != own.sort(-1).values).any(-1).float().mean() > 0.05  # some choices flipped
    routes[0, :2] = -1  # two tokens without a route: they route live
    seen, handles = seen_by_experts(model)
    with replaying(model, routes), recording(model) as live, torch.no_grad():
        model(input_ids)
    live = live.pop(3)  # the live choice: the first layer's is the model's own (later ones see replayed inputs)
    assert torch.equal(live[:, :, 0], own[:, :, 0]) and not torch.equal(live, routes)
    sites = router_sites(model)
    for layer, logits, weights, indices in seen:
        want = torch.where(routes[:, :, layer] >= 0, routes[:, :, layer], live[:, :, layer]).reshape(indices.shape)
        assert torch.equal(indices, want)
        naive = naive_weights(family, sites[layer].module, logits, want)
        torch.testing.assert_close(weights.double(), naive, rtol=1e-5, atol=1e-6)
    for handle in handles:
        handle.remove()


@pytest.mark.parametrize("family", FAMILIES)
def test_the_router_gets_gradients_under_replay(family):
    input_ids = ids()
    _, routes = record(perturbed(family), input_ids)
    model = make(family).train()
    with replaying(model, routes):  # every token replayed: the weights all come from the recomputation
        model(input_ids).logits.logsumexp(-1).sum().backward()
    for site in router_sites(model):
        grad = site.module.weight.grad
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_outside_the_contexts_the_forward_is_the_models_own(family):
    plain, hooked, input_ids = make(family), make(family), ids()
    record(hooked, input_ids)
    with replaying(hooked, record(perturbed(family), input_ids)[1]):
        hooked(input_ids)
    assert len(router_sites(hooked)) == len(router_sites(hooked))  # hooks are installed once
    assert all(len(site.module._forward_hooks) == 1 for site in router_sites(hooked))
    with torch.no_grad():
        assert torch.equal(hooked(input_ids).logits, plain(input_ids).logits)


def test_a_dense_model_has_no_routers_and_cannot_replay():
    model = build("qwen3_5")
    assert router_sites(model) == [] and not is_moe(model)
    with pytest.raises(ValueError, match="no Mixture-of-Experts router"), replaying(model, torch.zeros(1, 1, 1, 1)):
        pass


def test_an_unknown_moe_router_is_refused_by_name():
    config = transformers.PhimoeConfig(**COMMON, **ATTENTION, num_local_experts=4, num_experts_per_tok=2)
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match="PhimoeTopKRouter.*Qwen3-MoE"):
        router_sites(model)


def test_a_family_whose_formula_no_longer_holds_is_refused():
    """As if transformers had changed Qwen3-MoE's weights to GPT-OSS's softmax over the chosen logits."""
    wrong = routers.Family("Qwen3-MoE", "qwen3_moe", "Qwen3MoeTopKRouter", routers._softmax_of_chosen)
    cls, layout, reason = routers._check_family(wrong)
    assert cls is not None and layout is None
    assert "Qwen3MoeTopKRouter of transformers" in reason and "no longer routes" in reason and "Mismatch" in reason


def test_bad_routes_are_refused():
    model = make("qwen3_moe")
    for routes, match in [
        (torch.zeros(3, 9, 2, 3, dtype=torch.long), r"L=2, k=2"),
        (torch.zeros(3, 9, 2, 2), "integer"),
        (torch.full((3, 9, 2, 2), 4), r"\[0, 4\)"),
    ]:
        with pytest.raises(ValueError, match=match), replaying(model, routes):
            pass
    with pytest.raises(ValueError, match="the router got 27"), replaying(model, torch.zeros(3, 8, 2, 2).long()):
        model(ids())


def test_route_mismatch_counts_against_a_loop():
    generator = torch.Generator().manual_seed(0)
    recorded = torch.randint(0, 4, (3, 5, 2, 2), generator=generator)
    live = torch.where(torch.rand(recorded.shape, generator=generator) < 0.3, recorded.flip(-1), recorded)
    live[..., 0] = torch.where(torch.rand(live.shape[:3], generator=generator) < 0.3, 3 - live[..., 0], live[..., 0])
    recorded[1, 0] = -1
    mask = torch.rand(3, 5, generator=generator) < 0.8
    routes = differing = tokens = token_differing = 0
    for b in range(3):
        for t in range(5):
            if not mask[b, t] or (recorded[b, t] < 0).any():
                continue
            tokens += 1
            flags = [set(recorded[b, t, layer].tolist()) != set(live[b, t, layer].tolist()) for layer in range(2)]
            routes, differing, token_differing = routes + 2, differing + sum(flags), token_differing + any(flags)
    assert torch.equal(
        route_mismatch_counts(recorded, live, mask), torch.tensor([differing, routes, token_differing, tokens]).float()
    )
    share_routes, share_tokens = route_mismatch(recorded, live, mask)
    assert 0 < share_routes < share_tokens < 1
    torch.testing.assert_close(share_routes, torch.tensor(differing / routes))
    torch.testing.assert_close(share_tokens, torch.tensor(token_differing / tokens))


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_decode_steps_record_the_routes_of_one_forward(family):
    model, input_ids = make(family), ids(2, 8)
    _, full = record(model, input_ids)
    with recording(model) as recorder, torch.no_grad():
        cache = model(input_ids[:, :5], use_cache=True).past_key_values
        for step in range(5, 8):
            cache = model(
                input_ids[:, step : step + 1], **{cache_keyword(model): cache}, use_cache=True
            ).past_key_values
        routes = recorder.pop(2)
    assert torch.equal(routes, full)


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_recomputes_with_the_replayed_routes(reentrant):
    input_ids = ids()
    _, routes = record(perturbed("qwen3_moe"), input_ids)
    grads = []
    for checkpointing in (False, True):
        model = make("qwen3_moe").train()
        if checkpointing:
            kwargs = {"use_reentrant": reentrant}
            if hasattr(model, "activation_checkpointing_enable"):  # transformers 5.25 (5.19, vLLM's: the older name)
                model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        with replaying(model, routes):
            loss = model(input_ids).logits.logsumexp(-1).sum()
        loss.backward()  # outside the context, as the trainer's backward may be
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    for plain, checkpointed in zip(*grads, strict=True):
        torch.testing.assert_close(checkpointed, plain, rtol=1e-5, atol=1e-7)


def test_a_replayed_block_compiles_without_graph_breaks():
    model = make("qwen3_moe")
    block = model.model.layers[0].mlp
    hidden = torch.randn(2, 5, COMMON["hidden_size"])
    routes = torch.randint(0, 4, (2, 5, 2, 2))
    routes[..., 1] = (routes[..., 0] + 1) % 4  # two different experts per token
    with replaying(model, routes), torch.no_grad():
        eager = block(hidden)
        compiled = torch.compile(block, fullgraph=True, backend="eager")(hidden)
    torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-6)


def test_routers_are_found_through_lora_and_subclassing_wrappers():
    """PEFT wraps the model and its linear layers; FSDP2 swaps a sharded module's class for a subclass of it."""
    from peft import LoraConfig, get_peft_model

    input_ids = ids()
    _, routes = record(perturbed("qwen3_moe"), input_ids)
    model = make("qwen3_moe")
    with replaying(model, routes), torch.no_grad():
        want = model(input_ids).logits
    lora = get_peft_model(make("qwen3_moe"), LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=True))
    router = router_sites(lora)[0].module
    router.__class__ = type(f"FSDP{type(router).__name__}", (type(router),), {})
    assert [site.layer for site in router_sites(lora)] == [0, 1]
    with replaying(lora, routes), torch.no_grad():
        torch.testing.assert_close(lora(input_ids).logits, want, rtol=1e-6, atol=1e-6)


def test_a_copy_of_a_hooked_model_has_routes_of_its_own():
    """The async producer decodes a deep copy while the trainer replays on the policy."""
    import copy
    import pickle

    input_ids = ids()
    model = make("qwen3_moe")
    logits, _ = record(model, input_ids)
    twin = copy.deepcopy(model)
    assert pickle.loads(pickle.dumps(model)) is not None
    with replaying(model, record(perturbed("qwen3_moe"), input_ids)[1]), torch.no_grad():
        assert torch.equal(twin(input_ids).logits, logits)
        assert not torch.allclose(model(input_ids).logits, logits)
