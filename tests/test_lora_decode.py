"""LoRA decoding on merged copies (`grpo_hf.rollout.lora_decode`): the same logits and tokens as PEFT's layers, without
running the adapters; refreshed in place after an optimizer step; the base weights untouched; fallbacks logged.

CPU only, tiny llamas in fp32 (bf16 where the rounding is the point). The decode step's compile is checked with
`backend="eager"`, `fullgraph=True` (a graph break or a recompile fails it); the CUDA-graph capture needs a GPU.
"""

import contextlib
import logging

import pytest
import torch
from conftest import TRAINING, build_tiny_model, make_trainer, tiny_run_args
from transformers import GenerationConfig

from grpo_hf.peft_utils import merged_lora_weight
from grpo_hf.rollout import make_engine, tokenize_prompts
from grpo_hf.rollout.lora_decode import LoraDecode
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


# ---- decoding -----------------------------------------------------------------------------------------------------
def test_merged_forward_gives_peft_logits_without_running_the_adapters(tokenizer):
    """fp32: the logits with the merged copies equal PEFT's to 1e-5; lora_A/lora_B are not called inside `applied()`
    (also entered twice) and are again outside it (training forwards keep PEFT's layers)."""
    lora = _lora(tokenizer)
    decode, _ = LoraDecode.build(lora)
    calls = _count_calls(_lora_modules(lora, "lora_A") + _lora_modules(lora, "lora_B"))
    prompt_ids, prompt_mask, _ = tokenize_prompts(tokenizer, PROMPTS)
    with torch.no_grad():
        with decode.applied(), decode.applied():
            merged = lora(prompt_ids, attention_mask=prompt_mask).logits
        assert calls[0] == 0
        assert not [m for m in lora.modules() if "forward" in vars(m)]
        reference = lora(prompt_ids, attention_mask=prompt_mask).logits
    assert calls[0] == 8  # 4 layers x (A, B)
    torch.testing.assert_close(merged, reference, rtol=0, atol=1e-5)
    with torch.no_grad(), lora.disable_adapter():
        assert not torch.allclose(reference, lora(prompt_ids, attention_mask=prompt_mask).logits, atol=1e-3)


@pytest.mark.parametrize("name", ["loop", "generate", "cuda_graph"])
def test_a_seeded_rollout_samples_the_same_tokens_merged_or_not(tokenizer, name):
    """Sampling at temperature 1 (no top-k): the same tokens with and without the merged copies, for each of
    grpo_hf's engines (cuda_graph eagerly here), and no adapter module runs while merged."""
    lora = _lora(tokenizer)
    decode, _ = LoraDecode.build(lora)
    prompt_ids, prompt_mask, _ = tokenize_prompts(tokenizer, PROMPTS)
    config = _sampling_config(tokenizer)
    engine, why = make_engine(name, lora, config, [tokenizer.eos_token_id], compile=False)
    assert why.startswith(f"rollout engine: {name}")
    torch.manual_seed(5)
    reference = engine.generate(lora, prompt_ids, prompt_mask).completion_ids
    calls = _count_calls(_lora_modules(lora))
    torch.manual_seed(5)
    with decode.applied():
        merged = engine.generate(lora, prompt_ids, prompt_mask).completion_ids
    assert calls[0] == 0
    assert torch.equal(merged, reference)
    torch.manual_seed(5)
    with lora.disable_adapter():
        base = engine.generate(lora, prompt_ids, prompt_mask).completion_ids
    assert not torch.equal(base, reference)  # the adapters change what is sampled


def test_compiled_decode_step_has_no_graph_break_and_sees_refreshed_copies_without_recompiling(tokenizer):
    """`cuda_graph`'s step under `torch.compile(fullgraph=True, backend="eager")`, with the merged forwards: one
    graph, no adapter module called; after the adapters change and the copies are refreshed (same storage), the
    second rollout samples the updated model's tokens (argmax) from the same compiled step (a recompile raises)."""
    lora = _lora(tokenizer)
    decode, _ = LoraDecode.build(lora)
    prompt_ids, prompt_mask, _ = tokenize_prompts(tokenizer, PROMPTS)
    config = _sampling_config(tokenizer, top_k=1)
    engine, _ = make_engine("cuda_graph", lora, config, [tokenizer.eos_token_id], compile=True)
    engine.compile_kwargs = {"fullgraph": True, "backend": "eager", "dynamic": False}
    calls = _count_calls(_lora_modules(lora))
    pointers = [m.weight.data_ptr() for m in decode.layers]
    rollouts = []
    torch._dynamo.reset()  # this test's compile is the first of `decode_step`: earlier tests' shapes would recompile
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(2):
            with decode.applied():
                rollouts.append(engine.generate(lora, prompt_ids, prompt_mask).completion_ids)
            assert calls[0] == 0
            reference, _ = make_engine("generate", lora, config, [tokenizer.eos_token_id])
            assert torch.equal(rollouts[-1], reference.generate(lora, prompt_ids, prompt_mask).completion_ids)
            with torch.no_grad():  # an optimizer step on the adapters
                for module in _lora_modules(lora, "lora_B"):
                    module.weight.mul_(-2.0)
            decode.mark_stale()
            calls[0] = 0
    assert engine._buckets and all(b.compiled and not b.eager for b in engine._buckets.values())
    assert not torch.equal(rollouts[0], rollouts[1])
    assert [m.weight.data_ptr() for m in decode.layers] == pointers


# ---- fallbacks and the log line -----------------------------------------------------------------------------------
def test_dora_keeps_pefts_layers(tokenizer):
    lora = _lora(tokenizer, use_dora=True)
    decode, why = LoraDecode.build(lora)
    assert decode is None
    assert why == "LoRA decode: PEFT's layers (DoRA adapters cannot be merged into a copy)"


def test_switches_and_sharded_models_keep_pefts_layers(tokenizer):
    lora = _lora(tokenizer)
    off = (None, "LoRA decode: PEFT's layers (merge_lora_for_generation=False)")
    assert LoraDecode.build(lora, enabled=False) == off
    decode, why = LoraDecode.build(lora, sharded=True)
    assert decode is None and "sharded (FSDP / ZeRO-3)" in why


def test_non_linear_layers_keep_pefts_path_beside_merged_ones(tokenizer):
    """A LoRA Embedding keeps PEFT's layer (and still runs) while the Linear ones are merged; logits as PEFT's."""
    lora = _lora(tokenizer, target_modules=["embed_tokens", "q_proj", "v_proj"])
    decode, why = LoraDecode.build(lora)
    assert why == (
        "LoRA decode: 4 adapted Linear layers merged into fp32 copies (12.0 KiB), refreshed after each optimizer "
        "step; PEFT's layers for 1 other (Embedding layers: only LoRA Linear layers are merged)"
    )
    assert decode.nbytes == 2 * 4 * (32 * 32 + 16 * 32)  # layers x bytes x (q_proj + v_proj)
    prompt_ids, prompt_mask, _ = tokenize_prompts(tokenizer, PROMPTS)
    embedding = lora.base_model.model.model.embed_tokens
    with torch.no_grad(), decode.applied():
        merged = lora(prompt_ids, attention_mask=prompt_mask).logits
        assert "forward" not in vars(embedding)
    reference = lora(prompt_ids, attention_mask=prompt_mask).logits.detach()
    torch.testing.assert_close(merged, reference, rtol=0, atol=1e-5)


def test_disabled_adapters_decode_the_base_model(tokenizer):
    """Adapters switched off after the copies were made (`disable_adapter`): the layers keep PEFT's forward, which
    then is the base model's."""
    lora = _lora(tokenizer)
    decode, _ = LoraDecode.build(lora)
    prompt_ids, prompt_mask, _ = tokenize_prompts(tokenizer, PROMPTS)
    with torch.no_grad(), lora.disable_adapter():
        with decode.applied():
            assert "forward" not in vars(lora.base_model.model.model.layers[0].self_attn.q_proj)
            logits = lora(prompt_ids, attention_mask=prompt_mask).logits
        assert torch.equal(logits, lora(prompt_ids, attention_mask=prompt_mask).logits)
    with torch.no_grad(), decode.applied():
        assert not torch.allclose(logits, lora(prompt_ids, attention_mask=prompt_mask).logits, atol=1e-3)


# ---- in the trainer -----------------------------------------------------------------------------------------------
def test_trainer_decodes_with_copies_refreshed_after_each_step_and_base_weights_unchanged(tmp_path, tokenizer, caplog):
    """Two LoRA steps (a rollout each): the log line; no adapter module runs while sampling, they do in the training
    forward; the second rollout's copies are W + scale B A of the adapters after the first optimizer step, in the same
    storage; the base weights are bitwise those of the start."""
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights="gaussian")
    trainer = make_trainer(tiny_run_args(tmp_path, TRAINING), tokenizer=tokenizer, peft_config=config)
    base_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" not in n}
    sampler = trainer.experience.sampler
    calls = _count_calls(_lora_modules(trainer.model))
    seen = []  # per rollout: adapter calls so far, then each copy's (pointer, values, W + scale B A now)
    decoding = sampler.decoding

    @contextlib.contextmanager
    def recording():
        with decoding() as (model, engine):
            before = calls[0]
            yield model, engine
            layers = sampler.lora_decode.layers
            copies = [(m.weight.data_ptr(), m.weight.clone(), _naive_merged(m.layer).float()) for m in layers]
            seen.append((calls[0] - before, copies))

    sampler.decoding = recording
    with caplog.at_level(logging.INFO, logger="grpo_hf.rollout.sampler"):
        trainer.train()
    assert (
        "LoRA decode: 4 adapted Linear layers merged into fp32 copies (12.0 KiB), refreshed after each optimizer step"
        in caplog.messages
    )
    assert len(seen) == 2 and [n for n, _ in seen] == [0, 0]
    assert calls[0] > 0  # the training forwards ran the adapters
    (_, first), (_, second) = seen
    for (ptr, values, expected), (ptr2, values2, expected2) in zip(first, second, strict=True):
        assert ptr == ptr2
        torch.testing.assert_close(values, expected, rtol=0, atol=1e-6)
        torch.testing.assert_close(values2, expected2, rtol=0, atol=1e-6)
        assert not torch.equal(values, values2)  # refreshed after the optimizer step
    after = dict(trainer.model.named_parameters())
    assert all(torch.equal(after[n], p) for n, p in base_before.items())


def test_trainer_with_the_switch_off_samples_through_pefts_layers(tmp_path, tokenizer, caplog):
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights="gaussian")
    args = tiny_run_args(tmp_path, merge_lora_for_generation=False)
    trainer = make_trainer(args, tokenizer=tokenizer, peft_config=config)
    with caplog.at_level(logging.INFO, logger="grpo_hf.rollout.sampler"):
        trainer.train()
    assert "LoRA decode: PEFT's layers (merge_lora_for_generation=False)" in caplog.messages
    assert trainer.experience.sampler.lora_decode is None


def test_a_model_without_lora_gets_no_lora_line(tmp_path, tokenizer, caplog):
    trainer = make_trainer(tiny_run_args(tmp_path), tokenizer=tokenizer)
    with caplog.at_level(logging.INFO, logger="grpo_hf.rollout.sampler"):
        trainer.train()
    assert not [m for m in caplog.messages if m.startswith("LoRA decode")]
