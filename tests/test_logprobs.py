"""`grpo_hf.logprobs`: the fast forwards give the padded forward's numbers and gradients, without a trainer."""

import pytest
import torch
from conftest import build_tiny_model

from grpo_hf.core import grpo_loss
from grpo_hf.logprobs import (
    backward_per_group,
    completion_logps,
    length_buckets,
    logps_in_chunks,
    padded_logps,
    supports_shared_prefix,
)
from grpo_hf.rollout import MicroBatch, tokenize_prompts


def _batch(tokenizer):
    prompts = ["Hello there"] * 3 + ["A much longer prompt, with more tokens"] * 3
    prompt_ids, prompt_mask, _ = tokenize_prompts(tokenizer, prompts)
    torch.manual_seed(0)
    completion_ids = torch.randint(3, 200, (6, 7))  # [N, T]
    completion_mask = torch.ones_like(completion_ids)
    completion_mask[1, 4:] = 0  # right padding of different lengths
    completion_mask[4, 2:] = 0
    completion_mask[5, 1:] = 0
    return MicroBatch(prompt_ids, prompt_mask, completion_ids, completion_mask, advantages=torch.zeros(6))


@pytest.mark.kernel_paths
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_shared_prompt_prefix_logps_equal_the_padded_forward(tokenizer, arch):
    model = build_tiny_model(tokenizer, arch, seed=2)
    assert supports_shared_prefix(model)
    batch = _batch(tokenizer)
    mask = batch.completion_mask
    results = []
    for share in (True, False):
        logps, entropy = completion_logps(model, batch, share_prefix=share, temperature=0.7, with_entropy=True)
        logps.masked_fill(mask == 0, 0).sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        results.append((logps.detach() * mask, entropy * mask, grads))
    (shared, shared_entropy, shared_grads), (full, full_entropy, full_grads) = results
    torch.testing.assert_close(shared, full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(shared_entropy, full_entropy, rtol=1e-5, atol=1e-5)
    for a, b in zip(shared_grads, full_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.kernel_paths
def test_padded_logps_are_log_softmax_of_a_naive_forward(tokenizer):
    """Against the definition: log softmax(logits / temperature) at each completion token, position by position."""
    model = build_tiny_model(tokenizer, seed=3)
    batch = _batch(tokenizer)
    logps, _ = padded_logps(model, batch, temperature=0.5)
    for i in range(6):
        prompt = batch.prompt_ids[i][batch.prompt_mask[i] == 1]
        for t in range(int(batch.completion_mask[i].sum())):
            ids = torch.cat([prompt, batch.completion_ids[i, :t]])[None]
            logits = model(input_ids=ids).logits[0, -1] / 0.5
            expected = torch.log_softmax(logits.double(), -1)[batch.completion_ids[i, t]]
            torch.testing.assert_close(logps[i, t].double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.kernel_paths
def test_logps_in_chunks_is_no_grad_eval_mode_and_chunk_invariant(tokenizer):
    model = build_tiny_model(tokenizer, seed=4).train()
    batch = _batch(tokenizer)
    whole = logps_in_chunks(model, batch, 6, share_prefix=True)
    parts = logps_in_chunks(model, batch, 2, share_prefix=False)
    mask = batch.completion_mask
    assert not whole.requires_grad and model.training  # no graph; the train/eval mode is restored
    torch.testing.assert_close(whole * mask, parts * mask, rtol=1e-5, atol=1e-5)


@pytest.mark.kernel_paths
@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_backward_per_group_gives_the_full_backward(tokenizer, loss_type):
    """Accumulating the gradient one group at a time equals one backward of the whole micro-batch's loss."""
    model = build_tiny_model(tokenizer, seed=5)
    batch = _batch(tokenizer)
    mask = batch.completion_mask
    with torch.no_grad():
        old = completion_logps(model, batch, share_prefix=False)[0] + 0.05 * torch.randn(6, 7)  # off-policy ratio
    advantages = torch.tensor([1.0, -0.5, -0.5, 0.3, 0.2, -0.5])

    def loss_fn(logps):
        return grpo_loss(logps, old, old - 0.1, advantages, mask, loss_type=loss_type, beta=0.04)

    full_loss, _ = loss_fn(completion_logps(model, batch, share_prefix=False)[0])
    full_loss.backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    batch.old_logps = old
    loss, _, entropy = backward_per_group(model, batch, loss_fn, lambda part: part.backward())
    loss.backward()
    assert entropy.shape == (6, 7)
    torch.testing.assert_close(loss, full_loss, rtol=1e-5, atol=1e-6)
    for got, want in zip((p.grad for p in model.parameters()), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_length_buckets_split_only_when_it_saves_padding():
    assert [b.tolist() for b in length_buckets(torch.tensor([5, 5, 5, 5]))] == [[0, 1, 2, 3]]
    short, long = length_buckets(torch.tensor([2, 30, 3, 29]))
    assert sorted(short.tolist()) == [0, 2] and sorted(long.tolist()) == [1, 3]
