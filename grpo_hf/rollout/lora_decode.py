"""LoRA decoding on merged copies: while an engine samples, each LoRA `Linear` runs one matmul, `F.linear(x, W', b)`.

PEFT's LoRA `Linear` runs the base matmul, then dropout, A, B, the scale and the add (and dtype casts): several more
kernels per adapted layer and token, which on a GPU made a LoRA step 1.28x a full step (docs/benchmarks.md). Here
each adapted layer gets a copy W' = W + sum over its active adapters of scale * B A (`peft_utils.merged_lora_weight`),
in W's dtype, and `LoraDecode.applied()` makes the layers compute `F.linear(x, W', bias)` for the duration of a
rollout; outside it (log-probs, the loss) PEFT's own forward runs, unmerged. The base weights are never written (no
`merge_adapter`/`unmerge_adapter`: a bf16 round trip loses the low bits of W). Memory: one copy of the adapted
layers' weights.

The copies are refreshed lazily: `mark_stale()` after each optimizer step, and the next `applied()` recomputes them
once, in place (`copy_` into the same storage), so that a captured CUDA graph, which keeps their addresses
(`cuda_graph`), replays with the new values. They are marked static for torch.compile (no copy into the graph's own
buffers per replay), and each layer's decoding forward is made once, so a compiled step sees the same function
every rollout and does not recompile.

What keeps PEFT's path: a layer that is not a LoRA `Linear` on a plain `nn.Linear` with floating-point, unsharded
weights (LoRA `Embedding`/`Conv`, bitsandbytes and other quantized layers, a `Conv1D` base), DoRA and other LoRA
variants, adapters with a bias (`lora_bias`), a layer whose forward accelerate already replaced (offloading); the
whole model under FSDP or ZeRO-3 (its weights are gathered anew for each rollout), as a `PeftMixedModel`, or with
`merge_lora_for_generation=False`. A layer whose adapters were switched since the copies were made (disabled, merged
into W, another set active) runs PEFT's forward for that rollout. `LoraDecode.build` says which and why, for the log.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from grpo_hf.peft_utils import active_adapters, base_model, merged_lora_weight

_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}


@dataclass
class _MergedLayer:
    """One adapted layer's merged copy and the forward that reads it."""

    layer: nn.Module  # PEFT's LoRA `Linear`
    adapters: tuple[str, ...]  # the adapters merged into `weight`
    weight: torch.Tensor  # [out, in] W + their deltas, in W's dtype
    forward: Callable[..., torch.Tensor]  # F.linear(x, weight, the base layer's bias)


class LoraDecode:
    """Merged copies of a PEFT model's LoRA `Linear` weights, used while sampling (see the module docstring)."""

    def __init__(self, layers: list[_MergedLayer]):
        self.layers = layers
        self.stale = True  # the copies do not hold the current weights yet

    @classmethod
    def build(cls, model: nn.Module, *, enabled: bool = True, sharded: bool = False) -> tuple[LoraDecode | None, str]:
        """The merged copies for `model` (allocated, not yet filled), and one line for the log saying what decodes
        through them and what keeps PEFT's layers, and why; None and the reason when nothing does. `model`: a PEFT
        model (`peft_utils.is_peft_model`). `sharded`: FSDP or ZeRO-3."""
        reason = _model_reason(model, enabled, sharded)
        if reason is not None:
            return None, f"LoRA decode: PEFT's layers ({reason})"
        adapters = set(active_adapters(model))
        merged, kept = [], Counter()
        for layer in _lora_layers(model):
            names = _adapters_of(layer, adapters)
            if not names:
                continue
            reason = _layer_reason(layer, names)
            if reason is not None:
                kept[reason] += 1
            else:
                merged.append(_merged_layer(layer, names))
        if not merged:
            reasons = "; ".join(f"{n} layer{'s' * (n > 1)}: {r}" for r, n in kept.items()) if len(kept) > 1 else None
            return None, f"LoRA decode: PEFT's layers ({reasons or next(iter(kept), 'no adapted layer')})"
        decode = cls(merged)
        return decode, decode._summary(kept)

    def mark_stale(self) -> None:
        """The policy's weights changed (an optimizer step): the next `applied()` refreshes the copies first."""
        self.stale = True

    @torch.no_grad()
    def refresh(self) -> None:
        """Recompute the copies, in place, if stale."""
        if not self.stale:
            return
        for merged in self.layers:
            weight = merged.layer.base_layer.weight
            if (merged.weight.device, merged.weight.dtype) != (weight.device, weight.dtype):  # the model was moved
                merged.weight = _static_copy(weight)
                merged.forward = _linear_forward(merged.layer.base_layer, merged.weight)
            merged_lora_weight(merged.layer, list(merged.adapters), out=merged.weight)
        self.stale = False

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """Within: the merged layers compute `F.linear(x, W', bias)` with their copies (refreshed first if stale);
        PEFT's forward again afterwards. A layer whose active adapters are not the merged ones now keeps PEFT's."""
        self.refresh()
        switched = []
        try:
            for merged in self.layers:
                if _as_merged(merged):
                    merged.layer.forward = merged.forward  # an instance attribute: `nn.Module.__call__` finds it first
                    switched.append(merged.layer)
            yield
        finally:
            for layer in switched:
                del layer.forward

    @property
    def nbytes(self) -> int:
        """The memory the copies take."""
        return sum(merged.weight.numel() * merged.weight.element_size() for merged in self.layers)

    def _summary(self, kept: Counter) -> str:
        dtypes = "/".join(sorted({_DTYPE_NAMES.get(m.weight.dtype, str(m.weight.dtype)) for m in self.layers}))
        line = (
            f"LoRA decode: {len(self.layers)} adapted Linear layers merged into {dtypes} copies "
            f"({_size(self.nbytes)}), refreshed after each optimizer step"
        )
        if kept:
            line += "; PEFT's layers for " + "; ".join(f"{n} other{'s' * (n > 1)} ({r})" for r, n in kept.items())
        return line


def _model_reason(model: nn.Module, enabled: bool, sharded: bool) -> str | None:
    """Why the whole model keeps PEFT's layers, or None."""
    if not enabled:
        return "merge_lora_for_generation=False"
    if sharded:
        return "the weights are sharded (FSDP / ZeRO-3) and gathered anew for each rollout"
    from peft import PeftMixedModel

    if isinstance(model, PeftMixedModel):
        return "a PeftMixedModel: adapters of several kinds mixed"
    return None


def _lora_layers(model: nn.Module) -> Iterator[nn.Module]:
    from peft.tuners.lora import LoraLayer

    return (module for module in base_model(model).modules() if isinstance(module, LoraLayer))


def _adapters_of(layer: nn.Module, adapters: set[str]) -> tuple[str, ...]:
    """The adapters of `adapters` that `layer` has, in the layer's order."""
    return tuple(name for name in layer.r if name in adapters)


def _as_merged(merged: _MergedLayer) -> bool:
    """The layer still runs the adapters its copy holds (not disabled, not merged into W, the same ones active), and
    its forward is PEFT's (not switched already: `applied()` within `applied()`)."""
    layer = merged.layer
    unchanged = _adapters_of(layer, set(layer.active_adapters)) == merged.adapters
    return unchanged and not layer.disable_adapters and not layer.merged and "forward" not in vars(layer)


def _layer_reason(layer: nn.Module, adapters: tuple[str, ...]) -> str | None:
    """Why `layer` keeps PEFT's forward, or None: it can decode with a merged copy of its weight."""
    from peft.tuners.lora import Linear

    if type(layer) is not Linear:  # Embedding, Conv, bitsandbytes and the other quantized layers
        return f"{type(layer).__name__} layers: only LoRA Linear layers are merged"
    base = layer.base_layer
    if type(base) is not nn.Linear:
        return f"a {type(base).__name__} base layer: only a plain nn.Linear is merged"
    weight = base.weight
    if not weight.is_floating_point() or weight.device.type == "meta" or hasattr(weight, "full_tensor"):
        return "quantized, offloaded or sharded base weights"
    if hasattr(weight, "ds_id"):
        return "DeepSpeed ZeRO-3 parameters"
    if "forward" in vars(layer) or hasattr(base, "_hf_hook"):
        return "accelerate's hooks replace the layer's forward"
    for adapter in adapters:
        if adapter in layer.lora_variant or layer.use_dora.get(adapter):
            kind = "DoRA" if layer.use_dora.get(adapter) else type(layer.lora_variant[adapter]).__name__
            return f"{kind} adapters cannot be merged into a copy"
        if layer.lora_bias.get(adapter):
            return "adapters with a bias (lora_bias) are not merged"
    return None


def _merged_layer(layer: nn.Module, adapters: tuple[str, ...]) -> _MergedLayer:
    weight = _static_copy(layer.base_layer.weight)
    return _MergedLayer(layer, adapters, weight, _linear_forward(layer.base_layer, weight))


def _static_copy(weight: torch.Tensor) -> torch.Tensor:
    """Uninitialised storage like `weight`, at an address torch.compile's CUDA graphs keep (not copied per replay)."""
    copy = torch.empty_like(weight, requires_grad=False)
    torch._dynamo.mark_static_address(copy)
    return copy


def _linear_forward(base: nn.Linear, weight: torch.Tensor) -> Callable[..., torch.Tensor]:
    """The forward of an adapted layer while sampling: its base layer's, with the merged weight."""

    def forward(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return F.linear(x, weight, base.bias)

    return forward


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:,.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.1f} KiB"
