"""What training changes in a built model's heads: the LM head computes in float32; the MoE router's loss weight.

- `cast_lm_head_to_fp32` (`GRPOConfig.cast_lm_head_to_fp32`): the LM head becomes an `FP32LMHead`, which keeps its
  weights in float32 and computes the logits in float32 outside autocast (ScaleRL, arXiv:2510.13786).
- `router_aux_loss_coef`: the weight of a Mixture-of-Experts model's load-balancing loss in the training loss, by
  TRL's rule.
"""

from __future__ import annotations

import sys

import torch

from grpo_hf.peft_utils import base_model


class FP32LMHead(torch.nn.Linear):
    """An LM head (`nn.Linear`) with float32 weights whose logits are computed in float32, outside autocast:
    `cast_lm_head_to_fp32` (ScaleRL, arXiv:2510.13786). The hidden states are upcast; the weights are fp32 already."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        with torch.autocast(hidden_states.device.type, enabled=False):
            bias = None if self.bias is None else self.bias.float()
            return torch.nn.functional.linear(hidden_states.float(), self.weight.float(), bias)


def cast_lm_head_to_fp32(model: torch.nn.Module) -> None:
    """Make the LM head of `model` (a causal LM, or a PeftModel of one) an `FP32LMHead`, in place: its weights
    become float32 (the same Parameter objects) and it computes the logits in float32 outside autocast. With tied
    embeddings the shared matrix becomes float32 too, and the embedding's output is cast back to the dtype it had,
    so the decoder layers run as before. Refused when a PEFT adapter wraps the LM head (TRL refuses it too)."""
    base = base_model(model)
    head = base.get_output_embeddings()
    if isinstance(head, FP32LMHead):
        return
    if type(head) is not torch.nn.Linear:
        raise ValueError(
            f"cast_lm_head_to_fp32=True needs the LM head to be a torch.nn.Linear, but it is a {type(head).__name__} "
            "(e.g. a PEFT adapter on `lm_head`: remove it from the adapter's target_modules), or set "
            "cast_lm_head_to_fp32=False."
        )
    dtype = head.weight.dtype
    embeddings = base.get_input_embeddings()
    tied = embeddings is not None and embeddings.weight is head.weight
    head.float()
    head.__class__ = FP32LMHead
    if tied and dtype != torch.float32:
        embeddings.register_forward_hook(lambda module, args, output: output.to(dtype))


def router_aux_loss_coef(model: torch.nn.Module, coef: float | None) -> float:
    """The weight of the MoE load-balancing loss in the training loss (`router_aux_loss_coef`, TRL's rule): for a
    model whose config has `output_router_logits` (a Mixture-of-Experts model that can return its router logits),
    `coef`, or the config's own `router_aux_loss_coef` (0 if none) when `coef` is None; 0 for other models, for
    which a non-zero `coef` is an error, as it is for an MoE model whose forward computes no such loss (DeepSeek-V3;
    its config's own weight then counts as 0)."""
    config = base_model(model).config.get_text_config()
    is_moe = hasattr(config, "output_router_logits")
    if coef is not None and coef != 0.0 and not is_moe:
        raise ValueError(
            f"router_aux_loss_coef={coef} but {type(model).__name__} is not a Mixture-of-Experts model that returns "
            "its router logits (its config has no `output_router_logits`), so there is no auxiliary loss to weight. "
            "Leave router_aux_loss_coef=None (or 0.0)."
        )
    if not is_moe:
        return 0.0
    weight = float((getattr(config, "router_aux_loss_coef", None) or 0.0) if coef is None else coef)
    if weight != 0.0 and not has_load_balancing_loss(model):
        if coef is None:  # the config's own weight, for a loss its forward does not compute: nothing to add
            return 0.0
        raise ValueError(
            f"router_aux_loss_coef={coef}, but {type(base_model(model)).__name__} computes no load-balancing loss "
            "(its modeling module has no `load_balancing_loss_func`: DeepSeek-V3 balances its experts with a bias, "
            "without an auxiliary loss), so there is none to weight. Leave router_aux_loss_coef=None (or 0.0)."
        )
    return weight


def has_load_balancing_loss(model: torch.nn.Module) -> bool:
    """Whether `model`'s forward can return an MoE load-balancing loss: its modeling module defines transformers'
    `load_balancing_loss_func` (every MoE family with an auxiliary loss does; DeepSeek-V3's does not)."""
    module = sys.modules.get(type(base_model(model)).__module__)
    return getattr(module, "load_balancing_loss_func", None) is not None
