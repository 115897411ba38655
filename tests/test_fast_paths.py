"""The speed paths compute the same numbers as the plain ones they replace."""

import pytest
import torch
from conftest import build_tiny_model
from datasets import Dataset
from transformers import GenerationConfig

from grpo_hf import GRPOConfig, GRPOTrainer
from grpo_hf.rollout import generate, sample_groups, supports_sample_groups, tokenize_prompts


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


def test_shared_prompt_prefix_logps_equal_the_padded_forward(tmp_path, tokenizer):
    model = build_tiny_model(tokenizer, seed=2)
    prompt_ids, prompt_mask, _ = _prompts(tokenizer)
    torch.manual_seed(0)
    completion_ids = torch.randint(3, 200, (6, 7))  # [N, T]
    completion_mask = torch.ones_like(completion_ids)
    completion_mask[1, 4:] = 0  # right padding of different lengths
    completion_mask[4, 2:] = 0
    batch = dict(
        prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids, completion_mask=completion_mask
    )
    results = []
    for share in (True, False):
        args = GRPOConfig(
            output_dir=str(tmp_path),
            per_device_train_batch_size=6,
            num_generations=3,
            use_cpu=True,
            report_to="none",
            share_prompt_prefix=share,
            temperature=0.7,
        )
        trainer = GRPOTrainer(
            model,
            lambda completions, **kw: [0.0] * len(completions),
            args,
            train_dataset=Dataset.from_dict({"prompt": ["x"] * 4}),
            processing_class=tokenizer,
        )
        assert trainer._can_share_prefix(model) is share
        logps, entropy = trainer._completion_logps(model, batch, with_entropy=True)
        logps.masked_fill(completion_mask == 0, 0).sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        results.append((logps.detach() * completion_mask, entropy * completion_mask, grads))
    (shared, shared_entropy, shared_grads), (full, full_entropy, full_grads) = results
    torch.testing.assert_close(shared, full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(shared_entropy, full_entropy, rtol=1e-5, atol=1e-5)
    for a, b in zip(shared_grads, full_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


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
