"""grpo_hf.core against the naive loops of tests/oracle.py (docs/design.md's "The maths"), hand-worked cases and
memory bounds."""

import itertools
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from oracle import F64, TIGHT, assert_same, make_batch, naive_advantages, run_both

from grpo_hf.core import (
    IMPORTANCE_SAMPLING_LEVELS,
    LOSS_TYPES,
    SCALE_REWARDS,
    combine_rewards,
    entropy_from_logits,
    group_advantages,
    grpo_loss,
    selective_log_softmax,
)

COMBOS = list(itertools.product(LOSS_TYPES, IMPORTANCE_SAMPLING_LEVELS, (0.0, 0.04), (None, 0.28), (True, False)))


@pytest.mark.parametrize(
    "loss_type, level, beta, epsilon_high, on_policy",
    COMBOS,
    ids=[f"{lt}-{lvl}-beta{b}-epshigh{e}-{'on' if on else 'off'}" for lt, lvl, b, e, on in COMBOS],
)
def test_grpo_loss_matches_naive_loop(loss_type, level, beta, epsilon_high, on_policy):
    logps, old_logps, ref_logps, advantages, mask = make_batch()
    kwargs = dict(
        loss_type=loss_type,
        epsilon=0.2,
        epsilon_high=epsilon_high,
        beta=beta,
        importance_sampling_level=level,
        max_completion_length=9,  # > T: the dr_grpo constant is the budget, not the padded width
        num_items_in_batch=int(mask.sum()) + 11,  # a global count larger than the local one
    )
    old_logps = None if on_policy else old_logps
    ref_logps = None if beta == 0 else ref_logps
    logps.requires_grad_(True)
    if level == "sequence_sum" and loss_type != "grpo":
        with pytest.raises(ValueError, match="sequence_sum.*loss_type='grpo'"):
            grpo_loss(logps, old_logps, ref_logps, advantages, mask, **kwargs)
        return

    results = run_both(grpo_loss, (logps, old_logps, ref_logps, advantages, mask), **kwargs)
    assert_same(results)
    assert results[0][1].abs().sum() > 0


@pytest.mark.parametrize("level", IMPORTANCE_SAMPLING_LEVELS)
def test_fixture_clips_both_ways(level):
    """The comparison above is only meaningful if the off-policy batch has clipped and unclipped ratios."""
    logps, old_logps, ref_logps, advantages, mask = make_batch()
    _, metrics = grpo_loss(logps, old_logps, ref_logps, advantages, mask, importance_sampling_level=level)
    assert metrics["clip_ratio/low_mean"] > 0 and metrics["clip_ratio/high_mean"] > 0
    assert metrics["clip_ratio/region_mean"] < 1
    _, metrics = grpo_loss(logps, old_logps, ref_logps, advantages, mask, epsilon_high=0.28)
    assert metrics["clip_ratio/high_mean"] > 0  # clip-higher still clips some tokens


# ---------------------------------------------------------------------------------------------------------------
# grpo_loss: hand-worked cases and properties
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_on_policy_gradient_is_plain_policy_gradient(loss_type, level):
    """ratio == 1 and beta == 0: d loss / d logps[i, t] = -A_i m[i, t] / normaliser, with no clipping."""
    logps, _, _, advantages, mask = make_batch()
    N = mask.shape[0]
    lengths = mask.sum(-1, keepdim=True)  # [N, 1]
    normaliser = {
        "grpo": N * lengths.clamp(min=1),
        "bnpo": mask.sum(),
        "dr_grpo": N * 9,
        "dapo": mask.sum(),
    }[loss_type]
    logps.requires_grad_(True)
    kwargs = dict(loss_type=loss_type, beta=0.0, importance_sampling_level=level, max_completion_length=9)
    loss, metrics = grpo_loss(logps, None, None, advantages, mask, **kwargs)
    loss.backward()
    torch.testing.assert_close(logps.grad, -advantages[:, None] * mask / normaliser, **TIGHT)
    clip_names = ("low_mean", "high_mean", "region_mean", "low_min", "high_max")
    assert metrics == {f"clip_ratio/{name}": 0.0 for name in clip_names}
    if loss_type == "grpo":  # the value itself: -mean_i A_i over rows that have tokens (the empty row gives 0)
        assert loss.item() == pytest.approx(-(advantages * (lengths[:, 0] > 0)).sum().item() / N, abs=1e-12)


def test_on_policy_sequence_sum_gradient():
    """sequence_sum, ratio 1: J = mean_i s_i A_i and d s_i / d logps[i, t] = m[i, t], so no length normalisation."""
    logps, _, _, advantages, mask = make_batch()
    logps.requires_grad_(True)
    loss, _ = grpo_loss(logps, None, None, advantages, mask, beta=0.0, importance_sampling_level="sequence_sum")
    loss.backward()
    torch.testing.assert_close(logps.grad, -advantages[:, None] * mask / mask.shape[0], **TIGHT)


def test_hand_worked_clipping():
    """One row, three tokens with ratios 0.5, 1.0, 1.5; grpo, eps 0.2, beta 0."""
    logps = torch.zeros(1, 3, dtype=F64, requires_grad=True)
    old_logps = -torch.log(torch.tensor([[0.5, 1.0, 1.5]], dtype=F64))  # ratio = exp(0 - old)
    for a, expected_l, expected_grad in (
        (1.0, [0.5, 1.0, 1.2], [0.5, 1.0, 0.0]),  # A > 0: only the high side clips (value 1.2, no gradient)
        (-1.0, [-0.8, -1.0, -1.5], [0.0, -1.0, -1.5]),  # A < 0: only the low side clips (value -0.8, no gradient)
    ):
        logps.grad = None
        loss, metrics = grpo_loss(logps, old_logps, None, torch.tensor([a], dtype=F64), torch.ones(1, 3), beta=0.0)
        loss.backward()
        assert loss.item() == pytest.approx(-sum(expected_l) / 3, abs=1e-12)
        # d/dlogps of rho A = rho A; averaged over 3 tokens; loss = -J
        torch.testing.assert_close(logps.grad, -torch.tensor([expected_grad], dtype=F64) / 3, **TIGHT)
        assert metrics["clip_ratio/region_mean"] == pytest.approx(1 / 3)
        assert metrics["clip_ratio/high_mean" if a > 0 else "clip_ratio/low_mean"] == pytest.approx(1 / 3)


@pytest.mark.parametrize("sign", [-1.0, 1.0])
def test_hand_worked_per_sequence_clip_extremes(sign):
    """TRL's clip_ratio/low_min and high_max: per row, the fraction of its completion tokens clipped on that side
    (padding left out, an empty row NaN and skipped); then the smallest low one and the largest high one. eps 0.2."""
    ratios = torch.tensor(
        [
            [0.5, 1.5, 1.0, 9.0],  # low 1/3, high 1/3 (the padded 9.0 would make high 2/4)
            [0.5, 0.6, 1.5, 1.0],  # low 2/4, high 1/4
            [0.1, 0.1, 0.1, 0.1],  # no completion token: NaN, left out (else the min would be 0)
            [0.7, 1.3, 1.0, 9.0],  # low 1/3, high 1/3
        ],
        dtype=F64,
    )
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0], [1, 1, 1, 0]], dtype=F64)
    advantages = torch.full((4,), sign, dtype=F64)
    _, metrics = grpo_loss(torch.zeros(4, 4, dtype=F64), -ratios.log(), None, advantages, mask, beta=0.0)
    if sign < 0:  # only the low side clips
        assert metrics["clip_ratio/low_min"] == pytest.approx(1 / 3, abs=1e-12)
        assert metrics["clip_ratio/high_max"] == 0.0
        assert metrics["clip_ratio/low_mean"] == pytest.approx(4 / 10, abs=1e-12)  # 1 + 2 + 1 of 3 + 4 + 3 tokens
    else:  # only the high side clips
        assert metrics["clip_ratio/high_max"] == pytest.approx(1 / 3, abs=1e-12)
        assert metrics["clip_ratio/low_min"] == 0.0
        assert metrics["clip_ratio/high_mean"] == pytest.approx(3 / 10, abs=1e-12)
    empty = torch.zeros(4, 4, dtype=F64)  # no completion token anywhere: NaN, as TRL's nanmin / nanmax
    _, metrics = grpo_loss(torch.zeros(4, 4, dtype=F64), -ratios.log(), None, advantages, empty, beta=0.0)
    assert math.isnan(metrics["clip_ratio/low_min"]) and math.isnan(metrics["clip_ratio/high_max"])


def test_hand_worked_kl():
    """k3 at x = ref - logps = log 2: 2 - log 2 - 1 per token; sequence_sum uses d = 2 log 2 for two tokens."""
    logps = torch.zeros(1, 2, dtype=F64)
    ref_logps = torch.full((1, 2), math.log(2), dtype=F64)
    A = torch.zeros(1, dtype=F64)
    mask = torch.ones(1, 2)
    loss, metrics = grpo_loss(logps, None, ref_logps, A, mask, beta=0.5)
    assert metrics["kl"] == pytest.approx(1 - math.log(2), abs=1e-12)
    assert loss.item() == pytest.approx(0.5 * (1 - math.log(2)), abs=1e-12)
    loss, metrics = grpo_loss(logps, None, ref_logps, A, mask, beta=0.5, importance_sampling_level="sequence_sum")
    assert metrics["kl"] == pytest.approx(4 - 2 * math.log(2) - 1, abs=1e-12)
    assert loss.item() == pytest.approx(0.5 * (3 - 2 * math.log(2)), abs=1e-12)


@pytest.mark.parametrize("level", IMPORTANCE_SAMPLING_LEVELS)
def test_no_gradient_into_old_ref_or_advantages(level):
    logps, old_logps, ref_logps, advantages, mask = make_batch()
    for t in (logps, old_logps, ref_logps, advantages):
        t.requires_grad_(True)
    loss, _ = grpo_loss(logps, old_logps, ref_logps, advantages, mask, importance_sampling_level=level)
    loss.backward()
    assert logps.grad is not None and logps.grad.abs().sum() > 0
    assert old_logps.grad is None and ref_logps.grad is None and advantages.grad is None


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("count_as", [int, float, torch.tensor])
def test_dapo_is_invariant_to_accumulation(level, count_as):
    """Four accumulation slices, each normalised by the global token count, add up to the full batch."""
    logps, old_logps, ref_logps, advantages, mask = make_batch(seed=3, lengths=(7, 5, 3, 0, 1, 6, 2, 4))
    kwargs = dict(loss_type="dapo", importance_sampling_level=level, epsilon_high=0.28)
    logps.requires_grad_(True)
    full_loss, _ = grpo_loss(logps, old_logps, ref_logps, advantages, mask, **kwargs)
    (full_grad,) = torch.autograd.grad(full_loss, logps)

    num_items = count_as(int(mask.sum()))
    slice_loss = 0.0
    for rows in torch.arange(8).split(2):
        batch_slice = (t[rows] for t in (logps, old_logps, ref_logps, advantages, mask))
        loss, _ = grpo_loss(*batch_slice, num_items_in_batch=num_items, **kwargs)
        loss.backward()  # gradients accumulate in logps.grad, as over accumulation steps
        slice_loss += loss.item()
    assert slice_loss == pytest.approx(full_loss.item(), abs=1e-12)
    torch.testing.assert_close(logps.grad, full_grad, **TIGHT)

    # bnpo normalises per slice, so it is not invariant: this is what dapo's global count fixes
    bnpo = [
        grpo_loss(logps[r], old_logps[r], ref_logps[r], advantages[r], mask[r], loss_type="bnpo")[0].item()
        for r in torch.arange(8).split(2)
    ]
    full_bnpo = grpo_loss(logps, old_logps, ref_logps, advantages, mask, loss_type="bnpo")[0].item()
    assert abs(sum(bnpo) - full_bnpo) > 1e-3


def test_beta_zero_skips_kl():
    logps, old_logps, ref_logps, advantages, mask = make_batch()
    nan_ref = torch.full_like(ref_logps, float("nan"))
    for level in IMPORTANCE_SAMPLING_LEVELS:
        loss, metrics = grpo_loss(
            logps, old_logps, nan_ref, advantages, mask, beta=0.0, importance_sampling_level=level
        )
        assert torch.isfinite(loss) and "kl" not in metrics
        loss_none, _ = grpo_loss(logps, old_logps, None, advantages, mask, beta=0.0, importance_sampling_level=level)
        assert loss.item() == loss_none.item()


def test_bool_and_float_masks_agree():
    logps, old_logps, ref_logps, advantages, mask = make_batch()
    for loss_type in LOSS_TYPES:
        kwargs = dict(loss_type=loss_type, max_completion_length=7)
        a = grpo_loss(logps, old_logps, ref_logps, advantages, mask, **kwargs)
        b = grpo_loss(logps, old_logps, ref_logps, advantages, mask.bool(), **kwargs)
        assert a[0].item() == b[0].item() and a[1] == b[1]


def test_float32_inputs_compute_in_float32():
    logps, old_logps, ref_logps, advantages, mask = make_batch(dtype=torch.float32)
    loss, _ = grpo_loss(logps, old_logps, ref_logps, advantages.double(), mask.bool())
    assert loss.dtype == torch.float32
    ref_loss, _ = grpo_loss(logps.double(), old_logps.double(), ref_logps.double(), advantages.double(), mask)
    assert loss.item() == pytest.approx(ref_loss.item(), abs=1e-6)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(loss_type="ppo"), "loss_type must be one of 'grpo', 'bnpo', 'dr_grpo', 'dapo'"),
        (dict(importance_sampling_level="seq"), "importance_sampling_level must be one of 'token', 'sequence'"),
        (dict(loss_type="dr_grpo"), "max_completion_length"),
        (dict(loss_type="bnpo", importance_sampling_level="sequence_sum"), "sequence_sum"),
        (dict(ref_logps=None), "ref_logps is None but beta=0.04"),
        (dict(old_logps=torch.zeros(7, 6)), r"old_logps has shape \(7, 6\) but logps has shape \(7, 7\)"),
        (dict(ref_logps=torch.zeros(7, 8)), "ref_logps has shape"),
        (dict(completion_mask=torch.ones(7)), "completion_mask has shape"),
        (dict(advantages=torch.zeros(7, 1)), "advantages has shape"),
        (dict(logps=torch.zeros(7)), r"logps must be \[N, T\]"),
    ],
)
def test_grpo_loss_rejects_bad_arguments(kwargs, match):
    logps, old_logps, ref_logps, advantages, mask = make_batch()
    args = dict(logps=logps, old_logps=old_logps, ref_logps=ref_logps, advantages=advantages, completion_mask=mask)
    args.update((k, kwargs.pop(k)) for k in list(kwargs) if k in args)
    with pytest.raises(ValueError, match=match):
        grpo_loss(*args.values(), **kwargs)


# ---------------------------------------------------------------------------------------------------------------
# Advantages and reward combination
# ---------------------------------------------------------------------------------------------------------------


def test_advantages_hand_worked():
    """[0,1,0,1,1,0]: mean 0.5, sample std sqrt(1.5 / 5) = sqrt(0.3); A = +-0.5 / (sqrt(0.3) + 1e-4)."""
    adv = group_advantages(torch.tensor([0.0, 1, 0, 1, 1, 0]), num_generations=6)
    expected = 0.5 / (math.sqrt(0.3) + 1e-4)  # 0.91270; 0.5 / sqrt(0.3) = 0.91287 without the 1e-4
    assert expected == pytest.approx(0.9127, abs=1e-4)
    torch.testing.assert_close(adv, torch.tensor([-1.0, 1, -1, 1, 1, -1]) * expected, atol=1e-6, rtol=0)
    none = group_advantages(torch.tensor([0.0, 1, 0, 1, 1, 0]), num_generations=6, scale_rewards="none")
    assert none.tolist() == [-0.5, 0.5, -0.5, 0.5, 0.5, -0.5]


@pytest.mark.parametrize("scale_rewards", SCALE_REWARDS)
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_identical_rewards_give_exactly_zero(scale_rewards, dtype):
    rewards = torch.tensor([0.1] * 7 + [0.7] * 7 + [1 / 3] * 7 + [0, 1, 0, 0, 1, 0, 1], dtype=dtype)
    assert (rewards[:7] - rewards[:7].mean()).ne(0).any()  # the naive formula does leave rounding noise here
    adv = group_advantages(rewards, num_generations=7, scale_rewards=scale_rewards)
    assert adv.dtype == dtype
    assert torch.equal(adv[:21], torch.zeros(21, dtype=dtype))
    assert (adv[21:] != 0).all()


@pytest.mark.parametrize("scale_rewards", SCALE_REWARDS)
def test_advantages_match_loop_with_nan_rows(scale_rewards):
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(20, generator=g, dtype=F64)
    rewards[[1, 6, 7, 8, 11, 12, 13]] = float("nan")  # group 1: one NaN; group 3: one valid; group 4: two NaN
    rewards[16:20] = torch.tensor([float("nan")] * 4)  # group 5: no reward at all
    adv = group_advantages(rewards, num_generations=4, scale_rewards=scale_rewards)
    torch.testing.assert_close(adv, naive_advantages(rewards, 4, scale_rewards), **TIGHT)
    assert adv[[1, 6, 7, 8, 11, 12, 13, 16, 17, 18, 19]].eq(0).all()
    assert adv[[0, 2, 3, 4, 5]].ne(0).all()


def test_advantages_nan_hand_worked():
    """Group [1, NaN, 0, 1]: stats over [1, 0, 1], mean 2/3, std sqrt(1/3); the NaN row gets 0."""
    adv = group_advantages(torch.tensor([1.0, float("nan"), 0.0, 1.0]), num_generations=4)
    s = math.sqrt(1 / 3) + 1e-4
    torch.testing.assert_close(adv, torch.tensor([1 / 3 / s, 0.0, -2 / 3 / s, 1 / 3 / s]), atol=1e-6, rtol=0)


def test_advantages_options_and_errors():
    rewards = torch.tensor([0.0, 1, 0, 1, 1, 0])
    assert torch.equal(group_advantages(rewards, 3, True), group_advantages(rewards, 3, "group"))
    assert torch.equal(group_advantages(rewards, 3, False), group_advantages(rewards, 3, "none"))
    assert group_advantages(rewards.bfloat16(), 3).dtype == torch.float32
    assert group_advantages(torch.tensor([0, 1, 1, 1]), 2).dtype == torch.float32
    with pytest.raises(ValueError, match="groups of num_generations=4"):
        group_advantages(rewards, 4)
    with pytest.raises(ValueError, match="scale_rewards must be one of 'group', 'batch', 'none'"):
        group_advantages(rewards, 3, "std")
    with pytest.raises(ValueError, match=r"rewards must be \[N\]"):
        group_advantages(rewards.view(3, 2), 3)


def test_combine_rewards():
    nan = float("nan")
    rewards = torch.tensor([[1.0, nan], [nan, nan], [0.5, 2.0], [nan, -1.0]], dtype=F64)
    combined = combine_rewards(rewards, [1.0, 0.5])
    assert combined[[0, 2, 3]].tolist() == [1.0, 1.5, -0.5] and math.isnan(combined[1])
    unweighted = combine_rewards(rewards)
    assert unweighted[[0, 2, 3]].tolist() == [1.0, 2.5, -1.0] and math.isnan(unweighted[1])
    assert combine_rewards(rewards, torch.tensor([2.0, 0.0])).tolist()[2] == 1.0
    with pytest.raises(ValueError, match="3 reward weights for 2 reward functions"):
        combine_rewards(rewards, [1.0, 1.0, 1.0])
    # the no-reward row flows into group_advantages as advantage 0
    assert group_advantages(combined, 2)[1] == 0


# ---------------------------------------------------------------------------------------------------------------
# selective_log_softmax and entropy_from_logits
# ---------------------------------------------------------------------------------------------------------------


def reference_logps(logits, index):
    upcast = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return torch.log_softmax(upcast, -1).gather(-1, index.unsqueeze(-1)).squeeze(-1)


TOLERANCE = {torch.float64: TIGHT, torch.float32: dict(atol=2e-6, rtol=1e-6), torch.bfloat16: {}}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("shape, chunk_size", [((13, 50), 4), ((3, 5, 50), 4), ((3, 5, 50), None), ((2, 50), 1)])
def test_selective_log_softmax_matches_log_softmax(dtype, shape, chunk_size):
    g = torch.Generator().manual_seed(0)
    logits = (4 * torch.randn(shape, generator=g, dtype=F64)).to(dtype).requires_grad_(True)
    logits.data[..., 7] = float("-inf")  # a masked-out vocabulary entry
    index = torch.randint(0, 7, shape[:-1], generator=g)
    upstream = torch.randn(shape[:-1], generator=g, dtype=F64)

    logps = selective_log_softmax(logits, index, chunk_size=chunk_size)
    expected = reference_logps(logits, index)
    assert logps.dtype == expected.dtype == (F64 if dtype == F64 else torch.float32)
    torch.testing.assert_close(logps, expected, **TOLERANCE[dtype])

    (grad,) = torch.autograd.grad(logps, logits, upstream.to(logps.dtype))
    (expected_grad,) = torch.autograd.grad(expected, logits, upstream.to(logps.dtype))
    assert grad.dtype == dtype
    torch.testing.assert_close(grad, expected_grad, **TOLERANCE[dtype])


def test_selective_log_softmax_reads_sliced_logits_in_place():
    """logits[:, :-1] of a [B, L, V] tensor cannot be viewed as [B * (L - 1), V]: rows are walked per batch."""
    g = torch.Generator().manual_seed(1)
    base = torch.randn(3, 9, 40, generator=g, dtype=F64, requires_grad=True)
    logits = base[:, 1:-1]  # [3, 7, 40], non-contiguous
    index = torch.randint(0, 40, (3, 7), generator=g)
    logps = selective_log_softmax(logits, index, chunk_size=3)
    torch.testing.assert_close(logps, reference_logps(logits, index), **TIGHT)
    (grad,) = torch.autograd.grad(logps.sum(), base)
    (expected_grad,) = torch.autograd.grad(reference_logps(logits, index).sum(), base)
    torch.testing.assert_close(grad, expected_grad, **TIGHT)
    torch.testing.assert_close(entropy_from_logits(logits, chunk_size=3), entropy_from_logits(logits.contiguous()))


def test_selective_log_softmax_gradcheck_and_errors():
    logits = torch.randn(5, 6, dtype=F64, requires_grad=True)
    index = torch.tensor([0, 5, 2, 2, 1])
    assert torch.autograd.gradcheck(lambda z: selective_log_softmax(z, index, chunk_size=2), (logits,))
    with pytest.raises(ValueError, match="index must be logits.shape"):
        selective_log_softmax(logits, index[:4])
    with pytest.raises(ValueError, match="integer"):
        selective_log_softmax(logits, index.double())
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        selective_log_softmax(logits, index, chunk_size=0)


_MEMORY_PROBE = r"""
import resource
import torch
from grpo_hf.core import selective_log_softmax

def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()

def peak_since_reset():  # VmHWM, reset through /proc/self/clear_refs
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))

def full(logits, index):
    return torch.log_softmax(logits, -1).gather(-1, index.unsqueeze(-1)).squeeze(-1)

torch.manual_seed(0)
logits = torch.empty(8, 512, 49152).uniform_(-8, 8).requires_grad_(True)  # [N, T, V] fp32, 0.8 GB
index = torch.randint(0, 49152, (8, 512))
# selective first: memory the allocator keeps after a run could only hide the *second* run's peak
for fn in (selective_log_softmax, full):
    fn(logits[:1, :4], index[:1, :4])  # one-time allocations (thread pools, kernels) outside the measurement
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = resident()
    assert peak_since_reset() - before < 16 << 20, "peak resident size was not reset"
    logps = fn(logits, index)  # autograd on: what the forward keeps for backward counts too
    print(peak_since_reset() - before)
    del logps
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="peak RSS reset needs Linux /proc")
def test_selective_log_softmax_peak_memory():
    """Peak extra resident memory of one forward on [8, 512, 49152] fp32 logits, in a fresh process."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = subprocess.run([sys.executable, "-c", _MEMORY_PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    selective, full = map(int, out.stdout.split())
    print(f"peak extra memory: full log_softmax {full / 2**20:.0f} MiB, selective {selective / 2**20:.0f} MiB")
    assert full > 0.9 * 8 * 512 * 49152 * 4  # the probe does see the full [N, T, V] float32 log-softmax
    assert selective < full / 4


def test_entropy_from_logits():
    g = torch.Generator().manual_seed(2)
    logits = 3 * torch.randn(3, 4, 20, generator=g, dtype=F64)
    logits[0, 0, :5] = float("-inf")  # p = 0 entries contribute 0, not NaN
    p = torch.softmax(logits, -1)
    expected = -torch.where(p > 0, p * torch.log_softmax(logits, -1), 0.0).sum(-1)
    torch.testing.assert_close(entropy_from_logits(logits, chunk_size=5), expected, **TIGHT)
    uniform = entropy_from_logits(torch.zeros(2, 16, dtype=torch.bfloat16))
    assert uniform.dtype == torch.float32
    torch.testing.assert_close(uniform, torch.full((2,), math.log(16)))
    low = entropy_from_logits(logits.bfloat16())
    torch.testing.assert_close(low, entropy_from_logits(logits.bfloat16().float()), atol=1e-6, rtol=1e-6)
