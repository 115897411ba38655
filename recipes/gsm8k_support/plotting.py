"""Training curves from `Trainer.state.log_history`, drawn with matplotlib (Agg backend, no display needed).

One panel per quantity against the optimizer step: the total reward and each `rewards/<func>/mean`, with tools
`tools/call_frequency` (calls per completion), `tools/failure_frequency` (failed calls per call) and
`tools/turns_mean`, then `kl`, `completions/mean_length` and `clip_ratio/region_mean` (the metric names of
docs/design.md ("The maths") and docs/tools.md). Series that were never logged are skipped, so a run with `beta=0`
simply has no KL panel, and one without tools no tool panels. Several runs (a dict of label -> log history, as the
tool demo's arms and seeds) share the panels, one line per run and series.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

logger = logging.getLogger(__name__)

_PANELS = [
    ("Reward", lambda key: key == "reward" or (key.startswith("rewards/") and key.endswith("/mean"))),
    ("Tool calls per completion", lambda key: key == "tools/call_frequency"),
    ("Failed calls per call", lambda key: key == "tools/failure_frequency"),
    ("Model turns per episode", lambda key: key == "tools/turns_mean"),
    ("KL to reference", lambda key: key == "kl"),
    ("Completion length (tokens)", lambda key: key == "completions/mean_length"),
    ("Clip ratio", lambda key: key == "clip_ratio/region_mean"),
]


def _series(log_history: Iterable[dict], key: str) -> tuple[list[float], list[float]]:
    steps, values = [], []
    for entry in log_history:
        if key in entry and "step" in entry and isinstance(entry[key], (int, float)):
            steps.append(entry["step"])
            values.append(float(entry[key]))
    return steps, values


def plot_training_curves(
    log_history: list[dict] | dict[str, list[dict]], path: str | os.PathLike, title: str | None = None
) -> str | None:
    """Write the training curves of `log_history` to `path` (PNG); return the path, or None if nothing was logged.
    `log_history` is one run's `Trainer.state.log_history`, or a dict of run label -> log history: each line is then
    labelled "<run>: <key>". A reward function's mean is left out of several runs' reward panel when it is the run's
    only one (it repeats `reward`).

    Training entries are used: not evaluation entries (keys starting with `eval_`), nor the end-of-training row
    (`train_runtime`), which repeats the last step's metrics.
    """
    runs = log_history if isinstance(log_history, dict) else {"": log_history}
    runs = {
        label: [e for e in log if "train_runtime" not in e and not any(k.startswith("eval_") for k in e)]
        for label, log in runs.items()
    }
    panels = []
    for panel_title, wanted in _PANELS:
        series = {}
        for label, log in runs.items():
            keys = sorted({k for e in log for k in e if wanted(k)})
            if len(runs) > 1 and "reward" in keys and len(keys) == 2:
                keys = ["reward"]
            for k in keys:
                series[f"{label}: {k}" if label else k] = _series(log, k)
        series = {k: v for k, v in series.items() if v[0]}
        if series:
            panels.append((panel_title, series))
    if not panels:
        logger.warning("No training metrics in the log history; %s not written.", path)
        return None

    cols = 2 if len(panels) > 1 else 1
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 3.5 * rows), squeeze=False)
    for ax, (panel_title, series) in zip(axes.flat, panels, strict=False):
        for key, (steps, values) in series.items():
            ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3, label=key)
        ax.set_title(panel_title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if len(series) > 1 or panel_title == "Reward":
            ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    logger.info("Wrote training curves to %s", path)
    return str(path)
