"""The naive references of grpo_hf.core's maths: each formula of docs/design.md ("The maths") and of the docstring of
`grpo_hf/core/losses.py`, written as per-sample, per-token Python loops over scalars, and the batch they are run on.

`naive_loss` is the one reference of the loss: every loss type, importance-sampling level, clip range, KL term
(plain or bias-corrected), aggregation, `delta`, the off-policy mask, a policy mask (`top_entropy_quantile`) and a
sampler's importance weight. Beside it: the entropy bonus and the high-entropy mask, the vLLM correction's weights,
and the group advantages. Tests compare the vectorised code with these in float64 to `TIGHT`; `FROZEN_LOSS`
(tests/frozen_loss.json) holds the default loss's numbers as they were before the TRL 1.16 variants, so that a change
made to both the code and this module still shows.
"""

import json
import math
import statistics
from pathlib import Path

import torch

F64 = torch.float64
TIGHT = dict(atol=1e-12, rtol=1e-12)  # fp64: the vectorised code and the loops differ only by summation order

AGGREGATION = {  # loss_type -> how sum_t m l becomes J (TRL 1.16's pairing)
    "grpo": "sequence_mean",
    "sapo": "sequence_mean",
    "bnpo": "local_tokens",
    "dr_grpo": "budget",
    "dapo": "global_tokens",
    "cispo": "global_tokens",
    "vespo": "global_tokens",
    "luspo": "sequence_sum",
}
CLIP_FAMILY = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
TERM_DEFAULTS = dict(  # the TRL 1.16 knobs of the loss at their defaults: each variant or term off, or TRL's values
    delta=None,
    use_bias_correction_kl=False,
    off_policy_mask_threshold=None,
    sapo_temperature_pos=1.0,
    sapo_temperature_neg=1.05,
    vespo_k_pos=2.0,
    vespo_lambda_pos=3.0,
    vespo_k_neg=3.0,
    vespo_lambda_neg=2.0,
)

# ---------------------------------------------------------------------------------------------------------------
# The batch
# ---------------------------------------------------------------------------------------------------------------

LENGTHS = (7, 5, 3, 0, 1, 6, 2)  # right-padded rows, one of them empty
THRESHOLD = 0.5  # an off_policy_mask_threshold that drops row 1 of `make_batch` and keeps the other rows
DELTA = 1.5  # a delta above 1 + 0.28 that caps some ratios of row 2


def make_batch(seed=0, lengths=LENGTHS, T=7, drift=0.3, dtype=F64):
    """Random logps/old/ref/advantages with right-padded masks, and rows built to exercise every branch:
    row 0: A > 0 and ratios > 1 (clip high, cispo cap); row 1: A < 0 and ratios < 1 (clip low; its mean
    log(pi_old / pi) ~ 0.8 > THRESHOLD, so the off-policy mask drops it); row 2: A < 0 and ratios > 1 (the delta cap).
    """
    g = torch.Generator().manual_seed(seed)
    N = len(lengths)
    logps = -3 * torch.rand(N, T, generator=g, dtype=dtype)  # [N, T]
    old_logps = logps + drift * torch.randn(N, T, generator=g, dtype=dtype)  # [N, T]
    ref_logps = logps + 0.3 * torch.randn(N, T, generator=g, dtype=dtype)  # [N, T]
    advantages = torch.randn(N, generator=g, dtype=dtype)  # [N]
    advantages[:3] = advantages[:3].abs() * torch.tensor([1.0, -1.0, -1.0], dtype=dtype)
    old_logps[:3] += torch.tensor([[-0.8], [0.8], [-0.8]], dtype=dtype)
    mask = (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).to(dtype)  # [N, T]
    return logps, old_logps, ref_logps, advantages, mask


# ---------------------------------------------------------------------------------------------------------------
# The loss
# ---------------------------------------------------------------------------------------------------------------


def naive_loss(
    logps,
    old_logps,
    ref_logps,
    advantages,
    mask,
    *,
    loss_type="grpo",
    epsilon=0.2,
    epsilon_high=None,
    beta=0.04,
    importance_sampling_level="token",
    max_completion_length=None,
    num_items_in_batch=None,
    policy_mask=None,
    sampling_weight=None,
    off_policy_logps=None,
    **terms,
):
    """`grpo_loss`'s (loss, metrics), keyword for keyword; `terms` are the TRL 1.16 knobs of `TERM_DEFAULTS`. Only
    `logps` carries a graph: each logps[i, t] is its own scalar node. `policy_mask[i][t]` (truthy: keep) multiplies
    the policy term of token t; `sampling_weight(i, t)`, a function (t is None for "sequence_sum"), multiplies it, or
    for "vespo" enters w_i; neither touches the KL."""
    if set(terms) - set(TERM_DEFAULTS):
        raise TypeError(f"naive_loss has no keyword {sorted(set(terms) - set(TERM_DEFAULTS))}")
    terms = {**TERM_DEFAULTS, **terms}
    delta, use_bias_correction_kl = terms["delta"], terms["use_bias_correction_kl"]
    off_policy_mask_threshold = terms["off_policy_mask_threshold"]
    N, T = logps.shape
    level = importance_sampling_level
    eps_low, eps_high = epsilon, (epsilon if epsilon_high is None else epsilon_high)
    lp = [[logps[i, t] for t in range(T)] for i in range(N)]
    old = [[float(logps.detach()[i, t] if old_logps is None else old_logps[i, t]) for t in range(T)] for i in range(N)]
    sampler = old if off_policy_logps is None else off_policy_logps.tolist()  # what the off-policy mask measures
    ref = None if ref_logps is None else ref_logps.tolist()
    A = advantages.tolist()
    tokens = [[t for t in range(T) if mask[i, t] == 1] for i in range(N)]
    total_tokens = sum(len(ts) for ts in tokens)
    zero = logps.new_zeros(())

    def k3(x):
        return torch.exp(x) - x - 1

    def weight(i, t):  # the sampler's importance weight pi_old / pi_sampler, 1 without one
        return 1.0 if sampling_weight is None else sampling_weight(i, t)

    def clip_family(r, a):  # min(min(r, delta) A, clip(r, 1 - eps_low, 1 + eps_high) A)
        capped = r if delta is None else min(r, delta)
        return min(capped * a, min(max(r, 1 - eps_low), 1 + eps_high) * a)

    def cispo(r, a, logp):  # sg(min(r, eps_high)) A log pi
        return min(r.item(), eps_high) * a * logp

    def sapo(r, a):  # sigmoid(tau (r - 1)) * 4 / tau * A
        tau = terms["sapo_temperature_pos"] if a > 0 else terms["sapo_temperature_neg"]
        return 1 / (1 + torch.exp(-tau * (r - 1))) * 4 / tau * a

    def log_clamped(w):  # log w clamped to [log 1e-8, 20]; log 0 = -inf
        return min(max(math.log(w) if w > 0 else -math.inf, math.log(1e-8)), 20.0)

    def vespo_phi(i):  # w^k exp(lambda (1 - w)), w the clamped joint ratio of row i (times the sampler's weight)
        log_w = sum(min(max(lp[i][t].item() - old[i][t], -20.0), 20.0) for t in tokens[i])
        if sampling_weight is not None:
            log_w += sum(log_clamped(weight(i, t)) for t in tokens[i])
        w = math.exp(min(max(log_w, math.log(1e-8)), 20.0))
        sign = "pos" if A[i] >= 0 else "neg"
        k, lam = terms[f"vespo_k_{sign}"], terms[f"vespo_lambda_{sign}"]
        return w**k * math.exp(max(lam, 1e-4) * (1 - w))

    def keep(i):  # the off-policy mask M_i
        if off_policy_mask_threshold is None:
            return 1.0
        mean_log_ratio = sum(sampler[i][t] - lp[i][t].item() for t in tokens[i]) / max(len(tokens[i]), 1)
        return 1.0 if A[i] >= 0 or mean_log_ratio <= off_policy_mask_threshold else 0.0

    counts = dict.fromkeys(("low", "high", "cispo"), 0)
    kl_total, phis = 0.0, []
    rows = []  # rows[i]: sum_t m l[i, t] (sequence_sum: l_i)
    sequence_clips = {"low": [], "high": []}  # per row: the fraction of its tokens clipped on that side
    for i in range(N):
        a, ts = A[i], tokens[i]
        before = dict(counts)
        log_ratio_sum = sum((lp[i][t] - old[i][t] for t in ts), zero)
        s = {"sequence": torch.exp(log_ratio_sum / max(len(ts), 1)), "sequence_sum": torch.exp(log_ratio_sum)}
        phi = vespo_phi(i)
        if ts:
            phis.append(phi)
        row = zero
        for t in ts if level != "sequence_sum" else [None]:
            r = torch.exp(lp[i][t] - old[i][t]) if level == "token" else s[level]
            if loss_type == "cispo":
                l_it = cispo(r, a, lp[i][t])
            elif loss_type == "sapo":
                l_it = sapo(r, a)
            elif loss_type == "vespo":
                l_it = phi * a * lp[i][t]
            else:
                l_it = clip_family(r, a)
            l_it = l_it * keep(i)
            if policy_mask is not None:
                l_it = l_it * (1.0 if policy_mask[i][t] else 0.0)
            if loss_type != "vespo":  # vespo took the weight into phi
                l_it = l_it * weight(i, t)
            if beta != 0:
                if level == "sequence_sum":
                    kl = k3(sum((ref[i][u] - lp[i][u] for u in ts), zero))
                else:
                    kl = k3(ref[i][t] - lp[i][t])
                kl = kl * r if use_bias_correction_kl else kl
                kl_total += kl.item() * (1 / N if level == "sequence_sum" else 1 / total_tokens)
                l_it = l_it - beta * kl
            row = row + l_it
            count = len(ts) if level == "sequence_sum" else 1  # clip metrics count completion tokens
            counts["low"] += count * (r.item() < 1 - eps_low and a < 0)
            counts["high"] += count * (r.item() > 1 + eps_high and a > 0)
            counts["cispo"] += count * (r.item() > eps_high and a > 0)
        if level == "token":  # the fraction of the row's tokens clipped on each side; NaN for an empty row
            for side in ("low", "high"):
                sequence_clips[side].append((counts[side] - before[side]) / len(ts) if ts else math.nan)
        else:  # a sequence-level ratio: the row's own flag, even for an empty row (TRL)
            sequence_clips["low"].append(float(s[level].item() < 1 - eps_low and a < 0))
            sequence_clips["high"].append(float(s[level].item() > 1 + eps_high and a > 0))
        rows.append(row if ts else zero)

    if level == "sequence_sum":
        J = sum(rows, zero) / N
    else:
        per_sequence_means = [row / max(len(ts), 1) for row, ts in zip(rows, tokens, strict=True)]
        J = {
            "sequence_mean": lambda: sum(per_sequence_means, zero) / N,
            "local_tokens": lambda: sum(rows, zero) / max(total_tokens, 1),
            "budget": lambda: sum(rows, zero) / (N * max_completion_length),
            "global_tokens": lambda: sum(rows, zero) / (num_items_in_batch or total_tokens),
            "sequence_sum": lambda: sum(rows, zero) / N,
        }[AGGREGATION[loss_type]]()

    metrics = {}
    if loss_type in CLIP_FAMILY:
        metrics["clip_ratio/low_mean"] = counts["low"] / total_tokens
        metrics["clip_ratio/high_mean"] = counts["high"] / total_tokens
        metrics["clip_ratio/region_mean"] = (counts["low"] + counts["high"]) / total_tokens  # disjoint: A < 0, A > 0
        lows, highs = ([x for x in sequence_clips[side] if not math.isnan(x)] for side in ("low", "high"))
        metrics["clip_ratio/low_min"] = min(lows) if lows else math.nan
        metrics["clip_ratio/high_max"] = max(highs) if highs else math.nan
    elif loss_type == "cispo":
        metrics["cispo_clip_ratio"] = counts["cispo"] / total_tokens
    elif loss_type == "vespo":
        metrics["vespo/phi_seq_mean"] = sum(phis) / len(phis)
    if beta != 0:
        metrics["kl"] = kl_total
    return -J, metrics


def run_both(loss_fn, batch, **kwargs):
    """(loss, grad, metrics) of `loss_fn` (grpo_loss) and of `naive_loss` on the same batch."""
    logps, old_logps, ref_logps, advantages, mask = batch
    results = []
    for fn in (loss_fn, naive_loss):
        x = logps.detach().clone().requires_grad_(True)
        loss, metrics = fn(x, old_logps, ref_logps, advantages, mask, **kwargs)
        (grad,) = torch.autograd.grad(loss, x)
        results.append((loss, grad, metrics))
    return results


def assert_same(results):
    """`run_both`'s two results agree: loss and gradient to `TIGHT`, the same metric names, values to 1e-12."""
    import pytest

    (loss, grad, metrics), (ref_loss, ref_grad, ref_metrics) = results
    torch.testing.assert_close(loss, ref_loss, **TIGHT)
    torch.testing.assert_close(grad, ref_grad, **TIGHT)
    assert metrics.keys() == ref_metrics.keys()
    for name, value in ref_metrics.items():
        assert metrics[name] == pytest.approx(value, abs=1e-12), name


FROZEN_LOSS = json.loads((Path(__file__).parent / "frozen_loss.json").read_text())
"""The default loss (no TRL 1.16 variant or term) on `make_batch()` in float64, from the vectorised loss as it was
at commit e442058, before the variants: one row per loss type ("grpo", "bnpo", "dr_grpo", "dapo") x importance-sampling
level x beta (0, 0.04) x epsilon_high (None, 0.28) x on/off-policy, with epsilon 0.2, max_completion_length 9 and
num_items_in_batch 40. Each row: the loss, sum |grad| and sum_k (k + 1) grad_k over the flattened gradient, and the
metrics. Do not regenerate it to follow a change of the loss: that change is what it is there to catch."""


def gradient_digest(grad):
    """(sum |g|, sum_k (k + 1) g_k) of a gradient: `FROZEN_LOSS`'s two numbers, which move if any entry moves."""
    flat = grad.flatten()
    return flat.abs().sum().item(), (flat * torch.arange(1, flat.numel() + 1, dtype=flat.dtype)).sum().item()


# ---------------------------------------------------------------------------------------------------------------
# The entropy features, the vLLM correction's weights, the advantages
# ---------------------------------------------------------------------------------------------------------------


def naive_quantile(values: list[float], q: float) -> float:
    """Sort, x = q (n - 1), interpolate linearly between the neighbours of x."""
    v = sorted(values)
    x = q * (len(v) - 1)
    lo, hi = math.floor(x), math.ceil(x)
    return v[lo] + (x - lo) * (v[hi] - v[lo])


def naive_quantile_mask(entropy, mask, q) -> list[list[bool]]:
    """M[i][t] = m[i][t] and H[i][t] >= tau, tau the q quantile of the completion tokens' entropies (TRL's
    `get_high_entropy_mask` threshold; grpo_hf's `top_entropy_quantile` rho keeps the 1 - rho quantile)."""
    N, T = mask.shape
    pool = [float(entropy[i, t]) for i in range(N) for t in range(T) if mask[i, t] == 1]
    tau = naive_quantile(pool, q) if pool else math.inf
    return [[bool(mask[i, t] == 1 and float(entropy[i, t]) >= tau) for t in range(T)] for i in range(N)]


def naive_entropy_bonus(entropy, keep, coef):
    """coef * Hbar, Hbar the mean of entropy[i, t] over the tokens that `keep[i][t]`: each entry its own node."""
    kept = [entropy[i, t] for i in range(len(keep)) for t in range(len(keep[i])) if keep[i][t]]
    return coef * sum(kept, entropy.new_zeros(())) / max(len(kept), 1)


def naive_weights(old_logps, sampling_logps, mask, mode, clip_min, clip_max):
    """The vLLM correction: w = pi_old / pi_sampler per token or per sequence, truncated or masked to
    [clip_min, clip_max]: a dict (i, t) -> w for token modes, i -> w for sequence modes."""
    N, T = old_logps.shape
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max

    def bound(w):
        if mode.endswith("truncate"):
            return min(max(w, low), high)
        return 0.0 if (w < low or w > high) else w

    def diff(i, t):
        d = float(old_logps[i, t]) - float(sampling_logps[i, t])
        return 0.0 if math.isnan(d) else d

    tokens = [[t for t in range(T) if mask[i, t] == 1] for i in range(N)]
    if mode.startswith("sequence"):
        return {i: bound(math.exp(sum(diff(i, t) for t in tokens[i]))) for i in range(N)}
    return {(i, t): bound(math.exp(diff(i, t))) for i in range(N) for t in tokens[i]}


def naive_advantages(rewards, G, scale_rewards):
    """docs/design.md ("The maths") advantages with `statistics` over the non-NaN rewards of each group."""
    values = rewards.tolist()
    valid = [v for v in values if not math.isnan(v)]
    batch_std = statistics.stdev(valid) if len(valid) > 1 else 0.0
    out = []
    for g in range(0, len(values), G):
        group = [v for v in values[g : g + G] if not math.isnan(v)]
        mean = statistics.fmean(group) if group else 0.0
        std = statistics.stdev(group) if len(group) > 1 else 0.0
        for v in values[g : g + G]:
            if math.isnan(v) or len(set(group)) < 2:
                out.append(0.0)
            elif scale_rewards == "group":
                out.append((v - mean) / (std + 1e-4))
            elif scale_rewards == "batch":
                out.append((v - mean) / (batch_std + 1e-4))
            else:
                out.append(v - mean)
    return torch.tensor(out, dtype=F64)
