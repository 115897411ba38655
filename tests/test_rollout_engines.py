"""Rollout engines: the registry, `"auto"`'s choices and fallbacks, and the `generate` engines."""

import pytest
import torch
from conftest import build_tiny_model
from datasets import Dataset
from transformers import GenerationConfig

from grpo_hf import GRPOConfig, GRPOTrainer
from grpo_hf.rollout import (
    ENGINES,
    MicroBatch,
    RolloutEngine,
    engine_class,
    make_engine,
    register_engine,
    split_into_micro_batches,
    tokenize_prompts,
)
from grpo_hf.rollout.cuda_graph import CUDAGraphEngine
from grpo_hf.rollout.hf_generate import GenerateEngine, StaticGenerateEngine
from grpo_hf.rollout.loop import LoopEngine


def _config(tokenizer, **overrides):
    settings = dict(max_new_tokens=6, do_sample=True, pad_token_id=tokenizer.pad_token_id, top_k=0)
    return GenerationConfig(**{**settings, **overrides})


def _prompts(tokenizer):
    return tokenize_prompts(tokenizer, ["Hi"] * 2 + ["A longer prompt here"] * 2)[:2]


def test_engines_are_imported_lazily_and_unknown_names_list_the_known_ones():
    assert isinstance(ENGINES["cuda_graph"], str) or issubclass(ENGINES["cuda_graph"], RolloutEngine)
    assert engine_class("loop") is LoopEngine
    assert isinstance(ENGINES["vllm"], str) or issubclass(ENGINES["vllm"], RolloutEngine)
    with pytest.raises(ValueError, match="Unknown rollout engine 'sglang'.*'loop'"):
        engine_class("sglang")


@pytest.mark.parametrize(
    ("device", "overrides", "sharded", "expected"),
    [
        ("cpu", {}, False, "loop"),
        ("cpu", {"typical_p": 0.9}, False, "generate"),  # a setting only generate implements
        ("cpu", {"no_repeat_ngram_size": 2}, False, "loop"),  # the sampling spec's stage: loop draws through it
        ("cuda", {}, False, "cuda_graph"),
        ("cuda", {}, True, "generate_static"),  # sharded weights are gathered anew for each rollout: no captured graph
        ("cuda", {"no_repeat_ngram_size": 2}, False, "generate_static"),
    ],
)
def test_auto_picks_the_first_engine_that_applies(tokenizer, device, overrides, sharded, expected):
    model = build_tiny_model(tokenizer)
    engine, why = make_engine(
        "auto", model, _config(tokenizer, **overrides), [tokenizer.eos_token_id], sharded=sharded, device=device
    )
    assert engine.name == expected
    assert why.startswith(f"rollout engine: {expected} (requested auto)")
    if expected != ("cuda_graph" if device == "cuda" else "loop"):
        assert "skipped" in why  # the log line says why the faster engines were passed over


def test_a_named_engine_that_does_not_apply_falls_back_and_says_why(tokenizer):
    model = build_tiny_model(tokenizer)
    engine, why = make_engine("loop", model, _config(tokenizer, typical_p=0.9), [tokenizer.eos_token_id])
    assert isinstance(engine, GenerateEngine)
    assert "loop: the generation settings set typical_p" in why


def test_generate_static_needs_a_model_that_compiles(tokenizer):
    model = build_tiny_model(tokenizer)
    assert StaticGenerateEngine.unsupported_reason(model, _config(tokenizer)) is None
    model._can_compile_fullgraph = False
    assert "static" in StaticGenerateEngine.unsupported_reason(model, _config(tokenizer))


@pytest.mark.parametrize("engine_name", ["generate", "generate_static"])
def test_static_cache_generation_under_autocast_with_fp32_weights(tokenizer, engine_name):
    """fp32 weights under bf16 autocast: keys stay fp32 (rotary), values are bf16; the static cache holds both."""
    model = build_tiny_model(tokenizer)
    prompt_ids, prompt_mask = _prompts(tokenizer)
    config = _config(tokenizer, top_k=1, cache_implementation="static" if engine_name == "generate" else None)
    engine, _ = make_engine(engine_name, model, config, [tokenizer.eos_token_id])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ids, mask, _ = engine.generate(model, prompt_ids, prompt_mask)
        reference = model.generate(
            input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=_config(tokenizer, top_k=1)
        )[:, prompt_ids.size(1) :]  # dynamic cache, the same autocast
    assert ids.shape == (4, 6) and mask.sum() > 0
    torch.testing.assert_close(ids * mask, reference[:, : ids.size(1)] * mask)


def test_generate_static_rounds_its_cache_length_up_so_that_prompt_lengths_share_a_compiled_step(tokenizer):
    model = build_tiny_model(tokenizer)
    lengths, generate = [], model.generate
    model.generate = lambda **kwargs: lengths.append(kwargs["past_key_values"].get_max_length()) or generate(**kwargs)
    engine, _ = make_engine("generate_static", model, _config(tokenizer, top_k=1), [tokenizer.eos_token_id])
    for prompts in (["Hi"], ["Hello there, how are you?"], ["x" * 60]):
        prompt_ids, prompt_mask, _ = tokenize_prompts(tokenizer, prompts)
        ids, mask, _ = engine.generate(model, prompt_ids, prompt_mask)
        reference = generate(
            input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=_config(tokenizer, top_k=1)
        )
        assert torch.equal(ids * mask, reference[:, prompt_ids.size(1) :][:, : ids.size(1)] * mask)
    assert lengths == [64, 64, 128]  # prompt + 6 new tokens, rounded up to a multiple of 64


def test_a_registered_engine_is_used_by_the_trainer_and_told_of_every_optimizer_step(tmp_path, tokenizer):
    class Recording(RolloutEngine):
        instances = []

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.updates = 0
            Recording.instances.append(self)

        def sample(self, model, prompt_ids, prompt_mask):
            return torch.full((prompt_ids.size(0), 3), 70, dtype=torch.long)

        def on_weights_updated(self, model):
            self.updates += 1

    register_engine("recording", Recording)
    try:
        args = GRPOConfig(
            output_dir=str(tmp_path),
            per_device_train_batch_size=4,
            num_generations=2,
            max_completion_length=3,
            max_steps=3,
            rollout_engine="recording",
            use_cpu=True,
            report_to="none",
            save_strategy="no",
        )
        dataset = Dataset.from_dict({"prompt": ["a", "b", "c", "d"]})
        reward = lambda completion_ids, **kw: [float(i) for i in range(len(completion_ids))]  # noqa: E731
        trainer = GRPOTrainer(
            build_tiny_model(tokenizer), reward, args, train_dataset=dataset, processing_class=tokenizer
        )
        trainer.train()
    finally:
        del ENGINES["recording"]
    (engine,) = Recording.instances
    assert trainer.rollout is engine and trainer.num_generate_calls == 3 and engine.updates == 3


def test_config_checks_the_engine_name_and_the_old_alias(tmp_path):
    with pytest.raises(ValueError, match="rollout_engine='sglang' is not one of"):
        GRPOConfig(output_dir=str(tmp_path), rollout_engine="sglang", use_cpu=True)
    assert GRPOConfig(output_dir=str(tmp_path), use_model_generate=True, use_cpu=True).rollout_engine == "generate"
    with pytest.raises(ValueError, match="Keep only rollout_engine"):
        GRPOConfig(output_dir=str(tmp_path), use_model_generate=True, rollout_engine="loop", use_cpu=True)


@pytest.mark.parametrize("compiled", [False, True])
def test_cuda_graph_engine_follows_the_weights_the_optimizer_writes_in_place(
    tmp_path, tokenizer, monkeypatch, compiled
):
    """bf16 weights + fp32 master weights: after optimizer steps the engine's reused buffers sample the new policy.
    Compiled (as on CUDA; Dynamo's tracing only, `backend="eager"`): inside the trainer, under its autocast, the step
    compiles once, in the first rollout, and the later rollouts replay it without a recompile."""
    if compiled:
        torch._dynamo.reset()  # this test's compile is the first of `decode_step`; any other would be a recompile
        init = CUDAGraphEngine.__init__

        def compiling_init(self, *args, **kwargs):
            init(self, *args, compile=True)
            self.compile_kwargs = {"fullgraph": True, "backend": "eager", "dynamic": False}

        monkeypatch.setattr(CUDAGraphEngine, "__init__", compiling_init)
    model = build_tiny_model(tokenizer, hidden_size=64).to(torch.bfloat16)
    initial = [p.detach().clone() for p in model.parameters()]
    args = GRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=6,
        max_steps=3,
        learning_rate=1e-3,
        bf16=True,
        rollout_engine="cuda_graph",  # on the CPU its decode step runs eagerly; the buffers are reused all the same
        use_cpu=True,
        report_to="none",
        save_strategy="no",
    )
    dataset = Dataset.from_dict({"prompt": ["Hi", "Hello there"] * 4})
    reward = lambda completion_ids, **kw: [float(sum(ids) % 5) for ids in completion_ids]  # noqa: E731
    trainer = GRPOTrainer(model, reward, args, train_dataset=dataset, processing_class=tokenizer)
    with torch._dynamo.config.patch(error_on_recompile=True):
        trainer.train()
    assert trainer.rollout.name == "cuda_graph" and trainer.precision_guard.masters is not None
    buckets = list(trainer.rollout._buckets.values())
    assert len(buckets) == 1 and buckets[0].compiled == compiled and not buckets[0].eager
    assert (trainer.rollout._step is not None) == compiled
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), initial, strict=True))  # the policy moved

    prompt_ids, prompt_mask, _ = tokenize_prompts(tokenizer, ["Hi"] * 4 + ["Hello there"] * 4)
    argmax = _config(tokenizer, top_k=1, max_new_tokens=6)
    trainer.rollout.generation_config = argmax  # the same engine object, its buffers from training reused
    ours = trainer.rollout.generate(model, prompt_ids, prompt_mask)
    reference = RolloutEngine.generate(
        GenerateEngine(argmax, [tokenizer.eos_token_id]), model, prompt_ids, prompt_mask
    )
    width = min(ours.completion_ids.size(1), reference.completion_ids.size(1))
    mask = ours.completion_mask[:, :width]
    assert torch.equal(mask, reference.completion_mask[:, :width])
    assert torch.equal(ours.completion_ids[:, :width] * mask, reference.completion_ids[:, :width] * mask)


def test_split_into_micro_batches_trims_each_ones_own_padding():
    batch = MicroBatch(
        prompt_ids=torch.tensor([[0, 0, 5], [0, 0, 6], [0, 7, 8], [9, 9, 9]]),
        prompt_mask=torch.tensor([[0, 0, 1], [0, 0, 1], [0, 1, 1], [1, 1, 1]]),
        completion_ids=torch.tensor([[1, 2, 0, 0], [3, 0, 0, 0], [4, 5, 6, 0], [7, 0, 0, 0]]),
        completion_mask=torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0]]),
        old_logps=None,
        advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]),
    )
    first, second = split_into_micro_batches(batch, 2)
    assert first.prompt_ids.tolist() == [[5], [6]] and first.completion_ids.tolist() == [[1, 2], [3, 0]]
    assert second.prompt_ids.shape == (2, 3) and second.completion_mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert first.old_logps is None and second.advantages.tolist() == [0.5, -0.5]


def test_split_into_micro_batches_pads_each_one_once_to_the_multiple():
    """pad_to_multiple_of: each micro-batch is trimmed, then padded once; per-token columns follow the completions, the
    new positions are masked out, and the rows keep their values."""
    completion_mask = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0]])
    batch = MicroBatch(
        prompt_ids=torch.tensor([[0, 5, 6], [0, 5, 6], [0, 0, 7], [0, 0, 7]]),
        prompt_mask=torch.tensor([[0, 1, 1], [0, 1, 1], [0, 0, 1], [0, 0, 1]]),
        completion_ids=torch.arange(1, 21).view(4, 5) * completion_mask,
        completion_mask=completion_mask,
        advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]),
        ref_logps=-torch.rand(4, 5) * completion_mask,
    )
    first, second = split_into_micro_batches(batch, 2, multiple=4, pad_token_id=0)
    for part, rows in ((first, slice(0, 2)), (second, slice(2, 4))):
        assert part.prompt_ids.size(1) == 4 and part.completion_ids.size(1) == 4
        assert part.ref_logps.shape == part.completion_ids.shape
        width = int(batch.completion_mask[rows].sum(dim=1).max())  # the columns the rows use
        assert torch.equal(part.completion_mask[:, :width], batch.completion_mask[rows, :width])
        assert part.completion_mask[:, width:].sum() == 0 and part.ref_logps[:, width:].abs().sum() == 0
        assert torch.equal(part.ref_logps[:, :width], batch.ref_logps[rows, :width])
        assert torch.equal(part.advantages, batch.advantages[rows])
    assert first.prompt_ids.tolist() == [[0, 0, 5, 6], [0, 0, 5, 6]] and second.prompt_mask.tolist()[0] == [0, 0, 0, 1]


def test_continuous_batching_engine_decodes_what_generate_decodes(tokenizer):
    """transformers' continuous batching (`generate_batch`): greedy, each row's tokens are `model.generate`'s, in the
    rows' order, padded after EOS; the engine's config takes TRL's max_memory_percent unless one is given."""
    model = build_tiny_model(tokenizer).eval()
    prompt_ids, prompt_mask, _ = tokenize_prompts(tokenizer, ["Hi", "A longer prompt here", "x", "Hello there"])
    config = _config(tokenizer, do_sample=False, top_k=None, eos_token_id=[tokenizer.eos_token_id])
    with pytest.warns(FutureWarning, match="use_transformers_paged is deprecated"):
        args = GRPOConfig(output_dir="unused", use_transformers_paged=True, use_cpu=True, report_to="none")
    assert args.rollout_engine == "continuous_batching"
    engine, _ = make_engine(args.rollout_engine, model, config, [tokenizer.eos_token_id], args=args)
    assert engine.continuous_batching_config.max_memory_percent == 0.5  # TRL's default, not transformers' 0.9
    # A paged cache of a fixed size: sized from the free memory, it would take half of this machine's.
    custom = GRPOConfig(
        output_dir="unused",
        use_cpu=True,
        report_to="none",
        rollout_engine="continuous_batching",
        transformers_continuous_batching_config='{"num_blocks": 16, "max_batch_tokens": 256}',
    )
    engine, _ = make_engine(custom.rollout_engine, model, config, [tokenizer.eos_token_id], args=custom)
    assert engine.continuous_batching_config.num_blocks == 16
    ids, mask, _ = engine.generate(model, prompt_ids, prompt_mask)
    reference = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=config)
    reference = reference[:, prompt_ids.size(1) :]
    assert ids.shape == (4, 6) and mask.sum() > 0
    torch.testing.assert_close(ids * mask, reference * mask)


def test_cache_implementation_reaches_generate_and_picks_it(tmp_path, tokenizer):
    """TRL's cache_implementation: the KV cache of `model.generate`; with rollout_engine='auto' the generate engine,
    whose static cache then decodes what the dynamic one does."""
    args = GRPOConfig(output_dir=str(tmp_path), cache_implementation="static", use_cpu=True, report_to="none")
    assert args.rollout_engine == "generate"
    config = args.generation_config_for(tokenizer.pad_token_id, [tokenizer.eos_token_id])
    assert config.cache_implementation == "static"
    assert (
        GRPOConfig(output_dir=str(tmp_path), use_cpu=True).generation_config_for(0, [1]).cache_implementation is None
    )
    model = build_tiny_model(tokenizer)
    calls, generate = [], model.generate
    model.generate = lambda **kwargs: calls.append(kwargs) or generate(**kwargs)
    engine, _ = make_engine(args.rollout_engine, model, config, [tokenizer.eos_token_id])
    prompt_ids, prompt_mask = _prompts(tokenizer)
    engine.generate(model, prompt_ids, prompt_mask)
    assert type(calls[0]["past_key_values"]).__name__ == "StaticCache"
    with pytest.raises(ValueError, match="ask for different rollout engines"):
        GRPOConfig(output_dir=str(tmp_path), use_model_generate=True, use_transformers_continuous_batching=True)
