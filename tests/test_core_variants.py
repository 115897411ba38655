"""TRL 1.16's loss variants and objective terms in grpo_hf.core, against the naive loops of tests/oracle.py.

cispo, sapo, luspo, vespo, `delta`, `use_bias_correction_kl`, `off_policy_mask_threshold` (the module docstring of
core/losses.py has each formula and its source), `check_loss_settings`, and the numbers of the loss as it was before
them (`oracle.FROZEN_LOSS`), which the defaults must reproduce.
"""

import inspect
import itertools
import math
import re

import pytest
import torch
from oracle import (
    AGGREGATION,
    DELTA,
    F64,
    FROZEN_LOSS,
    TERM_DEFAULTS,
    THRESHOLD,
    TIGHT,
    assert_same,
    gradient_digest,
    make_batch,
    naive_loss,
    run_both,
)

from grpo_hf.core import IMPORTANCE_SAMPLING_LEVELS, LOSS_TYPES, LOSS_VARIANTS, check_loss_settings, grpo_loss

NEW_LOSS_TYPES = ("cispo", "sapo", "luspo", "vespo")
ALL_LOSS_TYPES = LOSS_TYPES + NEW_LOSS_TYPES
SIGMOID_1, SIGMOID_2 = 1 / (1 + math.exp(-1)), 1 / (1 + math.exp(-2))

# ---------------------------------------------------------------------------------------------------------------
# Every loss type and objective term against the loop
# ---------------------------------------------------------------------------------------------------------------

TERMS = {
    "none": {},
    "delta": dict(delta=DELTA),
    "bias_kl": dict(use_bias_correction_kl=True),
    "off_policy_mask": dict(off_policy_mask_threshold=THRESHOLD),
    "all": dict(delta=DELTA, use_bias_correction_kl=True, off_policy_mask_threshold=THRESHOLD),
}
GRID = [
    (loss_type, level, beta, clip_higher, on_policy, terms)
    for loss_type, level, beta, clip_higher, on_policy, terms in itertools.product(
        ALL_LOSS_TYPES, IMPORTANCE_SAMPLING_LEVELS, (0.0, 0.04), (False, True), (True, False), TERMS
    )
    if (level != "sequence_sum" or loss_type == "grpo")
    and not (loss_type in LOSS_TYPES and terms == "none")  # tests/test_core.py covers these
    and not (loss_type in NEW_LOSS_TYPES and terms in ("delta", "bias_kl", "off_policy_mask"))  # "all" has them
]


@pytest.mark.parametrize(
    "loss_type, level, beta, clip_higher, on_policy, terms",
    GRID,
    ids=[f"{lt}-{lvl}-beta{b}-{'eh' if e else 'e'}-{'on' if on else 'off'}-{tm}" for lt, lvl, b, e, on, tm in GRID],
)
def test_grpo_loss_matches_naive_loop(loss_type, level, beta, clip_higher, on_policy, terms):
    logps, old_logps, ref_logps, advantages, mask = make_batch()
    # clip-higher; for cispo epsilon_high is the cap of the weight itself (None: epsilon = 0.2, below every ratio)
    epsilon_high = (1.2 if loss_type == "cispo" else 0.28) if clip_higher else None
    kwargs = dict(
        loss_type=loss_type,
        epsilon=0.2,
        epsilon_high=epsilon_high,
        beta=beta,
        importance_sampling_level=level,
        max_completion_length=9,
        num_items_in_batch=int(mask.sum()) + 11,  # a global count larger than the local one
        **TERMS[terms],
    )
    batch = (logps, None if on_policy else old_logps, ref_logps if beta else None, advantages, mask)
    results = run_both(grpo_loss, batch, **kwargs)
    assert_same(results)
    assert results[0][1].abs().sum() > 0


def test_fixture_exercises_every_branch():
    """The grid above is only meaningful if each cap, clip and mask binds on some tokens and not on all."""
    logps, old_logps, _, advantages, mask = make_batch()
    ratio = torch.exp(logps - old_logps)  # [N, T]
    on_tokens = mask.bool()
    negative = (advantages < 0)[:, None] & on_tokens
    assert ((ratio > DELTA) & negative).any() and ((ratio < DELTA) & negative).any()
    assert ((ratio > 1.2) & on_tokens).any() and ((ratio < 1.2) & on_tokens).any()  # the cispo cap
    mean_log_ratio = ((old_logps - logps) * mask).sum(-1) / mask.sum(-1).clamp(min=1)  # [N]
    dropped = (advantages < 0) & (mean_log_ratio > THRESHOLD)
    kept_negative = (advantages < 0) & (mean_log_ratio <= THRESHOLD) & (mask.sum(-1) > 0)
    assert dropped.sum() >= 1 and kept_negative.sum() >= 1 and (mean_log_ratio - THRESHOLD).abs().min() > 1e-3
    _, metrics = grpo_loss(logps, old_logps, None, advantages, mask, loss_type="vespo", beta=0.0)
    assert 0.01 < metrics["vespo/phi_seq_mean"] < 0.99


# ---------------------------------------------------------------------------------------------------------------
# Hand-worked cases, one per variant and term
# ---------------------------------------------------------------------------------------------------------------


def one_row(logps, ratios, dtype=F64):
    """A [1, T] batch whose ratios pi / pi_old are `ratios`: old_logps = logps - log(ratios)."""
    logps = torch.tensor([logps], dtype=dtype, requires_grad=True)
    old_logps = logps.detach() - torch.log(torch.tensor([ratios], dtype=dtype))
    return logps, old_logps, torch.ones_like(old_logps)


def loss_and_grad(logps, *args, **kwargs):
    logps.grad = None
    loss, metrics = grpo_loss(logps, *args, **kwargs)
    loss.backward()
    return loss.item(), logps.grad, metrics


def test_hand_worked_cispo():
    """Ratios 0.5, 1, 3 capped at epsilon_high = 2: weights 0.5, 1, 2 on A log pi, over 3 tokens (dapo)."""
    logps, old_logps, mask = one_row([-1.0, -2.0, -0.5], [0.5, 1.0, 3.0])
    for a in (2.0, -2.0):
        kwargs = dict(loss_type="cispo", epsilon_high=2.0, beta=0.0)
        loss, grad, metrics = loss_and_grad(logps, old_logps, None, torch.tensor([a], dtype=F64), mask, **kwargs)
        # l = w A log pi = A [0.5 * -1, 1 * -2, 2 * -0.5] = -3.5 A; loss = -l.sum() / 3
        assert loss == pytest.approx(3.5 * a / 3, abs=1e-12)
        torch.testing.assert_close(grad, -a * torch.tensor([[0.5, 1.0, 2.0]], dtype=F64) / 3, **TIGHT)
        assert metrics == {"cispo_clip_ratio": pytest.approx(1 / 3 if a > 0 else 0.0)}  # TRL counts A > 0 only


def test_hand_worked_sapo():
    """Ratios 1 and 2, one row: f(r) = sigmoid(tau (r - 1)) 4 / tau, df/dlogp = 4 sigmoid (1 - sigmoid) r."""
    logps, old_logps, mask = one_row([-1.0, -2.0], [1.0, 2.0])
    kwargs = dict(loss_type="sapo", beta=0.0, sapo_temperature_pos=1.0, sapo_temperature_neg=2.0)
    loss, grad, metrics = loss_and_grad(logps, old_logps, None, torch.tensor([1.0], dtype=F64), mask, **kwargs)
    assert loss == pytest.approx(-(2 + 4 * SIGMOID_1) / 2, abs=1e-12)  # tau = 1: f(1) = 2, f(2) = 4 sigmoid(1)
    expected = [[-1.0 / 2, -4 * SIGMOID_1 * (1 - SIGMOID_1) * 2 / 2]]
    torch.testing.assert_close(grad, torch.tensor(expected, dtype=F64), **TIGHT)
    assert metrics == {}
    loss, grad, _ = loss_and_grad(logps, old_logps, None, torch.tensor([-1.0], dtype=F64), mask, **kwargs)
    assert loss == pytest.approx((1 + 2 * SIGMOID_2) / 2, abs=1e-12)  # A <= 0, tau = 2: f(1) = 1, f(2) = 2 sigmoid(2)
    expected = [[1.0 / 2, 4 * SIGMOID_2 * (1 - SIGMOID_2) * 2 / 2]]
    torch.testing.assert_close(grad, torch.tensor(expected, dtype=F64), **TIGHT)


def test_hand_worked_luspo():
    """GSPO weighted by length. Row 0 (2 tokens): s = e^0.5 > 1.2 with A = 1, clipped, l = 1.2, no gradient.
    Row 1 (4 tokens): s = 1, A = -0.5, l = -0.5. J = (2 * 1.2 + 4 * -0.5) / 2 = 0.2, and each token of row 1
    gets dJ/dlogp = |o| A (s / |o|) / N = A / 2: the length cancels the geometric mean's 1 / |o|."""
    logps = torch.full((2, 4), -1.0, dtype=F64, requires_grad=True)
    old_logps = torch.tensor([[-1.5, -1.5, 0.0, 0.0], [-1.0] * 4], dtype=F64)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]], dtype=F64)
    A = torch.tensor([1.0, -0.5], dtype=F64)
    kwargs = dict(loss_type="luspo", importance_sampling_level="sequence", beta=0.0)
    loss, grad, metrics = loss_and_grad(logps, old_logps, None, A, mask, **kwargs)
    assert loss == pytest.approx(-0.2, abs=1e-12)
    torch.testing.assert_close(grad, torch.tensor([[0.0] * 4, [0.25] * 4], dtype=F64), **TIGHT)
    assert metrics["clip_ratio/high_mean"] == pytest.approx(2 / 6)  # row 0's two tokens of six


def test_hand_worked_vespo():
    """Log-ratios ln 2 and 0: w = 2. A = 1 (k = 2, lambda = 3): phi = 4 e^-3; A = -1 (k = 3, lambda = 2): phi = 8 e^-2.
    l = phi A log pi over 2 tokens (dapo); phi carries no gradient."""
    logps, old_logps, mask = one_row([-1.0, -2.0], [2.0, 1.0])
    for a, phi in ((1.0, 4 * math.exp(-3)), (-1.0, 8 * math.exp(-2))):
        kwargs = dict(loss_type="vespo", beta=0.0)
        loss, grad, metrics = loss_and_grad(logps, old_logps, None, torch.tensor([a], dtype=F64), mask, **kwargs)
        assert loss == pytest.approx(-phi * a * -3 / 2, abs=1e-12)
        torch.testing.assert_close(grad, torch.full((1, 2), -phi * a / 2, dtype=F64), **TIGHT)
        assert metrics == {"vespo/phi_seq_mean": pytest.approx(phi, abs=1e-12)}


def test_vespo_clamps():
    """Per-token log-ratios clamp to [-20, 20] and their sum to [log 1e-8, 20] (TRL, the authors' code)."""
    A = torch.tensor([1.0], dtype=F64)
    logps, old_logps, mask = one_row([-1.0, -1.0], [1.0, 1.0])
    for shift, expected_phi in ((30.0, 0.0), (-30.0, math.exp(3 + 2 * math.log(1e-8) - 3e-8))):
        # shift 30: w = e^20, phi = exp(3 + 40 - 3 e^20) underflows to 0; shift -30: w = 1e-8, phi ~ 2e-15
        _, metrics = grpo_loss(logps, old_logps - shift, None, A, mask, loss_type="vespo", beta=0.0)
        assert metrics["vespo/phi_seq_mean"] == pytest.approx(expected_phi, rel=1e-12, abs=0)
    shifted = old_logps - torch.tensor([[30.0, -25.0]], dtype=F64)
    _, metrics = grpo_loss(logps, shifted, None, A, mask, loss_type="vespo", beta=0.0)
    assert metrics["vespo/phi_seq_mean"] == 1.0  # per token first: 20 - 20 = 0, w = 1 (unclamped: 5, phi ~ 0)
    _, metrics = grpo_loss(logps, old_logps, None, A, mask, loss_type="vespo", beta=0.0, vespo_lambda_pos=-1.0)
    assert metrics["vespo/phi_seq_mean"] == 1.0  # w = 1: phi(1) = exp(lambda + 0 - lambda) = 1, lambda raised to 1e-4


def test_hand_worked_delta():
    """Ratios 0.5, 1.5, 3 with A = -1, epsilon 0.2, delta 2: min(min(r, 2) A, clip(r) A) = -0.8 (clipped),
    -1.5 (gradient), -2 (capped, no gradient; -3 without delta). A = +1: delta changes nothing."""
    logps, old_logps, mask = one_row([-1.0, -1.0, -1.0], [0.5, 1.5, 3.0])
    A = torch.tensor([-1.0], dtype=F64)
    loss, grad, _ = loss_and_grad(logps, old_logps, None, A, mask, beta=0.0, delta=2.0)
    assert loss == pytest.approx(4.3 / 3, abs=1e-12)
    torch.testing.assert_close(grad, torch.tensor([[0.0, 0.5, 0.0]], dtype=F64), **TIGHT)
    loss, grad, _ = loss_and_grad(logps, old_logps, None, A, mask, beta=0.0)
    assert loss == pytest.approx(5.3 / 3, abs=1e-12)
    torch.testing.assert_close(grad, torch.tensor([[0.0, 0.5, 1.0]], dtype=F64), **TIGHT)
    # delta = 1.1 < 1 + epsilon (check_loss_settings warns; TRL computes it so): min(-1.1, -1.2) = -1.2 for
    # ratios 1.5 and 3, i.e. the usual clip at 1 + epsilon binds and nothing has a gradient
    loss, grad, _ = loss_and_grad(logps, old_logps, None, A, mask, beta=0.0, delta=1.1)
    assert loss == pytest.approx(3.2 / 3, abs=1e-12) and not grad.any()
    positive = [loss_and_grad(logps, old_logps, None, -A, mask, beta=0.0, delta=d) for d in (2.0, None)]
    assert positive[0][0] == positive[1][0] and torch.equal(positive[0][1], positive[1][1])


@pytest.mark.parametrize("level", ["token", "sequence_sum"])
def test_hand_worked_bias_corrected_kl(level):
    """r = 2, x = ref - logps = ln 2, A = 0, beta = 1: loss = r k3(x) = 2 (1 - ln 2), and
    d(r k3)/dlogp = r k3 - r (e^x - 1) = -r x = -2 ln 2 (uncorrected: -(e^x - 1) = -1). sequence_sum: the same
    numbers with s = 2 and d = ln 2 spread over two tokens, each getting -s d."""
    if level == "token":
        logps, old_logps, mask = one_row([0.0], [2.0])
        ref_logps = torch.tensor([[math.log(2)]], dtype=F64)
    else:
        logps, old_logps, mask = one_row([0.0, 0.0], [2.0, 1.0])
        ref_logps = torch.tensor([[math.log(2), 0.0]], dtype=F64)
    A = torch.zeros(1, dtype=F64)
    kwargs = dict(beta=1.0, importance_sampling_level=level)
    loss, grad, metrics = loss_and_grad(logps, old_logps, ref_logps, A, mask, use_bias_correction_kl=True, **kwargs)
    assert loss == pytest.approx(2 * (1 - math.log(2)), abs=1e-12)
    assert metrics["kl"] == pytest.approx(2 * (1 - math.log(2)), abs=1e-12)
    torch.testing.assert_close(grad, torch.full_like(grad, -2 * math.log(2)), **TIGHT)
    if level == "token":
        _, grad, metrics = loss_and_grad(logps, old_logps, ref_logps, A, mask, **kwargs)
        assert metrics["kl"] == pytest.approx(1 - math.log(2), abs=1e-12)
        torch.testing.assert_close(grad, torch.full_like(grad, -1.0), **TIGHT)


def test_hand_worked_off_policy_mask():
    """Three rows of two tokens, logps 0, mean log(pi_old / pi) 0.6, 0.5 (exactly the threshold: kept), 0.6,
    A = -1, -1, +1. Row 0 is dropped from the policy term but keeps its KL term; rows 1 and 2 are kept."""
    logps = torch.zeros(3, 2, dtype=F64, requires_grad=True)
    old_logps = torch.tensor([[0.6, 0.6], [0.4, 0.6], [0.6, 0.6]], dtype=F64)
    ref_logps = torch.full((3, 2), 0.3, dtype=F64)
    A = torch.tensor([-1.0, -1.0, 1.0], dtype=F64)
    mask = torch.ones(3, 2, dtype=F64)
    kwargs = dict(epsilon=0.9, beta=0.1, off_policy_mask_threshold=0.5)  # epsilon 0.9: nothing clips
    loss, grad, _ = loss_and_grad(logps, old_logps, ref_logps, A, mask, **kwargs)
    policy = (0.0 - (math.exp(-0.4) + math.exp(-0.6)) / 2 + math.exp(-0.6)) / 3  # J's policy part, rows 0, 1, 2
    kl = math.exp(0.3) - 0.3 - 1  # every token, every row
    assert loss == pytest.approx(-(policy - 0.1 * kl), abs=1e-12)
    kl_grad = 0.1 * (math.exp(0.3) - 1)  # d(-J)/dlogp of beta k3(ref - logp), before the 1 / (|o| N)
    expected = [[-kl_grad] * 2, [math.exp(-0.4) - kl_grad, math.exp(-0.6) - kl_grad], [-math.exp(-0.6) - kl_grad] * 2]
    torch.testing.assert_close(grad, torch.tensor(expected, dtype=F64) / 6, **TIGHT)


def test_off_policy_mask_measures_the_drift_from_the_sampler_when_given():
    """The hand-worked case above with pi_old = pi_theta (ratio 1) and the sampler's log-probs where its old_logps
    were: the mask reads log(pi_sampler / pi_theta) as TRL does, so row 0 (A < 0, mean drift 0.6 > 0.5) is dropped
    from the policy term; rows 1 (drift 0.5, kept) and 2 (A > 0) keep theirs. Without the sampler's log-probs the
    same call drops nothing (on-policy)."""
    logps = torch.zeros(3, 2, dtype=F64, requires_grad=True)
    sampler = torch.tensor([[0.6, 0.6], [0.4, 0.6], [0.6, 0.6]], dtype=F64)
    A, mask = torch.tensor([-1.0, -1.0, 1.0], dtype=F64), torch.ones(3, 2, dtype=F64)
    kwargs = dict(epsilon=0.9, beta=0.0, off_policy_mask_threshold=0.5)
    loss, _ = grpo_loss(logps, None, None, A, mask, off_policy_logps=sampler, **kwargs)
    loss.backward()
    # ratio 1: d(-J)/dlogp = -A_i M_i / (|o_i| N), M = (0, 1, 1)
    expected = torch.tensor([[0.0, 0.0], [1.0, 1.0], [-1.0, -1.0]], dtype=F64) / 6
    torch.testing.assert_close(logps.grad, expected, **TIGHT)
    assert loss.item() == pytest.approx(-(0.0 - 1.0 + 1.0) / 3, abs=1e-12)
    logps.grad = None
    grpo_loss(logps, None, None, A, mask, **kwargs)[0].backward()  # no sampler: every row kept
    torch.testing.assert_close(logps.grad, -A[:, None] * mask / 6, **TIGHT)


@pytest.mark.parametrize("loss_type", ALL_LOSS_TYPES)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_on_policy_gradient_is_plain_policy_gradient(loss_type, level):
    """ratio == 1 and beta == 0: every variant's gradient is -A_i m[i, t] / (its normaliser), whether its loss is
    built from the ratio (clip family, sapo: slope 1 at r = 1) or from log pi with weight 1 (cispo, vespo: phi(1) = 1).
    The off-policy mask keeps every row on-policy (mean log-ratio 0 <= threshold)."""
    logps, _, _, advantages, mask = make_batch()
    N = mask.shape[0]
    normaliser = {
        "sequence_mean": N * mask.sum(-1, keepdim=True).clamp(min=1),
        "local_tokens": mask.sum(),
        "budget": N * 9,
        "global_tokens": mask.sum(),
        "sequence_sum": N,
    }[AGGREGATION[loss_type]]
    logps.requires_grad_(True)
    kwargs = dict(loss_type=loss_type, beta=0.0, importance_sampling_level=level, max_completion_length=9)
    loss, _ = grpo_loss(logps, None, None, advantages, mask, epsilon_high=5.0, off_policy_mask_threshold=0.1, **kwargs)
    loss.backward()
    torch.testing.assert_close(logps.grad, -advantages[:, None] * mask / normaliser, **TIGHT)


# ---------------------------------------------------------------------------------------------------------------
# Properties: no gradient into the inputs that must not get one, accumulation, defaults
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("loss_type", ALL_LOSS_TYPES)
def test_no_gradient_into_old_ref_or_advantages(loss_type):
    logps, old_logps, ref_logps, advantages, mask = make_batch()
    for t in (logps, old_logps, ref_logps, advantages):
        t.requires_grad_(True)
    kwargs = dict(loss_type=loss_type, max_completion_length=9, **TERMS["all"])
    loss, _ = grpo_loss(logps, old_logps, ref_logps, advantages, mask, **kwargs)
    loss.backward()
    assert logps.grad is not None and logps.grad.abs().sum() > 0
    assert old_logps.grad is None and ref_logps.grad is None and advantages.grad is None


@pytest.mark.parametrize("loss_type", ["cispo", "vespo"])
def test_global_token_losses_are_invariant_to_accumulation(loss_type):
    """cispo and vespo divide by the global token count, as dapo: slices with that count add up to the batch."""
    logps, old_logps, ref_logps, advantages, mask = make_batch(seed=3, lengths=(7, 5, 3, 0, 1, 6, 2, 4))
    kwargs = dict(loss_type=loss_type, epsilon_high=1.2)
    logps.requires_grad_(True)
    full_loss, _ = grpo_loss(logps, old_logps, ref_logps, advantages, mask, **kwargs)
    (full_grad,) = torch.autograd.grad(full_loss, logps)
    slice_loss = 0.0
    for rows in torch.arange(8).split(2):
        batch_slice = (t[rows] for t in (logps, old_logps, ref_logps, advantages, mask))
        loss, _ = grpo_loss(*batch_slice, num_items_in_batch=int(mask.sum()), **kwargs)
        loss.backward()
        slice_loss += loss.item()
    assert slice_loss == pytest.approx(full_loss.item(), abs=1e-12)
    torch.testing.assert_close(logps.grad, full_grad, **TIGHT)


@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_defaults_leave_the_loss_as_it_was_before_the_variants(dtype):
    """Every loss type / level / beta / clip-higher / on-off-policy combination of the default loss gives the loss,
    gradient and metrics of `oracle.FROZEN_LOSS` (the vectorised loss before the variants), with the new knobs at their
    defaults omitted or passed explicitly (bit for bit the same); the oracle gives them too."""
    count = 0
    for row in FROZEN_LOSS:
        logps, old_logps, ref_logps, advantages, mask = (t.to(dtype) for t in make_batch())  # FROZEN_LOSS's inputs
        batch = (None if row["on_policy"] else old_logps, ref_logps if row["beta"] else None, advantages, mask)
        kwargs = dict(loss_type=row["loss_type"], epsilon=0.2, epsilon_high=row["epsilon_high"], beta=row["beta"])
        kwargs.update(importance_sampling_level=row["level"], max_completion_length=9, num_items_in_batch=40)
        results = []
        for fn, extra in ((grpo_loss, {}), (grpo_loss, TERM_DEFAULTS), (naive_loss, {})):
            x = logps.clone().requires_grad_(True)
            loss, metrics = fn(x, *batch, **kwargs, **extra)
            results.append((loss, torch.autograd.grad(loss, x)[0], metrics))
        (loss, grad, metrics), (explicit_loss, explicit_grad, explicit_metrics) = results[:2]
        assert torch.equal(loss, explicit_loss) and torch.equal(grad, explicit_grad) and metrics == explicit_metrics
        tolerance = dict(abs=1e-12, rel=1e-12) if dtype == F64 else dict(abs=1e-6, rel=1e-5)
        assert metrics.keys() == results[2][2].keys()  # the oracle's names; the metrics added since it was frozen
        for loss, grad, metrics in results[::2]:  # (clip_ratio/low_min, high_max) are checked against the oracle
            assert loss.item() == pytest.approx(row["loss"], **tolerance), row
            assert gradient_digest(grad) == pytest.approx((row["grad_abs_sum"], row["grad_weighted_sum"]), **tolerance)
            frozen = {name: metrics[name] for name in row["metrics"]}
            assert frozen == pytest.approx(row["metrics"], **tolerance), row
        count += 1
    assert count == 4 * 2 * 2 * 2 * 2 + 2 * 2 * 2


def test_grpo_loss_defaults_are_check_loss_settings_defaults():
    """grpo_loss's new keywords default to "off" and check_loss_settings has nothing to say about them."""
    params = inspect.signature(grpo_loss).parameters
    assert {name: params[name].default for name in TERM_DEFAULTS} == TERM_DEFAULTS
    for name, param in inspect.signature(check_loss_settings).parameters.items():
        assert param.default == params[name].default, name
    assert check_loss_settings() == []


# ---------------------------------------------------------------------------------------------------------------
# check_loss_settings: TRL's warnings, and errors for settings that cannot be computed
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("loss_type", ALL_LOSS_TYPES)
def test_sequence_level_with_token_sums_warns_like_trl(loss_type):
    """TRL warns when a sequence-level ratio meets a loss that sums per-token terms (bnpo, dr_grpo, dapo, cispo)."""
    kwargs = dict(loss_type=loss_type, max_completion_length=9, epsilon_high=5.0)
    warnings = check_loss_settings(importance_sampling_level="sequence", **kwargs)
    gspo = [w for w in warnings if "weights each sequence by its completion length" in w]
    assert len(gspo) == (loss_type in ("bnpo", "dr_grpo", "dapo", "cispo"))
    at_token_level = check_loss_settings(**kwargs)
    assert len(at_token_level) == (loss_type == "luspo")  # luspo's own warning: it wants "sequence"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(loss_type="luspo"), "importance_sampling_level='sequence' as in the LUSPO paper"),
        (dict(loss_type="vespo", importance_sampling_level="sequence"), "computes its own sequence-level weight"),
        (dict(loss_type="cispo"), r"caps the importance weight at epsilon_high=0.2 itself"),
        (dict(loss_type="cispo", epsilon_high=0.5), "ScaleRL: 5.0"),
        (dict(loss_type="sapo", delta=4.0), "delta=4.0 has no effect with loss_type='sapo'"),
        (dict(delta=1.1, epsilon_high=0.28), r"delta=1.1 <= 1 \+ epsilon_high"),
        (dict(off_policy_mask_threshold=-0.1), "drops negative-advantage sequences even on-policy"),
        (dict(loss_type="vespo", vespo_lambda_neg=0.0), "raised to 1e-4"),
    ],
)
def test_check_loss_settings_warns(kwargs, match):
    warnings = check_loss_settings(**kwargs)
    assert len(warnings) == 1 and re.search(match, warnings[0]), warnings


def test_check_loss_settings_quiet_on_recommended_settings():
    assert check_loss_settings(loss_type="luspo", importance_sampling_level="sequence") == []
    assert check_loss_settings(loss_type="cispo", epsilon_high=5.0) == []
    assert check_loss_settings(loss_type="dapo", delta=4.0, epsilon_high=0.28, off_policy_mask_threshold=0.5) == []
    assert check_loss_settings(loss_type="grpo", importance_sampling_level="sequence_sum", delta=4.0) == []


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(loss_type="ppo"), "loss_type must be one of 'grpo', 'bnpo', 'dr_grpo', 'dapo', .*'vespo'"),
        (dict(loss_type="sapo", importance_sampling_level="sequence_sum"), "sequence_sum.*loss_type='grpo'"),
        (dict(loss_type="sapo", sapo_temperature_neg=0.0), "must be > 0: SAPO's gate"),
        (dict(loss_type="cispo", epsilon_high=0.0), "caps the importance weight at epsilon_high=0.0, which must be"),
        (dict(loss_type="dr_grpo"), "max_completion_length"),
    ],
)
def test_impossible_settings_raise_in_check_and_in_the_loss(kwargs, match):
    with pytest.raises(ValueError, match=match):
        check_loss_settings(**kwargs)
    logps, old_logps, ref_logps, advantages, mask = make_batch()
    with pytest.raises(ValueError, match=match):
        grpo_loss(logps, old_logps, ref_logps, advantages, mask, **kwargs)


def test_every_loss_type_has_a_variant():
    assert set(LOSS_VARIANTS) == set(ALL_LOSS_TYPES) == set(AGGREGATION)
