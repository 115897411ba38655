"""Which forward and backward a micro-batch's log-probs take, chosen by device and memory (`Planner.plan`).

grpo_hf has three exact ways to get a micro-batch's log-probs and their gradient (`grpo_hf.logprobs`):

- **padded, one backward**: one forward over the padded prompt + completion rows, one backward. The fewest operator
  calls (kernel launches on a GPU), with every row's activations alive at once.
- **shared prefix, one backward**: each group's prompt once, then its completions on the prompt's cached keys and
  values: per group one prompt and one or two completion decoder calls. No compute on repeated prompts.
- **shared prefix, per-group backward**: the same, forward and backward one group at a time: one group's activations.

Which one is fastest depends on the device. On a CPU, compute is the cost, and the shared prefix saves it; a group at
a time keeps the host's memory low. On a GPU at RL shapes (tens of rows, a few hundred tokens), kernel launches are
the cost: the per-group path runs groups x 2-3 decoder calls, forward and backward, where the padded one runs one
(`benchmarks/launch_count.py` counts them). So the defaults (`share_prompt_prefix=None`, `backward_per_group=None`,
`logprob_chunk_size=None`) are:

- CUDA, where the padded micro-batch's forward and backward fit in `FIT_SHARE` of the memory available (measured per
  micro-batch, the same choice on every process): padded, one backward;
- elsewhere, or when memory is tight: the shared prefix, one group at a time;
- log-softmax chunks of `core.CHUNK_ELEMENTS` logits off CUDA, sized to the memory available on CUDA
  (`gpu_chunk_logits`).

A field set to True or False is obeyed. The estimate of the padded step (`padded_step_bytes`) measures the model's
activations once, on one row (`activation_bytes_per_token`), and adds the logits, their gradient, the log-softmax
temporaries and the parameter gradients not yet allocated.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch
from torch import nn

from grpo_hf.core import CHUNK_ELEMENTS
from grpo_hf.vision import forward_kwargs

logger = logging.getLogger(__name__)

FIT_SHARE = 0.7  # the share of the available memory the padded micro-batch's forward and backward may take
GPU_CHUNK_LOGITS = (CHUNK_ELEMENTS, 1 << 28)  # the range of logits per log-softmax chunk on a GPU (32 MiB-1 GiB fp32)
GIB = 2**30


class ForwardPlan(NamedTuple):
    """How one micro-batch's log-probs are computed: `share_prefix` (the shared-prefix forward), `per_group` (its
    backward one group at a time), `chunk_size` (positions per log-softmax chunk; None: `core.CHUNK_ELEMENTS`
    logits), and `why`, for the log."""

    share_prefix: bool
    per_group: bool
    chunk_size: int | None
    why: str

    def describe(self) -> str:
        if not self.share_prefix:
            path = "one padded forward over prompt + completion rows, one backward"
        else:
            backward = ", one group's backward at a time" if self.per_group else ", one backward"
            path = "shared prompt prefix" + backward
        chunks = "" if self.chunk_size is None else f", log-softmax chunks of {self.chunk_size} positions"
        return f"log-prob path: {path}{chunks} ({self.why})"


def available_bytes(device: torch.device) -> int | None:
    """Memory a forward on `device` can still use: the free device memory and the allocator's cached blocks. None
    off CUDA (the host's memory is not the limit the choice is about)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def gpu_chunk_logits(available: int) -> int:
    """Logits per log-softmax chunk on a GPU with `available` bytes: each chunk makes about three float32
    temporaries, kept to under 1/20 of the memory, within `GPU_CHUNK_LOGITS`."""
    low, high = GPU_CHUNK_LOGITS
    return max(low, min(high, available // 256))


def activation_bytes_per_token(model: nn.Module, batch) -> float:
    """Bytes the autograd graph of `model`'s padded forward on `batch`'s first row keeps per token: every tensor saved
    for the backward (`saved_tensors_hooks`), each storage counted once, parameters and buffers left out, the LM head
    run on the last position only (the logits are counted apart). Dropout is off for the measurement (no random
    numbers are drawn); the graph is freed on return."""
    row = batch.rows(0, 1)
    input_ids = torch.cat([row.prompt_ids, row.completion_ids], dim=1)  # [1, width]
    attention_mask = torch.cat([row.prompt_mask, row.attention_mask], dim=1)
    vision = forward_kwargs(model, input_ids, row.image_inputs)
    held = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in held:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    was_training = model.training
    model.eval()
    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=1, use_cache=False, **vision)
    finally:
        model.train(was_training)
    return sum(saved.values()) / input_ids.numel()


def padded_step_bytes(per_token: float, rows: int, width: int, logits: int, logit_copies: int, chunk: int) -> int:
    """Peak bytes of one padded forward and backward: the activations of `rows` x `width` tokens (`per_token` each),
    `logit_copies` tensors of `logits` bytes (the logits, their gradient, a copy divided by the temperature) and
    three float32 log-softmax temporaries of `chunk` logits."""
    return int(per_token * rows * width + logit_copies * logits + 3 * 4 * chunk)


class Planner:
    """The `ForwardPlan` of each micro-batch: the fields the user set, and for those left to None (auto) the choice
    by device and memory described above. Logs a training plan when it changes."""

    def __init__(
        self,
        accelerator,
        share_prompt_prefix,
        backward_per_group,
        chunk_size,
        temperature: float = 1.0,
        one_backward: str | None = None,
    ):
        """`one_backward`: why the shared prefix must backpropagate once, not a group at a time (None: it may)."""
        self.accelerator, self.chunk_size, self.temperature = accelerator, chunk_size, temperature
        self.share_prompt_prefix, self.backward_per_group = share_prompt_prefix, backward_per_group
        self.one_backward = one_backward
        self.per_token: float | None = None  # measured at the first auto choice with a gradient on CUDA
        self.last: tuple | None = None  # the last training plan logged, without its reason

    @property
    def auto(self) -> bool:
        """Whether the path is left to the device: the forward, or the backward of a shared prefix."""
        return self.share_prompt_prefix is None or (self.share_prompt_prefix and self.backward_per_group is None)

    def describe(self, blocker: str | None) -> str:
        """The start-up line: the path, or how it is chosen."""
        cuda = self.accelerator.device.type == "cuda"
        if blocker is not None and not cuda:
            return ForwardPlan(False, False, self.chunk_size, blocker).describe()
        if cuda and (self.auto or self.chunk_size is None):
            chosen = "log-softmax chunks sized to the free memory"
            if blocker is None and self.auto:
                backward = f"one backward ({self.one_backward})" if self.one_backward else "one group at a time"
                chosen = (
                    f"one padded forward and one backward where they fit in {FIT_SHARE:.0%} of the memory available, "
                    f"else the shared prompt prefix, {backward}; {chosen}"
                )
            return f"log-prob path: chosen per micro-batch on cuda: {chosen}" + (f" ({blocker})" if blocker else "")
        return self._fixed(fits=False, why=self._reason_off_cuda()).describe()

    def plan(self, model: nn.Module, batch, blocker: str | None, grad: bool = True) -> ForwardPlan:
        """The plan for `batch` on `model` (the bare module); `blocker`: why the shared prefix cannot be used, or
        None. `grad=False`: a no-grad pass (no activations kept, no backward; each process chooses alone)."""
        available = available_bytes(self.accelerator.device)
        if available is None:  # off CUDA: the fields, auto ones resolved to the shared prefix, a group at a time
            if blocker is not None:
                return ForwardPlan(False, False, self.chunk_size, blocker)
            return self._fixed(fits=False, why=self._reason_off_cuda())
        vocab = _vocab_size(model)
        chunk = self.chunk_size or max(1, gpu_chunk_logits(available) // vocab)
        if blocker is not None or not self.auto:
            plan = ForwardPlan(False, False, chunk, blocker) if blocker else self._fixed(False, "as configured")
            return plan._replace(chunk_size=chunk)
        needed = self._needed(model, batch, vocab, chunk, grad)
        fits = needed <= FIT_SHARE * available
        fits = self._everywhere(fits) if grad else fits
        shape = f"{len(batch)} rows x {batch.prompt_ids.size(1) + batch.completion_ids.size(1)} tokens"
        why = f"auto on cuda: {shape} need ~{_size(needed)}, {_size(available)} available"
        plan = self._fixed(fits, why)._replace(chunk_size=chunk)
        if grad and plan[:3] != self.last:  # a new path or chunk: the memory figures alone change every batch
            self.last = plan[:3]
            logger.info(plan.describe())
        return plan

    def _fixed(self, fits: bool, why: str) -> ForwardPlan:
        """The plan from the fields, auto ones resolved by `fits` (the padded micro-batch fits on a GPU)."""
        share = (not fits) if self.share_prompt_prefix is None else self.share_prompt_prefix
        if self.backward_per_group is True and self.share_prompt_prefix is None:
            share = True  # a backward one group at a time needs the shared prefix
        per_group = share and ((not fits) if self.backward_per_group is None else self.backward_per_group)
        if per_group and self.one_backward is not None:
            per_group, why = False, f"{why}; one backward: {self.one_backward}"
        return ForwardPlan(share, per_group, self.chunk_size, why)

    def _reason_off_cuda(self) -> str:
        if not self.auto:
            return "as configured"
        device = self.accelerator.device.type
        if self.one_backward is not None:
            return f"auto on {device}: the fewest FLOPs"
        return f"auto on {device}: the fewest FLOPs, one group's activations at a time"

    def _needed(self, model: nn.Module, batch, vocab: int, chunk: int, grad: bool) -> int:
        """Bytes the padded micro-batch's forward (and backward, with `grad`) needs: activations, logits, chunks and
        the parameter gradients not allocated yet."""
        completion_width = batch.completion_ids.size(1)
        width = batch.prompt_ids.size(1) + completion_width
        positions = len(batch) * (completion_width + 1)
        logits, chunk = positions * vocab * _logit_bytes(model), min(chunk, positions) * vocab
        copies = 1 + (self.temperature != 1.0)
        if not grad:  # no graph: the logits and the chunks only
            return padded_step_bytes(0.0, len(batch), width, logits, copies, chunk)
        if self.per_token is None:
            with self.accelerator.autocast():
                self.per_token = activation_bytes_per_token(model, batch)
        grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad and p.grad is None)
        return padded_step_bytes(self.per_token, len(batch), width, logits, copies + 1, chunk) + grads

    def _everywhere(self, fits: bool) -> bool:
        """`fits` on every process: one plan for all (DDP's reducer must see the same forwards everywhere)."""
        if self.accelerator.num_processes == 1:
            return fits
        flag = torch.tensor([1.0 if fits else 0.0], device=self.accelerator.device)
        return bool(self.accelerator.gather(flag).min().item())


def _size(nbytes: float) -> str:
    return f"{nbytes / GIB:.1f} GiB" if nbytes >= GIB / 10 else f"{nbytes / 2**20:.1f} MiB"


def _lm_head(model: nn.Module) -> nn.Module | None:
    return model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None


def _vocab_size(model: nn.Module) -> int:
    head = _lm_head(model)
    return head.weight.shape[0] if head is not None else model.config.get_text_config().vocab_size


def _logit_bytes(model: nn.Module) -> int:
    """Bytes per logit: 4 for a float32 LM head (`cast_lm_head_to_fp32`, a float32 model, where autocast may still
    give bf16: the larger is assumed), else 2."""
    head = _lm_head(model)
    return 4 if head is None or head.weight.dtype == torch.float32 else 2
