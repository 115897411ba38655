"""MoE routing replay side by side: a short GRPO run on a tiny Qwen3-MoE with `router_replay` off, "r3" and "r2".

The toy tag task of `tests/test_trainer.py` (copy a letter between tags; vocabulary of 32 ids) on a Qwen3-MoE built
from config (4 decoder layers, 64 experts, top-8: the top-k of Qwen3-30B-A3B), with the `loop` engine. The weights
and the training forwards are float32 (`--dtype`); the rollout runs under bfloat16 autocast (`--rollout-dtype`), as
a bf16 inference engine serves a trainer that computes in higher precision, so some top-k choices differ between
the two. (On a CPU a bf16 model alone shows none: its decode steps and its training forward round the same way,
measured here 0 routes differing and a log-prob gap of 4e-8.) The weights are drawn with std 0.2, not the config's
0.02: at 0.02 the experts' outputs are too small for the choice of experts to move the log-probs (replaying the
bf16 routes in the fp32 forward left the gap at 7.5e-4; at 0.2 it goes from 1.3e-2 to 8.6e-3), where a trained
model's experts matter. Each mode runs in a process of its own (same seed, same data), so that its peak memory is
its own. Prints, per step and mode, the metrics the trainer logs:

- `router/route_mismatch`: the share of (token, layer) routes whose top-k set in the loss forward (before replay)
  differs from the rollout's; `router/token_mismatch`: the share of tokens with any differing layer;
- `router/logp_gap`: mean |log pi_train - log pi_rollout| over completion tokens; `router/k3_kl`: the k3 estimate of
  KL(rollout || train) (the engine records its log-probs for them: `Sampler.metric_logps`);

and the seconds and peak memory of each step (CUDA: peak allocated in the step; CPU: the process's peak RSS so
far). Then one line per mode: the means over the steps and the median step time after the first.

    python benchmarks/router_replay.py [--steps 10] [--modes off,r3,r2] [--rollout-dtype bfloat16] [--dtype float32]
                                       [--num-iterations 1]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
METRICS = ("router/route_mismatch", "router/token_mismatch", "router/logp_gap", "router/k3_kl")


def tiny_qwen3_moe(dtype, vocab_size: int, seed: int = 0):
    """4 decoder layers, 64 experts, top-8, hidden 64, over the toy tokenizer's ids. (More experts, more top-k
    boundaries a rounding can cross: under bf16 autocast on random inputs, 0.4% of routes differ with 8 experts top-2,
    3.7% with 64 top-8.)"""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, moe_intermediate_size=16, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=64, num_experts_per_tok=8,
        max_position_embeddings=64, pad_token_id=0, eos_token_id=1, bos_token_id=None, initializer_range=0.2,
    )  # fmt: skip
    return AutoModelForCausalLM.from_config(config).to(dtype)


def _step_clock():
    """A callback that times each optimizer step and reads its peak memory (MiB)."""
    import torch
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def __init__(self):
            self.seconds, self.peak_mib, self.began = [], [], 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            self.began = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
                self.peak_mib.append(torch.cuda.max_memory_allocated() / 2**20)
            else:
                self.peak_mib.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
            self.seconds.append(time.perf_counter() - self.began)

    return StepClock()


def rollout_under_autocast(sampler, dtype) -> None:
    """`sampler.sample` (every rollout: prompts, decode steps, the engine's log-probs and routes) under autocast."""
    import torch

    sample = sampler.sample
    device = "cuda" if torch.cuda.is_available() else "cpu"

    def sample_in_dtype(prompts, columns):
        with torch.autocast(device, dtype=dtype):
            return sample(prompts, columns)

    sampler.sample = sample_in_dtype


def run_mode(mode: str, steps: int, dtype_name: str, rollout_dtype_name: str, num_iterations: int) -> dict:
    """One GRPO run with `router_replay=mode`: per step, the router metrics, seconds and peak MiB."""
    import torch
    import transformers
    from transformers import PrinterCallback

    sys.path.insert(0, str(ROOT / "tests"))
    from test_trainer import build_toy_tokenizer, toy_dataset, toy_reward

    from grpo_hf import GRPOConfig, GRPOTrainer

    transformers.logging.set_verbosity_error()
    dtype = getattr(torch, dtype_name)
    tokenizer = build_toy_tokenizer()
    model = tiny_qwen3_moe(dtype, len(tokenizer))
    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(
            output_dir=out, per_device_train_batch_size=16, num_generations=4, max_completion_length=8,
            max_steps=steps, learning_rate=1e-3, beta=0.0, num_iterations=num_iterations,
            rollout_engine="loop", router_replay=mode, bf16=dtype == torch.bfloat16,
            use_cpu=not torch.cuda.is_available(), logging_steps=1, report_to="none", save_strategy="no",
            disable_tqdm=True, seed=0,
        )  # fmt: skip
        trainer = GRPOTrainer(
            model, toy_reward, args, train_dataset=toy_dataset(tokenizer), processing_class=tokenizer
        )
        trainer.remove_callback(PrinterCallback)
        if rollout_dtype_name != dtype_name:
            rollout_under_autocast(trainer.experience.sampler, getattr(torch, rollout_dtype_name))
        clock = _step_clock()
        trainer.add_callback(clock)
        trainer.train()
    rows = [row for row in trainer.state.log_history if any(name in row for name in METRICS)]
    return {
        "mode": mode,
        "metrics": [{name: row.get(name) for name in METRICS} for row in rows],
        "seconds": clock.seconds,
        "peak_mib": clock.peak_mib,
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "dtypes": f"weights and training {dtype_name}, rollout {rollout_dtype_name}",
    }


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _cell(value, width: int = 10) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.4g}"


def report(runs: list[dict]) -> None:
    short = ["route_mm", "token_mm", "logp_gap", "k3_kl"]
    print(f"{'step':>4} {'mode':>4} " + " ".join(f"{n:>10}" for n in [*short, "s/step", "peak MiB"]))
    for step in range(max(len(run["seconds"]) for run in runs)):
        for run in runs:
            metrics = run["metrics"][step] if step < len(run["metrics"]) else {}
            seconds = run["seconds"][step] if step < len(run["seconds"]) else None
            peak = run["peak_mib"][step] if step < len(run["peak_mib"]) else None
            cells = [_cell(metrics.get(name)) for name in METRICS] + [_cell(seconds), _cell(peak)]
            print(f"{step + 1:>4} {run['mode']:>4} " + " ".join(cells))
    print(f"\nmeans over the steps ({runs[0]['device']}, {runs[0]['dtypes']}); s/step: median after the first step")
    for run in runs:
        means = [_mean(m.get(name) for m in run["metrics"]) for name in METRICS]
        later = run["seconds"][1:] or run["seconds"]
        cells = means + [statistics.median(later) if later else None, max(run["peak_mib"], default=None)]
        print(f"{'':>4} {run['mode']:>4} " + " ".join(_cell(c) for c in cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--modes", default="off,r3,r2")
    parser.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"])
    parser.add_argument("--rollout-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--num-iterations", type=int, default=1)
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # one mode, in a process of its own
    parser.add_argument("--out", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.worker:
        run = run_mode(options.worker, options.steps, options.dtype, options.rollout_dtype, options.num_iterations)
        Path(options.out).write_text(json.dumps(run))
        return
    runs = []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in options.modes.split(","):
            out = Path(tmp) / f"{mode}.json"
            command = [sys.executable, __file__, "--worker", mode, "--out", str(out), "--steps", str(options.steps)]
            command += ["--dtype", options.dtype, "--rollout-dtype", options.rollout_dtype]
            command += ["--num-iterations", str(options.num_iterations)]
            subprocess.run(command, check=True, env=env, cwd=ROOT)
            runs.append(json.loads(out.read_text()))
    report(runs)


if __name__ == "__main__":
    main()
