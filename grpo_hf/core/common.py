"""Two helpers every module of `grpo_hf.core` uses: the dtype the maths runs in, and the check of a named choice."""

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; everything else (bf16, fp16, ints) is computed in float32."""
    return torch.promote_types(dtype, torch.float32)


def check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    """Raise ValueError unless `value` is one of `choices`, naming the setting, the value given and the choices.

    The one choice check of the package: the core's functions and `GRPOConfig` (which passes its `Literal` types'
    arguments) both use it, so a bad choice reads the same wherever it is caught."""
    if value not in choices:
        raise ValueError(
            f"{name}={value!r} is not one of the choices: {name} must be one of {', '.join(map(repr, choices))}; "
            f"got {value!r}"
        )
