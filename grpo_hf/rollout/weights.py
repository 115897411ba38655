"""The policy's weights as vLLM loads them: checkpoint names, gathered a bucket at a time, LoRA deltas merged in.

Both vLLM modes push these: colocate mode (`vllm_engine`) in memory, server mode (`vllm_server`) over the wire.

`weight_buckets(model, bucket_bytes)` is the one walk. It plans the model's outputs first (`_plan`: one `_Item` per
weight vLLM loads: its names, tied weights under each; the parameters it is made of: a LoRA layer's base weight with
its adapters' A and B), packs consecutive items into buckets of at most `bucket_bytes` of full weights (an item larger
than the bound is a bucket alone), then gathers one bucket at a time and yields it:

| layout  | a bucket's parameters are                                   | released                                 |
|---------|-------------------------------------------------------------|------------------------------------------|
| DDP     | the parameters themselves (views, no copy)                  | nothing to release                       |
| FSDP2   | each DTensor's `full_tensor()` (an all-gather per parameter) | when the consumer drops the bucket       |
| ZeRO-3  | DeepSpeed's `GatheredParameters` of the bucket, in place    | when the consumer asks for the next one  |

So a process holds at most one bucket of gathered weights (plus what the consumer keeps of it), never the model.
Every process must walk the buckets, in the same order, since the gathers are collectives; the consumer decides who
sends (process 0, or every process where a transport shards). A yielded tensor is valid until the next bucket is
asked for: a consumer that keeps one must copy it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from grpo_hf.peft_utils import active_adapters, merged_lora_weight

BUCKET_BYTES = 1 << 30
"""Full weights gathered at once by default (1 GiB: a 7B model in bf16 is ~15 buckets)."""

Bucket = list[tuple[str, torch.Tensor]]


@dataclass
class _Item:
    """One weight vLLM loads: its checkpoint `names` (tied weights: several), the `param` it is, or for a LoRA layer
    the base weight `param` with the `layer` and `adapters` whose deltas are merged into it."""

    names: list[str]
    param: torch.Tensor
    layer: object = None
    adapters: list[str] = field(default_factory=list)

    def sources(self) -> list[torch.Tensor]:
        """The parameters to gather for it: the weight, and a LoRA layer's A and B of each adapter."""
        extra = [m[a].weight for a in self.adapters for m in (self.layer.lora_A, self.layer.lora_B)]
        return [self.param, *extra]

    def nbytes(self) -> int:
        """Bytes it holds gathered: its full sources, and a LoRA layer's merged copy of the weight."""
        merged = full_numel(self.param) * self.param.element_size() if self.layer is not None else 0
        return merged + sum(full_numel(p) * p.element_size() for p in self.sources())


def named_weights(
    model, bucket_bytes: int = BUCKET_BYTES, merge_lora: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's weights under their checkpoint names, gathered a bucket at a time (`weight_buckets`)."""
    for bucket in weight_buckets(model, bucket_bytes, merge_lora):
        yield from bucket


def weight_shapes(model, merge_lora: bool = True) -> list[tuple[str, torch.dtype, tuple[int, ...], bool]]:
    """(checkpoint name, dtype, full shape, tied) of each weight `weight_buckets` yields, in its order, without
    gathering anything: a DTensor's shape is its full one, a ZeRO-3 parameter keeps it as `ds_shape`. `tied`: a
    second name of one weight (a tied lm_head), which a checkpoint may leave out."""
    rows = []
    for item in _plan(model, merge_lora):
        shape = tuple(getattr(item.param, "ds_shape", item.param.shape))
        rows.extend((name, item.param.dtype, shape, index > 0) for index, name in enumerate(item.names))
    return rows


def weight_buckets(model, bucket_bytes: int = BUCKET_BYTES, merge_lora: bool = True) -> Iterator[Bucket]:
    """The model's weights as lists of (checkpoint name, full tensor), gathered one bucket at a time: at most
    `bucket_bytes` gathered at once (a LoRA layer's A and B and its merged copy counted; a weight larger than that
    alone) (see the module docstring). Every process must walk them.

    Tied weights come under each of their names: vLLM's in-place reload re-creates its parameters layer by layer, which
    unties its lm_head from the embeddings (a push without `lm_head.weight` leaves it random). A PEFT model yields its
    base weights with the active adapters' LoRA deltas merged in (W + scale B A, `peft_utils.merged_lora_weight`); the
    model itself stays unmerged. `merge_lora=False`: its base weights as they are (a server that applies the adapter
    itself, `lora_push`).
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be > 0: the bytes of full weights gathered at once.")
    for items in _packed(_plan(model, merge_lora), bucket_bytes):
        with _gathered(items) as full:
            bucket = []
            for item in items:
                weight = full[id(item.param)]
                if item.layer is not None:
                    with _swapped(item, full):
                        weight = merged_lora_weight(item.layer, item.adapters, weight=weight)
                bucket.extend((name, weight) for name in item.names)
            yield bucket
            del bucket, full


def _plan(model, merge_lora: bool) -> list[_Item]:
    """The weights vLLM loads, in the model's order: one item per parameter, its tied names with it."""
    if hasattr(model, "peft_config"):
        return _lora_plan(model, merge_lora)
    items: dict[int, _Item] = {}
    for name, param in model.named_parameters(remove_duplicate=False):  # tied weights under each name (lm_head)
        items.setdefault(id(param), _Item([], param)).names.append(name)
    return list(items.values())


def _lora_plan(model, merge: bool) -> list[_Item]:
    from peft.tuners.lora import LoraLayer

    adapters = active_adapters(model)
    base = model.get_base_model()
    layers = {}  # base weight's name -> (its LoRA layer, the layer's active adapters)
    for module_name, module in base.named_modules() if merge else ():
        if isinstance(module, LoraLayer) and (merged := [a for a in adapters if a in module.lora_A]):
            layers[f"{module_name}.base_layer.weight"] = module, merged
    items: dict[int, _Item] = {}
    for name, param in base.named_parameters(remove_duplicate=False):
        if "lora_" in name or ".original_module." in name:
            continue
        item = items.setdefault(id(param), _Item([], param, *layers.get(name, (None, []))))
        item.names.append(name.replace(".base_layer.", ".").replace(f".modules_to_save.{adapters[0]}.", "."))
    return list(items.values())


def _packed(items: list[_Item], bucket_bytes: int) -> Iterator[list[_Item]]:
    """Consecutive items in groups of at most `bucket_bytes` (an item over the bound alone)."""
    group, size = [], 0
    for item in items:
        if group and size + item.nbytes() > bucket_bytes:
            yield group
            group, size = [], 0
        group.append(item)
        size += item.nbytes()
    if group:
        yield group


def _gathered(items: list[_Item]):
    """id(parameter) -> its full tensor, for every source of `items`, for the duration of the block."""
    return gathered(list({id(p): p for item in items for p in item.sources()}.values()))


@contextlib.contextmanager
def gathered(params: list[torch.Tensor]) -> Iterator[dict[int, torch.Tensor]]:
    """id(parameter) -> its full tensor (detached), for each of `params`, for the duration of the block: a DTensor's
    `full_tensor()`, a ZeRO-3 parameter gathered in place, any other as it is. Collective where the parameters are
    sharded: every process calls it with the same parameters."""
    partitioned = [p for p in params if hasattr(p, "ds_id")]  # DeepSpeed ZeRO-3: gathered in place
    with _zero3_gathered(partitioned):
        yield {id(p): (p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for p in params}


def _zero3_gathered(params: list[torch.Tensor]):
    if not params:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)


@contextlib.contextmanager
def _swapped(item: _Item, full: dict[int, torch.Tensor]):
    """The LoRA layer's A and B modules hold their full tensors (gathered DTensors) for the block, so that PEFT's own
    `get_delta_weight` computes the delta; the sharded parameters are put back at its end."""
    modules = [m[a] for a in item.adapters for m in (item.layer.lora_A, item.layer.lora_B)]
    saved = [module._parameters["weight"] for module in modules]
    try:
        for module, param in zip(modules, saved, strict=True):
            if hasattr(param, "full_tensor"):  # ZeRO-3's and plain parameters hold their full tensors already
                module._parameters["weight"] = torch.nn.Parameter(full[id(param)], requires_grad=False)
        yield
    finally:
        for module, param in zip(modules, saved, strict=True):
            module._parameters["weight"] = param


def full_numel(param: torch.Tensor) -> int:
    """Elements of the full parameter: a DTensor's shape is its full one; a ZeRO-3 parameter keeps it as `ds_shape`."""
    return int(param.ds_numel) if hasattr(param, "ds_numel") else param.numel()
