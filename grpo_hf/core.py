"""The GRPO maths: rewards -> advantages, logits -> log-probabilities, and the clipped, KL-regularised loss.

Pure tensor functions: they take tensors and numbers, never a config object, and import only torch.
Tensors are `[N]` (one value per completion) or `[N, T]` (one per completion token); a group is
G = `num_generations` consecutive rows. Names follow DESIGN.md §6; the formulas are DESIGN.md §5.

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

Formula -> function map (DESIGN.md §5)
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
"""

from collections.abc import Iterator, Sequence

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
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
) -> tuple[Tensor, dict[str, float]]:
    """The clipped, KL-regularised GRPO loss of DESIGN.md §5 and its metrics: returns `(-J, metrics)`.

    Args:
        logps: `[N, T]` log pi_theta of the completion tokens, with gradient. Padded positions must be finite.
        old_logps: `[N, T]` log pi_old (the policy that sampled), or None for on-policy (ratio 1).
        ref_logps: `[N, T]` log pi_ref of the reference model; None is allowed only with `beta == 0`.
        advantages: `[N]` from `group_advantages`.
        completion_mask: `[N, T]` float or bool, 1 on completion tokens up to and including EOS.
        loss_type: how per-token terms become J: "grpo", "bnpo", "dr_grpo" or "dapo" (see the module map).
        epsilon, epsilon_high: clip range [1 - epsilon, 1 + epsilon_high]; `epsilon_high` defaults to `epsilon`.
        beta: weight of the k3 KL to the reference. At 0 the KL is not computed at all.
        importance_sampling_level: "token" (rho per token), "sequence" (GSPO s_i, length-normalised) or
            "sequence_sum" (DeepSeek-V2/V3 joint ratio with a sequence-level KL; needs `loss_type="grpo"`).
        max_completion_length: the `dr_grpo` constant (required for it).
        num_items_in_batch: the `dapo` denominator: completion tokens of the whole global batch (all processes
            and accumulation slices), so that summing the slices' losses gives the full batch's loss.
            None uses the local `completion_mask.sum()`.

    `old_logps`, `ref_logps` and `advantages` are detached here: no gradient flows into them. Computed in the
    dtype of `logps`. Metrics (python floats, TRL names): "kl" (only when beta != 0; masked token mean, or
    mean_i KL_i for sequence_sum), and "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean":
    the fraction of completion tokens whose ratio is clipped below with A < 0, above with A > 0, or either.
    """
    _check_choice("loss_type", loss_type, LOSS_TYPES)
    _check_choice("importance_sampling_level", importance_sampling_level, IMPORTANCE_SAMPLING_LEVELS)
    _check_shapes(logps, old_logps, ref_logps, advantages, completion_mask)
    if importance_sampling_level == "sequence_sum" and loss_type != "grpo":
        raise ValueError(
            f"importance_sampling_level='sequence_sum' has its own per-sequence objective (loss = -mean_i l_i) and "
            f"works only with loss_type='grpo', got loss_type={loss_type!r}"
        )
    if beta != 0 and ref_logps is None:
        raise ValueError(f"ref_logps is None but beta={beta}: pass the reference log-probs, or set beta=0 (no KL)")
    if loss_type == "dr_grpo" and max_completion_length is None:
        raise ValueError("loss_type='dr_grpo' normalises by N * max_completion_length: pass max_completion_length")
    eps_low, eps_high = epsilon, (epsilon if epsilon_high is None else epsilon_high)

    mask = completion_mask.to(logps.dtype)  # [N, T]
    lengths = mask.sum(-1)  # [N]  |o_i|
    advantages = advantages.detach().to(logps.dtype)  # [N]
    old_logps = logps.detach() if old_logps is None else old_logps.detach().to(logps.dtype)  # [N, T]
    log_ratio = logps - old_logps  # [N, T]
    log_ref_ratio = None if beta == 0 else ref_logps.detach().to(logps.dtype) - logps  # [N, T]  x = ref - logps

    kl = None
    if importance_sampling_level == "sequence_sum":
        ratio = torch.exp(_masked_sum(log_ratio, mask))  # [N]  s_i = pi(o_i) / pi_old(o_i)
        objective = _clipped_objective(ratio, advantages, eps_low, eps_high)  # [N]
        if beta != 0:
            kl = _k3(_masked_sum(log_ref_ratio, mask))  # [N]  KL_i with d_i = sum_t m (ref - logps)
            objective = objective - beta * kl
        objective = torch.where(lengths > 0, objective, 0.0).mean()  # J = mean_i l_i
        ratio = ratio[:, None]  # [N, 1] for the clip metrics
    else:
        if importance_sampling_level == "token":
            ratio = torch.exp(log_ratio)  # [N, T]  rho
        else:
            ratio = torch.exp(_masked_sum(log_ratio, mask) / lengths.clamp(min=1))[:, None]  # [N, 1]  GSPO s_i
        objective = _clipped_objective(ratio, advantages[:, None], eps_low, eps_high)  # [N, T]
        if beta != 0:
            kl = _k3(log_ref_ratio)  # [N, T]
            objective = objective - beta * kl
        objective = _aggregate(objective, mask, loss_type, max_completion_length, num_items_in_batch)

    metrics = _metrics(ratio, advantages[:, None], mask, kl, eps_low, eps_high)
    return -objective, metrics


def _clipped_objective(ratio: Tensor, advantages: Tensor, eps_low: float, eps_high: float) -> Tensor:
    """min(ratio A, clip(ratio, 1 - eps_low, 1 + eps_high) A): the PPO surrogate, elementwise."""
    clamped = ratio.clamp(1 - eps_low, 1 + eps_high)
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
    loss_type: str,
    max_completion_length: int | None,
    num_items_in_batch: int | float | Tensor | None,
) -> Tensor:
    """J from the per-token objective l `[N, T]`: sum_{i,t} m l over the normaliser of `loss_type`."""
    masked = per_token * mask  # [N, T]
    if loss_type == "grpo":  # mean_i (sum_t m l / |o_i|); an empty row contributes 0
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1)).mean()
    if loss_type == "bnpo":  # tokens of the local batch
        return masked.sum() / mask.sum().clamp(min=1)
    if loss_type == "dr_grpo":  # the local generation budget, a constant
        return masked.sum() / (mask.shape[0] * max_completion_length)
    # dapo: completion tokens of the global batch, all processes and accumulation slices
    num_items = mask.sum() if num_items_in_batch is None else num_items_in_batch
    num_items = torch.as_tensor(num_items, dtype=mask.dtype, device=mask.device).clamp(min=1)
    return masked.sum() / num_items


@torch.no_grad()
def _metrics(
    ratio: Tensor, advantages: Tensor, mask: Tensor, kl: Tensor | None, eps_low: float, eps_high: float
) -> dict[str, float]:
    """TRL's clip-ratio metrics (fractions of completion tokens) and the mean KL, with one device sync."""
    tokens = mask.sum().clamp(min=1)

    def token_mean(x: Tensor) -> Tensor:  # x broadcasts to [N, T]
        return (x * mask).sum() / tokens

    low = (ratio < 1 - eps_low) & (advantages < 0)  # [N, T] or [N, 1]
    high = (ratio > 1 + eps_high) & (advantages > 0)
    values = {
        "clip_ratio/low_mean": token_mean(low),
        "clip_ratio/high_mean": token_mean(high),
        "clip_ratio/region_mean": token_mean(low | high),
    }
    if kl is not None:
        values["kl"] = kl.mean() if kl.dim() == 1 else token_mean(kl)
    return dict(zip(values, torch.stack(list(values.values())).tolist(), strict=True))


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")


def _check_shapes(
    logps: Tensor, old_logps: Tensor | None, ref_logps: Tensor | None, advantages: Tensor, completion_mask: Tensor
) -> None:
    if logps.dim() != 2:
        raise ValueError(f"logps must be [N, T], got shape {tuple(logps.shape)}")
    shape = tuple(logps.shape)
    for name, tensor in (("old_logps", old_logps), ("ref_logps", ref_logps), ("completion_mask", completion_mask)):
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
