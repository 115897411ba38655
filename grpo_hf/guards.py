"""What made a value non-finite: the explanations behind `GRPOConfig.on_nonfinite`.

The trainer checks three values every step: the advantages of each rollout, the loss of each
micro-batch and the gradient norm before each optimizer step (rewards are checked as they arrive,
`core.check_finite_rewards`). When one is NaN or infinite it raises, or skips the optimizer step,
with a message built here that names the cause it can find: the reward functions and completion
behind an advantage, the inputs of a loss, the parameters whose gradient or weight is not finite.
These run only on the failure path, so they may be slow and thorough.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

_SHOWN = 5  # names listed before "... and N more"


def _listed(names: Sequence[str]) -> str:
    shown = ", ".join(names[:_SHOWN])
    return shown + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


def explain_advantages(advantages: Tensor, all_rewards: Tensor, weights: Tensor, names: Sequence[str], G: int) -> str:
    """The first completion whose advantage is not finite, its group, and each reward function's weighted share of
    its combined reward. `advantages` [N], `all_rewards` [N, R], `weights` [R]."""
    bad = (~torch.isfinite(advantages)).nonzero().flatten().tolist()
    row = bad[0]
    pieces = zip(names, weights.tolist(), all_rewards[row].tolist(), strict=True)
    shares = ", ".join(f"{name}: {w:g} x {r:g}" for name, w, r in pieces)
    return (
        f"the advantages of {len(bad)} completion(s) are not finite, first completion {row} (group {row // G}), whose "
        f"weighted rewards are {shares}. Their sum or their group's std overflows float32: scale the rewards or "
        "reward_weights down."
    )


def explain_loss(loss: Tensor, batch: dict[str, Any], named_parameters: Iterable[tuple[str, Tensor]]) -> str:
    """Which inputs of a micro-batch's loss are not finite: advantages, old or reference log-probs, or the weights;
    otherwise the policy's own log-probabilities."""
    causes = [
        f"{key} ({int((~torch.isfinite(batch[key])).sum())} values)"
        for key in ("advantages", "old_logps", "ref_logps")
        if batch.get(key) is not None and not bool(torch.isfinite(batch[key]).all())
    ]
    weights = [name for name, p in named_parameters if not bool(torch.isfinite(p).all())]
    if weights:
        causes.append(f"the model's weights ({_listed(weights)})")
    if causes:
        found = "non-finite inputs: " + "; ".join(causes)
    else:
        found = (
            "its inputs are finite, so the policy's log-probabilities or the ratio to the old policy overflowed: "
            "lower the learning rate, or use bf16/fp32 rather than fp16"
        )
    return f"the loss of this micro-batch is {loss.item()}; {found}."


def explain_gradients(norm: float, named_gradients: Iterable[tuple[str, Tensor | None]]) -> str:
    """The parameters whose gradient (or gradient norm, as measured before clipping) is not finite."""
    names = [name for name, g in named_gradients if g is not None and not bool(torch.isfinite(g).all())]
    where = f"non-finite gradients in {_listed(names)}" if names else "every tensor's gradient is finite"
    return f"the gradient norm is {norm} ({where}). Lower the learning rate, or set max_grad_norm."
