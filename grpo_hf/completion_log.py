"""The completions table of `log_completions`: rows per rollout, appended to `completions.jsonl` and printed."""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from tqdm.auto import tqdm

from grpo_hf.rollout.prompts import is_conversational


def completion_rows(
    step: int,
    prompts: list,
    texts: list[str],
    names: list[str],
    rewards: torch.Tensor,
    advantages: torch.Tensor,
    extra: list[dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """A row per completion: the prompt (its last message), the completion, its rewards [B, R], the columns reward
    functions logged for it with `log_extra` (`extra`, a dict per row; TRL's extra columns, top-level keys: a name
    that is one of the fixed keys becomes `extra/<name>`), and its advantage [B]."""

    def as_text(prompt):
        return prompt[-1]["content"] if is_conversational(prompt) else prompt

    def columns(logged: dict[str, Any]) -> dict[str, Any]:
        return {(f"extra/{k}" if k in _FIXED_KEYS else k): v for k, v in logged.items()}

    extra = extra if extra is not None else [{}] * len(texts)
    return [
        {
            "step": step,
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
