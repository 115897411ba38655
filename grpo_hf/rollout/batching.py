"""Batching: the sampler that serves whole groups, the typed batches of a step, and their padding.

A generation batch takes three shapes on its way through a training step (docs/design.md, "One training step"):

1. dataloader rows: this process's share of `generation_batch_size` prompt rows, each prompt's G copies together
   (`RepeatSampler`; `RepeatedStream` for a stream), served once to every micro-step that trains on them;
2. a `Rollout`: those rows sampled and scored, with the whole generation batch's rewards and this process's
   advantages;
3. `MicroBatch`es: the rollout cut into `per_device_train_batch_size` rows (`split_into_micro_batches`), each
   trimmed of the padding columns it does not need and padded once to `pad_to_multiple_of`, then given its
   old/reference log-probs and the token count its loss is normalised by.

Prompts are padded on the left and completions on the right everywhere: a forward reads `Sequences`.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, TypeVar

import torch
from torch import Tensor
from torch.utils.data import IterableDataset, Sampler

from grpo_hf.rollout.routes import realign as realign_routes
from grpo_hf.rollout.routes import trim as trim_routes

T = TypeVar("T")


# ---- the typed batches ---------------------------------------------------------------------------------------------
@dataclass
class Sequences:
    """The tokens of B rows, as every forward reads them."""

    prompt_ids: Tensor  # [B, P] long, left-padded
    prompt_mask: Tensor  # [B, P] long, 1 on prompt tokens
    completion_ids: Tensor  # [B, T] long, right-padded
    completion_mask: Tensor  # [B, T] long, 1 on the sampled tokens up to and including the last EOS: the loss
    # [B, T] long, 1 on tokens inside the completion that the model read but did not sample (tool results, environment
    # feedback of a multi-turn episode): attended to, out of the loss. None: there are none.
    context_mask: Tensor | None = field(default=None, kw_only=True)
    # [B] a vision-language model's rows' image inputs (`grpo_hf.vision.ImageRow`, one dict shared by a group's rows;
    # None for a text-only row), or None when no row has images (`rollout.vision`)
    image_inputs: list | None = field(default=None, kw_only=True)

    def __len__(self) -> int:
        return self.prompt_ids.size(0)

    @property
    def attention_mask(self) -> Tensor:
        """[B, T] the completion tokens a forward reads: the sampled ones and, in an episode, the tool output between
        them (a contiguous run from the first column)."""
        return self.completion_mask if self.context_mask is None else self.completion_mask + self.context_mask

    def tokens(self) -> dict[str, Tensor | list | None]:
        """The token tensors and the rows' image inputs by name (of a `Rollout` or `MicroBatch` too: what a new batch
        is built from)."""
        return {f.name: getattr(self, f.name) for f in fields(Sequences)}

    def rows(self, start: int, stop: int) -> Sequences:
        """Rows [start, stop) of the token tensors and the image inputs, as plain `Sequences`."""
        return Sequences(**{name: _rows_of(value, start, stop) for name, value in self.tokens().items()})


@dataclass
class Rollout(Sequences):
    """One rollout round: this process's B rows, sampled and scored, and the whole generation batch's N rewards."""

    is_truncated: Tensor  # [B] bool: no EOS within max_completion_length
    prompts: list  # [B] the prompts as the dataset holds them (text, or chat messages)
    texts: list[str]  # [B] the decoded completions, up to and including EOS
    rewards: Tensor  # [B, R] float32, one column per reward function, NaN = no reward
    all_rewards: Tensor  # [N, R] the rewards of every process's rows, in process order
    combined_rewards: Tensor  # [N] the weighted sum over reward functions (`core.combine_rewards`)
    extra: list[dict[str, Any]]  # [B] per row, the columns reward functions logged with `log_extra`
    sampling_logps: Tensor | None = None  # [B, T] the sampler's own log-probs (vLLM), 0 off the mask
    # [B, P + T, L, k] int16/int32: the top-k experts each MoE layer chose for each token the rollout fed the model,
    # column for column with cat(prompt_ids, completion_ids); -1 where nothing was recorded (padding, the last
    # completion token). None: not recorded (a dense model, or an engine that does not record them). `grpo_hf.replay`
    routes: Tensor | None = None
    advantages: Tensor | None = None  # [B] once computed; None while the batch cuts a group (evaluation)
    nonfinite: bool = False  # the advantages are not finite: every optimizer step this rollout feeds is skipped

    def as_batch(self) -> MicroBatch:
        """All B rows as one `MicroBatch` (advantages required), to be split or evaluated."""
        if self.advantages is None:
            raise ValueError("A rollout is batched once its advantages are computed (it holds whole groups).")
        return MicroBatch(
            **self.tokens(),
            advantages=self.advantages,
            sampling_logps=self.sampling_logps,
            routes=self.routes,
            nonfinite=self.nonfinite,
        )


@dataclass
class MicroBatch(Sequences):
    """The rows one loss is computed on (one micro-step), with everything that loss reads besides the policy."""

    advantages: Tensor  # [B] float32
    old_logps: Tensor | None = None  # [B, T] the policy's at sampling time; None: the current policy's, detached
    ref_logps: Tensor | None = None  # [B, T] the reference model's; None when beta = 0
    sampling_logps: Tensor | None = None  # [B, T] the sampler's own (vLLM's importance-sampling correction)
    # [B, T] the policy's at sampling time (as old_logps, or the current one's) under the distribution the sampler drew
    # from (`sampling.SamplingReplay`): the correction's weight only. None: that distribution is old_logps' own
    old_sampling_logps: Tensor | None = None
    routes: Tensor | None = None  # [B, P + T, L, k] the rollout's experts per token and MoE layer (`Rollout.routes`)
    # [B, P + T, L, k] the experts the old-policy forward chose (router_replay="r2", `grpo_hf.replay`); None: not taken
    old_routes: Tensor | None = None
    num_items_in_batch: Tensor | None = None  # [] completion tokens of its optimizer step, on every process (dapo)
    nonfinite: bool = False  # its rollout's advantages are not finite: skip the optimizer step

    @property
    def num_completion_tokens(self) -> Tensor:
        """[] this micro-batch's completion tokens (the loss's tokens, on this process)."""
        return self.completion_mask.sum()


# Per-token tensors padded with the completions (on the right), and what their padding holds.
_COMPLETION_COLUMNS = {
    "completion_ids": None,  # the pad token
    "completion_mask": 0,
    "context_mask": 0,
    "old_logps": 0.0,
    "ref_logps": 0.0,
    "sampling_logps": 0.0,
    "old_sampling_logps": 0.0,
}
# Per-token tensors of both halves, [B, P + T, L, k] aligned with cat(prompt_ids, completion_ids): MoE routes, padded
# with -1 on each side as the tokens are (`rollout.routes`).
_ROUTE_COLUMNS = ("routes", "old_routes")


def split_into_micro_batches(
    batch: MicroBatch, size: int, multiple: int | None = None, pad_token_id: int = 0
) -> list[MicroBatch]:
    """Cut `batch` into micro-batches of `size` rows. Each is trimmed of the padding columns none of its rows needs
    (left of its prompts, right of its completions), then padded once to widths that are multiples of `multiple`
    (`pad_to_multiple_of`; None: none). Padded positions are masked out, so no log-prob or loss changes."""
    parts = []
    for start in range(0, len(batch), size):
        part = replace(batch, **_tensor_rows(batch, start, start + size))
        used_p = part.prompt_mask.any(dim=0).nonzero()  # [k, 1] prompt columns some row uses
        first = int(used_p.min()) if used_p.numel() else 0
        used_c = part.attention_mask.any(dim=0).nonzero()
        last = int(used_c.max()) + 1 if used_c.numel() else 1
        for name in _ROUTE_COLUMNS:  # [b, P + T, L, k]: cut on both sides of the prompt's width
            if getattr(part, name) is not None:
                setattr(part, name, trim_routes(getattr(part, name), part.prompt_ids.size(1), first, last))
        part.prompt_ids, part.prompt_mask = part.prompt_ids[:, first:], part.prompt_mask[:, first:]
        for name in _COMPLETION_COLUMNS:
            if getattr(part, name) is not None:
                setattr(part, name, getattr(part, name)[:, :last])
        parts.append(pad_to_multiple(part, multiple, pad_token_id))
    return parts


def _tensor_rows(batch: MicroBatch, start: int, stop: int) -> dict[str, Tensor]:
    """Rows [start, stop) of every per-row tensor of `batch` (the scalar token count stays as it is), and of its
    image inputs."""
    return {
        f.name: value[start:stop]
        for f in fields(batch)
        if isinstance(value := getattr(batch, f.name), Tensor) and value.dim() > 0
    } | {"image_inputs": _rows_of(batch.image_inputs, start, stop)}


def _rows_of(value, start: int, stop: int):
    """Rows [start, stop) of a per-row tensor or list; None stays None."""
    return None if value is None else value[start:stop]


def pad_to_multiple(batch: MicroBatch, multiple: int | None, pad_token_id: int) -> MicroBatch:
    """`batch` with its prompt columns padded on the left and its per-token completion columns on the right to
    widths that are multiples of `multiple` (None or 1: unchanged). The new positions are masked out."""
    if multiple is None or multiple <= 1:
        return batch
    width = lambda value: value.size(1) + -value.size(1) % multiple  # noqa: E731
    padded = {
        "prompt_ids": pad_columns(batch.prompt_ids, width(batch.prompt_ids), pad_token_id, left=True),
        "prompt_mask": pad_columns(batch.prompt_mask, width(batch.prompt_mask), 0, left=True),
    }
    for name, fill in _COMPLETION_COLUMNS.items():
        value = getattr(batch, name)
        if value is not None:
            padded[name] = pad_columns(value, width(value), pad_token_id if fill is None else fill, left=False)
    widths = (batch.prompt_ids.size(1), width(batch.prompt_ids), width(batch.completion_ids))
    for name in _ROUTE_COLUMNS:
        if getattr(batch, name) is not None:
            padded[name] = realign_routes(getattr(batch, name), *widths)
    return replace(batch, **padded)


def pad_token_lists(rows: Sequence[Sequence[int]], pad_token_id: int, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-id lists -> ids and mask [n, max(1, longest)] (long), padded on the left or the right."""
    width = max([1, *(len(ids) for ids in rows)])
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        if len(row):
            span = slice(width - len(row), width) if left else slice(0, len(row))
            ids[i, span] = torch.tensor(list(row), dtype=torch.long)
            mask[i, span] = 1
    return ids, mask


def pad_columns(tensor: torch.Tensor, width: int, value: float, left: bool) -> torch.Tensor:
    """`tensor` [n, w] padded with `value` to [n, width], on the left or the right (as it is if w >= width)."""
    missing = width - tensor.size(1)
    if missing <= 0:
        return tensor
    padding = tensor.new_full((tensor.size(0), missing), value)
    return torch.cat([padding, tensor] if left else [tensor, padding], dim=1)


# ---- the sampler: whole groups, each generation batch repeated ------------------------------------------------------
def in_groups(batches: Iterable[list[T]], num_generations: int, repeat_count: int) -> Iterator[T]:
    """The order both `RepeatSampler` and `RepeatedStream` serve: each batch of prompts `repeat_count` times, each
    prompt `num_generations` times in a row."""
    for batch in batches:
        for _ in range(repeat_count):
            for prompt in batch:
                yield from itertools.repeat(prompt, num_generations)


class RepeatSampler(Sampler[int]):
    """Dataset indices for GRPO: whole groups, each generation batch repeated.

    With `num_generations=2`, `prompts_per_batch=3`, `repeat_count=2` and a dataset of 7 prompts
    `[a b c d e f g]` shuffled to `[e c g a b f d]`, it yields::

        e e c c g g  e e c c g g   <- generation batch 1, served to 2 micro-steps
        a a b b f f  a a b b f f   <- generation batch 2
                                      (d: too few prompts left for a batch, dropped)

    Prompts are shuffled under `seed`, with a new order on every pass over the data (deterministic:
    epoch k uses seed + k; `set_epoch`, which Trainer calls, so a run resumed in epoch k uses that
    epoch's order); the copies inside a group never are. `accelerate` then hands each
    process its contiguous share of each batch, so a group may straddle processes; the trainer
    gathers rewards before normalising.
    """

    def __init__(
        self,
        num_prompts: int,
        num_generations: int,
        prompts_per_batch: int,
        repeat_count: int = 1,
        shuffle: bool = True,
        seed: int = 0,
    ):
        if num_prompts < prompts_per_batch:
            raise ValueError(
                f"The dataset has {num_prompts} prompts but one generation batch needs {prompts_per_batch} "
                "(generation_batch_size / num_generations). Use a larger dataset or a smaller batch."
            )
        self.num_prompts = num_prompts
        self.num_generations = num_generations
        self.prompts_per_batch = prompts_per_batch
        self.repeat_count = repeat_count
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """The pass over the data the next iteration makes (its prompt order is seed + epoch)."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.num_prompts, generator=generator).tolist()
        else:
            order = list(range(self.num_prompts))
        self.epoch += 1  # without set_epoch, each iteration is the next pass
        size = self.prompts_per_batch
        batches = (order[b * size : (b + 1) * size] for b in range(self.num_prompts // size))
        yield from in_groups(batches, self.num_generations, self.repeat_count)

    def __len__(self) -> int:
        num_batches = self.num_prompts // self.prompts_per_batch
        return num_batches * self.prompts_per_batch * self.num_generations * self.repeat_count


class RepeatedStream(IterableDataset):
    """`RepeatSampler`'s order for a stream (`datasets.IterableDataset`, e.g. `load_dataset(..., streaming=True)`),
    which has no indices to sample: `prompts_per_batch` rows are read, each yielded `num_generations` times in a row,
    and the whole batch `repeat_count` times. Prompts left over at the end of a pass (fewer than a batch) are
    dropped, as the sampler drops them.

    `cycle=True` (training) goes on from pass to pass without end, pass k with the stream's epoch `epoch + k`; the
    trainer stops at `max_steps`. Trainer sees one endless epoch, so on resume it skips exactly the batches already
    trained on (for a stream it counts them from the start of its epoch 0), whichever pass they were in.
    `cycle=False` (evaluation) makes one pass.

    Shuffling is the stream's own (`dataset.shuffle(seed, buffer_size)`, a buffered shuffle with a new order each
    epoch: the trainer applies it when `shuffle_dataset`). Every process reads the whole stream and accelerate
    (`dispatch_batches=False`) hands each its contiguous share of each batch, as with the sampler. It must be read
    by a single loader worker: workers would each take part of the stream and interleave their batches, splitting
    groups.
    """

    def __init__(
        self, dataset, num_generations: int, prompts_per_batch: int = 1, repeat_count: int = 1, cycle: bool = False
    ):
        self.dataset = dataset
        self.num_generations = num_generations
        self.prompts_per_batch = prompts_per_batch
        self.repeat_count = repeat_count
        self.cycle = cycle
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """The stream's epoch for the next pass (Trainer calls it through accelerate)."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[dict]:
        for k in itertools.count() if self.cycle else range(1):
            if hasattr(self.dataset, "set_epoch"):
                self.dataset.set_epoch(self.epoch + k)
            served = False
            for row in in_groups(self._batches(), self.num_generations, self.repeat_count):
                served = True
                yield dict(row)  # a copy per completion row, as a dataset's rows are
            if self.cycle and not served:  # another pass would not serve one either: never end silently
                raise ValueError(
                    f"The stream's pass {k + 1} held fewer prompts than one generation batch takes "
                    f"({self.prompts_per_batch}), so training cannot go on. Give it more prompts, or lower "
                    "per_device_train_batch_size / steps_per_generation."
                )

    def _batches(self) -> Iterator[list[dict]]:
        batch: list[dict] = []
        for row in self.dataset:
            batch.append(row)
            if len(batch) == self.prompts_per_batch:
                yield batch
                batch = []
