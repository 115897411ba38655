"""Where one grpo_hf optimizer step spends its time: generation, rewards, no-grad log-probs, loss forward/backward.

Trains a `benchmarks/vs_trl.py` config with grpo_hf in one worker process (`benchmarks/_worker.py`, which times these
phases inside every step, the device synchronised) and prints the seconds per step of each phase, the first step
excluded: `generate` (the rollout engine's `generate`); `rewards` (the reward functions); `no-grad log-probs` (old
log-probs, only when the policy moves between generation and use, and reference log-probs, once per generation
batch); `loss forward + backward` (the rest of `training_step`: the policy's log-probs, the loss, its backward);
`optimizer and rest` (the rest of the step: gradient clipping, AdamW, scheduler, logging).

    python benchmarks/profile_step.py                  # config a: beta=0.04, num_iterations=1
    python benchmarks/profile_step.py --config c --extra '{"share_prompt_prefix": false}'
    python benchmarks/profile_step.py --device cuda --config J1
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

WORKER = Path(__file__).with_name("_worker.py")
PHASES = ["generate", "rewards", "no-grad log-probs", "loss forward + backward", "optimizer and rest", "total"]


def phases(record: dict, step: int) -> dict[str, float]:
    inside = record["phases"][step]
    generate, total = record["generate_seconds"][step], record["step_seconds"][step]
    rewards, no_grad = inside.get("rewards", 0.0), inside.get("no-grad log-probs", 0.0)
    loss = inside["training_step"] - generate - rewards - no_grad  # training_step holds the rollout (_prepare_inputs)
    rest = total - inside["training_step"]
    return dict(zip(PHASES, (generate, rewards, no_grad, loss, rest, total), strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="a", help="A config of benchmarks/_worker.py (default a).")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--tiny", action="store_true", help="A tiny random model, G=2, 1/16 of the tokens.")
    parser.add_argument("--steps", type=int, default=4, help="Optimizer steps, the first untimed (default 4).")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast (always on with CUDA).")
    parser.add_argument("--extra", default="{}", help="JSON dict of extra grpo_hf config fields.")
    args = parser.parse_args()
    if args.steps < 2:
        raise SystemExit("--steps must be at least 2: the first one is not timed.")
    print(f"# profile_step: config {args.config}, {args.device}, {args.steps} steps, extra {args.extra}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "run.json")
        command = [sys.executable, str(WORKER), "--impl", "grpo_hf", "--config", args.config, "--device", args.device]
        command += ["--steps", str(args.steps), "--seed", str(args.seed), "--extra", args.extra, "--out", str(out)]
        command += ["--bf16"] * (args.bf16 or args.device == "cuda") + ["--tiny"] * args.tiny
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise SystemExit(f"the run failed:\n{result.stderr[-6000:]}")
        record = json.loads(out.read_text())
    timed = [phases(record, step) for step in range(1, len(record["step_seconds"]))]
    total = statistics.fmean(step["total"] for step in timed)
    print(f"\n| phase | s/step (mean of {len(timed)}) | share |\n|---|---:|---:|")
    for name in PHASES:
        seconds = statistics.fmean(step[name] for step in timed)
        print(f"| {name} | {seconds:.2f} | {seconds / total:.0%} |")


if __name__ == "__main__":
    main()
