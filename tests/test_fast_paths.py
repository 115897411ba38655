"""The speed paths compute the same numbers as the plain ones they replace."""

import pytest
import torch
from conftest import build_tiny_model
from transformers import (
    GenerationConfig,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from grpo_hf.rollout import (
    engine_class,
    make_engine,
    sample_categorical,
    sample_groups,
    supports_sample_groups,
    tokenize_prompts,
)


def generate(model, prompt_ids, prompt_mask, generation_config, eos_token_ids, *, use_model_generate=False):
    """One rollout with the `loop` engine (where it applies) or `model.generate`: ids, mask [N, T], flags [N]."""
    name = "generate" if use_model_generate else "loop"
    engine, _ = make_engine(name, model, generation_config, eos_token_ids)
    return engine.generate(model, prompt_ids, prompt_mask)


def _prompts(tokenizer):
    prompts = ["Hello there"] * 3 + ["A much longer prompt, with more tokens"] * 3
    return tokenize_prompts(tokenizer, prompts)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_sample_groups_matches_model_generate_when_sampling_is_deterministic(tokenizer, arch):
    """top_k=1 makes sampling an argmax: the custom decoding loop must emit exactly generate()'s tokens."""
    model = build_tiny_model(tokenizer, arch, seed=1).eval()
    prompt_ids, prompt_mask, _ = _prompts(tokenizer)
    config = GenerationConfig(
        max_new_tokens=12,
        do_sample=True,
        top_k=1,
        temperature=1.0,
        top_p=1.0,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=[tokenizer.eos_token_id],
    )
    ours, _, _ = generate(model, prompt_ids, prompt_mask, config, [tokenizer.eos_token_id])
    reference, _, _ = generate(
        model, prompt_ids, prompt_mask, config, [tokenizer.eos_token_id], use_model_generate=True
    )
    width = max(ours.size(1), reference.size(1))
    pad = tokenizer.pad_token_id
    assert torch.equal(
        torch.nn.functional.pad(ours, (0, width - ours.size(1)), value=pad),
        torch.nn.functional.pad(reference, (0, width - reference.size(1)), value=pad),
    )
    assert sample_groups(model, prompt_ids, prompt_mask, config, [tokenizer.eos_token_id]).size(0) == 6


def test_sample_groups_uses_the_models_generation_config_defaults(tokenizer):
    """A sampling setting unset in the call's config takes the model's generation_config value, as in generate()."""
    model = build_tiny_model(tokenizer, seed=3).eval()
    model.generation_config.top_k = 1  # the model's default makes sampling an argmax
    prompt_ids, prompt_mask, _ = _prompts(tokenizer)
    config = GenerationConfig(
        max_new_tokens=10, do_sample=True, pad_token_id=tokenizer.pad_token_id, eos_token_id=[tokenizer.eos_token_id]
    )
    assert config.top_k is None and supports_sample_groups(model, config)
    ours, _, _ = generate(model, prompt_ids, prompt_mask, config, [tokenizer.eos_token_id])
    reference, _, _ = generate(
        model, prompt_ids, prompt_mask, config, [tokenizer.eos_token_id], use_model_generate=True
    )
    assert ours.shape == reference.shape and torch.equal(ours, reference)


def test_settings_the_loop_does_not_implement_fall_back_to_model_generate(tokenizer):
    model = build_tiny_model(tokenizer, seed=3).eval()
    config = GenerationConfig(max_new_tokens=4, do_sample=True, top_k=0, pad_token_id=tokenizer.pad_token_id)
    assert supports_sample_groups(model, config)
    blocked = GenerationConfig(max_new_tokens=4, do_sample=True, pad_token_id=tokenizer.pad_token_id)
    blocked.no_repeat_ngram_size = 2
    assert not supports_sample_groups(model, blocked)
    model.generation_config.no_repeat_ngram_size = 2  # set on the model: generate() would apply it too
    assert not supports_sample_groups(model, config)


def test_sample_categorical_inverse_transform():
    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3]]).expand(4, -1)  # cdf 0.1, 0.1, 0.7, 1.0
    uniform = torch.tensor([[0.0], [0.0999], [0.1], [0.9999999]], dtype=torch.float64)
    assert sample_categorical(probs, uniform).tolist() == [0, 0, 2, 3]  # token 1 (p = 0) is never drawn
    unnormalised = torch.tensor([[2.0, 0.0, 0.0, 0.0], [0.0, 0.0, 5.0, 0.0]])  # only the ratios matter
    assert sample_categorical(unnormalised, torch.tensor([[0.99], [0.5]], dtype=torch.float64)).tolist() == [0, 2]
    torch.manual_seed(0)
    draws = sample_categorical(probs[:1].expand(100_000, -1))
    frequencies = torch.bincount(draws, minlength=4).double() / draws.numel()
    torch.testing.assert_close(frequencies, torch.tensor([0.1, 0.0, 0.6, 0.3], dtype=torch.float64), atol=6e-3, rtol=0)


def _next_token_probs(model, input_ids, settings) -> torch.Tensor:
    """softmax of the processed next-token logits [B, V], computed directly from HF's own warpers."""
    scores = model(input_ids=input_ids).logits[:, -1].float()  # [B, V]
    if "repetition_penalty" in settings:
        scores = RepetitionPenaltyLogitsProcessor(settings["repetition_penalty"])(input_ids, scores)
    if "temperature" in settings:
        scores = TemperatureLogitsWarper(settings["temperature"])(input_ids, scores)
    if settings.get("top_k"):
        scores = TopKLogitsWarper(settings["top_k"])(input_ids, scores)
    if "top_p" in settings:
        scores = TopPLogitsWarper(settings["top_p"])(input_ids, scores)
    return torch.softmax(scores, dim=-1)


@torch.no_grad()
@pytest.mark.parametrize("engine", ["loop", "cuda_graph"])
def test_engines_draw_from_the_models_distribution(tokenizer, engine):
    model = build_tiny_model(tokenizer, seed=8).eval()
    model.lm_head.weight.mul_(20)  # peaked logits, so that every sampling setting changes the distribution
    torch.manual_seed(0)
    eos = tokenizer.eos_token_id
    # cuda_graph runs its decode step eagerly on the CPU
    assert_draws_follow_the_model(
        model, tokenizer, lambda config, *rows: engine_class(engine)(config, [eos]).sample(model, *rows)
    )


@torch.no_grad()
def assert_draws_follow_the_model(model, tokenizer, sample, settings=None):
    """The first two sampled tokens of 20,000 rows follow the exact distribution (repetition penalty, temperature,
    top-k, top-p, EOS -> pad), computed token by token from the model; leaving out any one setting would be far off.
    `sample(generation_config, prompt_ids, prompt_mask) -> completion_ids [N, >= 2]` is the engine under test."""
    settings = settings or {"repetition_penalty": 1.5, "temperature": 0.7, "top_k": 12, "top_p": 0.9}
    eos, pad, V = tokenizer.eos_token_id, tokenizer.pad_token_id, len(tokenizer)
    prompt = torch.arange(3, V, 2)[None]  # [1, P] every other byte token: the penalty hits about half the vocabulary
    # Exact: p1 from the prompt; p(t2 | t1) from prompt + t1 for every t1; a row that ended with EOS gets pad.
    p1 = _next_token_probs(model, prompt, settings)[0]  # [V]
    extended = torch.cat([prompt.expand(V, -1), torch.arange(V)[:, None]], dim=1)  # [V, P + 1]
    p2_given_t1 = _next_token_probs(model, extended, settings)  # [V, V]
    p2_given_t1[eos] = torch.nn.functional.one_hot(torch.tensor(pad), V).float()
    p2 = p1 @ p2_given_t1  # [V]

    N = 20_000
    config = GenerationConfig(max_new_tokens=2, do_sample=True, pad_token_id=pad, eos_token_id=[eos], **settings)
    completion_ids = sample(config, prompt.expand(N, -1), torch.ones(N, prompt.size(1)).long())

    def total_variation(p, q):
        return 0.5 * (p - q).abs().sum().item()

    tolerance = 0.025  # the sampling noise of N = 20,000 draws over ~20 tokens is ~0.01
    for position, exact in ((0, p1), (1, p2)):
        empirical = torch.bincount(completion_ids[:, position], minlength=V).float() / N
        assert total_variation(empirical, exact) < tolerance
    for left_out in settings:  # the check above can tell each setting apart
        others = {k: v for k, v in settings.items() if k != left_out}
        assert total_variation(_next_token_probs(model, prompt, others)[0], p1) > 3 * tolerance, left_out
