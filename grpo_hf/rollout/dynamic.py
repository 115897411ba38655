"""DAPO's dynamic sampling (Yu et al., 2025, section 3.2): train only on groups whose rewards differ.

A group whose rewards are all equal (all right, all wrong), or that has fewer than two rewards, has
zero advantage for every completion: it adds no policy gradient, only its KL term and its share of
the loss normalisation. Dynamic sampling drops such groups and generates for fresh prompts until
the generation batch holds `num_groups` groups with signal, or until a limit of extra rounds.

Everything here works on *global* rows, the whole generation batch over all processes, in the
order `accelerate` lays it out (process 0's rows, then process 1's, ...). Every process computes
the same selection from the same gathered rewards, so all of them keep the same groups and make the
same number of rounds: none can wait on a collective that another skips.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from grpo_hf.rollout.batching import pad_columns
from grpo_hf.rollout.routes import realign as realign_routes

# Rows of one rollout round: tensors [N, ...] and lists of N Python objects, all in global row order.
Rows = dict[str, Any]

# How each padded tensor is padded when rounds of different widths are stacked: prompts on the left.
_LEFT_PADDED = ("prompt_ids", "prompt_mask")
_RIGHT_PADDED = ("completion_ids", "completion_mask", "context_mask", "sampling_logps")
# MoE routes [N, P + T, L, k] (`rollout.routes`): re-padded on both sides, after the ids they are aligned with.
_ROUTES = ("routes",)


def groups_with_signal(total: Tensor, num_generations: int) -> Tensor:
    """`[N / G]` bool: True for each group of `total` [N] (combined rewards, NaN = none) that has at least two
    rewards and not all of them equal, i.e. a group whose advantages are not all zero."""
    grouped = total.reshape(-1, num_generations)  # [N / G, G]
    valid = ~torch.isnan(grouped)
    highest = grouped.where(valid, -math.inf).amax(dim=1)  # [N / G]
    lowest = grouped.where(valid, math.inf).amin(dim=1)  # [N / G]
    return (valid.sum(dim=1) >= 2) & (highest > lowest)


def prompt_key(prompt: Any) -> str:
    """A hashable key of a prompt (a string, or a list of chat messages)."""
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True, default=str)


class FreshPrompts:
    """Dataset rows for the extra rounds of one generation batch, the same on every process.

    A random order of the dataset under (seed, step), so a resumed run draws the same prompts, walked
    from the start; prompts already in the batch (`seen`, by `prompt_key`) are skipped until the whole
    dataset has been walked, and only then may repeat.
    """

    def __init__(self, dataset, seed: int, step: int):
        self.dataset = dataset
        generator = torch.Generator().manual_seed(seed * 1_000_003 + step + 1)
        self.order = torch.randperm(len(dataset), generator=generator).tolist()
        self.position = 0

    def take(self, count: int, seen: set[str]) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        while len(rows) < count:
            if self.position == len(self.order):  # every prompt has been offered: repeats are allowed now
                self.position, seen = 0, set()
            row = self.dataset[self.order[self.position]]
            self.position += 1
            if prompt_key(row.get("prompt", row)) not in seen:  # environments: rows may have no prompt
                rows.append(row)
        return rows


def stack_rows(parts: Sequence[Rows], pad_token_id: int) -> Rows:
    """Concatenate row sets along the rows: prompts left-padded and completions right-padded to common widths."""
    stacked: Rows = {}
    for key, first in parts[0].items():
        values = [part[key] for part in parts]
        if key in _ROUTES:  # [n, P + T, L, k]: each side to the widest part's
            P, T = (max(part[name].size(1) for part in parts) for name in ("prompt_ids", "completion_ids"))
            values = [realign_routes(part[key], part["prompt_ids"].size(1), P, T) for part in parts]
        if not isinstance(first, Tensor):
            stacked[key] = [item for value in values for item in value]
            continue
        if key in _LEFT_PADDED or key in _RIGHT_PADDED:
            width = max(value.size(1) for value in values)
            fill = pad_token_id if key.endswith("_ids") else 0
            values = [pad_columns(value, width, fill, left=key in _LEFT_PADDED) for value in values]
        stacked[key] = torch.cat(values, dim=0)
    return stacked


def take_rows(rows: Rows, index: Tensor) -> Rows:
    """The rows `index` (a 1-D long tensor) of every tensor and list in `rows`."""
    positions = index.tolist()
    return {
        key: value[index.to(value.device)] if isinstance(value, Tensor) else [value[i] for i in positions]
        for key, value in rows.items()
    }


class GroupPool:
    """The groups with signal collected over rollout rounds, and the dropped ones, for one generation batch.

    `add` takes one round's global rows (with `total` [N], the combined rewards) and keeps the groups
    `groups_with_signal` accepts, in arrival order; `batch` returns exactly `num_groups` groups: the
    first kept ones, then, if the rounds ran out, dropped groups to fill the shape, flagged in `kept`.
    """

    def __init__(self, num_groups: int, num_generations: int):
        self.num_groups = num_groups
        self.num_generations = num_generations
        self._kept: list[Rows] = []
        self._dropped: list[Rows] = []
        self.num_kept = 0
        self.num_dropped = 0
        self.seen: set[str] = set()  # `prompt_key` of every prompt generated for

    @property
    def full(self) -> bool:
        return self.num_kept >= self.num_groups

    def add(self, rows: Rows) -> None:
        G = self.num_generations
        self.seen.update(prompt_key(prompt) for prompt in rows["prompts"][::G])
        signal = groups_with_signal(rows["total"], G)  # [M]
        for wanted, store in ((signal, self._kept), (~signal, self._dropped)):
            groups = wanted.nonzero().flatten().cpu()  # [K]
            if groups.numel():
                row_index = (groups.unsqueeze(1) * G + torch.arange(G)).flatten()  # [K * G]
                store.append(take_rows(rows, row_index))
        self.num_kept += int(signal.sum())
        self.num_dropped += int((~signal).sum())

    def batch(self, pad_token_id: int) -> tuple[Rows, Tensor]:
        """`num_groups` groups of rows, and `kept` [num_groups * G] (bool): False on the rows of dropped groups
        that fill a batch the rounds could not complete."""
        G = self.num_generations
        rows = stack_rows(self._kept + self._dropped, pad_token_id)
        rows = take_rows(rows, torch.arange(self.num_groups * G))
        kept = torch.arange(self.num_groups * G) < min(self.num_kept, self.num_groups) * G
        return rows, kept


def gather_rows(rows: Rows, accelerator, pad_token_id: int) -> Rows:
    """This process's rows of a round -> the round's global rows, the same on every process.

    Padded tensors are first padded to the widest process (prompts on the left; MoE routes on both sides of the
    prompt width); lists are gathered as objects. With one process the rows are returned as they are.
    """
    if accelerator.num_processes == 1:
        return dict(rows)
    from accelerate.utils import gather_object

    gathered: Rows = {}
    for key, value in rows.items():
        if not isinstance(value, Tensor):
            gathered[key] = gather_object(list(value))
            continue
        if key in _ROUTES:  # [n, P + T, L, k]: each side to the widest process's (the ids' gathered widths), and
            # gathered as int32 (gloo has no int16)
            P, T = (gathered[name].size(1) for name in ("prompt_ids", "completion_ids"))
            routes = realign_routes(value, rows["prompt_ids"].size(1), P, T)
            gathered[key] = accelerator.gather(routes.int()).to(value.dtype)
            continue
        if key in _LEFT_PADDED or key in _RIGHT_PADDED:
            fill = pad_token_id if key.endswith("_ids") else 0
            value = accelerator.pad_across_processes(value, dim=1, pad_index=fill, pad_first=key in _LEFT_PADDED)
        gathered[key] = accelerator.gather(value)
    return gathered
