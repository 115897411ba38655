"""The completions table of `log_completions`: rows per rollout, appended to `completions.jsonl` and printed."""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from tqdm.auto import tqdm

from grpo_hf.rollout.prompts import is_conversational


def completion_rows(
    step: int, prompts: list, texts: list[str], names: list[str], rewards: torch.Tensor, advantages: torch.Tensor
) -> list[dict[str, Any]]:
    """A row per completion: the prompt (its last message), the completion, its rewards [B, R], its advantage [B]."""

    def as_text(prompt):
        return prompt[-1]["content"] if is_conversational(prompt) else prompt

    return [
        {
            "step": step,
            "prompt": as_text(p),
            "completion": c,
            "rewards": dict(zip(names, r, strict=True)),
            "advantage": a,
        }
        for p, c, r, a in zip(prompts, texts, rewards.tolist(), advantages.tolist(), strict=True)
    ]


def write_completions(rows: list[dict[str, Any]], output_dir: str, step: int, num_to_print: int | None) -> None:
    """Append `rows` to `output_dir/completions.jsonl` and print the first `num_to_print` (None: all)."""
    os.makedirs(output_dir, exist_ok=True)
    with open(os.path.join(output_dir, "completions.jsonl"), "a", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    shown = rows[:num_to_print] if num_to_print else rows
    lines = [f"completions at step {step}:"]
    for row in shown:
        rewards = " ".join(f"{k}={v:.3g}" for k, v in row["rewards"].items())
        lines.append(
            f"  prompt: {row['prompt'][-80:]!r}\n  completion: {row['completion'][:200]!r}\n"
            f"  rewards: {rewards}  advantage: {row['advantage']:+.3f}"
        )
    # A display the user asked for (log_completions), written beside the progress bar.
    tqdm.write("\n".join(lines))
