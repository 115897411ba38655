"""Rewards -> advantages: the weighted sum over reward functions, group-relative advantages, and GDPO's.

Pure tensor functions (torch only). `[N]` holds one value per completion, `[N, R]` one per completion and reward
function; a group is G = `num_generations` consecutive rows. Names follow docs/design.md ("Names").

Papers: DeepSeekMath (Shao et al. 2024, arXiv:2402.03300, eq. 3-4) for the group-normalised advantages;
Dr. GRPO (Liu et al. 2025, arXiv:2503.20783) for no std scaling (`scale_rewards="none"`); GDPO
(arXiv:2601.05242, as TRL 1.16 computes it) for `decoupled_advantages`.

Where this code departs from the papers: advantages divide by `std + 1e-4` (TRL) instead of `std`; a group whose
rewards are all equal (or that has fewer than two rewards) gets exactly 0 instead of 0/0. Completions with no
reward at all (NaN) get advantage 0 and do not enter any mean or std.

Formula -> function (docs/design.md ("The maths"))
  r_i = sum_k w_k r_ik, NaN skipped, all-NaN row -> NaN    combine_rewards: `torch.nansum(rewards * weights, dim=1)`
  mean_g, std_g over the non-NaN rewards (unbiased std)    group_advantages: `_nan_mean_std(grouped, dim=-1)`
  A_i = (r_i - mean_g) / (std_g + 1e-4)      "group"       group_advantages: `centered / (group_std + STD_EPS)`
  A_i = (r_i - mean_g) / (std_batch + 1e-4)  "batch"       group_advantages: `centered / (batch_std + STD_EPS)`
  A_i = r_i - mean_g                         "none"        group_advantages: `centered`
  all-equal group -> A_i = 0 exactly                       group_advantages: `torch.where(valid & (spread > 0), ...)`
  GDPO: per-function group z-scores, summed, batch-normalised                  decoupled_advantages
"""

from collections.abc import Sequence

import torch
from torch import Tensor

from grpo_hf.core.common import check_choice, compute_dtype

SCALE_REWARDS = ("group", "batch", "none")

STD_EPS = 1e-4
"""Added to the reward std before dividing (TRL's value), so a near-constant group cannot explode."""


def combine_rewards(rewards: Tensor, weights: Tensor | Sequence[float] | None = None) -> Tensor:
    """Weighted sum over reward functions, skipping NaN entries: r_i = sum_k w_k r_ik.

    `rewards` is `[N, R]`, one column per reward function, NaN where a function does not apply. A row in
    which every entry is NaN (no reward at all) stays NaN, so that `group_advantages` gives it 0.
    `weights` (length R) defaults to all ones. Returns `[N]` in at least float32.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [N, R] (one column per reward function), got shape {tuple(rewards.shape)}")
    dtype = compute_dtype(rewards.dtype)
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
    check_choice("scale_rewards", scale_rewards, SCALE_REWARDS)
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
    grouped = rewards.to(compute_dtype(rewards.dtype)).reshape(-1, num_generations)  # [N / G, G]
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


def nan_group_std(grouped: Tensor) -> Tensor:
    """Sample std of each row of `grouped` [M, G], ignoring NaN; 0 for rows with fewer than 2 values. -> [M]"""
    return _nan_mean_std(grouped, dim=1)[1].squeeze(1)


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
