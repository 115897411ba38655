"""The completions table of `log_completions`: rows per rollout, written at each log as TRL writes them
(`completions/completions_<step>.parquet`), appended to `completions.jsonl`, printed, sent to wandb / trackio as a
table (one row per prompt with `log_unique_prompts`), and pushed to a Hub dataset (`log_completions_hub_repo`)."""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any

import torch
from tqdm.auto import tqdm

from grpo_hf.rollout.prompts import is_conversational

logger = logging.getLogger(__name__)


def completion_rows(
    prompts: list,
    texts: list[str],
    names: list[str],
    rewards: torch.Tensor,
    advantages: torch.Tensor,
    extra: list[dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """A row per completion: the prompt (its last message), the completion, its rewards [B, R], the columns reward
    functions logged for it with `log_extra` (`extra`, a dict per row; TRL's extra columns, top-level keys: a name
    that is one of the fixed keys becomes `extra/<name>`), and its advantage [B]. Their "step" is set when they are
    written (`CompletionLog.write`)."""

    def as_text(prompt):
        return prompt[-1]["content"] if is_conversational(prompt) else prompt

    def columns(logged: dict[str, Any]) -> dict[str, Any]:
        return {(f"extra/{k}" if k in _FIXED_KEYS else k): v for k, v in logged.items()}

    extra = extra if extra is not None else [{}] * len(texts)
    return [
        {
            "step": None,
            "prompt": as_text(p),
            "completion": c,
            "rewards": dict(zip(names, r, strict=True)),
            **columns(x),
            "advantage": a,
        }
        for p, c, r, x, a in zip(prompts, texts, rewards.tolist(), extra, advantages.tolist(), strict=True)
    ]


_FIXED_KEYS = ("step", "prompt", "completion", "rewards", "advantage")


def write_completions(rows: list[dict[str, Any]], output_dir: str, step: int, num_to_print: int | None) -> None:
    """Append `rows` to `output_dir/completions.jsonl` and print the first `num_to_print` (None: all)."""
    os.makedirs(output_dir, exist_ok=True)
    for k, row in enumerate(rows):
        if row.get("images"):  # log_multimodal: the row's images, as files beside the log
            row["images"] = save_images(row["images"], os.path.join(output_dir, "completion_images"), f"{step}-{k}")
    with open(os.path.join(output_dir, "completions.jsonl"), "a", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False, default=str) + "\n")
    shown = rows[:num_to_print] if num_to_print else rows
    lines = [f"completions at step {step}:"]
    for row in shown:
        rewards = " ".join(f"{k}={v:.3g}" for k, v in row["rewards"].items())
        extra = "".join(f"  {k}: {_short(v)}" for k, v in row.items() if k not in _FIXED_KEYS)
        lines.append(
            f"  prompt: {row['prompt'][-80:]!r}\n  completion: {row['completion'][:200]!r}\n"
            f"  rewards: {rewards}  advantage: {row['advantage']:+.3f}{extra}"
        )
    # A display the user asked for (log_completions), written beside the progress bar.
    tqdm.write("\n".join(lines))


def save_images(images: list, directory: str, stem: str) -> list[str]:
    """Save each image (a PIL image; anything else is kept as its text) as `directory/<stem>-<i>.png`; returns the
    paths, relative to the output directory."""
    os.makedirs(directory, exist_ok=True)
    paths = []
    for i, image in enumerate(images):
        if not hasattr(image, "save"):
            paths.append(str(image))
            continue
        path = os.path.join(directory, f"{stem}-{i}.png")
        image.save(path)
        paths.append(os.path.join(os.path.basename(directory), os.path.basename(path)))
    return paths


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value) if not isinstance(value, str) else value
    return text if len(text) <= limit else text[: limit - 3] + "..."


class CompletionLog:
    """Where `log_completions` rows go at each log, on the main process (`write`). The table's columns are TRL's:
    step, prompt, completion, one per reward function, the columns reward functions logged, advantage; the prompt
    is its text (a chat prompt's last message) and the completion its text."""

    def __init__(self, args):
        self.args = args
        self.folder = os.path.join(args.output_dir, "completions")
        self.hub_repo = args.log_completions_hub_repo
        self.api = None  # a `huggingface_hub.HfApi`, made when the first file is pushed

    def write(self, rows: list[dict[str, Any]], step: int, mode: str = "train", main: bool = True) -> None:
        """`rows` of the latest rollout (training) or of the evaluation (mode "eval", files `eval_completions_*`),
        logged at `step`, the trainer's global step then (TRL's "step" column: the optimizer steps taken when the row
        is logged, so the first training step's rows say 1); only on the main process (`main`)."""
        if not main:
            return
        rows = [{**row, "step": step} for row in rows]
        write_completions(rows, self.args.output_dir, step, self.args.num_completions_to_print)
        table = completions_table(rows)
        os.makedirs(self.folder, exist_ok=True)
        name = f"{'eval_' if mode == 'eval' else ''}completions_{step:05d}.parquet"
        table.to_parquet(os.path.join(self.folder, name))
        self._report(table.drop_duplicates("prompt") if self.args.log_unique_prompts else table, mode)
        if self.hub_repo is not None:
            self._push(name)

    def _report(self, table, mode: str) -> None:
        """The table to the experiment trackers among `report_to` that take one (wandb, trackio), if running."""
        key = "eval/completions" if mode == "eval" else "completions"
        for name in ("wandb", "trackio"):
            backend = sys.modules.get(name)  # imported by its transformers callback when it reports
            if name in (self.args.report_to or []) and backend is not None:
                if name == "wandb" and backend.run is None:
                    continue
                backend.log({key: backend.Table(dataframe=table)})

    def _push(self, name: str) -> None:
        """Upload the file to the Hub dataset repository, creating it (private per `hub_private_repo`) at first use;
        the upload runs in the background, as TRL's commit scheduler does."""
        if self.api is None:
            from huggingface_hub import HfApi

            self.api = HfApi()
            private = bool(self.args.hub_private_repo)
            self.api.create_repo(self.hub_repo, repo_type="dataset", private=private, exist_ok=True)
        self.api.upload_file(
            path_or_fileobj=os.path.join(self.folder, name),
            path_in_repo=f"completions/{name}",
            repo_id=self.hub_repo,
            repo_type="dataset",
            run_as_future=True,
        )


def completions_table(rows: list[dict[str, Any]]):
    """TRL's completions table (a pandas DataFrame): the rewards dict of each row spread into one column per reward
    function, after step, prompt and completion, and before the logged columns and the advantage."""
    import pandas as pd

    flat = [
        {
            **{k: row[k] for k in ("step", "prompt", "completion")},
            **row["rewards"],
            **{k: v for k, v in row.items() if k not in _FIXED_KEYS},
            "advantage": row["advantage"],
        }
        for row in rows
    ]
    return pd.DataFrame(flat)
