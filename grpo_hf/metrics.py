"""The values a run records between two log rows, and their reduction into one row.

Each mode ("train", "eval") keeps, per metric name, the list of values recorded since the last row: one per
rollout (rewards, lengths), per micro-step (loss terms, entropy) or per optimizer step. A row holds each name's
mean over those values, then the mean over processes, which log at the same step.

The rewards of a generation batch become metrics here too (`reward_metrics`, TRL's names), after
`check_finite_rewards` has refused a reward that would turn the advantages into NaN.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch
from accelerate.utils import gather_object
from torch import Tensor

from grpo_hf.core import nan_group_std

MODES = ("train", "eval")
RATIO_PARTS = (" (numerator)", " (denominator)")  # the hidden names of a ratio's parts (`Metrics.add_ratio`)


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

    def add_ratio(self, mode: str, name: str, numerator: float, denominator: float) -> None:
        """Record a metric that a row logs as the sum of its numerators over the sum of its denominators, over the
        values since the last row and over processes (e.g. a share of tokens, over micro-batches of different sizes),
        not as a mean of ratios; a row where the denominators sum to 0 leaves it out. Each process records one pair
        per call site and step, as for every metric (the row divides the means, whose counts are then alike)."""
        self.modes[mode][name + RATIO_PARTS[0]].append(numerator)
        self.modes[mode][name + RATIO_PARTS[1]].append(denominator)

    def pop_means(self, mode: str, accelerator) -> dict[str, float]:
        """Each recorded name's mean over its values, averaged over processes; the values are then cleared, and the
        parts of a ratio (`add_ratio`) divided. Every process must call it at the same step."""
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
        row = _ratios(dict(zip(keys, means.tolist(), strict=True)))
        if mode == "train" and row:
            self.last_train = row
        return row

    def add_means(self, logs: dict[str, float], accelerator) -> str:
        """Put the means of the values recorded since the last row into Trainer's log row `logs` (`pop_means`), under
        Trainer's prefix: "eval_", or "eval_<split>_" for a dict of eval datasets. Returns the row's mode."""
        mode = "eval" if any(key.startswith("eval_") for key in logs) else "train"
        means = self.pop_means(mode, accelerator)
        if mode == "train" and "train_runtime" in logs and not means:
            # Trainer's end-of-training row: with every step already logged (logging_steps=1), it repeats the last
            # step's metrics, as TRL's does (logging_steps=10 leaves metrics unlogged there), for log_history[-1].
            means = self.last_train
        runtime = next((key for key in logs if key.startswith("eval_") and key.endswith("_runtime")), "eval_runtime")
        prefix = runtime.removesuffix("runtime") if mode == "eval" else ""
        logs.update({f"{prefix}{key}": value for key, value in means.items()})
        return mode

    def state(self) -> dict[str, list[float]]:
        """The train values not yet logged, for a checkpoint's run state."""
        return {key: list(values) for key, values in self.modes["train"].items()}

    def load_state(self, values: dict[str, list[float]]) -> None:
        self.modes["train"] = defaultdict(list, values)


def _ratios(row: dict[str, float]) -> dict[str, float]:
    """`row` with each ratio's parts (`Metrics.add_ratio`) replaced by their quotient (left out where the denominator
    is 0)."""
    top, bottom = RATIO_PARTS
    for key in [key for key in row if key.endswith(top)]:
        name = key.removesuffix(top)
        numerator, denominator = row.pop(key), row.pop(name + bottom)
        if denominator != 0:
            row[name] = numerator / denominator
    return row


def reward_metrics(rewards: Tensor, total: Tensor, names: Sequence[str], num_generations: int) -> dict[str, float]:
    """TRL's reward metrics of a generation batch: rewards [N, R] (NaN = None, one column per function in `names`)
    and their weighted sum `total` [N]. `reward_std` / `frac_reward_zero_std` need whole groups (N % G == 0)."""
    valid = ~torch.isnan(total)
    metrics = {"reward": total[valid].mean().item() if valid.any() else float("nan")}
    for k, name in enumerate(names):
        column = rewards[:, k]
        ok = ~torch.isnan(column)
        metrics[f"rewards/{name}/mean"] = column[ok].mean().item() if ok.any() else float("nan")
        metrics[f"rewards/{name}/std"] = column[ok].std().item() if ok.sum() > 1 else 0.0
    if total.numel() % num_generations == 0:
        group_std = nan_group_std(total.view(-1, num_generations))  # [N / G]
        metrics["reward_std"] = group_std.mean().item()
        metrics["frac_reward_zero_std"] = (group_std == 0).float().mean().item()
    return metrics


def length_metrics(lengths: Tensor, is_truncated: Tensor) -> dict[str, float]:
    """TRL's completion-length metrics of a generation batch, from every process's completions: their lengths [N]
    (the model's tokens) and `is_truncated` [N] (no EOS within max_completion_length). The `*_terminated_length`s
    are those of the completions that ended with EOS; when none did, TRL logs 0 for all three, and so do these."""
    lengths, truncated = lengths.float(), is_truncated.bool()
    terminated = lengths[~truncated]
    if terminated.numel() == 0:
        terminated = lengths.new_zeros(1)
    names = ("mean_length", "min_length", "max_length", "mean_terminated_length", "min_terminated_length")
    names += ("max_terminated_length", "clipped_ratio")
    values = [lengths.mean(), lengths.min(), lengths.max(), terminated.mean(), terminated.min(), terminated.max()]
    values.append(truncated.float().mean())
    return {f"completions/{name}": value for name, value in zip(names, torch.stack(values).tolist(), strict=True)}


def no_signal_warning(rewards: Tensor, names: Sequence[str], batches: int) -> str:
    """The warning for `batches` training generation batches in a row in which every group's rewards were all equal:
    what it means, which reward functions gave one value to every completion of the last batch (`rewards` [N, R],
    NaN = None; `names` one per column), and what to check."""
    constant = []
    for k, name in enumerate(names):
        column = rewards[:, k]
        given = column[~torch.isnan(column)]
        if given.numel() == 0:
            constant.append(f"{name!r} (None for every completion)")
        elif bool((given == given[0]).all()):
            constant.append(f"{name!r} ({given[0].item():g} for every completion)")
    if constant:
        which = f"Constant over the whole last batch: {', '.join(constant)}."
    else:
        which = (
            "No reward function is constant over the whole batch, but each gives one value per group: rewards that "
            "depend on the prompt (its columns) rather than on the completion."
        )
    return (
        f"No learning signal: in {batches} generation batches in a row, every group's completions got the same "
        f"reward (frac_reward_zero_std=1), so every advantage is 0 and the policy term of the loss is 0: the model "
        f"learns nothing from them (only a KL term, with beta > 0, moves it). {which} Check that each reward "
        "function reads the dataset column it needs (a column under another name, caught by **kwargs, often gives "
        "one value to all), that it can parse what the model writes (log_completions=True shows the completions "
        "and their rewards), and that the task is neither too hard nor too easy for the model. Said once per run."
    )


def check_finite_rewards(rewards: Tensor, names: Sequence[str]) -> None:
    """Raise when a reward in `rewards` [N, R] is infinite in its dtype (NaN means None and is allowed), naming the
    reward function and the row: e.g. 1e300 is finite in Python but inf in float32, and would turn the advantages,
    then the loss and the weights, into NaN."""
    bad = torch.isinf(rewards)  # [N, R]
    if bool(bad.any()):
        row, column = (int(k) for k in bad.nonzero()[0])
        raise ValueError(
            f"Reward function {names[column]!r} returned {rewards[row, column].item()} (after conversion to "
            f"{rewards.dtype}) for completion {row} of this batch: rewards must be finite and within the range of "
            f"{rewards.dtype}. Return None for 'no reward', or clip/scale the reward."
        )
