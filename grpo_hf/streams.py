"""Streams as datasets: `datasets.IterableDataset` (`load_dataset(..., streaming=True)`) for training and evaluation.

A stream has no length and no indices, so `RepeatSampler` cannot order it. Instead:

- `rollout.batching.RepeatedStream` reproduces the sampler's order on the stream itself (a prompt's G copies in a
  row, each generation batch repeated for its micro-steps), after a buffered `shuffle` when `shuffle_dataset`. For
  training it reads the stream pass after pass without end, so Trainer sees one epoch and, on resume, skips exactly
  the batches already trained on (re-reading the stream up to them);
- every process reads the whole stream and accelerate gives each its contiguous share of every batch. That needs
  `dispatch_batches=False` (with dispatching, process 0 would read the batches and send them as tensors, which rows of
  strings cannot be); `configure_args` sets it, and `validation` refuses an explicit `dispatch_batches=True`;
- one loader worker reads it (`one_worker`): several would each take part of the stream and interleave their
  batches, splitting groups. A stream train set sets `dataloader_num_workers=0` for the run, with a warning; a stream
  eval set only for its own loader.

What a stream cannot have: a step count of its own (`max_steps` is required), dynamic sampling (which draws extra
prompts by index), and a check of every prompt up front (`validation` checks its first rows).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import datasets

from grpo_hf.rollout.batching import RepeatedStream

logger = logging.getLogger(__name__)

ONE_WORKER = {"dataloader_num_workers": 0, "dataloader_persistent_workers": False, "dataloader_prefetch_factor": None}
"""The loader settings for reading in the main process (the last two are invalid with no worker processes)."""

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


def configure_args(args, train_dataset, eval_dataset) -> None:
    """Before `Trainer.__init__` builds the accelerator: `dispatch_batches=False` when any dataset is a stream, and a
    single loader worker for a stream train set (`validation._check_stream` has refused `dispatch_batches=True`)."""
    if not any_stream(train_dataset, eval_dataset):
        return
    args.accelerator_config.dispatch_batches = False
    if is_stream(train_dataset) and args.dataloader_num_workers != 0:
        logger.warning(
            "train_dataset is a stream (IterableDataset): it is read by a single loader worker, so that each prompt's "
            f"{args.num_generations} copies stay together; dataloader_num_workers={args.dataloader_num_workers} "
            "is set to 0."
        )
        _set(args, ONE_WORKER)


@contextmanager
def one_worker(args) -> Iterator[None]:
    """`args` read by one loader worker (no worker processes) inside the block, restored after it."""
    saved = {name: getattr(args, name) for name in ONE_WORKER}
    _set(args, ONE_WORKER)
    try:
        yield
    finally:
        _set(args, saved)


def _set(args, values: Mapping) -> None:
    for name, value in values.items():
        setattr(args, name, value)


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
