"""The vLLM importance-sampling correction (`core.sampling_importance_weights`, `grpo_loss(sampling_weight=...)`)
against the naive loops of tests/oracle.py: values and gradients."""

import itertools
import math

import pytest
import torch
from oracle import F64, TIGHT, make_batch, naive_loss, naive_weights

from grpo_hf.core import SAMPLING_CORRECTION_MODES, grpo_loss, sampling_importance_weights


def sampler_logps(old_logps, seed=1, scale=0.6):
    """The sampler's log-probs: old ones plus noise, one token it did not score (NaN)."""
    g = torch.Generator().manual_seed(seed)
    sampling = old_logps + scale * torch.randn(old_logps.shape, generator=g, dtype=old_logps.dtype)
    sampling[2, 1] = float("nan")
    return sampling


BOUNDS = [(None, 3.0), (0.5, 2.0), (0.8, None)]
CASES = list(itertools.product(SAMPLING_CORRECTION_MODES, BOUNDS))


@pytest.mark.parametrize("mode, bounds", CASES, ids=[f"{m}-{lo}-{hi}" for m, (lo, hi) in CASES])
def test_weights_match_naive_loop(mode, bounds):
    _, old_logps, _, _, mask = make_batch()
    sampling = sampler_logps(old_logps)
    weight, metrics = sampling_importance_weights(old_logps, sampling, mask, mode, *bounds)
    expected = naive_weights(old_logps, sampling, mask, mode, *bounds)
    if mode.startswith("sequence"):
        assert weight.shape == (mask.size(0), 1)
        values = [expected[i] for i in range(mask.size(0))]
        torch.testing.assert_close(weight.squeeze(1), torch.tensor(values, dtype=F64), **TIGHT)
    else:
        assert weight.shape == mask.shape
        values = list(expected.values())
        torch.testing.assert_close(weight[mask.bool()], torch.tensor(values, dtype=F64), **TIGHT)
    # the case bites: some weights are cut by a bound, some are not
    assert any(v in (0.0, bounds[0], bounds[1]) for v in values) and any(v not in (0.0, *bounds) for v in values)
    gaps = [abs(float(old_logps[i, t] - sampling[i, t])) for i, t in zip(*mask.nonzero(as_tuple=True), strict=True)]
    gaps = [g for g in gaps if not math.isnan(g)]
    assert metrics["sampling_logp_difference/mean"].item() == pytest.approx(sum(gaps) / len(gaps), abs=1e-12)
    assert metrics["sampling_logp_difference/max"].item() == pytest.approx(max(gaps), abs=1e-12)
    assert metrics["importance_sampling_ratio/min"].item() == pytest.approx(min(values), abs=1e-12)
    assert metrics["importance_sampling_ratio/mean"].item() == pytest.approx(sum(values) / len(values), abs=1e-12)
    assert metrics["importance_sampling_ratio/max"].item() == pytest.approx(max(values), abs=1e-12)


LOSS_CASES = list(
    itertools.product(("grpo", "dapo", "bnpo", "vespo"), ("token", "sequence"), SAMPLING_CORRECTION_MODES)
)


@pytest.mark.parametrize("loss_type, level, mode", LOSS_CASES, ids=["-".join(c) for c in LOSS_CASES])
def test_corrected_loss_matches_naive_loop(loss_type, level, mode):
    """The weight multiplies each policy term, not the KL (vespo: it enters w_i): loss and gradient as the naive loop,
    to 1e-12 in fp64 (and to 1e-6 in fp32)."""
    logps, old_logps, ref_logps, advantages, mask = make_batch()
    sampling = sampler_logps(old_logps)
    weight, _ = sampling_importance_weights(old_logps, sampling, mask, mode, 0.5, 2.0)
    table = naive_weights(old_logps, sampling, mask, mode, 0.5, 2.0)
    per_sequence = mode.startswith("sequence")
    kwargs = dict(
        loss_type=loss_type,
        epsilon=0.2,
        epsilon_high=0.28,
        beta=0.04,
        importance_sampling_level=level,
        max_completion_length=9,
        num_items_in_batch=int(mask.sum()),
    )
    for dtype, tol in ((F64, TIGHT), (torch.float32, dict(atol=1e-6, rtol=1e-6))):
        x = logps.to(dtype).requires_grad_(True)
        args = (old_logps.to(dtype), ref_logps.to(dtype), advantages.to(dtype), mask.to(dtype))
        loss, _ = grpo_loss(x, *args, sampling_weight=weight.to(dtype), **kwargs)
        (grad,) = torch.autograd.grad(loss, x)
        ref_loss, _ = naive_loss(
            x, *args, sampling_weight=lambda i, t: table[i] if per_sequence else table[i, t], **kwargs
        )
        (ref_grad,) = torch.autograd.grad(ref_loss, x)
        torch.testing.assert_close(loss, ref_loss.to(dtype), **tol)
        torch.testing.assert_close(grad, ref_grad.to(dtype), **tol)
    plain, _ = grpo_loss(logps, old_logps, ref_logps, advantages, mask, **kwargs)
    assert not torch.allclose(loss.double(), plain), "the weights must change the loss in this case"


def test_weight_carries_no_gradient_and_equal_logps_give_one():
    _, old_logps, _, _, mask = make_batch()
    old = old_logps.clone().requires_grad_(True)
    sampling = old_logps.clone().requires_grad_(True)
    for mode in SAMPLING_CORRECTION_MODES:
        weight, _ = sampling_importance_weights(old, sampling, mask, mode, None, 3.0)
        assert not weight.requires_grad
        assert torch.equal(weight, torch.ones_like(weight))


def test_hand_worked_sequence_mask():
    """Two rows: log-ratio sums 0.5 and 1.5 -> exp 1.65 (kept) and 4.48 (above clip_max=3: masked to 0)."""
    old = torch.tensor([[0.0, 0.0], [0.0, 0.0]], dtype=F64)
    sampling = torch.tensor([[-0.25, -0.25], [-1.0, -0.5]], dtype=F64)
    mask = torch.ones(2, 2, dtype=F64)
    weight, _ = sampling_importance_weights(old, sampling, mask, "sequence_mask", None, 3.0)
    torch.testing.assert_close(weight, torch.tensor([[math.exp(0.5)], [0.0]], dtype=F64), **TIGHT)
    weight, _ = sampling_importance_weights(old, sampling, mask, "sequence_truncate", None, 3.0)
    torch.testing.assert_close(weight, torch.tensor([[math.exp(0.5)], [3.0]], dtype=F64), **TIGHT)


def test_unknown_mode_is_refused():
    _, old_logps, _, _, mask = make_batch()
    with pytest.raises(ValueError, match="vllm_importance_sampling_mode must be one of.*got .tokens."):
        sampling_importance_weights(old_logps, old_logps, mask, "tokens")
