"""`LossSettings`: every setting of the GRPO loss in one frozen dataclass, checked once when it is built.

The fields are `GRPOConfig`'s (TRL's) names and `grpo_loss`'s keywords, with the same defaults. Building one
raises ValueError for settings that cannot be computed; `warnings()` lists the ones that run but are probably
not what was meant (TRL's warnings about loss types and importance-sampling levels, and more). `GRPOConfig`
builds it once (`GRPOConfig.loss_settings()`) and logs the warnings; the settings form of the loss
(`grpo_loss_with`) then checks nothing per micro-batch.
"""

import inspect
from dataclasses import dataclass, fields
from typing import Any

from grpo_hf.core.common import check_choice

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")  # docs/design.md's four; every loss type: `ALL_LOSS_TYPES`
CLIPPED_LOSS_TYPES = (*LOSS_TYPES, "luspo")  # the PPO-clip surrogate (`losses.LOSS_VARIANTS` pairs them)
ALL_LOSS_TYPES = (*CLIPPED_LOSS_TYPES, "cispo", "sapo", "vespo")  # TRL 1.16's; `tuple(LOSS_VARIANTS)`
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence", "sequence_sum")


@dataclass(frozen=True)
class LossSettings:
    """The settings of `grpo_loss`: which loss, its clip range, KL weight, ratio level and the variants' knobs.

    loss_type: the per-token surrogate and how per-token terms become J (`LOSS_VARIANTS`): "grpo", "bnpo",
        "dr_grpo", "dapo" (docs/design.md), or TRL 1.16's "cispo", "sapo", "luspo", "vespo" (`grpo_hf.core.losses`).
    epsilon, epsilon_high: clip range [1 - epsilon, 1 + epsilon_high]; `epsilon_high` None means `epsilon`
        (`clip_high`). For "cispo", `epsilon_high` is the cap of the importance weight itself (TRL; ScaleRL's eps_max).
    beta: weight of the k3 KL to the reference, >= 0. At 0 the KL is not computed at all.
    importance_sampling_level: "token" (rho per token), "sequence" (GSPO s_i, length-normalised) or
        "sequence_sum" (DeepSeek-V2/V3 joint ratio with a sequence-level KL; needs `loss_type="grpo"`).
    max_completion_length: the `dr_grpo` constant (required for it).
    delta: INTELLECT-2's two-sided clip, the unclipped ratio capped at `delta` (clip family); None: off.
    use_bias_correction_kl: KL -> ratio * KL (DeepSeek-V3.2's unbiased KL; TRL's config default is True).
    off_policy_mask_threshold: DeepSeek-V3.2's off-policy sequence mask: drop the policy term of sequences with
        A < 0 whose mean log(pi_old / pi_theta) exceeds it; None: off.
    sapo_temperature_pos, sapo_temperature_neg: SAPO's gate temperatures for A > 0 and A <= 0.
    vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg: VESPO's kernel for A >= 0 and A < 0.
    """

    loss_type: str = "grpo"
    epsilon: float = 0.2
    epsilon_high: float | None = None
    beta: float = 0.04
    importance_sampling_level: str = "token"
    max_completion_length: int | None = None
    delta: float | None = None
    use_bias_correction_kl: bool = False
    off_policy_mask_threshold: float | None = None
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0

    def __post_init__(self) -> None:
        check_choice("loss_type", self.loss_type, ALL_LOSS_TYPES)
        check_choice("importance_sampling_level", self.importance_sampling_level, IMPORTANCE_SAMPLING_LEVELS)
        for failed, message in self._errors():
            if failed:
                raise ValueError(message)

    @property
    def clip_high(self) -> float:
        """The upper clip range (cispo: the weight's cap): `epsilon_high`, or `epsilon` when it is None."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    @property
    def per_sequence(self) -> bool:
        """One objective l_i per sequence (`importance_sampling_level="sequence_sum"`), J = mean_i l_i."""
        return self.importance_sampling_level == "sequence_sum"

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """The settings' names: `GRPOConfig` fields and `grpo_loss` keywords of the same names."""
        return tuple(f.name for f in fields(cls))

    def _errors(self) -> list[tuple[bool, str]]:
        """(failed, message) for each setting that cannot be computed, in the order they are reported."""
        loss_type, level, eps_high = self.loss_type, self.importance_sampling_level, self.clip_high
        sapo_pos, sapo_neg = self.sapo_temperature_pos, self.sapo_temperature_neg
        return [
            (
                level == "sequence_sum" and loss_type != "grpo",
                f"importance_sampling_level='sequence_sum' has its own per-sequence objective (loss = -mean_i l_i) "
                f"and works only with loss_type='grpo', got loss_type={loss_type!r}",
            ),
            (
                loss_type == "dr_grpo" and self.max_completion_length is None,
                "loss_type='dr_grpo' normalises by N * max_completion_length: pass max_completion_length",
            ),
            (
                loss_type == "sapo" and min(sapo_pos, sapo_neg) <= 0,
                f"sapo_temperature_pos={sapo_pos} and sapo_temperature_neg={sapo_neg} must be > 0: SAPO's gate is "
                "sigmoid(tau (r - 1)) * 4 / tau (the paper uses 1.0 and 1.05)",
            ),
            (
                loss_type == "cispo" and eps_high <= 0,
                f"loss_type='cispo' caps the importance weight at epsilon_high={eps_high}, which must be > 0 "
                "(ScaleRL recommends 5.0)",
            ),
            (self.beta < 0, f"beta={self.beta} must be >= 0 (0 disables the KL term and the reference model)."),
            (self.epsilon < 0, f"epsilon={self.epsilon} must be >= 0."),
            (
                self.epsilon_high is not None and self.epsilon_high < self.epsilon,
                f"epsilon_high={self.epsilon_high} is smaller than epsilon={self.epsilon}; clip-higher needs "
                "epsilon_high >= epsilon. Raise epsilon_high or leave it None to use epsilon.",
            ),
        ]

    def warnings(self) -> list[str]:
        """Messages for settings that run but are probably not what was meant; the caller shows them."""
        return [message for applies, message in self._ratio_advice() + self._knob_advice() if applies]

    def _ratio_advice(self) -> list[tuple[bool, str]]:
        """Importance-sampling levels that do not fit the loss type, and cispo's cap below 1."""
        loss_type, level, eps_high = self.loss_type, self.importance_sampling_level, self.clip_high
        return [
            (
                level == "sequence" and loss_type in ("bnpo", "dr_grpo", "dapo", "cispo"),
                f"importance_sampling_level='sequence' with loss_type={loss_type!r}: this loss sums per-token terms, "
                "so each sequence's ratio counts once per token: it weights each sequence by its completion length, "
                "instead of GSPO's per-sequence objective. For GSPO set loss_type='grpo'.",
            ),
            (
                loss_type == "luspo" and level != "sequence",
                f"loss_type='luspo' is GSPO with each sequence weighted by its length: set importance_sampling_level="
                f"'sequence' as in the LUSPO paper (got {level!r}).",
            ),
            (
                loss_type == "vespo" and level != "token",
                f"loss_type='vespo' computes its own sequence-level weight; importance_sampling_level={level!r} only "
                "changes the ratio of the bias-corrected KL. Use 'token'.",
            ),
            (
                loss_type == "cispo" and 0 < eps_high < 1,
                f"loss_type='cispo' caps the importance weight at epsilon_high={eps_high} itself (not 1 + "
                "epsilon_high): every token's gradient is scaled by at most that. With epsilon_high=None it is "
                "epsilon. Set epsilon_high to the cap you mean (ScaleRL: 5.0).",
            ),
        ]

    def _knob_advice(self) -> list[tuple[bool, str]]:
        """delta outside the clip family or below 1 + epsilon_high, a negative mask threshold, VESPO's lambda."""
        loss_type, delta, eps_high = self.loss_type, self.delta, self.clip_high
        clipped, threshold = loss_type in CLIPPED_LOSS_TYPES, self.off_policy_mask_threshold
        return [
            (
                delta is not None and not clipped,
                f"delta={delta} has no effect with loss_type={loss_type!r}: it caps the ratio of the clipped "
                "objective (grpo, bnpo, dr_grpo, dapo, luspo).",
            ),
            (
                delta is not None and clipped and delta <= 1 + eps_high,
                f"delta={delta} <= 1 + epsilon_high={1 + eps_high}: the two-sided clip then also caps positive-"
                "advantage ratios and no longer bounds negative ones beyond the usual clip. INTELLECT-2 and TRL "
                "recommend delta > 1 + epsilon_high (e.g. 4).",
            ),
            (
                threshold is not None and threshold < 0,
                f"off_policy_mask_threshold={threshold} < 0 drops negative-advantage sequences even on-policy (their "
                "mean log(pi_old / pi_theta) is 0). Use a positive threshold (e.g. 0.5).",
            ),
            (
                loss_type == "vespo" and min(self.vespo_lambda_pos, self.vespo_lambda_neg) <= 0,
                f"vespo_lambda_pos={self.vespo_lambda_pos}, vespo_lambda_neg={self.vespo_lambda_neg}: lambda <= 0 is "
                "raised to 1e-4 (TRL), so the kernel barely decays for large ratios.",
            ),
        ]


def check_loss_settings(**settings: Any) -> list[str]:
    """Raise ValueError for loss settings that cannot be computed; return warnings for ones that run but are
    probably not what was meant. Takes `LossSettings`' fields (`GRPOConfig`'s names, TRL's) as keywords:
    `LossSettings(**settings).warnings()`, for callers that want the verdict without keeping the settings."""
    return LossSettings(**settings).warnings()


_FIELDS = inspect.signature(LossSettings).parameters.values()
check_loss_settings.__signature__ = inspect.Signature(  # what it takes: the settings' fields, keyword-only
    [field.replace(kind=inspect.Parameter.KEYWORD_ONLY) for field in _FIELDS], return_annotation=list[str]
)
