"""The one answer to "is this a PEFT model, and which model is under it?", for every module that asks.

A leaf module: it imports nothing of grpo_hf, so any layer may use it (`logprobs`, `rollout`, `validation`,
`models`). `peft` is imported when first asked, and its absence means "not a PEFT model": grpo_hf stays
importable without it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["base_model", "is_peft_model"]


def _peft_classes() -> tuple[type, ...]:
    try:
        from peft import PeftMixedModel, PeftModel
    except ImportError:  # peft is a dependency, but keep grpo_hf importable without it
        return ()
    return PeftModel, PeftMixedModel


def is_peft_model(model: Any) -> bool:
    """True when `model` is a PEFT wrapper (`peft.PeftModel` or `peft.PeftMixedModel`) around a transformers model."""
    classes = _peft_classes()
    return bool(classes) and isinstance(model, classes)


def base_model(model: Any) -> Any:
    """The transformers model under a PEFT wrapper (its LoRA layers live inside it), or `model` itself."""
    return model.get_base_model() if is_peft_model(model) else model
