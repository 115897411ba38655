"""The policy's weights as vLLM loads them: checkpoint names, one tensor at a time, LoRA deltas merged in.

Both vLLM modes push these: colocate mode (`vllm_engine`) in memory, server mode (`vllm_server`) over the wire.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from grpo_hf.peft_utils import active_adapters, merged_lora_weight


def named_weights(model) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's weights under their checkpoint names, one tensor at a time (never a second full copy).

    Tied weights come under each of their names: vLLM's in-place reload re-creates its parameters layer by layer, which
    unties its lm_head from the embeddings (a push without `lm_head.weight` leaves it random). A PEFT model yields its
    base weights with the active adapters' LoRA deltas merged in (W + scale B A, `peft_utils.merged_lora_weight`),
    computed per layer; the model itself stays unmerged.
    A sharded parameter (FSDP2's DTensor) is gathered one at a time.
    """
    if hasattr(model, "peft_config"):
        yield from _merged_lora_weights(model)
        return
    for name, param in model.named_parameters(remove_duplicate=False):  # tied weights under each name (lm_head)
        yield name, _full(param)


def _merged_lora_weights(model) -> Iterator[tuple[str, torch.Tensor]]:
    from peft.tuners.lora import LoraLayer

    adapters = active_adapters(model)
    base = model.get_base_model()
    layers = {}  # base weight's name -> (its LoRA layer, the layer's active adapters)
    for module_name, module in base.named_modules():
        if isinstance(module, LoraLayer) and (merged := [a for a in adapters if a in module.lora_A]):
            layers[f"{module_name}.base_layer.weight"] = module, merged
    for name, param in base.named_parameters(remove_duplicate=False):
        if "lora_" in name or ".original_module." in name:
            continue
        weight = _full(param)
        if name in layers:
            weight = merged_lora_weight(*layers[name], weight=weight)
        yield name.replace(".base_layer.", ".").replace(f".modules_to_save.{adapters[0]}.", "."), weight


def _full(param: torch.Tensor) -> torch.Tensor:
    return param.full_tensor().detach() if hasattr(param, "full_tensor") else param.detach()
