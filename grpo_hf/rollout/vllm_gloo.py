"""The server's end of grpo_hf's gloo transport: a vLLM weight-transfer engine (`WeightTransferEngine`) whose group is
torch.distributed's gloo over TCP, so that vLLM's weight-transfer protocol runs where NCCL does not (vLLM's CPU
build). It runs inside the server's workers only: `grpo_hf.vllm_plugin` registers it with vLLM's
`WeightTransferEngineFactory` under the name "gloo", and `--weight-transfer-config '{"backend": "gloo"}'` selects it.

Like vLLM's NCCL engine, with only the transport changed: the trainer is rank 0 of the group, the workers ranks
`rank_offset + their global rank`; each update is loaded by the model's `load_weights` inside vLLM's layerwise reload
(`start_weight_update` / `finish_weight_update`), with vLLM's CPU MoE experts made to reload exactly
(`vllm_moe_reload`, installed when the worker builds the engine, so that a reload from files is exact too). Each
`/update_weights` is one bucket: its names, dtypes and shapes in the request, its bytes in a broadcast per tensor (the
trainer sends its parameters as they are), or packed in one (`weight_transfer.pack` / `unpack`, `packed` in the init
info). At init the first worker puts the served checkpoint's parameters into the group's store, for the trainer's
check (`weight_transfer.check_same_weights`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from grpo_hf.rollout.vllm_moe_reload import exact_moe_reload
from grpo_hf.rollout.weight_transfer import (
    SERVED_WEIGHTS_KEY,
    GlooGroup,
    address_towards,
    checkpoint_weights,
    unpack,
)


@dataclass(kw_only=True)
class GlooInitInfo(WeightTransferInitInfo):
    """Where the trainer (rank 0) waits: its address and port; the group's size; this server's first rank; the
    seconds any wait of the group may take."""

    master_address: str
    master_port: int
    world_size: int
    rank_offset: int = 1
    timeout_s: float = 240.0
    packed: bool = False


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """One bucket: the names, dtypes and shapes of its tensors, in the order their bytes are packed."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """Receives the trainer's buckets over a gloo group and loads them with vLLM's own load path."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        # vLLM builds this engine once the model is loaded: from now on its CPU MoE experts reload exactly, from the
        # network and from files (`/collective_rpc reload_weights`) alike
        self.exact_moe_layers = exact_moe_reload(model)
        self.group: GlooGroup | None = None
        self.packed = False  # each bucket in one broadcast (as `weight_transfer.pack` packs it), or one per tensor
        # the checkpoint the server started from: a reload from files (`/collective_rpc reload_weights`) points the
        # model config at the files' directory, which the trainer deletes after it
        self.checkpoint = (self.model_config.model, getattr(self.model_config, "revision", None))

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        parallel = self.parallel_config
        rank = parallel.data_parallel_index * parallel.world_size + parallel.rank + init_info.rank_offset
        self.packed = init_info.packed
        self.group = GlooGroup(
            init_info.master_address, init_info.master_port, rank, init_info.world_size, init_info.timeout_s,
            interface_host=address_towards(init_info.master_address),
        )  # fmt: skip
        if rank == init_info.rank_offset:
            served = checkpoint_weights(*self.checkpoint)
            self.group.store.set(SERVED_WEIGHTS_KEY, json.dumps(served))

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict) -> None:
        """vLLM's, without its accelerator synchronisation (none on a CPU; `receive_weights` is synchronous)."""
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("The gloo weight transfer is not initialised: call /init_weight_transfer_engine first.")
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        names, dtype_names, shapes = update_info.names, update_info.dtype_names, update_info.shapes
        if self.packed:
            packed = torch.empty(sum(map(_nbytes, shapes, dtype_names)), dtype=torch.uint8)
            self.group.broadcast(packed)
            weights = unpack(packed, names, dtype_names, shapes)
        else:  # a broadcast per tensor
            weights = [(name, torch.empty(shape, dtype=getattr(torch, dtype))) for name, dtype, shape in zip(
                names, dtype_names, shapes, strict=True)]  # fmt: skip
            for _, tensor in weights:
                self.group.broadcast(tensor)
        if self.device.type != "cpu":
            weights = [(name, tensor.to(self.device)) for name, tensor in weights]
        with disable_mtp_completeness_check():
            self.model.load_weights(weights)

    def shutdown(self) -> None:
        self.group = None


def _nbytes(shape: list[int], dtype_name: str) -> int:
    count = getattr(torch, dtype_name).itemsize
    for size in shape:
        count *= size
    return count
