"""The GRPO maths: rewards -> advantages, logits -> log-probabilities, and the clipped, KL-regularised loss.

Pure tensor functions: they take tensors and numbers, never a config object, and import only torch.
Tensors are `[N]` (one value per completion) or `[N, T]` (one per completion token); a group is
G = `num_generations` consecutive rows. Names follow docs/design.md ("Names"); the formulas are its "The maths".

Papers implemented
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
- Advantages divide by `std + 1e-4` (TRL) instead of `std`; a group whose rewards are all equal (or that
  has fewer than two rewards) gets exactly 0 instead of 0/0. Completions with no reward at all (NaN) get
  advantage 0 and do not enter any mean or std.
- GSPO and sequence_sum are defined for whole sequences; `"sequence"` broadcasts s_i over the tokens and
  then goes through the chosen aggregation and the per-token KL (as TRL). With `loss_type="grpo"` and
  `beta=0` that is exactly GSPO's objective. GSPO's own clip range is ~3e-4/4e-4: set `epsilon` yourself.
- `sequence_sum`: a row with no completion token (|o_i| = 0) contributes 0, as it does in the token-level
  forms. exp of a sum over a whole sequence overflows float32 once |sum| > 88: that is the formula as written.
- Dr. GRPO's constant is N_local * max_completion_length (TRL), the generation budget of the local batch.
- `old_logps=None` (on-policy): rho = exp(logps - logps.detach()) = 1 with gradient d logps, i.e.
  pi_old = pi_theta numerically, the single-update case of the papers. Clipping never triggers then.

Formula -> function map (docs/design.md ("The maths"))
--------------------------------------
Each formula, then the function and the expression in it that computes it.

Rewards and advantages
  r_i = sum_k w_k r_ik, NaN skipped, all-NaN row -> NaN    combine_rewards: `torch.nansum(rewards * weights, dim=1)`
  mean_g, std_g over the non-NaN rewards (unbiased std)    group_advantages: `_nan_mean_std(grouped, dim=-1)`
  A_i = (r_i - mean_g) / (std_g + 1e-4)      "group"       group_advantages: `centered / (group_std + STD_EPS)`
  A_i = (r_i - mean_g) / (std_batch + 1e-4)  "batch"       group_advantages: `centered / (batch_std + STD_EPS)`
  A_i = r_i - mean_g                         "none"        group_advantages: `centered`
  all-equal group -> A_i = 0 exactly                       group_advantages: `torch.where(valid & (spread > 0), ...)`

Log-probabilities
  log pi(o_t) = z[o_t] - logsumexp(z)                      _SelectiveLogSoftmax.forward: `chosen - logsumexp`
  d log pi(o_t) / dz = onehot(o_t) - softmax(z)            _SelectiveLogSoftmax.backward: `probs.mul_(-grad)...`
  H_t = -sum_v p_v log p_v                                 entropy_from_logits: `torch.special.entr(probs).sum(-1)`

Ratios, clipping, KL (all in grpo_loss)
  rho[i,t] = exp(logps - old_logps)          token         `ratio = torch.exp(log_ratio)`
  s_i = exp(sum_t m (logps - old) / |o_i|)   sequence      `torch.exp(_masked_sum(log_ratio, mask) / lengths...)`
  s_i = exp(sum_t m (logps - old))           sequence_sum  `torch.exp(_masked_sum(log_ratio, mask))`
  min(rho A, clip(rho, 1-eps, 1+eps_high) A)               _clipped_objective: `torch.min(ratio * A, clamped * A)`
  KL[i,t] = exp(x) - x - 1, x = ref - logps  k3            `_k3(log_ref_ratio)`
  KL_i = exp(d_i) - d_i - 1, d_i = sum_t m x sequence_sum  `_k3(_masked_sum(log_ref_ratio, mask))`
  l = min(...) - beta KL                                   `objective - beta * kl`

Aggregation (_aggregate; sequence_sum in grpo_loss), loss = -J
  grpo:     J = mean_i (sum_t m l / |o_i|)                 `(masked.sum(-1) / mask.sum(-1).clamp(min=1)).mean()`
  bnpo:     J = sum m l / sum m                            `masked.sum() / mask.sum().clamp(min=1)`
  dr_grpo:  J = sum m l / (N * max_completion_length)      `masked.sum() / (mask.shape[0] * max_completion_length)`
  dapo:     J = sum m l / (tokens of the global batch)     `masked.sum() / num_items`
  sequence_sum: J = mean_i l_i                             `torch.where(lengths > 0, objective, 0.0).mean()`
  loss = -J                                                `return -objective, metrics`

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
         / |o_i| > d, else 1  (DeepSeek-V3.2 arXiv:2512.02556, eq. 9)                                 _off_policy_mask
  use_bias_correction_kl: KL[i,t] <- r KL[i,t], r with its gradient; sequence_sum: KL_i <- s_i KL_i
         (DeepSeek-V3.2's unbiased KL estimate)                                                             grpo_loss
  l = surrogate * M - beta KL, then the aggregation of the loss type; loss = -J.
Where TRL 1.16, and so this code, departs from the papers:
- cispo: the weight is capped at `epsilon_high` itself (ScaleRL's eps_max, recommended 5), not at 1 + eps_high,
  and has no lower bound; MiniMax-M1 writes clip(r, 1 - eps_low^IS, 1 + eps_high^IS) with a token mask M that
  is not implemented. `epsilon_high=None` falls back to `epsilon` (a cap of 0.2): `check_loss_settings` warns.
  The loss value contains log pi_theta, so it is not comparable across loss types; its gradient is.
- vespo: the clamps of the authors' code: each token's log-ratio to [-20, 20], log w_i to [log 1e-8, 20],
  lambda >= 1e-4, a NaN/inf phi -> 0; phi is computed as exp(lambda + k log w - lambda w). TRL's extra factor
  for vLLM sampling (its `importance_sampling_ratio`) is not folded into phi here: vespo refuses that correction.
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
  them, with a warning from `check_loss_settings`.
"""

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")  # docs/design.md's four; every loss type: `tuple(LOSS_VARIANTS)`
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence", "sequence_sum")
SCALE_REWARDS = ("group", "batch", "none")

STD_EPS = 1e-4
"""Added to the reward std before dividing (TRL's value), so a near-constant group cannot explode."""

CHUNK_ELEMENTS = 1 << 23
"""Default row-chunk budget of `selective_log_softmax` / `entropy_from_logits`: about 8M logits per chunk,
i.e. 32 MiB per float32 temporary (170 rows at V=49152, 55 rows at V=151936)."""


# ---------------------------------------------------------------------------------------------------------------
# Rewards -> advantages
# ---------------------------------------------------------------------------------------------------------------


def combine_rewards(rewards: Tensor, weights: Tensor | Sequence[float] | None = None) -> Tensor:
    """Weighted sum over reward functions, skipping NaN entries: r_i = sum_k w_k r_ik.

    `rewards` is `[N, R]`, one column per reward function, NaN where a function does not apply. A row in
    which every entry is NaN (no reward at all) stays NaN, so that `group_advantages` gives it 0.
    `weights` (length R) defaults to all ones. Returns `[N]` in at least float32.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [N, R] (one column per reward function), got shape {tuple(rewards.shape)}")
    dtype = _compute_dtype(rewards.dtype)
    rewards = rewards.to(dtype)  # [N, R]
    num_funcs = rewards.shape[1]
    if weights is None:
        weights = torch.ones(num_funcs, dtype=dtype, device=rewards.device)  # [R]
    else:
        weights = torch.as_tensor(weights, dtype=dtype, device=rewards.device)  # [R]
        if weights.shape != (num_funcs,):
            raise ValueError(f"got {weights.numel()} reward weights for {num_funcs} reward functions; pass one each")
    combined = torch.nansum(rewards * weights, dim=1)  # [N]
    return combined.masked_fill(torch.isnan(rewards).all(dim=1), float("nan"))


def group_advantages(rewards: Tensor, num_generations: int, scale_rewards: str = "group") -> Tensor:
    """Group-relative advantages A_i from rewards r_i (DeepSeekMath outcome supervision; Dr. GRPO for "none").

    `rewards` is `[N]`, already combined over reward functions; rows i*G .. i*G+G-1 form one group.
    - "group": A_i = (r_i - mean_g) / (std_g + 1e-4)
    - "batch": A_i = (r_i - mean_g) / (std_batch + 1e-4), std over every reward of `rewards`
    - "none":  A_i = r_i - mean_g
    std is the unbiased sample std (`torch.std`). NaN rewards get A_i = 0 and are left out of every mean and
    std; a group whose remaining rewards are all equal, or number fewer than two, gets exactly 0.
    `True`/`False` are accepted for "group"/"none" (TRL). For "batch" over several processes, pass the
    gathered rewards of the whole batch. Returns `[N]` in the rewards' dtype, at least float32.
    """
    scale_rewards = {True: "group", False: "none"}.get(scale_rewards, scale_rewards)
    _check_choice("scale_rewards", scale_rewards, SCALE_REWARDS)
    if rewards.dim() != 1:
        raise ValueError(
            f"rewards must be [N], got shape {tuple(rewards.shape)}; combine columns with combine_rewards"
        )
    if isinstance(num_generations, bool) or not isinstance(num_generations, int) or num_generations < 1:
        raise ValueError(f"num_generations must be a positive int, got {num_generations!r}")
    if rewards.numel() % num_generations != 0:
        raise ValueError(
            f"{rewards.numel()} rewards do not split into groups of num_generations={num_generations}; "
            "each prompt needs exactly num_generations consecutive completions"
        )
    grouped = rewards.to(_compute_dtype(rewards.dtype)).reshape(-1, num_generations)  # [N / G, G]
    valid = ~torch.isnan(grouped)  # [N / G, G]
    mean, group_std = _nan_mean_std(grouped, dim=-1)  # [N / G, 1] each
    inf = float("inf")
    spread = grouped.where(valid, -inf).amax(-1, keepdim=True) - grouped.where(valid, inf).amin(-1, keepdim=True)
    # `spread > 0` makes an all-equal group exactly 0: r - mean(r) can be 1e-17 there from rounding alone.
    centered = torch.where(valid & (spread > 0), grouped - mean, 0.0)  # [N / G, G]
    if scale_rewards == "group":
        centered = centered / (group_std + STD_EPS)
    elif scale_rewards == "batch":
        _, batch_std = _nan_mean_std(grouped.reshape(-1), dim=0)  # [1]
        centered = centered / (batch_std + STD_EPS)
    return centered.reshape(-1)  # [N]


def _nan_mean_std(x: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    """Mean and unbiased std along `dim` over the non-NaN entries (keepdim); 0 where fewer than two."""
    valid = ~torch.isnan(x)
    count = valid.sum(dim, keepdim=True)
    mean = torch.nansum(x, dim, keepdim=True) / count.clamp(min=1)
    squares = torch.where(valid, x - mean, 0.0).square().sum(dim, keepdim=True)
    return mean, (squares / (count - 1).clamp(min=1)).sqrt()


# ---------------------------------------------------------------------------------------------------------------
# Logits -> log-probabilities and entropy, in row chunks
# ---------------------------------------------------------------------------------------------------------------


def selective_log_softmax(logits: Tensor, index: Tensor, chunk_size: int | None = None) -> Tensor:
    """log_softmax(logits)[..., index] without materialising the `[..., V]` log-softmax.

    Equal to `log_softmax(logits.float(), -1).gather(-1, index.unsqueeze(-1)).squeeze(-1)`. The leading
    dims are walked in chunks of `chunk_size` rows (default: `CHUNK_ELEMENTS // V` rows), computing
    `logits.gather(index) - logsumexp(logits)` per chunk, so the extra peak memory is a few chunk-sized
    float32 temporaries, in the forward and in the backward pass. Exact for float32/float64; bf16/fp16
    chunks are upcast to float32. Sliced logits such as `logits[:, :-1]` are read in place, never copied.

    Differentiable: the backward pass (d/dz = onehot - softmax(z), times the incoming gradient) is also
    computed chunk by chunk from the saved logits and the `[...]` logsumexp; it is not twice differentiable.

    `logits` `[..., V]`, `index` `[...]` (integer) -> `[...]` in float32 (float64 for float64 logits).
    """
    if index.shape != logits.shape[:-1]:
        raise ValueError(
            f"index has shape {tuple(index.shape)} but logits has shape {tuple(logits.shape)}: "
            "index must be logits.shape[:-1]"
        )
    if index.dtype.is_floating_point or index.dtype.is_complex or index.dtype == torch.bool:
        raise ValueError(f"index must be an integer tensor, got {index.dtype}")
    return _SelectiveLogSoftmax.apply(logits, index, _rows_per_chunk(logits, chunk_size))


@torch.no_grad()
def entropy_from_logits(logits: Tensor, chunk_size: int | None = None) -> Tensor:
    """Entropy H = -sum_v p_v log p_v of softmax(logits) at each position, in row chunks (a metric: no grad).

    `logits` `[..., V]` -> `[...]` in float32 (float64 for float64 logits). Vocabulary entries at -inf
    (p = 0) contribute 0.
    """
    dtype = _compute_dtype(logits.dtype)
    entropy = torch.empty(logits.shape[:-1], dtype=dtype, device=logits.device)  # [...]
    flat = entropy.view(-1)  # [M]
    for start, chunk in _row_chunks(logits, _rows_per_chunk(logits, chunk_size)):
        probs = torch.softmax(chunk, -1, dtype=dtype)  # [n, V]
        flat[start : start + chunk.shape[0]] = torch.special.entr(probs).sum(-1)  # entr(p) = -p log p, 0 at p = 0
    return entropy


class _SelectiveLogSoftmax(torch.autograd.Function):
    """Chunked `log_softmax(z).gather(index)` whose backward recomputes softmax chunk by chunk."""

    @staticmethod
    def forward(ctx, logits: Tensor, index: Tensor, rows: int) -> Tensor:
        dtype = _compute_dtype(logits.dtype)
        flat_index = index.reshape(-1).long()  # [M]
        logps = torch.empty(flat_index.shape, dtype=dtype, device=logits.device)  # [M]
        logsumexp = torch.empty_like(logps)  # [M]
        for start, chunk in _row_chunks(logits, rows):  # chunk: [n, V]
            stop = start + chunk.shape[0]
            chosen = chunk.gather(-1, flat_index[start:stop, None]).squeeze(-1).to(dtype)  # [n]
            logsumexp[start:stop] = torch.logsumexp(chunk.to(dtype), dim=-1)
            logps[start:stop] = chosen - logsumexp[start:stop]
        ctx.save_for_backward(logits, flat_index, logsumexp)
        ctx.rows = rows
        return logps.view(index.shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logps: Tensor) -> tuple[Tensor | None, None, None]:
        logits, flat_index, logsumexp = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None
        grad_flat = grad_logps.reshape(-1, 1).to(logsumexp.dtype)  # [M, 1]
        grad_logits = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)  # [..., V]
        grad_rows = grad_logits.view(-1, logits.shape[-1])  # [M, V]
        for start, chunk in _row_chunks(logits, ctx.rows):  # chunk: [n, V]
            stop = start + chunk.shape[0]
            grad = grad_flat[start:stop]  # [n, 1]
            probs = (chunk - logsumexp[start:stop, None]).exp_()  # [n, V] softmax, in the compute dtype
            grad_rows[start:stop] = probs.mul_(-grad).scatter_add_(-1, flat_index[start:stop, None], grad)
        return grad_logits, None, None


def _row_chunks(x: Tensor, rows: int, start: int = 0) -> Iterator[tuple[int, Tensor]]:
    """Yield `(first_row, view [n <= rows, V])` covering `x [..., V]` in row-major order, without copying.

    Leading dims that cannot be merged into one view (e.g. `logits[:, :-1]` of a `[B, L, V]` tensor) are
    walked one index at a time.
    """
    try:
        flat = x.view(-1, x.shape[-1])  # [M, V]
    except RuntimeError:
        for sub in x.unbind(0):
            yield from _row_chunks(sub, rows, start)
            start += sub.numel() // max(x.shape[-1], 1)
        return
    for offset in range(0, flat.shape[0], rows):
        yield start + offset, flat[offset : offset + rows]


def _rows_per_chunk(logits: Tensor, chunk_size: int | None) -> int:
    if chunk_size is None:
        return max(1, CHUNK_ELEMENTS // max(logits.shape[-1], 1))
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int (rows per chunk) or None, got {chunk_size!r}")
    return chunk_size


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; everything else (bf16, fp16, ints) is computed in float32."""
    return torch.promote_types(dtype, torch.float32)


# ---------------------------------------------------------------------------------------------------------------
# The policy loss
# ---------------------------------------------------------------------------------------------------------------


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
) -> tuple[Tensor, dict[str, float]]:
    """The clipped, KL-regularised GRPO loss of docs/design.md ("The maths") and its metrics: returns `(-J, metrics)`.

    Args:
        logps: `[N, T]` log pi_theta of the completion tokens, with gradient. Padded positions must be finite.
        old_logps: `[N, T]` log pi_old (the policy that sampled), or None for on-policy (ratio 1).
        ref_logps: `[N, T]` log pi_ref of the reference model; None is allowed only with `beta == 0`.
        advantages: `[N]` from `group_advantages`.
        completion_mask: `[N, T]` float or bool, 1 on completion tokens up to and including EOS.
        loss_type: the per-token surrogate and how per-token terms become J (`LOSS_VARIANTS`): "grpo", "bnpo",
            "dr_grpo", "dapo" (docs/design.md), or TRL 1.16's "cispo", "sapo", "luspo", "vespo" (module docstring).
        epsilon, epsilon_high: clip range [1 - epsilon, 1 + epsilon_high]; `epsilon_high` defaults to `epsilon`.
            For "cispo", `epsilon_high` is the cap of the importance weight itself (TRL; ScaleRL's eps_max).
        beta: weight of the k3 KL to the reference. At 0 the KL is not computed at all.
        importance_sampling_level: "token" (rho per token), "sequence" (GSPO s_i, length-normalised) or
            "sequence_sum" (DeepSeek-V2/V3 joint ratio with a sequence-level KL; needs `loss_type="grpo"`).
        max_completion_length: the `dr_grpo` constant (required for it).
        num_items_in_batch: the `dapo` denominator: completion tokens of the whole global batch (all processes
            and accumulation slices), so that summing the slices' losses gives the full batch's loss.
            None uses the local `completion_mask.sum()`. "cispo" and "vespo" aggregate like "dapo".
        delta: INTELLECT-2's two-sided clip, the unclipped ratio capped at `delta` (clip family); None: off.
        use_bias_correction_kl: KL -> ratio * KL (DeepSeek-V3.2's unbiased KL; TRL's config default is True).
        off_policy_mask_threshold: DeepSeek-V3.2's off-policy sequence mask: drop the policy term of sequences with
            A < 0 whose mean log(pi_old / pi_theta) exceeds it; None: off.
        sapo_temperature_pos, sapo_temperature_neg: SAPO's gate temperatures for A > 0 and A <= 0.
        vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg: VESPO's kernel for A >= 0 and A < 0.
        policy_mask: `[N, T]` 0/1 on the tokens whose policy term counts (`high_entropy_mask`); the KL and every
            normaliser keep `completion_mask` (TRL). None: all. Not with "sequence_sum" (one term per sequence).
        sampling_weight: `[N, T]` or `[N, 1]` importance weight pi_old / pi_sampler of the tokens (from
            `sampling_importance_weights`): it multiplies the policy term, not the KL (TRL's vLLM correction).

    `old_logps`, `ref_logps` and `advantages` are detached here: no gradient flows into them. Computed in the
    dtype of `logps`. Impossible settings raise (`check_loss_settings`; its warnings are the caller's to show).
    Metrics (python floats, TRL names): "kl" (only when beta != 0; masked token mean, or mean_i KL_i for
    sequence_sum; after the bias correction, as TRL logs it), and per loss type: "clip_ratio/low_mean",
    "clip_ratio/high_mean", "clip_ratio/region_mean" (clip family: the fraction of completion tokens whose ratio
    is clipped below with A < 0, above with A > 0, or either), "cispo_clip_ratio", "vespo/phi_seq_mean"; none
    for "sapo".
    """
    check_loss_settings(
        loss_type=loss_type,
        importance_sampling_level=importance_sampling_level,
        epsilon=epsilon,
        epsilon_high=epsilon_high,
        max_completion_length=max_completion_length,
        delta=delta,
        off_policy_mask_threshold=off_policy_mask_threshold,
        sapo_temperature_pos=sapo_temperature_pos,
        sapo_temperature_neg=sapo_temperature_neg,
        vespo_lambda_pos=vespo_lambda_pos,
        vespo_lambda_neg=vespo_lambda_neg,
    )
    _check_shapes(logps, old_logps, ref_logps, advantages, completion_mask, policy_mask)
    if beta != 0 and ref_logps is None:
        raise ValueError(f"ref_logps is None but beta={beta}: pass the reference log-probs, or set beta=0 (no KL)")
    knobs = LossKnobs(
        epsilon_low=epsilon,
        epsilon_high=epsilon if epsilon_high is None else epsilon_high,
        delta=delta,
        sapo_temperature_pos=sapo_temperature_pos,
        sapo_temperature_neg=sapo_temperature_neg,
        vespo_k_pos=vespo_k_pos,
        vespo_lambda_pos=vespo_lambda_pos,
        vespo_k_neg=vespo_k_neg,
        vespo_lambda_neg=vespo_lambda_neg,
    )

    mask = completion_mask.to(logps.dtype)  # [N, T]
    lengths = mask.sum(-1)  # [N]  |o_i|
    advantages = advantages.detach().to(logps.dtype)[:, None]  # [N, 1]
    old_logps = logps.detach() if old_logps is None else old_logps.detach().to(logps.dtype)  # [N, T]
    log_ratio = logps - old_logps  # [N, T]
    log_ref_ratio = None if beta == 0 else ref_logps.detach().to(logps.dtype) - logps  # [N, T]  x = ref - logps
    per_sequence = importance_sampling_level == "sequence_sum"  # one objective l_i per sequence, J = mean_i l_i

    if importance_sampling_level == "token":
        ratio = torch.exp(log_ratio)  # [N, T]  rho
    elif importance_sampling_level == "sequence":
        ratio = torch.exp(_masked_sum(log_ratio, mask) / lengths.clamp(min=1))[:, None]  # [N, 1]  GSPO s_i
    else:
        ratio = torch.exp(_masked_sum(log_ratio, mask))[:, None]  # [N, 1]  s_i = pi(o_i) / pi_old(o_i)

    variant = LOSS_VARIANTS[loss_type]
    objective, values = variant.surrogate(ratio, advantages, logps, log_ratio, mask, knobs)  # [N, T] or [N, 1]
    if off_policy_mask_threshold is not None:
        objective = objective * _off_policy_mask(log_ratio, advantages, mask, off_policy_mask_threshold)  # M_i
    if policy_mask is not None:  # e.g. top_entropy_quantile: the policy term of the high-entropy tokens only
        objective = objective * _token_mask(policy_mask, per_sequence, objective.dtype)  # [N, T]
    if sampling_weight is not None:  # the sampler was not exactly pi_old (vLLM): reweight its samples
        objective = objective * sampling_weight.detach().to(objective.dtype)
    if beta != 0:
        if per_sequence:
            kl = _k3(_masked_sum(log_ref_ratio, mask))[:, None]  # [N, 1]  KL_i with d_i = sum_t m (ref - logps)
        else:
            kl = _k3(log_ref_ratio)  # [N, T]
        if use_bias_correction_kl:
            kl = kl * ratio  # DeepSeek-V3.2: the importance-weighted KL, its gradient flows through the ratio too
        objective = objective - beta * kl
        values["kl"] = kl.detach().mean() if per_sequence else _token_mean(kl, mask)
    if per_sequence:
        objective = objective.squeeze(-1)  # [N]  l_i
        objective = torch.where(lengths > 0, objective, 0.0).mean()  # J = mean_i l_i
    else:
        objective = _aggregate(objective, mask, variant.aggregation, max_completion_length, num_items_in_batch)

    metrics = _to_floats(values)
    return -objective, metrics


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
# Per-token surrogates of the loss types (TRL 1.16 names), the off-policy mask, and the settings check
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LossKnobs:
    """The numbers a per-token surrogate may read: `grpo_loss`'s keywords, with `epsilon_high` resolved."""

    epsilon_low: float
    epsilon_high: float
    delta: float | None
    sapo_temperature_pos: float
    sapo_temperature_neg: float
    vespo_k_pos: float
    vespo_lambda_pos: float
    vespo_k_neg: float
    vespo_lambda_neg: float


Surrogate = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, LossKnobs], tuple[Tensor, dict[str, Tensor]]]
"""`(ratio [N, T] or [N, 1], advantages [N, 1], logps [N, T], log_ratio [N, T], mask [N, T], knobs)` ->
`(l [N, T] or [N, 1], metric tensors)`: the per-token objective to maximise, before the mask, the KL and the
aggregation. `log_ratio` = logps - old_logps per token, whatever the importance-sampling level of `ratio`."""


def _clipped_surrogate(
    ratio: Tensor, advantages: Tensor, logps: Tensor, log_ratio: Tensor, mask: Tensor, knobs: LossKnobs
) -> tuple[Tensor, dict[str, Tensor]]:
    """grpo, bnpo, dr_grpo, dapo, luspo: min(min(r, delta) A, clip(r, 1 - eps_low, 1 + eps_high) A).

    Metrics: TRL's clip ratios, fractions of completion tokens (of the ratio before the delta cap)."""
    low = (ratio < 1 - knobs.epsilon_low) & (advantages < 0)  # [N, T] or [N, 1]
    high = (ratio > 1 + knobs.epsilon_high) & (advantages > 0)
    metrics = {
        "clip_ratio/low_mean": _token_mean(low, mask),
        "clip_ratio/high_mean": _token_mean(high, mask),
        "clip_ratio/region_mean": _token_mean(low | high, mask),
    }
    return _clipped_objective(ratio, advantages, knobs.epsilon_low, knobs.epsilon_high, knobs.delta), metrics


def _cispo_surrogate(
    ratio: Tensor, advantages: Tensor, logps: Tensor, log_ratio: Tensor, mask: Tensor, knobs: LossKnobs
) -> tuple[Tensor, dict[str, Tensor]]:
    """cispo (MiniMax-M1, as TRL): sg(min(r, epsilon_high)) A log pi_theta; the weight carries no gradient.

    Metric: TRL's "cispo_clip_ratio", the fraction of completion tokens with r > epsilon_high and A > 0."""
    weight = ratio.detach().clamp(max=knobs.epsilon_high)  # [N, T] or [N, 1]
    clipped = (ratio > knobs.epsilon_high) & (advantages > 0)
    return weight * advantages * logps, {"cispo_clip_ratio": _token_mean(clipped, mask)}


def _sapo_surrogate(
    ratio: Tensor, advantages: Tensor, logps: Tensor, log_ratio: Tensor, mask: Tensor, knobs: LossKnobs
) -> tuple[Tensor, dict[str, Tensor]]:
    """sapo: sigmoid(tau (r - 1)) 4 / tau A, with tau = sapo_temperature_pos where A > 0, else _neg. No metric.

    At r = 1 the gate's slope is 1, so on-policy its gradient is the plain policy gradient A grad log pi."""
    tau = torch.full_like(advantages, knobs.sapo_temperature_neg)  # [N, 1]
    tau = tau.masked_fill(advantages > 0, knobs.sapo_temperature_pos)
    return torch.sigmoid(tau * (ratio - 1)) * 4 / tau * advantages, {}


def _vespo_surrogate(
    ratio: Tensor, advantages: Tensor, logps: Tensor, log_ratio: Tensor, mask: Tensor, knobs: LossKnobs
) -> tuple[Tensor, dict[str, Tensor]]:
    """vespo: sg(phi(w_i)) A log pi_theta with VESPO's kernel phi(w) = w^k exp(lambda (1 - w)) (phi(1) = 1).

    w_i is the sequence ratio pi(o_i) / pi_old(o_i), not length-normalised, whatever `ratio` is; (k, lambda) are
    the _pos knobs where A >= 0, else the _neg ones. Computed as exp(lambda + k log w - lambda w) with TRL's
    clamps: each token's log-ratio to [-20, 20], log w_i to [log 1e-8, 20], lambda >= 1e-4; NaN/inf -> 0.
    Metric: "vespo/phi_seq_mean", the mean of phi over the sequences that have completion tokens."""
    with torch.no_grad():
        log_w = _masked_sum(log_ratio.clamp(-20.0, 20.0), mask).clamp(math.log(1e-8), 20.0)[:, None]  # [N, 1]
        nonnegative = advantages >= 0  # [N, 1]
        k = torch.full_like(advantages, knobs.vespo_k_neg).masked_fill(nonnegative, knobs.vespo_k_pos)
        lam = torch.full_like(advantages, knobs.vespo_lambda_neg).masked_fill(nonnegative, knobs.vespo_lambda_pos)
        lam = lam.clamp(min=1e-4)
        phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
        has_tokens = (mask.sum(-1, keepdim=True) > 0).to(phi.dtype)  # [N, 1]
        phi_mean = (phi * has_tokens).sum() / has_tokens.sum().clamp(min=1)
    return phi * advantages * logps, {"vespo/phi_seq_mean": phi_mean}


class LossVariant(NamedTuple):
    surrogate: Surrogate
    aggregation: str  # an `_aggregate` mode


LOSS_VARIANTS: dict[str, LossVariant] = {
    "grpo": LossVariant(_clipped_surrogate, "grpo"),
    "bnpo": LossVariant(_clipped_surrogate, "bnpo"),
    "dr_grpo": LossVariant(_clipped_surrogate, "dr_grpo"),
    "dapo": LossVariant(_clipped_surrogate, "dapo"),
    "luspo": LossVariant(_clipped_surrogate, "luspo"),
    "cispo": LossVariant(_cispo_surrogate, "dapo"),
    "sapo": LossVariant(_sapo_surrogate, "grpo"),
    "vespo": LossVariant(_vespo_surrogate, "dapo"),
}
"""loss_type -> (per-token surrogate, aggregation), as TRL 1.16 pairs them. An aggregation of "dapo" divides by
the global token count `num_items_in_batch`: the trainer must undo its accumulation/process averaging for it."""


@torch.no_grad()
def _off_policy_mask(log_ratio: Tensor, advantages: Tensor, mask: Tensor, threshold: float) -> Tensor:
    """DeepSeek-V3.2's off-policy sequence mask M_i `[N, 1]`, no gradient: 0 where A_i < 0 and the mean over the
    completion of log(pi_old / pi_theta) exceeds `threshold`, 1 elsewhere."""
    mean_log_ratio = _masked_sum(-log_ratio, mask) / mask.sum(-1).clamp(min=1)  # [N]  mean_t log(pi_old / pi)
    keep = (advantages >= 0) | (mean_log_ratio[:, None] <= threshold)  # [N, 1]
    return keep.to(log_ratio.dtype)


@torch.no_grad()
def _token_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of `x` (broadcasting to `[N, T]`) over the completion tokens: a metric, no gradient."""
    return (x * mask).sum() / mask.sum().clamp(min=1)


def _to_floats(values: dict[str, Tensor]) -> dict[str, float]:
    """Scalar metric tensors -> python floats with one device sync."""
    if not values:
        return {}
    return dict(zip(values, torch.stack(list(values.values())).tolist(), strict=True))


def check_loss_settings(
    *,
    loss_type: str = "grpo",
    importance_sampling_level: str = "token",
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    max_completion_length: int | None = None,
    delta: float | None = None,
    off_policy_mask_threshold: float | None = None,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    vespo_lambda_pos: float = 3.0,
    vespo_lambda_neg: float = 2.0,
) -> list[str]:
    """Raise ValueError for loss settings that cannot be computed; return warnings for ones that run but are
    probably not what was meant (TRL's warnings about loss types and importance-sampling levels, and more).

    Takes `GRPOConfig`'s field names (TRL's), so the config can pass its fields and log what comes back.
    """
    _check_choice("loss_type", loss_type, tuple(LOSS_VARIANTS))
    _check_choice("importance_sampling_level", importance_sampling_level, IMPORTANCE_SAMPLING_LEVELS)
    eps_high = epsilon if epsilon_high is None else epsilon_high
    errors = [
        (
            importance_sampling_level == "sequence_sum" and loss_type != "grpo",
            f"importance_sampling_level='sequence_sum' has its own per-sequence objective (loss = -mean_i l_i) and "
            f"works only with loss_type='grpo', got loss_type={loss_type!r}",
        ),
        (
            LOSS_VARIANTS[loss_type].aggregation == "dr_grpo" and max_completion_length is None,
            "loss_type='dr_grpo' normalises by N * max_completion_length: pass max_completion_length",
        ),
        (
            loss_type == "sapo" and min(sapo_temperature_pos, sapo_temperature_neg) <= 0,
            f"sapo_temperature_pos={sapo_temperature_pos} and sapo_temperature_neg={sapo_temperature_neg} must be "
            "> 0: SAPO's gate is sigmoid(tau (r - 1)) * 4 / tau (the paper uses 1.0 and 1.05)",
        ),
        (
            loss_type == "cispo" and eps_high <= 0,
            f"loss_type='cispo' caps the importance weight at epsilon_high={eps_high}, which must be > 0 "
            "(ScaleRL recommends 5.0)",
        ),
    ]
    for failed, message in errors:
        if failed:
            raise ValueError(message)

    clip_family = LOSS_VARIANTS[loss_type].surrogate is _clipped_surrogate
    advice = [
        (
            importance_sampling_level == "sequence" and loss_type in ("bnpo", "dr_grpo", "dapo", "cispo"),
            f"importance_sampling_level='sequence' with loss_type={loss_type!r}: this loss sums per-token terms, so "
            "each sequence's ratio counts once per token: it weights each sequence by its completion length, "
            "instead of GSPO's per-sequence objective. For GSPO set loss_type='grpo'.",
        ),
        (
            loss_type == "luspo" and importance_sampling_level != "sequence",
            f"loss_type='luspo' is GSPO with each sequence weighted by its length: set importance_sampling_level="
            f"'sequence' as in the LUSPO paper (got {importance_sampling_level!r}).",
        ),
        (
            loss_type == "vespo" and importance_sampling_level != "token",
            f"loss_type='vespo' computes its own sequence-level weight; importance_sampling_level="
            f"{importance_sampling_level!r} only changes the ratio of the bias-corrected KL. Use 'token'.",
        ),
        (
            loss_type == "cispo" and 0 < eps_high < 1,
            f"loss_type='cispo' caps the importance weight at epsilon_high={eps_high} itself (not 1 + epsilon_high): "
            "every token's gradient is scaled by at most that. With epsilon_high=None it is epsilon. "
            "Set epsilon_high to the cap you mean (ScaleRL: 5.0).",
        ),
        (
            delta is not None and not clip_family,
            f"delta={delta} has no effect with loss_type={loss_type!r}: it caps the ratio of the clipped objective "
            "(grpo, bnpo, dr_grpo, dapo, luspo).",
        ),
        (
            delta is not None and clip_family and delta <= 1 + eps_high,
            f"delta={delta} <= 1 + epsilon_high={1 + eps_high}: the two-sided clip then also caps positive-"
            "advantage ratios and no longer bounds negative ones beyond the usual clip. INTELLECT-2 and TRL "
            "recommend delta > 1 + epsilon_high (e.g. 4).",
        ),
        (
            off_policy_mask_threshold is not None and off_policy_mask_threshold < 0,
            f"off_policy_mask_threshold={off_policy_mask_threshold} < 0 drops negative-advantage sequences even "
            "on-policy (their mean log(pi_old / pi_theta) is 0). Use a positive threshold (e.g. 0.5).",
        ),
        (
            loss_type == "vespo" and min(vespo_lambda_pos, vespo_lambda_neg) <= 0,
            f"vespo_lambda_pos={vespo_lambda_pos}, vespo_lambda_neg={vespo_lambda_neg}: lambda <= 0 is raised to "
            "1e-4 (TRL), so the kernel barely decays for large ratios.",
        ),
    ]
    return [message for applies, message in advice if applies]


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")


def _check_shapes(
    logps: Tensor,
    old_logps: Tensor | None,
    ref_logps: Tensor | None,
    advantages: Tensor,
    completion_mask: Tensor,
    policy_mask: Tensor | None = None,
) -> None:
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


def nan_group_std(grouped: torch.Tensor) -> torch.Tensor:
    """Sample std of each row of `grouped` [M, G], ignoring NaN; 0 for rows with fewer than 2 values."""
    valid = ~torch.isnan(grouped)  # [M, G]
    n = valid.sum(dim=1)  # [M]
    values = torch.where(valid, grouped, torch.zeros_like(grouped))
    mean = values.sum(dim=1) / n.clamp(min=1)  # [M]
    var = (((values - mean.unsqueeze(1)) ** 2) * valid).sum(dim=1) / (n - 1).clamp(min=1)
    return torch.where(n > 1, var.sqrt(), torch.zeros_like(var))


def prompt_runs(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> list[tuple[int, int]]:
    """`(start, stop)` of every run of identical consecutive rows of `prompt_ids`/`prompt_mask` [N, P].

    A group's G copies of one prompt are such a run (`RepeatSampler` keeps them together); a group
    split across processes or micro-batches gives one run per piece.
    """
    if prompt_ids.size(0) == 0:
        return []
    same = (prompt_ids[1:] == prompt_ids[:-1]).all(dim=1) & (prompt_mask[1:] == prompt_mask[:-1]).all(dim=1)  # [N-1]
    starts = [0, *(torch.nonzero(~same).flatten() + 1).tolist()]
    return list(zip(starts, [*starts[1:], prompt_ids.size(0)], strict=True))


def reward_metrics(rewards: Tensor, total: Tensor, names: Sequence[str], num_generations: int) -> dict[str, float]:
    """TRL's reward metrics of a generation batch: rewards [N, R] (NaN = None, one column per function in `names`)
    and their weighted sum `total` [N]. `reward_std` / `frac_reward_zero_std` need whole groups (N % G == 0)."""
    valid = ~torch.isnan(total)
    metrics = {"reward": total[valid].mean().item() if valid.any() else float("nan")}
    for k, name in enumerate(names):
        column = rewards[:, k]
        ok = ~torch.isnan(column)
        metrics[f"rewards/{name}/mean"] = column[ok].mean().item() if ok.any() else float("nan")
        metrics[f"rewards/{name}/std"] = column[ok].std().item() if ok.sum() > 1 else 0.0
    if total.numel() % num_generations == 0:
        group_std = nan_group_std(total.view(-1, num_generations))  # [N / G]
        metrics["reward_std"] = group_std.mean().item()
        metrics["frac_reward_zero_std"] = (group_std == 0).float().mean().item()
    return metrics


def check_finite_rewards(rewards: Tensor, names: Sequence[str]) -> None:
    """Raise when a reward in `rewards` [N, R] is infinite in its dtype (NaN means None and is allowed), naming the
    reward function and the row: e.g. 1e300 is finite in Python but inf in float32, and would turn the advantages,
    then the loss and the weights, into NaN."""
    bad = torch.isinf(rewards)  # [N, R]
    if bool(bad.any()):
        row, column = (int(k) for k in bad.nonzero()[0])
        raise ValueError(
            f"Reward function {names[column]!r} returned {rewards[row, column].item()} (after conversion to "
            f"{rewards.dtype}) for completion {row} of this batch: rewards must be finite and within the range of "
            f"{rewards.dtype}. Return None for 'no reward', or clip/scale the reward."
        )


# ---------------------------------------------------------------------------------------------------------------
# Entropy terms of TRL 1.16: the high-entropy token mask, the entropy bonus and its adaptive coefficient
# ---------------------------------------------------------------------------------------------------------------


def entropy_with_grad(logits: Tensor, chunk_size: int | None = None) -> Tensor:
    """`entropy_from_logits` with a gradient, for the entropy bonus: H = -sum_v p_v log p_v, p = softmax(z).

    dH/dz_v = -p_v (log p_v + H) = entr(p_v) - p_v H, with entr(p) = -p log p (0 at p = 0, so -inf logits are fine).
    The forward values are `entropy_from_logits`'s, bit for bit. Row chunks as in `selective_log_softmax`: the
    backward recomputes softmax chunk by chunk from the saved logits, so the extra memory is a few chunk-sized
    temporaries plus the `[..., V]` gradient itself. `logits` `[..., V]` -> `[...]` in float32 (float64 for float64).
    """
    return _EntropyWithGrad.apply(logits, _rows_per_chunk(logits, chunk_size))


class _EntropyWithGrad(torch.autograd.Function):
    """Chunked softmax entropy whose backward recomputes softmax chunk by chunk."""

    @staticmethod
    def forward(ctx, logits: Tensor, rows: int) -> Tensor:
        with torch.no_grad():
            entropy = entropy_from_logits(logits, rows)  # [...]
        ctx.save_for_backward(logits, entropy)
        ctx.rows = rows
        return entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_entropy: Tensor) -> tuple[Tensor | None, None]:
        logits, entropy = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None
        dtype = entropy.dtype
        grad_flat = grad_entropy.reshape(-1, 1).to(dtype)  # [M, 1]
        entropy_flat = entropy.reshape(-1, 1)  # [M, 1]
        grad_logits = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)  # [..., V]
        grad_rows = grad_logits.view(-1, logits.shape[-1])  # [M, V]
        for start, chunk in _row_chunks(logits, ctx.rows):  # chunk: [n, V]
            stop = start + chunk.shape[0]
            probs = torch.softmax(chunk, -1, dtype=dtype)  # [n, V]
            grad = torch.special.entr(probs).sub_(probs * entropy_flat[start:stop])  # dH/dz = entr(p) - p H
            grad_rows[start:stop] = grad.mul_(grad_flat[start:stop])
        return grad_logits, None


@torch.no_grad()
def high_entropy_mask(entropy: Tensor, mask: Tensor, quantile: float, pool: Tensor | None = None) -> Tensor:
    """The top-`quantile` (rho) of completion tokens by entropy ("Beyond the 80/20 rule", Wang et al. 2025,
    arXiv:2506.01939; TRL's `top_entropy_quantile`): the tokens whose policy term is trained (`grpo_loss`'s
    `policy_mask`).

        tau = Q_{1 - rho}(pool): sort the pool's n entropies v_0 <= ... <= v_{n-1}, x = (1 - rho)(n - 1),
              tau = v_floor(x) + (x - floor(x)) (v_ceil(x) - v_floor(x))   (`torch.quantile`, linear interpolation)
        M[i,t] = m[i,t] and H[i,t] >= tau

    rho = 1 keeps every completion token (tau = min); rho = 0 keeps the highest-entropy token, and every token tied
    with it (tau = max). Ties at tau are all kept, so slightly more than rho of the tokens may be. `pool` is the 1-D
    set of entropies tau is taken over: default the completion tokens of this batch (`entropy[mask]`); the trainer
    passes those of the micro-batch on every process (TRL gathers them). An empty pool gives an all-False mask.
    No size limit (`torch.quantile` refuses more than 2^24 values). `entropy`, `mask` `[N, T]` -> bool `[N, T]`.
    """
    if not 0.0 <= quantile <= 1.0:
        raise ValueError(f"top_entropy_quantile={quantile} must be in [0, 1] (1: every token, 0: the top one)")
    keep = mask.bool()  # [N, T]
    pool = entropy[keep] if pool is None else pool.reshape(-1)  # [n]
    if pool.numel() == 0:
        return torch.zeros_like(keep)
    values = pool.sort().values  # [n] ascending
    rank = torch.tensor(1.0 - quantile, dtype=values.dtype, device=values.device) * (values.numel() - 1)
    below, above = values[rank.long()], values[rank.ceil().long()]
    threshold = torch.lerp(below, above, rank - rank.floor())  # tau
    return keep & (entropy >= threshold)


def entropy_bonus(entropy: Tensor, mask: Tensor, coef: float) -> Tensor:
    """The entropy term of the loss (TRL's `entropy_coef`): loss = loss_policy - coef * Hbar, returned as coef * Hbar:

        Hbar = sum_{i,t} m H / max(sum_{i,t} m, 1)

    the mean per-token entropy over this batch's tokens `mask` `[N, T]` (the policy term's: the completion mask
    times `high_entropy_mask`), whatever the loss type's normalisation, so that `coef` means the same for every
    loss type. Differentiable through `entropy` (`entropy_with_grad`). A scalar tensor.
    """
    mask = mask.to(entropy.dtype)
    return coef * (entropy * mask).sum() / mask.sum().clamp(min=1)


@dataclass
class EntropyControl:
    """The coefficient c of `entropy_bonus`: `entropy_coef` as given, or adapted once per optimizer step
    (Skywork-OR1, He et al. 2025, arXiv:2505.22312, as TRL 1.16 runs it) when `use_adaptive_entropy`.

    Adaptive: after each optimizer step, with H_w the entropy of its whole accumulation window (token mean over the
    policy-term tokens of every micro-batch on every process: `accumulate`, then `step` with the summed totals),
        c <- min(c + entropy_coef_delta, entropy_coef_max)   if H_w <= entropy_target
        c <- max(c - entropy_coef_delta, entropy_coef_min)   otherwise
    and the next step's bonus uses `applied` = c if H_w <= entropy_target else 0; before the first measurement H_w
    is +inf, so the first step has no bonus. Field names are GRPOConfig's (TRL's); `entropy_coef` is the current c.
    """

    entropy_coef: float = 0.0
    use_adaptive_entropy: bool = False
    entropy_coef_min: float = 0.0
    entropy_coef_max: float = 1.0
    entropy_coef_delta: float = 0.005
    entropy_target: float = 0.2
    last_entropy: float = math.inf  # H_w of the last optimizer step
    window: Tensor | None = None  # [2]: sum m H and sum m of this accumulation window so far (this process)

    @property
    def enabled(self) -> bool:
        """Whether the loss has an entropy term at all (TRL: a non-zero coefficient, or adaptive control)."""
        return self.entropy_coef != 0 or self.use_adaptive_entropy

    @property
    def applied(self) -> float:
        """The coefficient of this step's bonus."""
        if self.use_adaptive_entropy and not self.last_entropy <= self.entropy_target:
            return 0.0
        return self.entropy_coef

    def accumulate(self, entropy: Tensor, mask: Tensor) -> None:
        """Add one micro-batch's entropy `[N, T]` over its policy-term tokens `mask` to the window (no gradient)."""
        mask = mask.to(entropy.dtype)
        totals = torch.stack([(entropy.detach() * mask).sum(), mask.sum()])  # [2]
        self.window = totals if self.window is None else self.window + totals

    def step(self, totals: Tensor) -> None:
        """End of an optimizer step: `totals` = `window` summed over the processes -> H_w; update c; clear `window`."""
        self.last_entropy = (totals[0] / totals[1].clamp(min=1)).item()
        if self.last_entropy <= self.entropy_target:
            self.entropy_coef = min(self.entropy_coef + self.entropy_coef_delta, self.entropy_coef_max)
        else:
            self.entropy_coef = max(self.entropy_coef - self.entropy_coef_delta, self.entropy_coef_min)
        self.window = None

    def state(self) -> dict[str, float]:
        return {"entropy_coef": self.entropy_coef, "last_entropy": self.last_entropy}

    def load_state(self, state: dict[str, float] | None) -> None:
        """Restore `state()` of a checkpoint (adaptive control only; None, from an older checkpoint: keep)."""
        if state is not None and self.use_adaptive_entropy:
            self.entropy_coef, self.last_entropy = state["entropy_coef"], state["last_entropy"]


def check_entropy_settings(
    *,
    top_entropy_quantile: float = 1.0,
    importance_sampling_level: str = "token",
    entropy_coef: float = 0.0,
    use_adaptive_entropy: bool = False,
    entropy_coef_min: float = 0.0,
    entropy_coef_max: float = 1.0,
    entropy_coef_delta: float = 0.005,
    entropy_target: float = 0.2,
) -> list[str]:
    """Raise ValueError for entropy settings that cannot run; return warnings for ones that probably mislead.
    Takes `GRPOConfig`'s field names (TRL's)."""
    numbers = (top_entropy_quantile, entropy_coef, entropy_coef_min, entropy_coef_max, entropy_coef_delta)
    errors = [
        (
            not all(math.isfinite(value) for value in numbers) or math.isnan(entropy_target),
            "top_entropy_quantile, entropy_coef, entropy_coef_min, entropy_coef_max, entropy_coef_delta must be "
            f"finite and entropy_target a number, got {(*numbers, entropy_target)}",
        ),
        (
            not 0.0 <= top_entropy_quantile <= 1.0,
            f"top_entropy_quantile={top_entropy_quantile} must be in [0, 1]: the fraction of completion tokens, by "
            "entropy, whose policy term is trained (1.0: all; the paper uses 0.2)",
        ),
        (
            top_entropy_quantile < 1.0 and importance_sampling_level == "sequence_sum",
            "top_entropy_quantile < 1 masks tokens, but importance_sampling_level='sequence_sum' has one policy term "
            "per sequence: use 'token' or 'sequence', or top_entropy_quantile=1.0",
        ),
        (
            entropy_coef_min > entropy_coef_max,
            f"entropy_coef_min={entropy_coef_min} > entropy_coef_max={entropy_coef_max}: swap them",
        ),
        (entropy_coef_delta < 0, f"entropy_coef_delta={entropy_coef_delta} must be >= 0 (the coefficient's step)"),
    ]
    for failed, message in errors:
        if failed:
            raise ValueError(message)
    advice = [
        (
            use_adaptive_entropy and not entropy_coef_min <= entropy_coef <= entropy_coef_max,
            f"use_adaptive_entropy=True starts from entropy_coef={entropy_coef}, outside [entropy_coef_min, "
            f"entropy_coef_max] = [{entropy_coef_min}, {entropy_coef_max}]: the first update clamps it into range.",
        ),
        (
            use_adaptive_entropy and entropy_target <= 0,
            f"entropy_target={entropy_target} <= 0: the mean entropy is never below it, so the adaptive bonus never "
            "applies. Set it near the `entropy` you observe early in training.",
        ),
        (
            not use_adaptive_entropy and entropy_coef < 0,
            f"entropy_coef={entropy_coef} < 0 penalises entropy (the loss grows with it): the bonus needs > 0.",
        ),
    ]
    return [message for applies, message in advice if applies]


def _token_mask(policy_mask: Tensor, per_sequence: bool, dtype: torch.dtype) -> Tensor:
    """`grpo_loss`'s policy_mask as a `[N, T]` factor; refused for a per-sequence objective (sequence_sum)."""
    if per_sequence:
        raise ValueError(
            "policy_mask (e.g. top_entropy_quantile < 1) masks tokens, but importance_sampling_level='sequence_sum' "
            "has one policy term per sequence: use 'token' or 'sequence'"
        )
    return policy_mask.to(dtype)


# ---------------------------------------------------------------------------------------------------------------
# Multi-reward aggregation (GDPO) and the reference-model update (TR-DPO) of TRL 1.16
# ---------------------------------------------------------------------------------------------------------------


def decoupled_advantages(
    rewards: Tensor, num_generations: int, weights: Tensor | Sequence[float] | None = None
) -> Tensor:
    """GDPO's advantages (`multi_objective_aggregation="normalize_then_sum"`; arXiv:2601.05242, as TRL 1.16 computes
    them): each reward function's rewards are normalised within each group first, the weighted sum is taken next,
    and that sum is normalised over the whole batch last.

    `rewards` is `[N, R]` for the whole generation batch (NaN = no reward); rows i*G .. i*G+G-1 form a group.
      z_ik = (r_ik - mean_g(r_k)) / (std_g(r_k) + 1e-4)    over the group's non-NaN r_k; 0 when the group has fewer
             than two of them or they are all equal; NaN where r_ik is NaN     (group_advantages of column k)
      s_i  = sum_k w_k z_ik over the non-NaN z_ik; NaN when every r_ik is NaN    (combine_rewards)
      A_i  = (s_i - mean(s)) / (std(s) + 1e-4)    over the batch's non-NaN s; 0 where s_i is NaN, and 0 when fewer
             than two s_i or all equal                                        (group_advantages, one group)
    std is the unbiased sample std. `scale_rewards` does not enter (TRL ignores it here too). TRL gives ~1e-13
    instead of exactly 0 for an all-equal group (rounding of its mean), and NaN (then 0) for a single value.
    Returns `[N]` in the rewards' dtype, at least float32.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [N, R] (one column per reward function), got shape {tuple(rewards.shape)}")
    per_function = [group_advantages(rewards[:, k], num_generations, "group") for k in range(rewards.shape[1])]
    normalised = torch.stack(per_function, dim=1).masked_fill(torch.isnan(rewards), float("nan"))  # [N, R]
    summed = combine_rewards(normalised, weights)  # [N]
    return group_advantages(summed, summed.numel(), "group")


@torch.no_grad()
def mix_parameters_(targets: Iterator[Tensor], sources: Iterator[Tensor], alpha: float) -> None:
    """TR-DPO's reference update (arXiv:2404.09656), in place: target <- alpha * source + (1 - alpha) * target,
    computed as `target.mul_(1 - alpha).add_(source, alpha=alpha)` (as TRL). Pairs the tensors in order."""
    for target, source in zip(targets, sources, strict=True):
        if target.shape != source.shape:
            raise ValueError(
                f"cannot mix a {tuple(source.shape)} parameter into a {tuple(target.shape)} one: the reference and "
                "the policy must have the same architecture and unsharded parameters"
            )
        target.mul_(1.0 - alpha).add_(source.to(target.dtype), alpha=alpha)


SAMPLING_CORRECTION_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


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
    _check_choice("vllm_importance_sampling_mode", mode, SAMPLING_CORRECTION_MODES)
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
