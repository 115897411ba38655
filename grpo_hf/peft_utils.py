"""The one answer to "is this a PEFT model, and which model is under it?", for every module that asks.

A leaf module: it imports nothing of grpo_hf, so any layer may use it (`logprobs`, `rollout`, `validation`,
`models`). `peft` is imported when first asked, and its absence means "not a PEFT model": grpo_hf stays
importable without it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch

__all__ = [
    "REFERENCE_ADAPTER",
    "active_adapters",
    "add_reference_adapter",
    "base_model",
    "can_add_reference_adapter",
    "is_peft_model",
    "merged_lora_weight",
    "reference_adapter",
]

logger = logging.getLogger(__name__)

REFERENCE_ADAPTER = "ref"  # TRL's name for the frozen copy of a given adapter


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


def active_adapters(model: Any) -> list[str]:
    """The active adapters of a PEFT model or of one of its adapted layers (PEFT keeps one name or a list)."""
    active = model.active_adapter
    return [active] if isinstance(active, str) else list(active)


@torch.no_grad()
def merged_lora_weight(
    layer: Any, adapters: list[str], weight: torch.Tensor | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """W + the sum over `adapters` of the LoRA layer's deltas (PEFT's `get_delta_weight`: scale * B A, in W's layout,
    fan_in_fan_out included), added in float32 (or W's dtype, if wider) and rounded once to W's dtype. `weight`: the
    W to start from (default: the layer's base weight; a gathered copy of a sharded one). Written into `out` (W's
    shape and dtype) when given, else returned as a new tensor. Neither the layer nor W is changed (PEFT's
    `merge_adapter` adds into W, and a bf16 merge-unmerge round trip loses the low bits of W)."""
    weight = layer.get_base_layer().weight if weight is None else weight
    total = weight.detach().to(torch.promote_types(weight.dtype, torch.float32), copy=True)  # W's shape
    with torch.autocast(weight.device.type, enabled=False):  # B A in the adapters' dtype, also under a bf16 autocast
        for adapter in adapters:
            total += layer.get_delta_weight(adapter).to(total.dtype)
    return total.to(weight.dtype) if out is None else out.copy_(total)


def can_add_reference_adapter(model: Any) -> bool:
    """Whether the PeftModel `model` can hold a second adapter beside its active one. TRL's rule: PEFT 0.17 to 0.19
    take a single adapter where the LoRA config uses `target_parameters` (MoE experts; peft#3340, fixed in 0.20)."""
    import peft
    from packaging.version import Version

    config = model.peft_config[active_adapters(model)[0]]
    one_only = Version("0.17.0") <= Version(peft.__version__) < Version("0.20.0")
    return not (one_only and getattr(config, "target_parameters", None))


def add_reference_adapter(model: Any) -> None:
    """Copy the active adapter of the PeftModel `model` into a second adapter, `REFERENCE_ADAPTER`, frozen: the
    reference of a run that starts from a trained adapter is that adapter, not the base model (TRL does the same).
    The active adapter stays the trained one. Where PEFT cannot hold the copy (`can_add_reference_adapter`), TRL's
    fallback, with a warning: no copy, the reference is the model with its adapters off (`reference_adapter`)."""
    from peft import __version__, get_peft_model_state_dict, set_peft_model_state_dict

    if not can_add_reference_adapter(model):
        logger.warning(
            "PEFT %s takes one adapter only where the LoRA config uses `target_parameters` (peft#3340), so the "
            "reference is the base model (adapters disabled), not a frozen copy of the given adapter: the same only "
            "while that adapter is freshly initialised. Upgrade to peft>=0.20.0 to train against a copy of the "
            "adapter, or pass the base model with a peft_config.",
            __version__,
        )
        return

    active = model.active_adapter
    model.add_adapter(REFERENCE_ADAPTER, model.peft_config[active])
    set_peft_model_state_dict(model, get_peft_model_state_dict(model, adapter_name=active), REFERENCE_ADAPTER)
    for name, param in model.named_parameters():
        if f".{REFERENCE_ADAPTER}." in name:
            param.requires_grad_(False)


@contextlib.contextmanager
def reference_adapter(model: Any) -> Iterator[None]:
    """The PeftModel `model` as the reference, for the duration: its `REFERENCE_ADAPTER` when it has one (a given
    adapter, `add_reference_adapter`), else with its adapters off (a new adapter starts as the base model). The
    trained adapter is active, and trainable, again afterwards."""
    if REFERENCE_ADAPTER not in model.peft_config:
        with model.disable_adapter():
            yield
        return
    active = model.active_adapter
    model.set_adapter(REFERENCE_ADAPTER, inference_mode=True)
    try:
        yield
    finally:
        model.set_adapter(active)
