"""The `cuda_graph` engine draws what `model.generate` draws, with a decode step that compiles without a graph break.

CPU only: the step runs eagerly (compile=False), except where `torch.compile(..., backend="eager", fullgraph=True)`
checks that it traces as one graph, and one test compiles it as a GPU run does (inductor, the engine's own
`compile_kwargs`). That the graph is captured by CUDA graphs is measured on a GPU, not here.
"""

import abc
import logging
import shutil

import pytest
import torch
from conftest import build_tiny_model
from transformers import (
    GenerationConfig,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import grpo_hf.rollout.cuda_graph as cuda_graph
from grpo_hf.rollout import logits_processors, make_engine, tokenize_prompts
from grpo_hf.rollout.cuda_graph import (
    CUDAGraphEngine,
    SamplingSettings,
    min_p_filter,
    process_logits,
    prompt_seen_mask,
    repetition_penalty,
    top_k_filter,
    top_p_filter,
)
from grpo_hf.rollout.sampling import GENERATE_SKIPS_PADDING

PROMPTS = ["Hello there"] * 2 + ["A much longer prompt, with more tokens"] * 3 + ["Why?"] * 2 + ["Count: 1 2 3 4"]


def _config(tokenizer, **settings) -> GenerationConfig:
    settings = {"max_new_tokens": 12, "top_k": 1, "do_sample": True, **settings}
    return GenerationConfig(pad_token_id=tokenizer.pad_token_id, eos_token_id=[tokenizer.eos_token_id], **settings)


def _model(tokenizer, arch="llama", seed=1, eos_scale=2.0, attention="sdpa"):
    """A tiny model whose EOS logit is scaled up, so that some rows (not all) end early under argmax."""
    model = build_tiny_model(tokenizer, arch, seed=seed).eval()
    model.config._attn_implementation = attention
    with torch.no_grad():
        model.lm_head.weight[tokenizer.eos_token_id] *= eos_scale
    return model


def _engine(model, config, tokenizer, **options) -> CUDAGraphEngine:
    engine, why = make_engine("cuda_graph", model, config, [tokenizer.eos_token_id], **options)
    assert isinstance(engine, CUDAGraphEngine), why
    return engine


def _assert_compiled(engine: CUDAGraphEngine) -> None:
    """Every bucket ran its compiled step: none fell back to eager (which would draw the same tokens)."""
    assert engine._buckets and all(b.compiled and not b.eager for b in engine._buckets.values())


def _reference(model, prompt_ids, prompt_mask, config, tokenizer):
    engine, _ = make_engine("generate", model, config, [tokenizer.eos_token_id])
    return engine.generate(model, prompt_ids, prompt_mask)


@pytest.mark.parametrize(
    ("arch", "seed", "eos_scale", "attention"), [("llama", 1, 2.0, "sdpa"), ("qwen2", 2, 3.0, "eager")]
)
def test_argmax_sampling_matches_model_generate_token_for_token(tokenizer, arch, seed, eos_scale, attention):
    """Left-padded prompts of four lengths, groups of 1 to 3 rows, some ending with EOS and some truncated."""
    model = _model(tokenizer, arch, seed, eos_scale, attention)
    prompt_ids, prompt_mask, _ = tokenize_prompts(tokenizer, PROMPTS)
    config = _config(tokenizer)
    ours = _engine(model, config, tokenizer, compile=False).generate(model, prompt_ids, prompt_mask)
    reference = _reference(model, prompt_ids, prompt_mask, config, tokenizer)
    assert 0 < int(reference.is_truncated.sum()) < len(PROMPTS)  # the case is not degenerate
    for ours_tensor, reference_tensor in zip(ours, reference, strict=True):
        assert torch.equal(ours_tensor, reference_tensor)


def test_unset_settings_take_the_models_generation_config_defaults(tokenizer):
    model = _model(tokenizer)
    model.generation_config.top_k = 1  # the model's default makes sampling an argmax
    prompt_ids, prompt_mask, _ = tokenize_prompts(tokenizer, PROMPTS)
    config = _config(tokenizer, top_k=None)
    assert SamplingSettings.of(model, config).top_k == 1
    ours = _engine(model, config, tokenizer, compile=False).generate(model, prompt_ids, prompt_mask)
    assert torch.equal(
        ours.completion_ids, _reference(model, prompt_ids, prompt_mask, config, tokenizer).completion_ids
    )


def test_finished_rows_emit_pad_and_the_loop_stops_when_all_rows_have_finished(tokenizer, monkeypatch):
    model = _model(tokenizer, seed=3, eos_scale=3.0)  # every row draws EOS within 2 tokens
    prompt_ids, prompt_mask, _ = tokenize_prompts(tokenizer, PROMPTS)
    config = _config(tokenizer, max_new_tokens=64)
    engine = _engine(model, config, tokenizer, compile=False)
    engine.check_every = 4
    steps, decode_step = [], cuda_graph.decode_step
    monkeypatch.setattr(cuda_graph, "decode_step", lambda *args: steps.append(1) or decode_step(*args))
    completion_ids, completion_mask, is_truncated = engine.generate(model, prompt_ids, prompt_mask)

    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    lengths = completion_mask.sum(1)  # [N]
    assert not is_truncated.any() and completion_ids.size(1) == int(lengths.max()) == 2 and int(lengths.min()) == 1
    for row, length in zip(completion_ids, lengths.tolist(), strict=True):
        assert row[length - 1] == eos and (row[length:] == pad).all() and (row[: length - 1] != eos).all()
    assert torch.equal(completion_mask, (torch.arange(completion_ids.size(1)) < lengths[:, None]).long())
    assert len(steps) <= 2 * engine.check_every  # early stop, not 63 steps
    sampled = engine.sample(model, prompt_ids, prompt_mask)  # before `generate` pads: the engine's own padding
    assert torch.equal(sampled, completion_ids)
    assert torch.equal(completion_ids, _reference(model, prompt_ids, prompt_mask, config, tokenizer).completion_ids)


@pytest.mark.parametrize("compiled", [False, True])
def test_weights_changed_in_place_are_seen_by_the_next_call(tokenizer, compiled):
    model = _model(tokenizer)
    prompt_ids, prompt_mask, _ = tokenize_prompts(tokenizer, PROMPTS)
    config = _config(tokenizer)
    engine = _engine(model, config, tokenizer, compile=compiled)
    engine.compile_kwargs = {"fullgraph": True, "backend": "eager", "dynamic": False}
    before = engine.generate(model, prompt_ids, prompt_mask).completion_ids
    weight = model.lm_head.weight
    pointer = weight.data_ptr()
    with torch.no_grad():
        weight.data.copy_(weight.flip(0))  # the argmax v becomes V - 1 - v
    engine.on_weights_updated(model)
    after = engine.generate(model, prompt_ids, prompt_mask).completion_ids
    assert weight.data_ptr() == pointer and engine._buckets  # in place: the buffers were kept
    if compiled:
        _assert_compiled(engine)
    assert torch.equal(after[:, 0], len(tokenizer) - 1 - before[:, 0])
    assert torch.equal(after, _reference(model, prompt_ids, prompt_mask, config, tokenizer).completion_ids)


@pytest.mark.parametrize("compiled", [False, True])
def test_lora_model_samples_what_the_merged_model_samples(tokenizer, compiled):
    """The LoRA layers run inside the step (traced as one graph when compiled), without merging the adapter."""
    peft = pytest.importorskip("peft")
    model = _model(tokenizer)
    prompt_ids, prompt_mask, _ = tokenize_prompts(tokenizer, PROMPTS)
    config = _config(tokenizer)
    base = _engine(model, config, tokenizer, compile=False).generate(model, prompt_ids, prompt_mask).completion_ids
    torch.manual_seed(0)
    lora_config = peft.LoraConfig(r=4, lora_alpha=32, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    lora = peft.get_peft_model(model, lora_config).eval()
    engine = _engine(lora, config, tokenizer, compile=compiled)
    engine.compile_kwargs = {"fullgraph": True, "backend": "eager", "dynamic": False}
    ours = engine.generate(lora, prompt_ids, prompt_mask).completion_ids
    merged = lora.merge_and_unload()
    reference = _engine(merged, config, tokenizer, compile=False).generate(merged, prompt_ids, prompt_mask)
    assert not torch.equal(ours, base)  # the adapter changes what is sampled
    assert torch.equal(ours, reference.completion_ids)
    if compiled:
        _assert_compiled(engine)


def test_decode_step_compiles_as_one_graph_and_draws_what_the_eager_step_draws(tokenizer):
    """fullgraph=True fails on any graph break (`.item()`, `.tolist()`, a branch on a tensor's value); the second
    batch (shorter prompts, same rows) reuses the bucket and the graph: a recompile would raise."""
    model = _model(tokenizer, seed=3, eos_scale=1.5)
    prompt_ids, prompt_mask, _ = tokenize_prompts(tokenizer, PROMPTS)
    settings = dict(max_new_tokens=6, temperature=0.8, top_k=20, top_p=0.9, min_p=0.02, repetition_penalty=1.3)
    config = _config(tokenizer, **settings)
    eager = _engine(model, config, tokenizer, compile=False)
    compiled = _engine(model, config, tokenizer, compile=True)
    compiled.compile_kwargs = {"fullgraph": True, "backend": "eager", "dynamic": False}
    shorter_ids, shorter_mask, _ = tokenize_prompts(tokenizer, [p[:5] for p in PROMPTS])
    for batch, recompile_raises in (((prompt_ids, prompt_mask), False), ((shorter_ids, shorter_mask), True)):
        torch.manual_seed(0)
        expected = eager.generate(model, *batch)
        torch.manual_seed(0)
        with torch._dynamo.config.patch(error_on_recompile=recompile_raises):
            got = compiled.generate(model, *batch)
        assert torch.equal(got.completion_ids, expected.completion_ids)
    assert expected.completion_ids.size(1) == 6 and expected.completion_mask.sum() > len(PROMPTS)
    assert compiled._step is not None and len(compiled._buckets) == 1
    _assert_compiled(compiled)


@pytest.mark.skipif(not any(map(shutil.which, ("g++", "c++", "clang++"))), reason="inductor needs a C++ compiler")
def test_the_engines_own_compile_settings_build_a_step_that_reads_the_weights_where_they_live(tokenizer):
    """The step as a GPU run compiles it (`compile_kwargs` as shipped: inductor, `mode="reduce-overhead"`, which on
    CPU skips only the CUDA-graph capture): every processor lowers, the in-place cache and state updates survive
    functionalisation, and the generated code reads the parameters instead of baking them in, so that an in-place
    optimizer update is seen by the next call without a recompile."""
    torch._dynamo.reset()  # a fresh cache for `decode_step`: earlier tests' entries count towards the recompile limit
    model = _model(tokenizer, seed=3, eos_scale=1.5)
    prompt_ids, prompt_mask, _ = tokenize_prompts(tokenizer, PROMPTS)
    settings = dict(max_new_tokens=8, temperature=0.7, top_p=0.9, min_p=0.02, repetition_penalty=1.3)
    config = _config(tokenizer, **settings)  # top_k=1: an argmax after every processor, so that draws can be compared
    eager = _engine(model, config, tokenizer, compile=False)
    compiled = _engine(model, config, tokenizer, compile=True)
    assert compiled.compile_kwargs == {"mode": "reduce-overhead", "fullgraph": True, "dynamic": False}
    before = compiled.generate(model, prompt_ids, prompt_mask).completion_ids
    assert torch.equal(before, eager.generate(model, prompt_ids, prompt_mask).completion_ids)
    assert torch.equal(before, _reference(model, prompt_ids, prompt_mask, config, tokenizer).completion_ids)

    with torch.no_grad():  # what an optimizer step does: new values, same storage
        for parameter in model.model.layers[-1].parameters():
            parameter.add_(torch.randn_like(parameter) * parameter.abs().mean())
    compiled.on_weights_updated(model)
    with torch._dynamo.config.patch(error_on_recompile=True):
        after = compiled.generate(model, prompt_ids, prompt_mask).completion_ids
    assert not torch.equal(after, before)
    assert torch.equal(after, eager.generate(model, prompt_ids, prompt_mask).completion_ids)
    _assert_compiled(compiled)

    # Sampled, not argmax: inductor calls torch.rand as eager does (`fallback_random`), where its own kernel would
    # draw float32 and cast, so the compiled step draws the very tokens the eager step draws from the same seed.
    sampled = _config(tokenizer, **settings, top_k=None)
    compiled = _engine(model, sampled, tokenizer, compile=True)
    draws = []
    for engine in (_engine(model, sampled, tokenizer, compile=False), compiled):
        torch.manual_seed(7)
        draws.append(engine.generate(model, prompt_ids, prompt_mask).completion_ids)
    assert torch.equal(draws[0], draws[1]) and len(set(draws[0][:, 0].tolist())) > 1  # sampled: rows differ
    _assert_compiled(compiled)


def test_a_batch_of_fewer_rows_reuses_the_compiled_step_of_a_bucket_of_more_rows(tokenizer):
    """Dynamic sampling's later rounds and eval batches are smaller: they decode in the larger bucket (its spare rows
    start finished and are cut off) instead of compiling for every row count, down to a quarter of its rows; the
    eager engine keeps exact rows."""
    model = _model(tokenizer, seed=3, eos_scale=1.5)
    config = _config(tokenizer, max_new_tokens=6, repetition_penalty=1.2)
    eager = _engine(model, config, tokenizer, compile=False)
    compiled = _engine(model, config, tokenizer, compile=True)
    compiled.compile_kwargs = {"fullgraph": True, "backend": "eager", "dynamic": False}
    for count in (len(PROMPTS), 5, 2, 1):
        prompt_ids, prompt_mask, _ = tokenize_prompts(tokenizer, PROMPTS[-count:])
        with torch._dynamo.config.patch(error_on_recompile=count in (5, 2)):
            got = compiled.generate(model, prompt_ids, prompt_mask)
        expected = eager.generate(model, prompt_ids, prompt_mask)
        for got_tensor, expected_tensor in zip(got, expected, strict=True):
            assert torch.equal(got_tensor, expected_tensor), count
    assert sorted(key[1:] for key in compiled._buckets) == [(1, 64), (len(PROMPTS), 64)]  # 1 row: a bucket of its own
    assert sorted(key[1] for key in eager._buckets) == [1, 2, 5, len(PROMPTS)]
    _assert_compiled(compiled)


def _broken_backend(graph_module, example_inputs):
    raise RuntimeError("this backend cannot compile")


@pytest.mark.parametrize("failure", ["recompile limit", "backend error"])
def test_a_step_that_does_not_compile_runs_eagerly_with_one_warning(tokenizer, caplog, failure):
    """Under fullgraph=True Dynamo raises at its recompile limit (8 by default: 8 row counts or prompt buckets would
    stop a run) and when a backend fails; the bucket then decodes eagerly, drawing the same tokens, and says why."""
    torch._dynamo.reset()  # count this test's compiles only
    model = _model(tokenizer, seed=3, eos_scale=1.5)
    config = _config(tokenizer, max_new_tokens=5)
    eager = _engine(model, config, tokenizer, compile=False)
    compiled = _engine(model, config, tokenizer, compile=True)
    backend = "eager" if failure == "recompile limit" else _broken_backend
    compiled.compile_kwargs = {"fullgraph": True, "backend": backend, "dynamic": False}
    compiled.max_compiles = 2
    batches = [tokenize_prompts(tokenizer, PROMPTS[:count])[:2] for count in (2, 4, 6, 6, 3)]
    with caplog.at_level(logging.INFO, logger="grpo_hf.rollout.cuda_graph"):
        with torch._dynamo.config.patch(recompile_limit=2):
            for prompt_ids, prompt_mask in batches:
                got = compiled.generate(model, prompt_ids, prompt_mask).completion_ids
                assert torch.equal(got, eager.generate(model, prompt_ids, prompt_mask).completion_ids)
    messages = [record.getMessage() for record in caplog.records]
    compiled_for = [m for m in messages if "compiled the decode step" in m]
    eager_for = [m for m in messages if "did not compile" in m]
    if failure == "recompile limit":  # 2 and 4 rows compile; 6 rows would be the third compile
        assert len(compiled_for) == 2 and len(eager_for) == 1 and "6 rows" in eager_for[0]
        assert "FailOnRecompileLimitHit" in eager_for[0] and "up to 2 shapes" in eager_for[0]
    else:  # 2, 4 and 6 rows each try once
        assert not compiled_for and len(eager_for) == 3 and "cannot compile" in eager_for[0]
    assert all(record.levelno == logging.WARNING for record in caplog.records if "did not compile" in record.msg)


def test_the_engine_lifts_dynamos_recompile_limit_of_8_while_it_decodes(tokenizer, caplog):
    """Nine row counts, one after another, each a new bucket: under Dynamo's default limit the ninth compile raises
    (fullgraph=True); the engine decodes under `max_compiles` (64), and leaves the global limit as it was."""
    torch._dynamo.reset()
    model = _model(tokenizer, seed=3, eos_scale=1.5)
    compiled = _engine(model, _config(tokenizer, max_new_tokens=3), tokenizer, compile=True)
    compiled.compile_kwargs = {"fullgraph": True, "backend": "eager", "dynamic": False}
    assert torch._dynamo.config.recompile_limit == 8
    with caplog.at_level(logging.INFO, logger="grpo_hf.rollout.cuda_graph"):
        for count in range(1, 10):
            compiled.generate(model, *tokenize_prompts(tokenizer, ["Hello there"] * count)[:2])
    assert sum("compiled the decode step" in record.getMessage() for record in caplog.records) == 9
    assert [key[1] for key in compiled._buckets] == [9]  # each bucket replaced the one before, which it holds
    _assert_compiled(compiled)
    assert torch._dynamo.config.recompile_limit == 8


def test_unsupported_reason_names_what_the_static_step_cannot_take(tokenizer):
    model = _model(tokenizer)
    config = _config(tokenizer)
    assert CUDAGraphEngine.unsupported_reason(model, config) is None
    assert "do_sample" in CUDAGraphEngine.unsupported_reason(model, _config(tokenizer, do_sample=False))
    model.config._attn_implementation = "flash_attention_2"
    assert "4-D mask" in CUDAGraphEngine.unsupported_reason(model, config)


# ----------------------------------------------------------------------------------------------------
# The processors, one by one and chained, against transformers' own on random logits


def _random_scores(N=16, V=300, seed=0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randn((N, V), generator=generator) * 3  # [N, V]
    return scores.round(decimals=1)  # ties, which the top-k and top-p boundaries must treat as transformers does


def _padded_history(N=16, P=10, T=5, V=300, seed=1):
    """Left-padded prompts (one with an id beyond the logits' vocabulary) followed by generated tokens."""
    generator = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(0, V, (N, P), generator=generator)  # [N, P]
    prompt_mask = (torch.arange(P)[None] >= torch.randint(0, P - 1, (N, 1), generator=generator)).long()  # [N, P]
    prompt_ids[0, -1] = V + 3
    generated = torch.randint(0, V, (N, T), generator=generator)  # [N, T]
    return prompt_ids, prompt_mask, generated


def test_each_processor_equals_transformers_on_random_logits():
    scores = _random_scores()
    input_ids = torch.zeros((scores.size(0), 1), dtype=torch.long)
    for k in (1, 7, 50, 1000):
        assert torch.equal(top_k_filter(scores, k), TopKLogitsWarper(k)(input_ids, scores)), k
    for p in (0.0, 0.05, 0.5, 0.9, 0.99):  # 0.0: only the kept top token is left
        assert torch.equal(top_p_filter(scores, p), TopPLogitsWarper(p)(input_ids, scores)), p
    for p in (0.0, 0.05, 0.3, 1.0):
        assert torch.equal(min_p_filter(scores, p), MinPLogitsWarper(p)(input_ids, scores)), p
    warmer = process_logits(scores, None, SamplingSettings(temperature=0.7))
    assert torch.equal(warmer, TemperatureLogitsWarper(0.7)(input_ids, scores))

    prompt_ids, prompt_mask, generated = _padded_history(V=scores.size(1))
    seen = prompt_seen_mask(prompt_ids, prompt_mask, scores.size(1)).scatter(1, generated, True)  # [N, V]
    history = torch.cat([prompt_ids, generated], dim=1)  # [N, P + T]
    for penalty in (0.8, 1.5):
        assert torch.equal(
            repetition_penalty(scores, seen, penalty), generates_penalty(penalty, prompt_mask)(history, scores)
        ), penalty
    V = scores.size(1)
    everything = torch.zeros((len(seen), V + 1), dtype=torch.bool).scatter(1, history.clamp(max=V), True)[:, :V]
    # transformers >= 5.23: the left padding holds tokens that are not penalised; before, `generate` penalises them
    assert torch.equal(seen, everything) != GENERATE_SKIPS_PADDING


def generates_penalty(penalty: float, prompt_mask: torch.Tensor) -> RepetitionPenaltyLogitsProcessor:
    """transformers' repetition penalty as the installed `generate` builds it (`GENERATE_SKIPS_PADDING`, itself
    checked against `generate` in test_sampling_replay.py): each row's left padding skipped from 5.23 on."""
    if GENERATE_SKIPS_PADDING:
        return RepetitionPenaltyLogitsProcessor(penalty, prompt_ignore_length=(prompt_mask != 0).int().argmax(dim=1))
    return RepetitionPenaltyLogitsProcessor(penalty)


def test_chained_processors_equal_the_ones_generate_applies():
    scores = _random_scores(seed=2)
    prompt_ids, prompt_mask, generated = _padded_history(V=scores.size(1))
    settings = dict(temperature=0.7, top_k=40, top_p=0.8, min_p=0.05, repetition_penalty=1.3)
    config = GenerationConfig(do_sample=True, max_new_tokens=5, pad_token_id=0, **settings)
    expected = logits_processors(config, prompt_mask)(torch.cat([prompt_ids, generated], dim=1), scores)
    seen = prompt_seen_mask(prompt_ids, prompt_mask, scores.size(1)).scatter(1, generated, True)  # [N, V]
    ours = process_logits(scores, seen, SamplingSettings(pad_token_id=0, **settings))
    assert torch.equal(ours, expected)
    assert (ours == -float("inf")).any(dim=1).all() and torch.isfinite(ours).sum(dim=1).min() >= 1


# ----------------------------------------------------------------------------------------------------
# Logging (the sampled distribution is tested for every engine in test_fast_paths.py)


def test_the_first_compiled_step_of_a_bucket_reports_its_compile_time_once(tokenizer, caplog):
    model = build_tiny_model(tokenizer, "llama", seed=1).eval()
    prompt_ids, prompt_mask, _ = tokenize_prompts(tokenizer, ["Hi"] * 2 + ["Hello again"] * 2)
    config = GenerationConfig(max_new_tokens=4, do_sample=True, top_k=0, pad_token_id=tokenizer.pad_token_id)
    engine = CUDAGraphEngine(config, [tokenizer.eos_token_id], compile=True)
    engine.compile_kwargs = {"backend": "eager", "fullgraph": True}
    with caplog.at_level(logging.INFO, logger="grpo_hf.rollout.cuda_graph"):
        engine.generate(model, prompt_ids, prompt_mask)
        engine.generate(model, prompt_ids, prompt_mask)  # the same bucket: no second report
    reports = [r.getMessage() for r in caplog.records if "compiled the decode step" in r.getMessage()]
    assert len(reports) == 1 and "4 rows x 68 positions" in reports[0]
    _assert_compiled(engine)


# ----------------------------------------------------------------------------------------------------
# GPU hardening: grouped-query decode attention, guarded first calls, exact draws, LoRA precision, drift


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_grouped_decode_attention_equals_transformers_sdpa_with_the_cache_repeated(tokenizer, arch):
    """One query token over the un-repeated cache equals transformers' sdpa path (`repeat_kv`), values to float32
    rounding, for a boolean and an additive mask, on the attention modules of tiny GQA models (4 heads, 2 KV)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    model = _model(tokenizer, arch)
    module = model.model.layers[0].self_attn
    assert module.num_key_value_groups == 2
    generator = torch.Generator().manual_seed(0)
    N, H, H_kv, L, D = 3, 4, 2, 9, module.head_dim
    query = torch.randn((N, H, 1, D), generator=generator)
    key, value = torch.randn((2, N, H_kv, L, D), generator=generator)
    visible = torch.rand((N, 1, 1, L), generator=generator) > 0.3
    visible[..., -1] = True
    additive = torch.zeros(visible.shape).masked_fill(~visible, torch.finfo(torch.float32).min)
    for mask in (visible, additive):
        ours, _ = cuda_graph.grouped_decode_attention(module, query, key, value, mask, scaling=module.scaling)
        with torch._dynamo.config.patch(verbose=False), torch.compiler.set_stance("default"):
            reference, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=module.scaling)
        assert ours.shape == reference.shape == (N, 1, H, D)
        torch.testing.assert_close(ours, reference, rtol=1e-6, atol=1e-6)


def test_the_compiled_step_of_a_gqa_model_holds_no_copy_of_the_cache(tokenizer):
    """The traced decode step has no tensor of the repeated cache's shape [N, H, L, D] (H query heads): attention
    reads the [N, H_kv, L, D] buffers as they are. With grouped attention off (transformers' sdpa path under
    torch.compile), the same trace holds two such copies per layer (keys and values); that is what the test tells
    apart."""
    model = _model(tokenizer, "qwen2")
    prompt_ids, prompt_mask, _ = tokenize_prompts(tokenizer, PROMPTS)
    config = _config(tokenizer, max_new_tokens=3)
    N, H, layers = prompt_ids.size(0), model.config.num_attention_heads, model.config.num_hidden_layers

    def repeated_cache_tensors(grouped: bool) -> int:
        graphs = []

        def backend(graph_module, example_inputs):
            graphs.append(graph_module)
            return graph_module

        torch._dynamo.reset()
        engine = _engine(model, config, tokenizer, compile=True)
        engine.compile_kwargs = {"fullgraph": True, "backend": backend, "dynamic": False}
        engine.grouped_query_attention = grouped
        engine.generate(model, prompt_ids, prompt_mask)
        (graph,) = graphs
        L = engine._buckets[next(iter(engine._buckets))].state.attention_mask.size(-1)
        values = [node.meta.get("example_value") for node in graph.graph.nodes]
        shapes = [tuple(value.shape) for value in values if isinstance(value, torch.Tensor)]
        return sum(shape == (N, H, L, model.config.hidden_size // H) for shape in shapes)

    assert repeated_cache_tensors(grouped=False) >= 2 * layers  # the check can see the copies
    assert repeated_cache_tensors(grouped=True) == 0


class _FailOnCall:
    """The compiled step, failing at call `fail_at` (1-based) after it ran, as a failed CUDA-graph recording would:
    the step's in-place updates happened, then the error."""

    def __init__(self, step, fail_at: int):
        self.step, self.fail_at, self.calls = step, fail_at, 0

    def __call__(self, *args):
        self.calls += 1
        self.step(*args)
        if self.calls == self.fail_at:
            raise RuntimeError("CUDA error: operation failed during capture (injected)")


@pytest.mark.parametrize("fail_at", [2, 3])
def test_an_error_in_a_compiled_buckets_first_calls_falls_back_to_eager_with_the_batch_intact(
    tokenizer, caplog, fail_at
):
    """Calls 2 and 3 of a compiled bucket record and first replay its CUDA graph. An error there restores the step's
    state (the failed call's tokens, positions and cache slot are undone) and the bucket decodes the rest eagerly,
    with one warning: the completions equal an eager run's."""
    model = _model(tokenizer, seed=3, eos_scale=1.5)
    prompt_ids, prompt_mask, _ = tokenize_prompts(tokenizer, PROMPTS)
    config = _config(tokenizer, max_new_tokens=8)
    compiled = _engine(model, config, tokenizer, compile=True)
    compiled.compile_kwargs = {"fullgraph": True, "backend": "eager", "dynamic": False}
    failing = _FailOnCall(compiled._compiled_step(), fail_at)
    compiled._step = failing
    with caplog.at_level(logging.INFO, logger="grpo_hf.rollout.cuda_graph"):
        got = compiled.generate(model, prompt_ids, prompt_mask)
        again = compiled.generate(model, prompt_ids, prompt_mask)
    expected = _engine(model, config, tokenizer, compile=False).generate(model, prompt_ids, prompt_mask)
    for result in (got, again):
        for got_tensor, expected_tensor in zip(result, expected, strict=True):
            assert torch.equal(got_tensor, expected_tensor)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and f"compiled call {fail_at}" in warnings[0] and "(injected)" in warnings[0]
    assert failing.calls == fail_at  # the second generate ran eagerly from the start
    (bucket,) = compiled._buckets.values()
    assert bucket.eager


def test_a_recompile_error_asked_for_is_raised_not_caught(tokenizer):
    model = _model(tokenizer, seed=3)
    compiled = _engine(model, _config(tokenizer, max_new_tokens=3), tokenizer, compile=True)
    compiled.compile_kwargs = {"fullgraph": True, "backend": "eager", "dynamic": False}

    def raises(*args):
        raise torch._dynamo.exc.RecompileError("asked for")

    compiled._step = raises
    with pytest.raises(torch._dynamo.exc.RecompileError):
        compiled.generate(model, *tokenize_prompts(tokenizer, PROMPTS)[:2])


def test_the_compiled_step_leaves_the_vocabulary_sums_to_eager_kernels(tokenizer):
    """The draw's CDF and top-p's sum over the whole vocabulary are operators of their own (`grpo_hf::inverse_cdf`,
    `grpo_hf::cumsum`), which the compiled step calls rather than handing inductor a split scan (whose Triton code
    failed for float64 in torch 2.11 on an H100, leaving the step eager)."""
    model = _model(tokenizer, seed=3)
    graphs = []

    def backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module

    torch._dynamo.reset()
    compiled = _engine(model, _config(tokenizer, max_new_tokens=3, top_k=None, top_p=0.9), tokenizer, compile=True)
    compiled.compile_kwargs = {"fullgraph": True, "backend": backend, "dynamic": False}
    compiled.generate(model, *tokenize_prompts(tokenizer, PROMPTS)[:2])
    (graph,) = graphs
    targets = [str(node.target) for node in graph.graph.nodes if node.op in ("call_function", "call_method")]
    assert "grpo_hf.inverse_cdf.default" in targets and "grpo_hf.cumsum.default" in targets
    assert not [t for t in targets if "cumsum" in t and "grpo_hf" not in t]


def test_lora_decodes_under_the_trainers_autocast(tokenizer):
    """The step calls the PEFT wrapper's base model, which accelerate's autocast wrapper does not cover; the engine's
    `autocast` puts the whole call (LoRA layers included) under the training precision, and the tokens are those of
    the PEFT model's own forward under the same autocast (argmax, bf16)."""
    peft = pytest.importorskip("peft")
    model = _model(tokenizer, seed=3)
    prompt_ids, prompt_mask, _ = tokenize_prompts(tokenizer, PROMPTS)
    config = _config(tokenizer, max_new_tokens=6)
    torch.manual_seed(0)
    lora_config = peft.LoraConfig(r=4, lora_alpha=32, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    lora = peft.get_peft_model(model, lora_config).eval()

    def autocast():
        return torch.autocast("cpu", dtype=torch.bfloat16)

    seen = []
    lora_a = lora.base_model.model.model.layers[0].self_attn.q_proj.lora_A["default"]
    lora_a.register_forward_hook(lambda module, inputs, output: seen.append(output.dtype))
    engine = _engine(lora, config, tokenizer, compile=False, autocast=autocast)
    ours = engine.generate(lora, prompt_ids, prompt_mask).completion_ids
    assert seen and set(seen) == {torch.bfloat16}
    seen.clear()
    without = _engine(lora, config, tokenizer, compile=False).generate(lora, prompt_ids, prompt_mask).completion_ids
    assert set(seen) == {torch.float32}  # what the engine did before: the LoRA layers in fp32
    with autocast():
        reference = _reference(lora, prompt_ids, prompt_mask, config, tokenizer).completion_ids
    assert torch.equal(ours, reference)
    assert ours.shape == without.shape


def test_a_transformers_that_cannot_build_the_static_layer_skips_the_engine_with_its_reason(tokenizer, monkeypatch):
    """A later transformers 5.x adding an abstract method to `CacheLayerMixin` would make `StaticRowsLayer`
    unbuildable; "auto" then passes to the next engine on CUDA and says why, instead of crashing at the first
    rollout."""
    model = _model(tokenizer)
    config = _config(tokenizer)
    assert cuda_graph.static_cache_reason() is None

    class Newer(cuda_graph.StaticRowsLayer):  # what the engine's layer would be under such a release
        @abc.abstractmethod
        def crop(self, max_length: int) -> None: ...

    monkeypatch.setattr(cuda_graph, "StaticRowsLayer", Newer)
    reason = CUDAGraphEngine.unsupported_reason(model, config)
    assert reason is not None and "transformers" in reason and "static cache layer" in reason
    engine, why = make_engine("auto", model, config, [tokenizer.eos_token_id], device=torch.device("cuda"))
    assert engine.name == "generate_static" and "cuda_graph: transformers" in why


def test_engines_pass_the_cache_by_the_keyword_the_model_takes(tokenizer):
    """transformers 5.24 renamed the forward's `past_key_values` to `cache` and warns at every call with the old
    name (one warning per decoded token); the engines use whichever the model's forward takes."""
    import warnings

    from grpo_hf.rollout.sampling import cache_keyword

    model = _model(tokenizer)
    expected = "cache" if "cache" in __import__("inspect").signature(model.forward).parameters else "past_key_values"
    assert cache_keyword(model) == expected
    prompt_ids, prompt_mask, _ = tokenize_prompts(tokenizer, PROMPTS)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        for name in ("cuda_graph", "loop"):
            engine, _ = make_engine(name, model, _config(tokenizer, max_new_tokens=3), [tokenizer.eos_token_id])
            engine.generate(model, prompt_ids, prompt_mask)
