"""Prompts and groups: the sampler that keeps a prompt's G copies together, tokenisation, masks.

- `RepeatSampler` orders dataset indices so every prompt's G copies are consecutive and every
  generation batch is served to `repeat_count` training micro-steps; `RepeatedStream`, the same order for a stream.
- `tokenize_prompts` applies the chat template, left-truncates to `max_prompt_length`, left-pads,
  and encodes each distinct prompt once (a group's G copies share one encoding).
- `completion_mask` marks completion tokens up to and including the first EOS (docs/design.md ("The maths"), `m`).
- `prompt_runs` finds the groups inside a batch: runs of identical consecutive prompt rows.
- `split_into_slices` cuts a generation batch into the micro-batches that training steps take.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, TypeVar

import torch
from torch.utils.data import IterableDataset, Sampler

from grpo_hf.core import prompt_runs  # noqa: F401  (re-exported: the groups inside a batch)

T = TypeVar("T")


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


def is_conversational(prompt: Any) -> bool:
    """A prompt is conversational when it is a list of `{"role", "content"}` messages."""
    return isinstance(prompt, list) and len(prompt) > 0 and isinstance(prompt[0], dict) and "role" in prompt[0]


def prompt_text(tokenizer, prompt: str | list[dict], chat_template_kwargs: dict | None = None) -> str:
    """The text the model sees: the chat template with a generation prompt, or the string itself."""
    if is_conversational(prompt):
        return tokenizer.apply_chat_template(
            prompt, tokenize=False, add_generation_prompt=True, **(chat_template_kwargs or {})
        )
    if isinstance(prompt, str):
        return prompt
    raise TypeError(
        f"A prompt must be a string or a list of chat messages with 'role' and 'content'; got {type(prompt).__name__}."
    )


def tokenize_prompts(
    tokenizer,
    prompts: Sequence[str | list[dict]],
    max_prompt_length: int | None = None,
    chat_template_kwargs: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Encode prompts once per run of identical consecutive prompts (a group), left-pad and left-truncate.

    Returns `prompt_ids [N, P]`, `prompt_mask [N, P]` and `is_prompt_truncated [N]` (bool).
    Special tokens are not added again: chat templates already contain them.
    """
    # Runs of identical consecutive prompts: a group's G copies are encoded once.
    starts = [i for i in range(len(prompts)) if i == 0 or prompts[i] != prompts[i - 1]]
    counts = [b - a for a, b in zip(starts, starts[1:] + [len(prompts)], strict=True)]
    texts = [prompt_text(tokenizer, prompts[i], chat_template_kwargs) for i in starts]
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]

    truncated = []
    for k, ids in enumerate(encoded):
        too_long = max_prompt_length is not None and len(ids) > max_prompt_length
        truncated.append(too_long)
        if too_long:
            encoded[k] = ids[-max_prompt_length:]  # keep the end: it holds the question and generation prompt
    if any(len(ids) == 0 for ids in encoded):
        raise ValueError("A prompt encodes to zero tokens; remove empty prompts from the dataset.")

    unique_ids, unique_mask = pad_token_lists(encoded, tokenizer.pad_token_id, left=True)  # [U, P] each
    repeats = torch.tensor(counts)
    prompt_ids = unique_ids.repeat_interleave(repeats, dim=0)  # [N, P]
    prompt_mask = unique_mask.repeat_interleave(repeats, dim=0)  # [N, P]
    is_prompt_truncated = torch.tensor(truncated).repeat_interleave(repeats)  # [N]
    return prompt_ids, prompt_mask, is_prompt_truncated


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


def completion_mask(completion_ids: torch.Tensor, eos_token_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask of real completion tokens, up to and including the first EOS, and the truncation flags.

    Returns `completion_mask [N, T]` (long, 1 = real token) and `is_truncated [N]` (bool: no EOS
    within the completion, i.e. it hit max_completion_length).
    """
    eos = torch.isin(completion_ids, torch.tensor(list(eos_token_ids), device=completion_ids.device))  # [N, T]
    T = completion_ids.size(1)
    has_eos = eos.any(dim=1)  # [N]
    first_eos = torch.where(has_eos, eos.int().argmax(dim=1), torch.full_like(has_eos, T, dtype=torch.long))  # [N]
    positions = torch.arange(T, device=completion_ids.device).unsqueeze(0)  # [1, T]
    mask = (positions <= first_eos.unsqueeze(1)).long()  # [N, T]
    return mask, ~has_eos


def eos_token_ids_of(model, tokenizer) -> list[int]:
    """Every id that ends a completion: the generation config's EOS ids plus the tokenizer's."""
    ids: set[int] = set()
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(configured, int):
        ids.add(configured)
    elif configured is not None:
        ids.update(int(i) for i in configured)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    if not ids:
        raise ValueError(
            "Neither the model's generation_config nor the tokenizer defines an EOS token, so no completion could "
            "end. Set tokenizer.eos_token (e.g. '<|im_end|>') or model.generation_config.eos_token_id."
        )
    return sorted(ids)


def split_into_slices(batch: dict[str, Any], size: int) -> list[dict[str, Any]]:
    """Cut a generation batch (tensors [B, ...]; other values are copied to every part) into micro-batches of `size`
    rows, each trimmed of the padding columns it does not need: left of its prompts, right of its completions."""
    slices = []
    for start in range(0, batch["prompt_ids"].size(0), size):
        part = {k: (v[start : start + size] if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
        keep_p = part["prompt_mask"].any(dim=0).nonzero()
        first = int(keep_p.min()) if keep_p.numel() else 0
        keep_c = part["completion_mask"].any(dim=0).nonzero()
        last = int(keep_c.max()) + 1 if keep_c.numel() else 1
        part["prompt_ids"], part["prompt_mask"] = part["prompt_ids"][:, first:], part["prompt_mask"][:, first:]
        for key in ("completion_ids", "completion_mask", "old_logps", "ref_logps", "sampling_logps"):
            if part.get(key) is not None:
                part[key] = part[key][:, :last]
        slices.append(part)
    return slices
