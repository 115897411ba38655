"""The clipped, KL-regularised GRPO loss: importance ratios, the loss types' surrogates, the KL term, aggregation.

Pure tensor functions (torch only): they take tensors and a `LossSettings`, never a config object. Tensors are
`[N]` (one value per completion) or `[N, T]` (one per completion token). Names follow docs/design.md ("Names");
the formulas are its "The maths". `grpo_loss` is the public keyword form; `grpo_loss_with` takes settings that
were checked once, when they were built.

Papers implemented
------------------
------------------
- DeepSeekMath (Shao et al. 2024, arXiv:2402.03300, eq. 3-4): group-normalised advantages, the per-token
  clipped objective, the k3 KL estimator against a frozen reference (Schulman 2020, "Approximating KL
  divergence"), and the per-sequence mean then batch mean: `loss_type="grpo"`.
- Dr. GRPO (Liu et al. 2025, arXiv:2503.20783): no std scaling (`scale_rewards="none"`) and a constant
  normaliser instead of the completion length: `loss_type="dr_grpo"`.
- DAPO (Yu et al. 2025, arXiv:2503.14476): clip-higher (`epsilon_high`) and the token-level mean over
  every token of the batch: `loss_type="dapo"`. `"bnpo"` is the same mean over the local batch only (TRL).
- GSPO (Zheng et al. 2025, arXiv:2507.18071): the length-normalised sequence ratio,
  `importance_sampling_level="sequence"`.
- DeepSeek-V2 (arXiv:2405.04434) / DeepSeek-V3 (arXiv:2412.19437): GRPO as printed there, with the
  joint-probability ratio pi(o|q) / pi_old(o|q) and a sequence-level KL: `importance_sampling_level="sequence_sum"`.


Where this code departs from the papers
---------------------------------------
- GSPO and sequence_sum are defined for whole sequences; `"sequence"` broadcasts s_i over the tokens and
  then goes through the chosen aggregation and the per-token KL (as TRL). With `loss_type="grpo"` and
  `beta=0` that is exactly GSPO's objective. GSPO's own clip range is ~3e-4/4e-4: set `epsilon` yourself.
- `sequence_sum`: a row with no completion token (|o_i| = 0) contributes 0, as it does in the token-level
  forms. exp of a sum over a whole sequence overflows float32 once |sum| > 88: that is the formula as written.
- Dr. GRPO's constant is N_local * max_completion_length (TRL), the generation budget of the local batch.
- `old_logps=None` (on-policy): rho = exp(logps - logps.detach()) = 1 with gradient d logps, i.e.
  pi_old = pi_theta numerically, the single-update case of the papers. Clipping never triggers then.

Formula -> function map (docs/design.md ("The maths"))

Formula -> function map (docs/design.md ("The maths"))
------------------------------------------------------
Each formula, then the function and the expression in it that computes it.

Ratios, clipping, KL
  rho[i,t] = exp(logps - old_logps)          token         _importance_ratio: `torch.exp(log_ratio)`
  s_i = exp(sum_t m (logps - old) / |o_i|)   sequence      _importance_ratio: `torch.exp(_masked_sum(...) / ...)`
  s_i = exp(sum_t m (logps - old))           sequence_sum  _importance_ratio: `torch.exp(_masked_sum(log_ratio, mask))`
  min(rho A, clip(rho, 1-eps, 1+eps_high) A)               _clipped_objective: `torch.min(ratio * A, clamped * A)`
  KL[i,t] = exp(x) - x - 1, x = ref - logps  k3            _kl_term: `_k3(log_ref_ratio)`
  KL_i = exp(d_i) - d_i - 1, d_i = sum_t m x sequence_sum  _kl_term: `_k3(_masked_sum(log_ref_ratio, mask))`
  l = min(...) - beta KL                                   grpo_loss_with: `objective - settings.beta * kl`

Aggregation (_aggregate; sequence_sum in grpo_loss_with), loss = -J
  grpo:     J = mean_i (sum_t m l / |o_i|)                 `(masked.sum(-1) / mask.sum(-1).clamp(min=1)).mean()`
  bnpo:     J = sum m l / sum m                            `masked.sum() / mask.sum().clamp(min=1)`
  dr_grpo:  J = sum m l / (N * max_completion_length)      `masked.sum() / (mask.shape[0] * max_completion_length)`
  dapo:     J = sum m l / (tokens of the global batch)     `masked.sum() / num_items`
  sequence_sum: J = mean_i l_i                             `torch.where(lengths > 0, objective..., 0.0).mean()`
  loss = -J                                                `return -objective, _to_floats(values)`

Loss variants and objective terms of TRL 1.16
---------------------------------------------
A loss type is a per-token surrogate l[i,t] (the objective to maximise) plus an aggregation: `LOSS_VARIANTS`.
r is the ratio of `importance_sampling_level` (rho[i,t] or s_i broadcast over t), sg() stops the gradient,
A = A_i, m = completion mask. Each entry: formula (source), then the function that computes it.
  grpo, bnpo, dr_grpo, dapo, luspo: l = min(min(r, delta) A, clip(r, 1-eps_low, 1+eps_high) A)    _clipped_objective
  cispo: l = sg(min(r, eps_high)) A log pi_theta  (MiniMax-M1 arXiv:2506.13585, ScaleRL 2510.13786)  _cispo_surrogate
  sapo:  l = sigmoid(tau (r - 1)) 4 / tau A, tau = tau_pos if A > 0 else tau_neg  (SAPO 2511.20347)  _sapo_surrogate
  vespo: l = sg(phi_i) A log pi_theta, phi_i = w_i^k exp(lambda (1 - w_i)), w_i = prod_t (pi / pi_old)[i,t],
         (k, lambda) = (vespo_k_pos, vespo_lambda_pos) if A >= 0 else the _neg pair  (VESPO 2602.10693)
                                                                                                    _vespo_surrogate
  aggregation: grpo, sapo: mean_i (sum_t m l / |o_i|); dapo, cispo, vespo: sum m l / (global tokens); bnpo and
         dr_grpo as above; luspo: J = mean_i sum_t m l = GSPO's l_i weighted by |o_i| (LUSPO 2602.05261)  _aggregate
Terms that apply to every loss type, off by default:
  delta: min(r, delta) in the unclipped term above, two-sided clipping (INTELLECT-2 2505.07291)    _clipped_objective
  off_policy_mask_threshold = d:  l[i,t] <- M_i l[i,t],  M_i = 0 if A_i < 0 and sum_t m log(pi_old / pi_theta)
         / |o_i| > d, else 1  (DeepSeek-V3.2 arXiv:2512.02556, eq. 9)                                  off_policy_mask
  use_bias_correction_kl: KL[i,t] <- r KL[i,t], r with its gradient; sequence_sum: KL_i <- s_i KL_i
         (DeepSeek-V3.2's unbiased KL estimate)                                                        _kl_term
  l = surrogate * M - beta KL, then the aggregation of the loss type; loss = -J.
Where TRL 1.16, and so this code, departs from the papers:
- cispo: the weight is capped at `epsilon_high` itself (ScaleRL's eps_max, recommended 5), not at 1 + eps_high,
  and has no lower bound; MiniMax-M1 writes clip(r, 1 - eps_low^IS, 1 + eps_high^IS) with a token mask M that
  is not implemented. `epsilon_high=None` falls back to `epsilon` (a cap of 0.2): `LossSettings.warnings()` says so.
  The loss value contains log pi_theta, so it is not comparable across loss types; its gradient is.
- vespo: the clamps of the authors' code: each token's log-ratio to [-20, 20], log w_i to [log 1e-8, 20],
  lambda >= 1e-4, a NaN/inf phi -> 0; phi is computed as exp(lambda + k log w - lambda w). With vLLM's per-token
  correction (token_truncate / token_mask, as TRL allows), the sampler's weight enters w instead of multiplying
  the loss: log w_i += sum_t m clamp(log(pi_old / pi_vllm)[i,t], log 1e-8, 20), before the clamp of log w_i.
- delta: TRL caps r for every advantage; with delta > 1 + eps_high this changes only A < 0 terms, as in
  INTELLECT-2. The clip-ratio metrics use r before the cap (TRL: after; equal when delta > 1 + eps_high).
- off-policy mask: pi_old is `old_logps` (TRL prefers vLLM's sampling log-probs when it has them); M_i scales
  the policy term only, the KL term stays (TRL). Any importance-sampling level and loss type.
- use_bias_correction_kl: "sequence" multiplies the per-token KL by s_i (TRL; the unbiased property holds for
  "token"); "sequence_sum" (not in TRL) uses the joint ratio s_i on the sequence KL_i. The "kl" metric is the
  corrected one (TRL). TRL's config defaults it to True; here the default is False (unchanged loss).
- sapo, vespo: TRL builds the temperatures and (k, lambda) as float32 tensors; here they are in the dtype of
  `logps` (identical in float32).
- luspo and vespo at other importance-sampling levels than the papers' ("sequence", "token") run as TRL runs
  them, with a warning from `LossSettings.warnings()`.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from grpo_hf.core.common import check_choice
from grpo_hf.core.settings import LossSettings


def grpo_loss(
    logps: Tensor,
    old_logps: Tensor | None,
    ref_logps: Tensor | None,
    advantages: Tensor,
    completion_mask: Tensor,
    *,
    loss_type: str = "grpo",
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    beta: float = 0.04,
    importance_sampling_level: str = "token",
    max_completion_length: int | None = None,
    num_items_in_batch: int | float | Tensor | None = None,
    delta: float | None = None,
    use_bias_correction_kl: bool = False,
    off_policy_mask_threshold: float | None = None,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    vespo_k_pos: float = 2.0,
    vespo_lambda_pos: float = 3.0,
    vespo_k_neg: float = 3.0,
    vespo_lambda_neg: float = 2.0,
    policy_mask: Tensor | None = None,
    sampling_weight: Tensor | None = None,
    off_policy_logps: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The clipped, KL-regularised GRPO loss of docs/design.md ("The maths") and its metrics: returns `(-J, metrics)`.

    The public keyword form of `grpo_loss_with`: each setting keyword is the `LossSettings` field of that name (its
    docstring says what each means). It builds the settings, which raise for impossible ones (their `warnings()`
    are the caller's to show), checks the tensors' shapes and that `ref_logps` is given when `beta != 0`, then
    computes the loss with `grpo_loss_with`; `num_items_in_batch` is its `num_items`. Tensors as there.
    """
    settings = LossSettings(
        loss_type=loss_type,
        epsilon=epsilon,
        epsilon_high=epsilon_high,
        beta=beta,
        importance_sampling_level=importance_sampling_level,
        max_completion_length=max_completion_length,
        delta=delta,
        use_bias_correction_kl=use_bias_correction_kl,
        off_policy_mask_threshold=off_policy_mask_threshold,
        sapo_temperature_pos=sapo_temperature_pos,
        sapo_temperature_neg=sapo_temperature_neg,
        vespo_k_pos=vespo_k_pos,
        vespo_lambda_pos=vespo_lambda_pos,
        vespo_k_neg=vespo_k_neg,
        vespo_lambda_neg=vespo_lambda_neg,
    )
    _check_inputs(logps, old_logps, ref_logps, advantages, completion_mask, policy_mask, settings)
    tensors = (logps, old_logps, ref_logps, advantages, completion_mask, settings)
    return grpo_loss_with(
        *tensors,
        num_items=num_items_in_batch,
        policy_mask=policy_mask,
        sampling_weight=sampling_weight,
        off_policy_logps=off_policy_logps,
    )


def grpo_loss_with(
    logps: Tensor,
    old_logps: Tensor | None,
    ref_logps: Tensor | None,
    advantages: Tensor,
    completion_mask: Tensor,
    settings: LossSettings,
    *,
    num_items: int | float | Tensor | None = None,
    policy_mask: Tensor | None = None,
    sampling_weight: Tensor | None = None,
    off_policy_logps: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """`grpo_loss` with settings that were checked when they were built: it checks nothing (the trainer's form).

    logps `[N, T]` log pi_theta of the completion tokens, with gradient (padded positions finite); old_logps `[N, T]`
    log pi_old, or None for on-policy (ratio 1); ref_logps `[N, T]` log pi_ref, None only with beta = 0; advantages
    `[N]`; completion_mask `[N, T]`, 1 on completion tokens up to and including EOS. num_items: the "dapo"
    aggregation's denominator (dapo, cispo, vespo), the completion tokens of the whole global batch (None: the local
    `completion_mask.sum()`). policy_mask `[N, T]`: the tokens whose policy term counts (`high_entropy_mask`; the KL
    and every normaliser keep `completion_mask`, TRL), not with "sequence_sum". sampling_weight `[N, T]` or
    `[N, 1]`: pi_old / pi_sampler (`sampling_importance_weights`), on the policy term only (TRL's vLLM correction).
    off_policy_logps `[N, T]`: the log-probs of the policy that sampled (vLLM's, `rollout_func`'s), which the
    off-policy mask then measures the drift from instead of old_logps (TRL).
    old_logps, ref_logps, advantages are detached; computed in the dtype of `logps`. Metrics (floats, TRL names):
    "kl" when beta != 0 (after the bias correction), and the loss type's ("clip_ratio/low_mean", "high_mean",
    "region_mean", "low_min", "high_max" for the clip family, "cispo_clip_ratio", "vespo/phi_seq_mean"; none for
    "sapo")."""
    mask = completion_mask.to(logps.dtype)  # [N, T]
    lengths = mask.sum(-1)  # [N]  |o_i|
    advantages = advantages.detach().to(logps.dtype)[:, None]  # [N, 1]
    old_logps = logps.detach() if old_logps is None else old_logps.detach().to(logps.dtype)  # [N, T]
    log_ratio = logps - old_logps  # [N, T]
    ratio = _importance_ratio(log_ratio, mask, settings.importance_sampling_level)  # [N, T] or [N, 1]

    variant = LOSS_VARIANTS[settings.loss_type]
    folded = {"sampling_weight": sampling_weight} if variant.folds_sampling_weight else {}  # vespo: into phi
    objective, values = variant.surrogate(ratio, advantages, logps, log_ratio, mask, settings, **folded)
    if settings.off_policy_mask_threshold is not None:  # the drift from the sampler where known, else from pi_old
        drift = log_ratio if off_policy_logps is None else logps - off_policy_logps.detach().to(logps.dtype)
        objective = objective * off_policy_mask(drift, advantages, mask, settings.off_policy_mask_threshold)
    if policy_mask is not None:  # e.g. top_entropy_quantile: the policy term of the high-entropy tokens only
        objective = objective * _token_mask(policy_mask, settings.per_sequence, objective.dtype)  # [N, T]
    if sampling_weight is not None and not folded:  # the sampler was not exactly pi_old (vLLM): reweight samples
        objective = objective * sampling_weight.detach().to(objective.dtype)
    if settings.beta != 0:
        kl = _kl_term(ref_logps.detach().to(logps.dtype) - logps, mask, ratio, settings)  # [N, T] or [N, 1]
        objective = objective - settings.beta * kl
        values["kl"] = kl.detach().mean() if settings.per_sequence else _token_mean(kl, mask)
    if settings.per_sequence:
        objective = torch.where(lengths > 0, objective.squeeze(-1), 0.0).mean()  # J = mean_i l_i
    else:
        objective = _aggregate(objective, mask, variant.aggregation, settings.max_completion_length, num_items)
    return -objective, _to_floats(values)


def _importance_ratio(log_ratio: Tensor, mask: Tensor, level: str) -> Tensor:
    """The ratio r of `importance_sampling_level` from log(pi_theta / pi_old) `[N, T]`: rho `[N, T]` ("token"),
    GSPO's length-normalised s_i `[N, 1]` ("sequence") or the joint s_i = pi(o_i) / pi_old(o_i) ("sequence_sum")."""
    if level == "token":
        return torch.exp(log_ratio)  # [N, T]  rho
    if level == "sequence":
        return torch.exp(_masked_sum(log_ratio, mask) / mask.sum(-1).clamp(min=1))[:, None]  # [N, 1]  GSPO s_i
    return torch.exp(_masked_sum(log_ratio, mask))[:, None]  # [N, 1]  s_i = pi(o_i) / pi_old(o_i)


def _kl_term(log_ref_ratio: Tensor, mask: Tensor, ratio: Tensor, settings: LossSettings) -> Tensor:
    """The k3 KL of x = ref - logps: per token `[N, T]`, or per sequence `[N, 1]` with d_i = sum_t m x for
    "sequence_sum"; times the ratio (with its gradient) under `use_bias_correction_kl` (DeepSeek-V3.2)."""
    if settings.per_sequence:
        kl = _k3(_masked_sum(log_ref_ratio, mask))[:, None]  # [N, 1]  KL_i
    else:
        kl = _k3(log_ref_ratio)  # [N, T]
    return kl * ratio if settings.use_bias_correction_kl else kl


def _clipped_objective(
    ratio: Tensor, advantages: Tensor, eps_low: float, eps_high: float, delta: float | None = None
) -> Tensor:
    """min(min(ratio, delta) A, clip(ratio, 1 - eps_low, 1 + eps_high) A): the PPO surrogate, elementwise.

    `delta` (INTELLECT-2's two-sided clipping; None: off) caps the unclipped ratio, so that a token with A < 0
    and a large ratio contributes at most delta * |A|, with no gradient beyond it."""
    clamped = ratio.clamp(1 - eps_low, 1 + eps_high)
    if delta is not None:
        ratio = ratio.clamp(max=delta)
    return torch.min(ratio * advantages, clamped * advantages)


def _k3(x: Tensor) -> Tensor:
    """k3 estimator of KL(pi_theta || pi_ref) from x = log pi_ref - log pi_theta: exp(x) - x - 1 (>= 0)."""
    return torch.exp(x) - x - 1


def _masked_sum(x: Tensor, mask: Tensor) -> Tensor:
    """sum_t m[i, t] x[i, t]: `[N, T]` -> `[N]`."""
    return (x * mask).sum(-1)


def _aggregate(
    per_token: Tensor,
    mask: Tensor,
    aggregation: str,
    max_completion_length: int | None,
    num_items_in_batch: int | float | Tensor | None,
) -> Tensor:
    """J from the per-token objective l `[N, T]` (or `[N, 1]`, broadcast): sum_{i,t} m l over a normaliser.

    `aggregation` is named after the loss type that introduced it (`LOSS_VARIANTS` maps every loss type to one).
    """
    masked = per_token * mask  # [N, T]
    if aggregation == "grpo":  # mean_i (sum_t m l / |o_i|); an empty row contributes 0
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1)).mean()
    if aggregation == "bnpo":  # tokens of the local batch
        return masked.sum() / mask.sum().clamp(min=1)
    if aggregation == "dr_grpo":  # the local generation budget, a constant
        return masked.sum() / (mask.shape[0] * max_completion_length)
    if aggregation == "luspo":  # mean_i sum_t m l: each sequence weighted by its length
        return masked.sum(-1).mean()
    # dapo: completion tokens of the global batch, all processes and accumulation slices
    num_items = mask.sum() if num_items_in_batch is None else num_items_in_batch
    num_items = torch.as_tensor(num_items, dtype=mask.dtype, device=mask.device).clamp(min=1)
    return masked.sum() / num_items


# ---------------------------------------------------------------------------------------------------------------
# Per-token surrogates of the loss types (TRL 1.16 names) and the off-policy mask
# ---------------------------------------------------------------------------------------------------------------

Surrogate = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, LossSettings], tuple[Tensor, dict[str, Tensor]]]
"""`(ratio [N, T] or [N, 1], advantages [N, 1], logps [N, T], log_ratio [N, T], mask [N, T], settings)` ->
`(l [N, T] or [N, 1], metric tensors)`: the per-token objective to maximise, before the mask, the KL and the
aggregation. `log_ratio` = logps - old_logps per token, whatever the importance-sampling level of `ratio`."""


def _clipped_surrogate(
    ratio: Tensor, advantages: Tensor, logps: Tensor, log_ratio: Tensor, mask: Tensor, settings: LossSettings
) -> tuple[Tensor, dict[str, Tensor]]:
    """grpo, bnpo, dr_grpo, dapo, luspo: min(min(r, delta) A, clip(r, 1 - eps_low, 1 + eps_high) A).

    Metrics: TRL's clip ratios, of the ratio before the delta cap: the `*_mean`s are fractions of completion tokens;
    `low_min` / `high_max` the smallest low-clipped / largest high-clipped fraction of one sequence's tokens
    (`_sequence_means`), of this micro-batch's sequences (the trainer takes them over every process's)."""
    low = (ratio < 1 - settings.epsilon) & (advantages < 0)  # [N, T] or [N, 1]
    high = (ratio > 1 + settings.clip_high) & (advantages > 0)
    per_token = settings.importance_sampling_level == "token"
    metrics = {
        "clip_ratio/low_mean": _token_mean(low, mask),
        "clip_ratio/high_mean": _token_mean(high, mask),
        "clip_ratio/region_mean": _token_mean(low | high, mask),
        "clip_ratio/low_min": _nan_extreme(_sequence_means(low, mask, per_token), largest=False),
        "clip_ratio/high_max": _nan_extreme(_sequence_means(high, mask, per_token), largest=True),
    }
    return _clipped_objective(ratio, advantages, settings.epsilon, settings.clip_high, settings.delta), metrics


def _cispo_surrogate(
    ratio: Tensor, advantages: Tensor, logps: Tensor, log_ratio: Tensor, mask: Tensor, settings: LossSettings
) -> tuple[Tensor, dict[str, Tensor]]:
    """cispo (MiniMax-M1, as TRL): sg(min(r, epsilon_high)) A log pi_theta; the weight carries no gradient.

    Metric: TRL's "cispo_clip_ratio", the fraction of completion tokens with r > epsilon_high and A > 0."""
    weight = ratio.detach().clamp(max=settings.clip_high)  # [N, T] or [N, 1]
    clipped = (ratio > settings.clip_high) & (advantages > 0)
    return weight * advantages * logps, {"cispo_clip_ratio": _token_mean(clipped, mask)}


def _sapo_surrogate(
    ratio: Tensor, advantages: Tensor, logps: Tensor, log_ratio: Tensor, mask: Tensor, settings: LossSettings
) -> tuple[Tensor, dict[str, Tensor]]:
    """sapo: sigmoid(tau (r - 1)) 4 / tau A, with tau = sapo_temperature_pos where A > 0, else _neg. No metric.

    At r = 1 the gate's slope is 1, so on-policy its gradient is the plain policy gradient A grad log pi."""
    tau = torch.full_like(advantages, settings.sapo_temperature_neg)  # [N, 1]
    tau = tau.masked_fill(advantages > 0, settings.sapo_temperature_pos)
    return torch.sigmoid(tau * (ratio - 1)) * 4 / tau * advantages, {}


def _vespo_surrogate(
    ratio: Tensor,
    advantages: Tensor,
    logps: Tensor,
    log_ratio: Tensor,
    mask: Tensor,
    settings: LossSettings,
    sampling_weight: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """vespo: sg(phi(w_i)) A log pi_theta with VESPO's kernel phi(w) = w^k exp(lambda (1 - w)) (phi(1) = 1).

    w_i is the sequence ratio pi(o_i) / pi_old(o_i), not length-normalised, whatever `ratio` is; (k, lambda) are
    the _pos knobs where A >= 0, else the _neg ones. Computed as exp(lambda + k log w - lambda w) with TRL's
    clamps: each token's log-ratio to [-20, 20], log w_i to [log 1e-8, 20], lambda >= 1e-4; NaN/inf -> 0.
    vLLM's per-token weight pi_old / pi_vllm `[N, T]` (`sampling_weight`) is folded into w (TRL): its log, clamped to
    [log 1e-8, 20], summed over the completion into log w_i before that clamp.
    Metric: "vespo/phi_seq_mean", the mean of phi over the sequences that have completion tokens."""
    with torch.no_grad():
        log_w = _masked_sum(log_ratio.clamp(-20.0, 20.0), mask)  # [N]
        if sampling_weight is not None:
            log_weight = torch.log(sampling_weight.to(log_w.dtype)).clamp(math.log(1e-8), 20.0)  # [N, T]
            log_w = log_w + _masked_sum(log_weight, mask)
        log_w = log_w.clamp(math.log(1e-8), 20.0)[:, None]  # [N, 1]
        nonnegative = advantages >= 0  # [N, 1]
        k = torch.full_like(advantages, settings.vespo_k_neg).masked_fill(nonnegative, settings.vespo_k_pos)
        lam = torch.full_like(advantages, settings.vespo_lambda_neg).masked_fill(
            nonnegative, settings.vespo_lambda_pos
        )
        lam = lam.clamp(min=1e-4)
        phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
        has_tokens = (mask.sum(-1, keepdim=True) > 0).to(phi.dtype)  # [N, 1]
        phi_mean = (phi * has_tokens).sum() / has_tokens.sum().clamp(min=1)
    return phi * advantages * logps, {"vespo/phi_seq_mean": phi_mean}


class LossVariant(NamedTuple):
    surrogate: Surrogate
    aggregation: str  # an `_aggregate` mode
    folds_sampling_weight: bool = False  # the surrogate takes vLLM's weight itself (`sampling_weight=`)


LOSS_VARIANTS: dict[str, LossVariant] = {
    "grpo": LossVariant(_clipped_surrogate, "grpo"),
    "bnpo": LossVariant(_clipped_surrogate, "bnpo"),
    "dr_grpo": LossVariant(_clipped_surrogate, "dr_grpo"),
    "dapo": LossVariant(_clipped_surrogate, "dapo"),
    "luspo": LossVariant(_clipped_surrogate, "luspo"),
    "cispo": LossVariant(_cispo_surrogate, "dapo"),
    "sapo": LossVariant(_sapo_surrogate, "grpo"),
    "vespo": LossVariant(_vespo_surrogate, "dapo", folds_sampling_weight=True),
}
"""loss_type -> (per-token surrogate, aggregation), as TRL 1.16 pairs them. An aggregation of "dapo" divides by
the global token count `num_items_in_batch`: the trainer must undo its accumulation/process averaging for it.
Its keys are `settings.ALL_LOSS_TYPES`, and its `_clipped_surrogate` rows `settings.CLIPPED_LOSS_TYPES` (tested)."""


@torch.no_grad()
def off_policy_mask(log_ratio: Tensor, advantages: Tensor, mask: Tensor, threshold: float) -> Tensor:
    """DeepSeek-V3.2's off-policy sequence mask M_i `[N, 1]`, no gradient: 0 where A_i < 0 and the mean over the
    completion of log(pi_old / pi_theta) exceeds `threshold`, 1 elsewhere."""
    mean_log_ratio = _masked_sum(-log_ratio, mask) / mask.sum(-1).clamp(min=1)  # [N]  mean_t log(pi_old / pi)
    keep = (advantages >= 0) | (mean_log_ratio[:, None] <= threshold)  # [N, 1]
    return keep.to(log_ratio.dtype)


@torch.no_grad()
def _token_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of `x` (broadcasting to `[N, T]`) over the completion tokens: a metric, no gradient."""
    return (x * mask).sum() / mask.sum().clamp(min=1)


@torch.no_grad()
def _sequence_means(x: Tensor, mask: Tensor, per_token: bool) -> Tensor:
    """Per sequence, the mean of `x` `[N, T]` over its completion tokens `[N]`: NaN for a sequence without any (TRL's
    `masked_seq_mean`). Not `per_token` (a sequence-level ratio), `x` `[N, 1]` holds one value per sequence already."""
    if not per_token:
        return x[:, 0].to(mask.dtype)
    return (x * mask).sum(-1) / mask.sum(-1)


@torch.no_grad()
def _nan_extreme(values: Tensor, largest: bool) -> Tensor:
    """The largest (or smallest) of `values` `[N]`, NaN left out; NaN when all are NaN (TRL's `nanmax` / `nanmin`).
    A 0-d tensor, without a host sync."""
    ignored = -math.inf if largest else math.inf  # the values are fractions: never infinite themselves
    extreme = torch.where(torch.isnan(values), ignored, values)
    extreme = extreme.max() if largest else extreme.min()
    return torch.where(torch.isinf(extreme), math.nan, extreme)


def _to_floats(values: dict[str, Tensor]) -> dict[str, float]:
    """Scalar metric tensors -> python floats with one device sync."""
    if not values:
        return {}
    return dict(zip(values, torch.stack(list(values.values())).tolist(), strict=True))


def _token_mask(policy_mask: Tensor, per_sequence: bool, dtype: torch.dtype) -> Tensor:
    """`grpo_loss`'s policy_mask as a `[N, T]` factor; refused for a per-sequence objective (sequence_sum)."""
    if per_sequence:
        raise ValueError(
            "policy_mask (e.g. top_entropy_quantile < 1) masks tokens, but importance_sampling_level='sequence_sum' "
            "has one policy term per sequence: use 'token' or 'sequence'"
        )
    return policy_mask.to(dtype)


def _check_inputs(
    logps: Tensor,
    old_logps: Tensor | None,
    ref_logps: Tensor | None,
    advantages: Tensor,
    completion_mask: Tensor,
    policy_mask: Tensor | None,
    settings: LossSettings,
) -> None:
    """The keyword form's checks of its tensors: `[N, T]` shapes that agree, `[N]` advantages, and `ref_logps`
    given when the KL term is on."""
    if logps.dim() != 2:
        raise ValueError(f"logps must be [N, T], got shape {tuple(logps.shape)}")
    shape = tuple(logps.shape)
    tensors = {"old_logps": old_logps, "ref_logps": ref_logps, "completion_mask": completion_mask}
    for name, tensor in {**tensors, "policy_mask": policy_mask}.items():
        if tensor is not None and tuple(tensor.shape) != shape:
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)} but logps has shape {shape}; both must be [N, T]"
            )
    if tuple(advantages.shape) != shape[:1]:
        raise ValueError(
            f"advantages has shape {tuple(advantages.shape)} but must be [N] = {shape[:1]} (logps is {shape})"
        )
    if settings.beta != 0 and ref_logps is None:
        raise ValueError(
            f"ref_logps is None but beta={settings.beta}: pass the reference log-probs, or set beta=0 (no KL)"
        )


# ---------------------------------------------------------------------------------------------------------------
# The vLLM importance-sampling correction (TRL): the weight pi_old / pi_sampler of `grpo_loss`'s sampling_weight
# ---------------------------------------------------------------------------------------------------------------

SAMPLING_CORRECTION_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


@dataclass(frozen=True)
class SamplingCorrection:
    """The settings of `sampling_importance_weights` (`GRPOConfig`'s `vllm_importance_sampling_mode`,
    `vllm_importance_sampling_clip_min` and `_clip_max`), checked when built: a known mode, a lower bound below the
    upper, and a bound at all where the mode truncates."""

    mode: str = "sequence_mask"
    clip_min: float | None = None
    clip_max: float | None = 3.0

    def __post_init__(self) -> None:
        check_choice("vllm_importance_sampling_mode", self.mode, SAMPLING_CORRECTION_MODES)
        low, high = self.clip_min, self.clip_max
        if low is not None and high is not None and low >= high:
            raise ValueError(
                f"vllm_importance_sampling_clip_min={low} must be less than vllm_importance_sampling_clip_max={high}."
            )
        if self.mode.endswith("truncate") and low is None and high is None:
            raise ValueError(
                f"vllm_importance_sampling_mode={self.mode!r} truncates the ratio, but both bounds are None. Set "
                "vllm_importance_sampling_clip_max (TRL's default: 3.0) or clip_min."
            )

    @property
    def per_token(self) -> bool:
        return self.mode.startswith("token")

    def weights(
        self, old_logps: Tensor, sampling_logps: Tensor, completion_mask: Tensor
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """`sampling_importance_weights` under these settings."""
        return sampling_importance_weights(
            old_logps, sampling_logps, completion_mask, self.mode, self.clip_min, self.clip_max
        )


def sampling_importance_weights(
    old_logps: Tensor,
    sampling_logps: Tensor,
    completion_mask: Tensor,
    mode: str = "sequence_mask",
    clip_min: float | None = None,
    clip_max: float | None = 3.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Truncated / masked importance sampling for a sampler that is not exactly pi_old (TRL's vLLM correction).

    The completions were drawn by a sampler (vLLM) whose log-probs `sampling_logps` [N, T] differ from the
    trainer's `old_logps` [N, T] of the same tokens. The weight is w = pi_old / pi_sampler:
    - token level: w[i,t] = exp(old - sampling)[i,t];  sequence level: w_i = exp(sum_t m (old - sampling)) [N, 1];
    - "*_truncate": w <- clamp(w, clip_min, clip_max) (truncated IS, Ionides 2008);
    - "*_mask": w <- 0 where w < clip_min or w > clip_max (masked IS); a None bound is no bound.
    A NaN sampling log-prob (a token the sampler did not score) counts as no difference. No gradient.
    Returns the weight and its metrics as tensors (TRL's names, without the "sampling/" prefix): the mean and
    max |old - sampling| over the completion tokens, and min/mean/max of the weight (over the completion tokens,
    or over the rows at sequence level).
    """
    check_choice("vllm_importance_sampling_mode", mode, SAMPLING_CORRECTION_MODES)
    mask = completion_mask.bool()  # [N, T]
    diff = torch.nan_to_num((old_logps.detach() - sampling_logps.detach()) * mask, nan=0.0)  # [N, T]
    per_sequence = mode.startswith("sequence")
    weight = torch.exp(diff.sum(-1, keepdim=True) if per_sequence else diff)  # [N, 1] or [N, T]
    if mode.endswith("truncate"):
        weight = weight.clamp(min=clip_min, max=clip_max)
    else:
        low = -math.inf if clip_min is None else clip_min
        high = math.inf if clip_max is None else clip_max
        weight = weight.masked_fill((weight < low) | (weight > high), 0.0)
    gap = (old_logps.detach() - sampling_logps.detach()).abs()[mask & ~torch.isnan(sampling_logps)]  # [n]
    values = weight.flatten() if per_sequence else weight[mask]  # [N] or [n]
    empty = weight.new_zeros(())
    metrics = {
        "sampling_logp_difference/mean": gap.mean() if gap.numel() else empty,
        "sampling_logp_difference/max": gap.max() if gap.numel() else empty,
        "importance_sampling_ratio/min": values.min() if values.numel() else empty,
        "importance_sampling_ratio/mean": values.mean() if values.numel() else empty,
        "importance_sampling_ratio/max": values.max() if values.numel() else empty,
    }
    return weight, metrics
