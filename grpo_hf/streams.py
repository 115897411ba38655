"""Streams as datasets: `datasets.IterableDataset` (`load_dataset(..., streaming=True)`) for training and evaluation.

A stream has no length and no indices, so `RepeatSampler` cannot order it. Instead:

- `rollout.batching.RepeatedStream` reproduces the sampler's order on the stream itself (a prompt's G copies in a
  row, each generation batch repeated for its micro-steps), after a buffered `shuffle` when `shuffle_dataset`. For
  training it reads the stream pass after pass without end, so Trainer sees one epoch and, on resume, skips exactly
  the batches already trained on (re-reading the stream up to them);
- every process reads the whole stream and accelerate gives each its contiguous share of every batch. That needs
  `dispatch_batches=False` (with dispatching, process 0 would read the batches and send them as tensors, which rows of
  strings cannot be): `loader` sets it on the accelerator, and `validation` refuses an explicit
  `dispatch_batches=True`;
- one loader worker reads it, in the main process (`loader`): several would each take part of the stream and
  interleave their batches, splitting groups. `dataloader_num_workers` applies to map-style datasets only (a stream
  train set with workers set gets a warning when the trainer is built).

What a stream cannot have: a step count of its own (`max_steps` is required), dynamic sampling (which draws extra
prompts by index), and a check of every prompt up front (`validation` checks its first rows).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping

import datasets
from torch.utils.data import DataLoader

from grpo_hf.rollout.batching import RepeatedStream

STREAM_ROWS_CHECKED = 64
"""Rows read from the start of a stream to check its columns and prompts before training (`validation`)."""


def is_stream(dataset) -> bool:
    return isinstance(dataset, datasets.IterableDataset)


def eval_splits(eval_dataset) -> list:
    """The eval datasets `Trainer.evaluate` runs: each split of a dict of them, or the one dataset (or None)."""
    return list(eval_dataset.values()) if isinstance(eval_dataset, Mapping) else [eval_dataset]


def any_stream(train_dataset, eval_dataset) -> bool:
    """Whether the train dataset, the eval dataset or one of the eval splits is a stream."""
    return is_stream(train_dataset) or any(is_stream(dataset) for dataset in eval_splits(eval_dataset))


def loader(stream, args, accelerator, batch_size: int, is_training: bool, collate_fn) -> DataLoader:
    """`stream` in the samplers' order (`in_sampler_order`), read in the main process, each process taking its share
    of every batch (`dispatch_batches=False` on `accelerator`), prepared by `accelerator`. `args` is read only."""
    accelerator.dataloader_config.dispatch_batches = False
    ordered = in_sampler_order(stream, args, is_training)
    return accelerator.prepare(
        DataLoader(ordered, batch_size=batch_size, collate_fn=collate_fn, pin_memory=args.dataloader_pin_memory)
    )


def first_rows(dataset, n: int = STREAM_ROWS_CHECKED) -> list:
    """Up to `n` rows from the start of a stream (reading it again later starts over)."""
    return list(itertools.islice(dataset, n))


def in_sampler_order(stream, args, is_training: bool) -> RepeatedStream:
    """`stream` in the order `RepeatSampler` gives a dataset: for training, after a buffered shuffle when
    `shuffle_dataset`, each prompt `num_generations` times in a row, each generation batch once per micro-step it
    serves, pass after pass without end; for evaluation, each prompt `num_generations_eval` times."""
    if not is_training:
        return RepeatedStream(stream, args.num_generations_eval or args.num_generations)
    if args.shuffle_dataset:
        stream = stream.shuffle(seed=args.seed)
    G, per_generation = args.num_generations, args.steps_per_generation * args.num_iterations
    return RepeatedStream(stream, G, args.generation_batch_size // G, per_generation, cycle=True)
