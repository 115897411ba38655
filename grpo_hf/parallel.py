"""Data parallelism: gradients averaged without DDP's reducer, and processes that fail or stop together.

The shared-prompt-prefix forward calls the decoder and the LM head directly (`logprobs.shared_prefix_logits`), not
the model's `forward`, so under DDP it bypasses the wrapper and DDP's reducer never hears of the backward. The
trainer then averages the gradients itself, once per optimizer step, exactly as DDP would (a sum over processes
divided by their number, with a missing gradient counted as zero), in buckets so that the flat copy stays small.

A process that fails alone leaves the others waiting in their next collective. `stop_together` makes a failure in
user code (a reward function) stop every process with the same message; `check_same_dataset` catches, before the
first step, a dataset that differs between processes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist

BUCKET_BYTES = 25 * 2**20  # DDP's default bucket size


@torch.no_grad()
def average_gradients(params: Iterable[torch.Tensor], bucket_bytes: int = BUCKET_BYTES) -> None:
    """Replace each trainable parameter's `.grad` by its mean over all processes (one all-reduce per bucket).

    Every process must call it with the same parameters in the same order. A parameter without a gradient on
    this process contributes zeros (another process may have one), and ends with the mean like the others.
    """
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    params = [p for p in params if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    bucket: list[torch.Tensor] = []
    size = 0
    for p in params:
        bucket.append(p.grad)
        size += p.grad.numel() * p.grad.element_size()
        if size >= bucket_bytes:
            _all_reduce_mean(bucket)
            bucket, size = [], 0
    if bucket:
        _all_reduce_mean(bucket)


def _all_reduce_mean(grads: list[torch.Tensor]) -> None:
    """One all-reduce over the flattened `grads` (grouped by dtype), divided by the process count, copied back."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for grad in grads:
        by_dtype.setdefault(grad.dtype, []).append(grad)
    for same in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in same])  # [n] one buffer for the whole bucket
        dist.all_reduce(flat)
        flat /= dist.get_world_size()
        offset = 0
        for grad in same:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()


def stop_together(failure: BaseException | None, accelerator, doing: str) -> None:
    """Every process calls this after work that may fail on some processes only (user code: reward functions).

    If any process failed, every process raises, naming the process(es) and the error, instead of the healthy
    ones waiting in the next collective for one that is gone (until a timeout, or for ever). One collective.
    """
    if accelerator.num_processes == 1:
        if failure is not None:
            raise failure
        return
    from accelerate.utils import gather_object

    reports = gather_object([None if failure is None else f"{type(failure).__name__}: {failure}"])
    failed = [(rank, report) for rank, report in enumerate(reports) if report is not None]
    if failed:
        where = "; ".join(f"process {rank}: {report}" for rank, report in failed)
        raise RuntimeError(
            f"Failed while {doing} on {len(failed)} of {len(reports)} processes ({where}). Every "
            "process stops here, so that none waits for the others."
        ) from failure


def check_same_dataset(dataset, accelerator, name: str = "train_dataset") -> None:
    """Raise unless every process holds the same dataset (same length, same prompts at a few rows): accelerate gives
    each process its share of every batch, so a dataset filtered or split per process would make the processes
    train on different data, or run different numbers of steps and hang."""
    if accelerator.num_processes == 1 or not hasattr(dataset, "__len__"):
        return
    from accelerate.utils import gather_object

    n = len(dataset)
    rows = sorted({0, n // 2, n - 1}) if n else []
    signature = (n, [repr(dataset[i]["prompt"]) if "prompt" in dataset[i] else "" for i in rows])
    signatures = gather_object([signature])
    if any(other != signatures[0] for other in signatures):
        lengths = ", ".join(f"process {rank}: {length} rows" for rank, (length, _) in enumerate(signatures))
        raise ValueError(
            f"{name} differs between processes ({lengths}; or different prompts at rows {rows}). Every process "
            "must load the same dataset: accelerate hands each process its share of each batch. Do not filter, "
            "shuffle or split it per process (e.g. by rank) before passing it to the trainer."
        )


def is_zero3(accelerator) -> bool:
    """Whether DeepSpeed ZeRO-3 shards the parameters (a forward outside the engine's must gather them first)."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    return plugin is not None and plugin.zero_stage == 3


def is_fsdp2(accelerator) -> bool:
    """Whether the model is sharded by FSDP2 (`fully_shard`: DTensor parameters, one shard unit per wrapped module)."""
    return bool(getattr(accelerator, "is_fsdp2", False))


@contextlib.contextmanager
def fsdp2_gathered(model: torch.nn.Module) -> Iterator[None]:
    """Every FSDP2 shard unit of `model` all-gathered once for the whole block, and resharded at its end.

    Generation calls the model once per token; FSDP2 would gather each unit's weights in every forward and free them
    after it, so a rollout would cost (units x tokens) all-gathers. Here it costs one per unit, whatever the length,
    and each process holds the full weights for the block's duration (as ZeRO-3's gathered generation does). The
    units' own reshard-after-forward settings are restored afterwards (FSDP2 keeps them on its parameter groups).
    """
    from torch.distributed.fsdp import FSDPModule

    units = [module for module in model.modules() if isinstance(module, FSDPModule)]
    groups = [group for unit in units for group in unit._get_fsdp_state()._fsdp_param_groups]
    saved = [group.post_forward_mesh_info for group in groups]  # None: the unit stays gathered after a forward
    for group in groups:
        group.post_forward_mesh_info = None
    try:
        for unit in units:
            unit.unshard()
        yield
    finally:
        for group, info in zip(groups, saved, strict=True):
            group.post_forward_mesh_info = info
        for unit in units:
            unit.reshard()


def sum_over_processes(accelerator, value: int) -> int:
    """`value` summed over all processes (every process must call it), or `value` itself with one process."""
    if accelerator.num_processes == 1:
        return value
    return int(accelerator.reduce(torch.tensor(value, device=accelerator.device), "sum").item())
