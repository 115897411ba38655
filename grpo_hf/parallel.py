"""Data parallelism the fast log-prob path needs: gradients averaged over processes without DDP's reducer.

The shared-prompt-prefix forward calls the decoder and the LM head directly (`logprobs.shared_prefix_logits`), not
the model's `forward`, so under DDP it bypasses the wrapper and DDP's reducer never hears of the backward. The
trainer then averages the gradients itself, once per optimizer step, exactly as DDP would (a sum over processes
divided by their number, with a missing gradient counted as zero), in buckets so that the flat copy stays small.
"""

from __future__ import annotations

from collections.abc import Iterable

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
