"""bf16 weights learn with fp32 master weights and do not without: the toy tag task, three ways, side by side.

The task of `tests/test_trainer.py::test_toy_task_learns_from_scratch` (a tiny Llama trained from scratch to write
`<think> ... </think> <answer> X </answer>` and copy a letter) at a learning rate at which most AdamW steps on bf16
weights round away (`--lr`, default 3e-5; weights of ~0.02 have a bf16 half-spacing of ~6e-5): fp32 weights (the
reference); bf16 weights with fp32 master weights (the default); bf16 weights with `fp32_master_weights=False`. Prints
per run the mean reward and entropy over the first and last 10 steps, the L1 distance the weights moved and the logged
`precision/lost_updates`. A few minutes on a CPU (bf16 backward matmuls are slow without AMX).

    python benchmarks/bf16_toy.py [--steps 100] [--lr 3e-5]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def run(dtype: torch.dtype, master_weights: bool, steps: int, lr: float) -> dict:
    import transformers
    from test_trainer import build_toy_model, build_toy_tokenizer, toy_dataset, toy_reward
    from transformers import PrinterCallback

    from grpo_hf import GRPOConfig, GRPOTrainer

    transformers.logging.set_verbosity_error()
    tokenizer = build_toy_tokenizer()
    dataset = toy_dataset(tokenizer)
    model = build_toy_model().to(dtype)
    start = [p.detach().float().clone() for p in model.parameters()]
    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(
            output_dir=out,
            per_device_train_batch_size=32,
            num_generations=8,
            max_completion_length=6,
            max_steps=steps,
            learning_rate=lr,
            beta=0.0,
            loss_type="dr_grpo",
            scale_rewards="none",
            lr_scheduler_type="constant",
            bf16=dtype == torch.bfloat16,
            fp32_master_weights=master_weights,
            lost_update_check_steps=10,
            use_cpu=True,
            report_to="none",
            save_strategy="no",
            disable_tqdm=True,
            seed=0,
        )
        trainer = GRPOTrainer(model, toy_reward, args, train_dataset=dataset, processing_class=tokenizer)
        trainer.remove_callback(PrinterCallback)  # the table below is the output
        began = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - began
    history = trainer.state.log_history
    rewards = [row["reward"] for row in history if "reward" in row]
    entropy = [row["entropy"] for row in history if "entropy" in row]
    lost = [row["precision/lost_updates"] for row in history if "precision/lost_updates" in row]
    moved = sum((p.detach().float() - s).abs().sum().item() for p, s in zip(model.parameters(), start, strict=True))
    return {
        "first": sum(rewards[:10]) / 10,
        "last": sum(rewards[-10:]) / 10,
        "entropy": (sum(entropy[:10]) / 10, sum(entropy[-10:]) / 10),
        "moved": moved,
        "lost": lost,
        "seconds": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--lr", type=float, default=3e-5)
    args = parser.parse_args()
    runs = [
        ("fp32 weights", torch.float32, True),
        ("bf16 weights + fp32 masters", torch.bfloat16, True),
        ("bf16 weights, no masters", torch.bfloat16, False),
    ]
    print(f"toy tag task, {args.steps} steps, lr {args.lr:g}, AdamW, 32 completions per step")
    print("| weights | reward, first 10 | reward, last 10 | entropy, first → last 10 | L1 moved | lost updates | s |")
    print("|---|---:|---:|---:|---:|---|---:|")
    for name, dtype, masters in runs:
        r = run(dtype, masters, args.steps, args.lr)
        lost = ", ".join(f"{x:.2f}" for x in r["lost"])
        entropy = f"{r['entropy'][0]:.3f} → {r['entropy'][1]:.3f}"
        numbers = [f"{r['first']:.3f}", f"{r['last']:.3f}", entropy, f"{r['moved']:.2f}", lost, f"{r['seconds']:.0f}"]
        cells = [name, *numbers]
        print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
