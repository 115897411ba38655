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
    blocked.typical_p = 0.9  # no_repeat_ngram_size and the like the loop draws through its sampling spec
    assert not supports_sample_groups(model, blocked)
    model.generation_config.typical_p = 0.9  # set on the model: generate() would apply it too
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


# ---- per-row random streams (tool episodes) -------------------------------------------------------------------------
def _splitmix_uniform(seed: int, stream: int, counter: int) -> float:
    """`counter_uniform`, written out on Python integers modulo 2**64."""
    mask = 2**64 - 1

    def mix(z: int) -> int:
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    gamma = 0x9E3779B97F4A7C15
    key = mix((mix((seed + stream * gamma) & mask) + counter * gamma) & mask)
    return (key >> 11) * 2.0**-53


def test_counter_uniform_is_a_hash_of_seed_stream_and_counter():
    from grpo_hf.rollout.sampling import RowDraws, counter_uniform

    seed, streams, counters = -(2**62) + 12345, torch.tensor([0, 1, 7, 2**33 + 5]), torch.tensor([0, 3, 2**40, 9])
    got = counter_uniform(seed, streams, counters)  # [4, 1]
    expected = [
        _splitmix_uniform(seed % 2**64, s, c) for s, c in zip(streams.tolist(), counters.tolist(), strict=True)
    ]
    assert got.squeeze(1).tolist() == expected
    # A row's draws are its own: the same numbers alone, in another batch, in another order.
    draws = RowDraws(seed, torch.tensor([4, 9]), torch.tensor([2, 0]))
    batch = [draws.uniform().squeeze(1).tolist() for _ in range(3)]
    alone = RowDraws(seed, torch.tensor([9]), torch.tensor([0]))
    assert [alone.uniform().item() for _ in range(3)] == [row[1] for row in batch]
    # Uniform on [0, 1): the mean, the variance and ten equal bins of 100,000 draws.
    many = counter_uniform(seed, torch.arange(1000).repeat_interleave(100), torch.arange(100).repeat(1000))
    assert 0 <= float(many.min()) and float(many.max()) < 1
    assert abs(float(many.mean()) - 0.5) < 0.005 and abs(float(many.var()) - 1 / 12) < 0.002
    bins = torch.histc(many.float(), bins=10, min=0, max=1) / many.numel()
    torch.testing.assert_close(bins, torch.full((10,), 0.1), atol=0.005, rtol=0)


@torch.no_grad()
def test_generate_draws_each_row_from_its_own_stream_whatever_its_batch(tokenizer):
    """`model.generate` with `draws` (`DrawFromStreams`): each row's completion is the same sampled alone or beside
    other rows of other lengths, and is the one a naive loop gives (full forward, the warpers, the inverse CDF of the
    row's uniform); the global generator plays no part."""
    from grpo_hf.rollout.sampling import RowDraws, counter_uniform

    model = build_tiny_model(tokenizer, seed=3).eval()
    settings = dict(temperature=0.8, top_k=40, top_p=0.95)
    config = GenerationConfig(
        max_new_tokens=6, do_sample=True, pad_token_id=tokenizer.pad_token_id, eos_token_id=[], **settings
    )
    engine, _ = make_engine("generate", model, config, [])
    ids, mask, _ = tokenize_prompts(tokenizer, ["Hi", "A longer prompt, this one", "Mid length"])
    seed, streams, counters = 1234, torch.tensor([5, 6, 7]), torch.tensor([0, 3, 10])
    torch.manual_seed(0)
    together = engine.generate(model, ids, mask, draws=RowDraws(seed, streams, counters)).completion_ids
    for row in range(3):
        prompt = ids[row : row + 1, mask[row].bool()]  # [1, P] without padding
        torch.manual_seed(row + 1)  # another global state: it must not matter
        draws = RowDraws(seed, streams[row : row + 1], counters[row : row + 1])
        alone = engine.generate(model, prompt, torch.ones_like(prompt), draws=draws).completion_ids
        assert alone.tolist() == together[row : row + 1].tolist()
        naive = prompt
        for t in range(6):
            probs = _next_token_probs(model, naive, settings)[0].double()  # [V]
            u = counter_uniform(seed, streams[row : row + 1], counters[row : row + 1] + t).item()
            token = int((probs.cumsum(0) > u * probs.sum()).int().argmax())
            naive = torch.cat([naive, torch.tensor([[token]])], dim=1)
        assert naive[0, prompt.size(1) :].tolist() == together[row].tolist()
