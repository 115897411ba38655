"""The values a run records between two log rows, and their reduction into one row.

Each mode ("train", "eval") keeps, per metric name, the list of values recorded since the last row: one per
rollout (rewards, lengths), per micro-step (loss terms, entropy) or per optimizer step. A row holds each name's
mean over those values, then the mean over processes, which log at the same step.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from accelerate.utils import gather_object

MODES = ("train", "eval")


class Metrics:
    """Per mode, per name, the values recorded since the last log row (`metrics["train"][name].append(x)`)."""

    def __init__(self):
        self.modes: dict[str, defaultdict[str, list[float]]] = {mode: defaultdict(list) for mode in MODES}
        self.last_train: dict[str, float] = {}  # the last train row's means, for the end-of-training row

    def __getitem__(self, mode: str) -> defaultdict[str, list[float]]:
        return self.modes[mode]

    @staticmethod
    def add_logged(into: dict[str, list[float]], logged: dict[str, list[float]], accelerator) -> None:
        """The values reward functions passed to `log_metric` in one rollout: one mean per name over every value of
        every process (TRL), recorded under that name in `into` (one mode's values, `metrics["train"]`); the row then
        averages these means over the rollouts."""
        names = sorted(logged)
        if accelerator.num_processes > 1:  # every process takes part in the reduction of every name
            names = sorted({name for part in gather_object([names]) for name in part})
        if not names:
            return
        stats = [[sum(logged.get(name, [])), len(logged.get(name, []))] for name in names]
        stats = torch.tensor(stats, dtype=torch.float64, device=accelerator.device)  # [M, 2]: sum, count
        if accelerator.num_processes > 1:
            stats = accelerator.reduce(stats, "sum")
        for name, (total, count) in zip(names, stats.tolist(), strict=True):
            into[name].append(total / count)

    def pop_means(self, mode: str, accelerator) -> dict[str, float]:
        """Each recorded name's mean over its values, averaged over processes; the values are then cleared. Every
        process must call it at the same step."""
        collected = self.modes[mode]
        keys = sorted(key for key, values in collected.items() if values)
        means = torch.tensor(
            [sum(collected[key]) / len(collected[key]) for key in keys],
            dtype=torch.float64,
            device=accelerator.device,
        )
        collected.clear()
        if keys and accelerator.num_processes > 1:
            means = accelerator.reduce(means, "mean")
        row = dict(zip(keys, means.tolist(), strict=True))
        if mode == "train" and row:
            self.last_train = row
        return row

    def state(self) -> dict[str, list[float]]:
        """The train values not yet logged, for a checkpoint's run state."""
        return {key: list(values) for key, values in self.modes["train"].items()}

    def load_state(self, values: dict[str, list[float]]) -> None:
        self.modes["train"] = defaultdict(list, values)
