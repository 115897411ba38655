"""What made a value non-finite: the explanations behind `GRPOConfig.on_nonfinite`.

`NonfiniteGuard` checks three values every step: the advantages of each rollout, the loss of each micro-batch and the
gradient norm before each optimizer step (rewards are checked as they arrive, `metrics.check_finite_rewards`). When one
is NaN or infinite it raises, or marks the optimizer step to be skipped (`callbacks.SkipNonfiniteUpdates` drops it),
with a message built here that names the cause it can find: the reward functions and completion behind an advantage,
the inputs of a loss, the parameters whose gradient or weight is not finite. The explanations run only on the
failure path, so they may be slow and thorough.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor, nn

from grpo_hf.parallel import sum_over_processes

logger = logging.getLogger(__name__)

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


def explain_loss(loss: Tensor, batch, named_parameters: Iterable[tuple[str, Tensor]]) -> str:
    """Which inputs of a micro-batch's loss are not finite: advantages, old or reference log-probs, or the weights;
    otherwise the policy's own log-probabilities."""
    inputs = {key: getattr(batch, key) for key in ("advantages", "old_logps", "ref_logps")}  # a `MicroBatch`'s
    causes = [
        f"{key} ({int((~torch.isfinite(value)).sum())} values)"
        for key, value in inputs.items()
        if value is not None and not bool(torch.isfinite(value).all())
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


class NonfiniteGuard:
    """`on_nonfinite` for one run: each check returns True when its value is NaN/inf, and then either raises
    (`"raise"`, before the step updates the weights) or warns and sets `skip_update` (`"skip_step"`).

    `accelerator`: the loss is bad when it is bad on any process (the others decide alike from gathered values).
    `reward_names`, `reward_weights` [R]: to name the reward functions behind non-finite advantages.
    """

    def __init__(self, accelerator, on_nonfinite: str, reward_names: Sequence[str], reward_weights: Tensor):
        self.accelerator, self.on_nonfinite = accelerator, on_nonfinite
        self.reward_names, self.reward_weights = list(reward_names), reward_weights
        self.skip_update = False  # a non-finite value was met in this optimizer step
        self.skipped_steps = 0
        self.pre_clip_norms: list[tuple[str, Tensor]] | None = None  # per-tensor gradient norms, before clipping

    def advantages(self, advantages: Tensor, all_rewards: Tensor, G: int, step: int) -> bool:
        """`advantages` [N] of a generation batch, from the rewards `all_rewards` [N, R] of groups of `G`."""
        if bool(torch.isfinite(advantages).all()):
            return False
        return self._report(
            "advantages", explain_advantages(advantages, all_rewards, self.reward_weights, self.reward_names, G), step
        )

    def loss(self, loss: Tensor, batch, model: nn.Module, step: int) -> bool:
        """A micro-batch's loss (a `MicroBatch`), non-finite on any process; `model` unwrapped."""
        bad = sum_over_processes(self.accelerator, int(not bool(torch.isfinite(loss).all()))) > 0
        return bad and self._report("loss", explain_loss(loss, batch, model.named_parameters()), step)

    def gradient_norm(self, norm, model: nn.Module, step: int) -> bool:
        """The gradient norm before clipping; `model` unwrapped (its gradients, when no pre-clip norms were kept)."""
        norms, self.pre_clip_norms = self.pre_clip_norms, None
        if bool(torch.isfinite(torch.as_tensor(norm)).all()):
            return False
        norms = norms or [(name, p.grad) for name, p in model.named_parameters()]
        return self._report("gradient norm", explain_gradients(float(norm), norms), step)

    def drop_update(self, model: nn.Module) -> bool:
        """Before the optimizer step: when a value was not finite, clear every gradient (optimizers leave parameters
        without one, and their state, untouched) and count the skipped step."""
        if not self.skip_update:
            return False
        for param in model.parameters():
            param.grad = None
        self.skip_update = False
        self.skipped_steps += 1
        return True

    def _report(self, what: str, cause: str, step: int) -> bool:
        message = f"Non-finite {what} at optimizer step {step}: {cause}"
        if self.on_nonfinite == "raise":
            raise FloatingPointError(
                f"{message} Training stopped before this step updated the weights (on_nonfinite='raise'); "
                "on_nonfinite='skip_step' skips such steps instead."
            )
        logger.warning(f"{message} This optimizer step is skipped (on_nonfinite='skip_step').")
        self.skip_update = True
        return True
