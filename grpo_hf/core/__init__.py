"""The GRPO maths: rewards -> advantages, logits -> log-probabilities and entropy, and the clipped, KL-regularised
loss.

Pure tensor functions: they take tensors, numbers and frozen settings (`LossSettings`, `EntropySettings`,
`SamplingCorrection`), never a config object, and import only torch
(nothing else of grpo_hf: tests/test_layout.py). Tensors are `[N]` (one value per completion) or `[N, T]` (one per
completion token); a group is G = `num_generations` consecutive rows. Names follow docs/design.md ("Names"); the
formulas are its "The maths", and each module maps them to the code that computes them.

- `advantages`: `combine_rewards`, `group_advantages` (DeepSeekMath, Dr. GRPO) and GDPO's `decoupled_advantages`.
- `logits`: `selective_log_softmax`, `entropy_from_logits`, `entropy_with_grad`, chunked over rows.
- `entropy`: `high_entropy_mask`, `entropy_bonus`, `EntropyControl` and its `EntropySettings` (TRL 1.16).
- `settings`: `LossSettings`, every setting of the loss in one frozen dataclass that checks itself once.
- `losses`: `grpo_loss` (keywords) and `grpo_loss_with` (a `LossSettings`), the loss types' surrogates
  (`LOSS_VARIANTS`), the off-policy mask, and the vLLM importance-sampling weights (`SamplingCorrection`).
- `groups`: `prompt_runs`, the runs of rows that share a prompt.

Every name is importable from `grpo_hf.core` itself.
"""

from grpo_hf.core.advantages import (
    SCALE_REWARDS,
    STD_EPS,
    combine_rewards,
    decoupled_advantages,
    group_advantages,
    nan_group_std,
)
from grpo_hf.core.common import check_choice, compute_dtype
from grpo_hf.core.entropy import (
    EntropyControl,
    EntropySettings,
    check_entropy_settings,
    entropy_bonus,
    high_entropy_mask,
)
from grpo_hf.core.groups import prompt_runs
from grpo_hf.core.logits import CHUNK_ELEMENTS, entropy_from_logits, entropy_with_grad, selective_log_softmax
from grpo_hf.core.losses import (
    LOSS_VARIANTS,
    SAMPLING_CORRECTION_MODES,
    LossVariant,
    SamplingCorrection,
    Surrogate,
    grpo_loss,
    grpo_loss_with,
    off_policy_mask,
    sampling_importance_weights,
)
from grpo_hf.core.settings import (
    ALL_LOSS_TYPES,
    CLIPPED_LOSS_TYPES,
    IMPORTANCE_SAMPLING_LEVELS,
    LOSS_TYPES,
    LossSettings,
    check_loss_settings,
)

__all__ = [
    "ALL_LOSS_TYPES",
    "CHUNK_ELEMENTS",
    "CLIPPED_LOSS_TYPES",
    "IMPORTANCE_SAMPLING_LEVELS",
    "LOSS_TYPES",
    "LOSS_VARIANTS",
    "SAMPLING_CORRECTION_MODES",
    "SCALE_REWARDS",
    "STD_EPS",
    "EntropyControl",
    "EntropySettings",
    "LossSettings",
    "LossVariant",
    "SamplingCorrection",
    "Surrogate",
    "check_choice",
    "check_entropy_settings",
    "check_loss_settings",
    "combine_rewards",
    "compute_dtype",
    "decoupled_advantages",
    "entropy_bonus",
    "entropy_from_logits",
    "entropy_with_grad",
    "group_advantages",
    "grpo_loss",
    "grpo_loss_with",
    "high_entropy_mask",
    "nan_group_std",
    "off_policy_mask",
    "prompt_runs",
    "sampling_importance_weights",
    "selective_log_softmax",
]
