"""Where one grpo_hf optimizer step spends its time: generation, rewards, no-grad log-probs, loss forward/backward.

Builds the trainer of a `benchmarks/vs_trl.py` config (same model, data and knobs: `_worker.build_trainer`), wraps the
phases of a step with wall-clock timers (the device synchronised), trains `--steps` steps and prints the seconds per
step of each phase, the first step excluded. Phases:

- `generate`: sampling the completions (the rollout engine's `generate`);
- `rewards`: the reward functions;
- `no-grad log-probs`: old (only when the policy moves between generation and use) and reference log-probs, once
  per generation batch;
- `loss forward + backward`: the policy's log-probs, the loss and its backward pass;
- `optimizer and rest`: the rest of the step (gradient clipping, AdamW, scheduler, logging).

    python benchmarks/profile_step.py                  # config a: beta=0.04, num_iterations=1
    python benchmarks/profile_step.py --config c --extra '{"share_prompt_prefix": false}'
    python benchmarks/profile_step.py --device cuda --config J1
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _worker  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", choices=list(_worker.CONFIGS), default="a")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--tiny", action="store_true", help="A tiny random model, G=2, 1/16 of the tokens.")
    parser.add_argument("--steps", type=int, default=4, help="Optimizer steps, the first untimed (default 4).")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast (always on with CUDA).")
    parser.add_argument("--extra", default="{}", help="JSON dict of extra grpo_hf config fields.")
    args = parser.parse_args()
    if args.steps < 2:
        raise SystemExit("--steps must be at least 2: the first one is not timed.")

    import torch
    import transformers
    from transformers import TrainerCallback

    import grpo_hf.experience as experience_module
    import grpo_hf.trainer as trainer_module
    from grpo_hf.logprobs import LogprobPath
    from grpo_hf.rollout import RolloutEngine

    transformers.logging.set_verbosity_error()
    phases: list[dict[str, float]] = []  # one dict of seconds per phase for each optimizer step
    current: dict[str, float] = defaultdict(float)

    def timed(name: str, fn):
        @functools.wraps(fn)
        def wrapper(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                current[name] += time.perf_counter() - start

        return wrapper

    cls = trainer_module.GRPOTrainer
    RolloutEngine.generate = timed("generate", RolloutEngine.generate)
    experience_module.compute_rewards = timed("rewards", experience_module.compute_rewards)
    LogprobPath.no_grad = timed("no-grad log-probs", LogprobPath.no_grad)
    training_step = cls.training_step
    inner = ("generate", "rewards", "no-grad log-probs")

    def timed_training_step(self, *a, **k):
        before = sum(current[name] for name in inner)
        start = time.perf_counter()
        loss = training_step(self, *a, **k)
        # training_step = the timed phases (from _prepare_inputs) + the policy's forward, loss and backward.
        elapsed = time.perf_counter() - start
        current["loss forward + backward"] += elapsed - (sum(current[name] for name in inner) - before)
        return loss

    cls.training_step = timed_training_step

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *_, **__):
            current.clear()
            self.start = time.perf_counter()

        def on_step_end(self, *_, **__):
            total = time.perf_counter() - self.start
            step = dict(current)
            step["optimizer and rest"] = total - sum(step.values())
            step["total"] = total
            phases.append(step)

    device = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    extra = json.loads(args.extra)
    print(f"# profile_step: config {args.config}, {device}, {args.steps} steps, extra {extra}", flush=True)
    with tempfile.TemporaryDirectory() as output_dir:
        options = dict(bf16=args.bf16 or args.device == "cuda", tiny=args.tiny)
        trainer = _worker.build_trainer(
            "grpo_hf", args.config, args.steps, args.seed, args.device, output_dir, extra, **options
        )
        trainer.add_callback(StepTimer())
        trainer.train()

    timed_steps = phases[1:]
    names = ["generate", "rewards", "no-grad log-probs", "loss forward + backward", "optimizer and rest", "total"]
    total = statistics.fmean(step["total"] for step in timed_steps)
    print(f"\n| phase | s/step (mean of {len(timed_steps)}) | share |\n|---|---:|---:|")
    for name in names:
        seconds = statistics.fmean(step.get(name, 0.0) for step in timed_steps)
        print(f"| {name} | {seconds:.2f} | {seconds / total:.0%} |")


if __name__ == "__main__":
    main()
