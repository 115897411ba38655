"""The train dataset of a run with `environment_factory` (TRL 1.16's argument): rows routed to known environments,
environment-owned data without any dataset (docs/tools.md). A dataset without a `prompt` column is kept as it is (as
TRL): each rollout starts such a row from an empty user message that its environment's `reset` writes, and `reset`
gets the row as the dataset has it, without a `prompt`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import datasets

from grpo_hf import streams
from grpo_hf.rollout.environments import EMPTY_PROMPT

__all__ = ["train_rows"]


def train_rows(train_dataset, environment_factory, args):
    """The train dataset: as given; with environments and no dataset, environment-owned data: a placeholder of empty
    prompts (which `reset` gets as TRL's placeholder gives them), cycled for `max_steps`."""
    if environment_factory is None:
        if train_dataset is None:
            raise ValueError(  # TRL's words first
                "`train_dataset` is required unless an `environment_factory` is provided (an environment that owns "
                "its data and writes each prompt in reset()): pass a datasets.Dataset with a 'prompt' column."
            )
        return train_dataset
    routed = isinstance(environment_factory, Mapping)
    if train_dataset is None:
        if routed:
            raise ValueError(  # TRL's words
                "environment_factory is a dict of several environments, which requires a `train_dataset` with an "
                "`environment` column routing each row to one of them. Pass such a dataset, or a single factory."
            )
        if args.max_steps <= 0:
            raise ValueError(
                "Without a train_dataset (the environment owns the data and writes each prompt in reset()), set "
                "max_steps > 0 in GRPOConfig: nothing else says how long to train."
            )
        return datasets.Dataset.from_dict(
            {"prompt": [EMPTY_PROMPT] * (args.generation_batch_size // args.num_generations)}
        )
    if routed and not streams.is_stream(train_dataset):
        _check_routes(train_dataset, environment_factory)
    return train_dataset


def _check_routes(dataset, factories: Mapping[str, Any]) -> None:
    """Every row of `dataset` names one of `factories` in its `environment` column."""
    columns = getattr(dataset, "column_names", None) or []
    if "environment" not in columns:
        raise ValueError(
            f"environment_factory is a dict ({sorted(factories)}): each train_dataset row must name its environment "
            f"in an `environment` column, and the dataset has none (columns: {columns})."
        )
    unknown = sorted({name for name in dataset["environment"] if name not in factories})
    if unknown:
        raise ValueError(  # TRL's words
            f"train_dataset names environments {unknown} in its `environment` column, which are not among the "
            f"environments passed to `environment_factory`: it has {sorted(factories)}."
        )
