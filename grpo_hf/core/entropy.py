"""Entropy terms of TRL 1.16: the high-entropy token mask, the entropy bonus and its adaptive coefficient.

Pure tensor functions and one small state object (torch only): "Beyond the 80/20 rule" (Wang et al. 2025,
arXiv:2506.01939) chooses the tokens whose policy term is trained; the bonus subtracts coef x the mean entropy;
Skywork-OR1 (He et al. 2025, arXiv:2505.22312) adapts coef once per optimizer step. `[N, T]` is one value per
completion token. The entropy itself comes from `grpo_hf.core.logits`.
"""

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor


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


@dataclass(frozen=True)
class EntropySettings:
    """The entropy terms' settings (`GRPOConfig`'s names, TRL's), checked when built: the high-entropy token mask's
    `top_entropy_quantile` and the bonus's coefficient, fixed or adaptive (`EntropyControl` runs it). Building one
    raises ValueError for settings that cannot run; `warnings()` lists the ones that probably mislead."""

    top_entropy_quantile: float = 1.0
    importance_sampling_level: str = "token"
    entropy_coef: float = 0.0
    use_adaptive_entropy: bool = False
    entropy_coef_min: float = 0.0
    entropy_coef_max: float = 1.0
    entropy_coef_delta: float = 0.005
    entropy_target: float = 0.2

    def __post_init__(self) -> None:
        for failed, message in self._errors():
            if failed:
                raise ValueError(message)

    @property
    def masks_tokens(self) -> bool:
        """Whether the policy term is trained on the high-entropy tokens only (`top_entropy_quantile` < 1)."""
        return self.top_entropy_quantile < 1.0

    def _errors(self) -> list[tuple[bool, str]]:
        quantile, coef_min, coef_max = self.top_entropy_quantile, self.entropy_coef_min, self.entropy_coef_max
        numbers = (quantile, self.entropy_coef, coef_min, coef_max, self.entropy_coef_delta)
        return [
            (
                not all(math.isfinite(value) for value in numbers) or math.isnan(self.entropy_target),
                "top_entropy_quantile, entropy_coef, entropy_coef_min, entropy_coef_max, entropy_coef_delta must be "
                f"finite and entropy_target a number, got {(*numbers, self.entropy_target)}",
            ),
            (
                not 0.0 <= quantile <= 1.0,
                f"top_entropy_quantile={quantile} must be in [0, 1]: the fraction of completion tokens, by "
                "entropy, whose policy term is trained (1.0: all; the paper uses 0.2)",
            ),
            (
                quantile < 1.0 and self.importance_sampling_level == "sequence_sum",
                "top_entropy_quantile < 1 masks tokens, but importance_sampling_level='sequence_sum' has one policy "
                "term per sequence: use 'token' or 'sequence', or top_entropy_quantile=1.0",
            ),
            (coef_min > coef_max, f"entropy_coef_min={coef_min} > entropy_coef_max={coef_max}: swap them"),
            (
                self.entropy_coef_delta < 0,
                f"entropy_coef_delta={self.entropy_coef_delta} must be >= 0 (the coefficient's step)",
            ),
        ]

    def warnings(self) -> list[str]:
        """Messages for settings that run but probably mislead; the caller shows them."""
        adaptive, coef, target = self.use_adaptive_entropy, self.entropy_coef, self.entropy_target
        low, high = self.entropy_coef_min, self.entropy_coef_max
        advice = [
            (
                adaptive and not low <= coef <= high,
                f"use_adaptive_entropy=True starts from entropy_coef={coef}, outside [entropy_coef_min, "
                f"entropy_coef_max] = [{low}, {high}]: the first update clamps it into range.",
            ),
            (
                adaptive and target <= 0,
                f"entropy_target={target} <= 0: the mean entropy is never below it, so the adaptive bonus never "
                "applies. Set it near the `entropy` you observe early in training.",
            ),
            (
                not adaptive and coef < 0,
                f"entropy_coef={coef} < 0 penalises entropy (the loss grows with it): the bonus needs > 0.",
            ),
        ]
        return [message for applies, message in advice if applies]


@dataclass
class EntropyControl:
    """The coefficient c of `entropy_bonus` during a run: `settings.entropy_coef` as given, or adapted once per
    optimizer step (Skywork-OR1, He et al. 2025, arXiv:2505.22312, as TRL 1.16 runs it) when
    `settings.use_adaptive_entropy`.

    Adaptive: after each optimizer step, with H_w the entropy of its whole accumulation window (token mean over the
    policy-term tokens of every micro-batch on every process: `accumulate`, then `step` with the summed totals),
        c <- min(c + entropy_coef_delta, entropy_coef_max)   if H_w <= entropy_target
        c <- max(c - entropy_coef_delta, entropy_coef_min)   otherwise
    and the next step's bonus uses `applied` = c if H_w <= entropy_target else 0; before the first measurement H_w
    is +inf, so the first step has no bonus. `entropy_coef` is the current c (it starts at the settings').
    """

    settings: EntropySettings = field(default_factory=lambda: EntropySettings())
    entropy_coef: float | None = None  # c; None: the settings' entropy_coef
    last_entropy: float = math.inf  # H_w of the last optimizer step
    window: Tensor | None = None  # [2]: sum m H and sum m of this accumulation window so far (this process)

    def __post_init__(self) -> None:
        if self.entropy_coef is None:
            self.entropy_coef = self.settings.entropy_coef

    @property
    def adaptive(self) -> bool:
        return self.settings.use_adaptive_entropy

    @property
    def enabled(self) -> bool:
        """Whether the loss has an entropy term at all (TRL: a non-zero coefficient, or adaptive control)."""
        return self.entropy_coef != 0 or self.adaptive

    @property
    def applied(self) -> float:
        """The coefficient of this step's bonus."""
        if self.adaptive and not self.last_entropy <= self.settings.entropy_target:
            return 0.0
        return self.entropy_coef

    def accumulate(self, entropy: Tensor, mask: Tensor) -> None:
        """Add one micro-batch's entropy `[N, T]` over its policy-term tokens `mask` to the window (no gradient)."""
        mask = mask.to(entropy.dtype)
        totals = torch.stack([(entropy.detach() * mask).sum(), mask.sum()])  # [2]
        self.window = totals if self.window is None else self.window + totals

    def step(self, totals: Tensor) -> None:
        """End of an optimizer step: `totals` = `window` summed over the processes -> H_w; update c; clear `window`."""
        settings = self.settings
        self.last_entropy = (totals[0] / totals[1].clamp(min=1)).item()
        if self.last_entropy <= settings.entropy_target:
            self.entropy_coef = min(self.entropy_coef + settings.entropy_coef_delta, settings.entropy_coef_max)
        else:
            self.entropy_coef = max(self.entropy_coef - settings.entropy_coef_delta, settings.entropy_coef_min)
        self.window = None

    def state(self) -> dict[str, float]:
        return {"entropy_coef": self.entropy_coef, "last_entropy": self.last_entropy}

    def load_state(self, state: dict[str, float] | None) -> None:
        """Restore `state()` of a checkpoint (adaptive control only; a checkpoint without it: keep)."""
        if state is not None and self.adaptive:
            self.entropy_coef, self.last_entropy = state["entropy_coef"], state["last_entropy"]


def check_entropy_settings(**settings) -> list[str]:
    """Raise ValueError for entropy settings that cannot run; return warnings for ones that probably mislead.
    Takes `EntropySettings`' fields (`GRPOConfig`'s names, TRL's): `EntropySettings(**settings).warnings()`."""
    return EntropySettings(**settings).warnings()
