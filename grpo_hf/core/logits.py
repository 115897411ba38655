"""Logits -> log-probabilities and entropy, in row chunks, without materialising a `[..., V]` log-softmax.

Pure tensor functions (torch only). `logits` are `[..., V]`; the leading dims are walked `CHUNK_ELEMENTS // V`
rows at a time, so the extra peak memory is a few chunk-sized float32 temporaries, forward and backward.

Formula -> function (docs/design.md ("The maths"))
  log pi(o_t) = z[o_t] - logsumexp(z)                      _SelectiveLogSoftmax.forward: `chosen - logsumexp`
  d log pi(o_t) / dz = onehot(o_t) - softmax(z)            _SelectiveLogSoftmax.backward: `probs.mul_(-grad)...`
  H_t = -sum_v p_v log p_v                                 entropy_from_logits: `torch.special.entr(probs).sum(-1)`
  dH/dz_v = entr(p_v) - p_v H                              _EntropyWithGrad.backward
"""

from collections.abc import Iterator

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from grpo_hf.core.common import compute_dtype

CHUNK_ELEMENTS = 1 << 23
"""Default row-chunk budget of `selective_log_softmax` / `entropy_from_logits`: about 8M logits per chunk,
i.e. 32 MiB per float32 temporary (170 rows at V=49152, 55 rows at V=151936)."""


def selective_log_softmax(logits: Tensor, index: Tensor, chunk_size: int | None = None) -> Tensor:
    """log_softmax(logits)[..., index] without materialising the `[..., V]` log-softmax.

    Equal to `log_softmax(logits.float(), -1).gather(-1, index.unsqueeze(-1)).squeeze(-1)`. The leading
    dims are walked in chunks of `chunk_size` rows (default: `CHUNK_ELEMENTS // V` rows), computing
    `logits.gather(index) - logsumexp(logits)` per chunk, so the extra peak memory is a few chunk-sized
    float32 temporaries, in the forward and in the backward pass. Exact for float32/float64; bf16/fp16
    chunks are upcast to float32. Sliced logits such as `logits[:, :-1]` are read in place, never copied.

    Differentiable: the backward pass (d/dz = onehot - softmax(z), times the incoming gradient) is also
    computed chunk by chunk from the saved logits and the `[...]` logsumexp; it is not twice differentiable.

    `logits` `[..., V]`, `index` `[...]` (integer) -> `[...]` in float32 (float64 for float64 logits).
    """
    if index.shape != logits.shape[:-1]:
        raise ValueError(
            f"index has shape {tuple(index.shape)} but logits has shape {tuple(logits.shape)}: "
            "index must be logits.shape[:-1]"
        )
    if index.dtype.is_floating_point or index.dtype.is_complex or index.dtype == torch.bool:
        raise ValueError(f"index must be an integer tensor, got {index.dtype}")
    return _SelectiveLogSoftmax.apply(logits, index, _rows_per_chunk(logits, chunk_size))


@torch.no_grad()
def entropy_from_logits(logits: Tensor, chunk_size: int | None = None) -> Tensor:
    """Entropy H = -sum_v p_v log p_v of softmax(logits) at each position, in row chunks (a metric: no grad).

    `logits` `[..., V]` -> `[...]` in float32 (float64 for float64 logits). Vocabulary entries at -inf
    (p = 0) contribute 0.
    """
    dtype = compute_dtype(logits.dtype)
    entropy = torch.empty(logits.shape[:-1], dtype=dtype, device=logits.device)  # [...]
    flat = entropy.view(-1)  # [M]
    for start, chunk in _row_chunks(logits, _rows_per_chunk(logits, chunk_size)):
        probs = torch.softmax(chunk, -1, dtype=dtype)  # [n, V]
        flat[start : start + chunk.shape[0]] = torch.special.entr(probs).sum(-1)  # entr(p) = -p log p, 0 at p = 0
    return entropy


class _SelectiveLogSoftmax(torch.autograd.Function):
    """Chunked `log_softmax(z).gather(index)` whose backward recomputes softmax chunk by chunk."""

    @staticmethod
    def forward(ctx, logits: Tensor, index: Tensor, rows: int) -> Tensor:
        dtype = compute_dtype(logits.dtype)
        flat_index = index.reshape(-1).long()  # [M]
        logps = torch.empty(flat_index.shape, dtype=dtype, device=logits.device)  # [M]
        logsumexp = torch.empty_like(logps)  # [M]
        for start, chunk in _row_chunks(logits, rows):  # chunk: [n, V]
            stop = start + chunk.shape[0]
            chosen = chunk.gather(-1, flat_index[start:stop, None]).squeeze(-1).to(dtype)  # [n]
            logsumexp[start:stop] = torch.logsumexp(chunk.to(dtype), dim=-1)
            logps[start:stop] = chosen - logsumexp[start:stop]
        ctx.save_for_backward(logits, flat_index, logsumexp)
        ctx.rows = rows
        return logps.view(index.shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logps: Tensor) -> tuple[Tensor | None, None, None]:
        logits, flat_index, logsumexp = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None
        grad_flat = grad_logps.reshape(-1, 1).to(logsumexp.dtype)  # [M, 1]
        grad_logits = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)  # [..., V]
        grad_rows = grad_logits.view(-1, logits.shape[-1])  # [M, V]
        for start, chunk in _row_chunks(logits, ctx.rows):  # chunk: [n, V]
            stop = start + chunk.shape[0]
            grad = grad_flat[start:stop]  # [n, 1]
            probs = (chunk - logsumexp[start:stop, None]).exp_()  # [n, V] softmax, in the compute dtype
            grad_rows[start:stop] = probs.mul_(-grad).scatter_add_(-1, flat_index[start:stop, None], grad)
        return grad_logits, None, None


def _row_chunks(x: Tensor, rows: int, start: int = 0) -> Iterator[tuple[int, Tensor]]:
    """Yield `(first_row, view [n <= rows, V])` covering `x [..., V]` in row-major order, without copying.

    Leading dims that cannot be merged into one view (e.g. `logits[:, :-1]` of a `[B, L, V]` tensor) are
    walked one index at a time.
    """
    try:
        flat = x.view(-1, x.shape[-1])  # [M, V]
    except RuntimeError:
        for sub in x.unbind(0):
            yield from _row_chunks(sub, rows, start)
            start += sub.numel() // max(x.shape[-1], 1)
        return
    for offset in range(0, flat.shape[0], rows):
        yield start + offset, flat[offset : offset + rows]


def _rows_per_chunk(logits: Tensor, chunk_size: int | None) -> int:
    if chunk_size is None:
        return max(1, CHUNK_ELEMENTS // max(logits.shape[-1], 1))
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int (rows per chunk) or None, got {chunk_size!r}")
    return chunk_size


def entropy_with_grad(logits: Tensor, chunk_size: int | None = None) -> Tensor:
    """`entropy_from_logits` with a gradient, for the entropy bonus: H = -sum_v p_v log p_v, p = softmax(z).

    dH/dz_v = -p_v (log p_v + H) = entr(p_v) - p_v H, with entr(p) = -p log p (0 at p = 0, so -inf logits are fine).
    The forward values are `entropy_from_logits`'s, bit for bit. Row chunks as in `selective_log_softmax`: the
    backward recomputes softmax chunk by chunk from the saved logits, so the extra memory is a few chunk-sized
    temporaries plus the `[..., V]` gradient itself. `logits` `[..., V]` -> `[...]` in float32 (float64 for float64).
    """
    return _EntropyWithGrad.apply(logits, _rows_per_chunk(logits, chunk_size))


class _EntropyWithGrad(torch.autograd.Function):
    """Chunked softmax entropy whose backward recomputes softmax chunk by chunk."""

    @staticmethod
    def forward(ctx, logits: Tensor, rows: int) -> Tensor:
        with torch.no_grad():
            entropy = entropy_from_logits(logits, rows)  # [...]
        ctx.save_for_backward(logits, entropy)
        ctx.rows = rows
        return entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_entropy: Tensor) -> tuple[Tensor | None, None]:
        logits, entropy = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None
        dtype = entropy.dtype
        grad_flat = grad_entropy.reshape(-1, 1).to(dtype)  # [M, 1]
        entropy_flat = entropy.reshape(-1, 1)  # [M, 1]
        grad_logits = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)  # [..., V]
        grad_rows = grad_logits.view(-1, logits.shape[-1])  # [M, V]
        for start, chunk in _row_chunks(logits, ctx.rows):  # chunk: [n, V]
            stop = start + chunk.shape[0]
            probs = torch.softmax(chunk, -1, dtype=dtype)  # [n, V]
            grad = torch.special.entr(probs).sub_(probs * entropy_flat[start:stop])  # dH/dz = entr(p) - p H
            grad_rows[start:stop] = grad.mul_(grad_flat[start:stop])
        return grad_logits, None
