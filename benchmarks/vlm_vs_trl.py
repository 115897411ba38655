"""grpo_hf's GRPOTrainer against TRL's on a vision-language model, side by side: seconds per optimizer step and peak
memory (docs/vision.md, docs/benchmarks.md).

Both trainers get the same Qwen2-VL-shaped model built from a config (`tests/tiny_vlm.py`, widened: 4 text layers of
256, a 4-layer vision tower of 256; random weights, same seed), the same processor, the same 16 prompts each with
its own 112x112 image (16 image tokens), the same reward (a function of the completion's token ids) and every shared
knob set explicitly (`_worker.common_config`: 2 prompts x G=8 per step, beta=0.04, fp32, AdamW, lr 1e-6). Each run is
a fresh subprocess; the two alternate and their order flips every repetition. Configs:

    full:   every parameter trains (TRL's default, and grpo_hf's without LoRA)
    frozen: the vision tower is frozen (model.model.visual.requires_grad_(False)) for both

A run makes `--steps` optimizer steps; the table gives the median seconds per step over all but each run's first,
the median peak RSS, and the ratios (grpo_hf over TRL).

    python benchmarks/vlm_vs_trl.py                        # configs full,frozen; --reps 1 --steps 4
    python benchmarks/vlm_vs_trl.py --configs frozen --reps 2 --steps 5

The last line is `time_ratio=X.XX memory_ratio=Y.YY` for the first config: grpo_hf's seconds per step over TRL's,
and grpo_hf's peak RSS over TRL's.
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

HERE = Path(__file__).resolve().parent
NUM_PROMPTS = 16
MAX_COMPLETION_LENGTH = 64


def reward(completions, completion_ids, **kwargs):
    """A reward that differs between completions, from their token ids (both trainers' signature)."""
    return [float(sum(ids) % 7) for ids in completion_ids]


def build(impl: str, config: str, steps: int, seed: int, output_dir: str):
    """The trainer of `impl` ("trl" or "grpo_hf") for `config`, with the shared model, data and settings."""
    sys.path.insert(0, str(HERE))
    sys.path.insert(1, str(HERE.parent / "tests"))
    sys.path.insert(2, str(HERE.parent))
    import _worker
    import torch
    from datasets import Dataset
    from tiny_vlm import image, tiny_qwen2_vl
    from transformers import Qwen2VLForConditionalGeneration

    model, processor = tiny_qwen2_vl(seed=seed, hidden_size=256, vision_depth=4, vision_dim=256)
    model.save_pretrained(os.path.join(output_dir, "model"))  # TRL loads its reference model from the path
    model = Qwen2VLForConditionalGeneration.from_pretrained(os.path.join(output_dir, "model"), dtype=torch.float32)
    if config == "frozen":
        model.model.visual.requires_grad_(False)
    prompts = [[{"role": "user", "content": f"Describe picture {k}."}] for k in range(NUM_PROMPTS)]
    rows = [{"prompt": prompt, "image": image(k, 112, 112)} for k, prompt in enumerate(prompts)]
    use_cpu = not torch.cuda.is_available()
    kwargs = _worker.common_config("a", steps, seed, bf16=False, use_cpu=use_cpu, output_dir=output_dir)
    kwargs.update(max_completion_length=MAX_COMPLETION_LENGTH, reward_weights=[1.0])
    if impl == "trl":
        from trl import GRPOConfig, GRPOTrainer

        kwargs.update(_worker.trl_only_config())
    else:
        from grpo_hf import GRPOConfig, GRPOTrainer

        kwargs.update(_worker.grpo_hf_only_config())
    return GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=GRPOConfig(**kwargs),
        train_dataset=Dataset.from_list(rows),
        processing_class=processor,
    )


def worker(impl: str, config: str, steps: int, seed: int, out: str) -> None:
    from transformers import TrainerCallback

    with tempfile.TemporaryDirectory() as tmp:
        trainer = build(impl, config, steps, seed, tmp)
        seconds: list[float] = []

        class Clock(TrainerCallback):
            def on_step_begin(self, *_, **__):
                self.start = time.perf_counter()

            def on_step_end(self, *_, **__):
                seconds.append(time.perf_counter() - self.start)

        trainer.add_callback(Clock())
        trainer.train()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    Path(out).write_text(json.dumps({"step_seconds": seconds, "peak_rss_mib": peak}))


def run(impl: str, config: str, steps: int, seed: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        command = [sys.executable, __file__, "--worker", impl, "--configs", config, "--steps", str(steps)]
        result = subprocess.run([*command, "--seed", str(seed), "--out", out], capture_output=True, text=True)
        if result.returncode != 0 or not os.path.exists(out):
            sys.stderr.write(result.stdout[-3000:] + result.stderr[-6000:])
            raise SystemExit(f"{impl} run of config {config} failed with exit code {result.returncode}")
        return json.loads(Path(out).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="full,frozen")
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--worker", choices=["trl", "grpo_hf"])
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.configs, args.steps, args.seed, args.out)
    print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    ratios = []
    print("| config | trainer | s/step | peak RSS (MiB) |\n|---|---|---:|---:|")
    for config in args.configs.split(","):
        results = {"trl": [], "grpo_hf": []}
        for rep in range(args.reps):
            for impl in ("trl", "grpo_hf") if rep % 2 == 0 else ("grpo_hf", "trl"):
                results[impl].append(run(impl, config, args.steps, args.seed))
        summary = {}
        for impl, runs in results.items():
            per_step = statistics.median(s for r in runs for s in r["step_seconds"][1:])
            peak = statistics.median(r["peak_rss_mib"] for r in runs)
            summary[impl] = (per_step, peak)
            print(f"| {config} | {impl} | {per_step:.2f} | {peak:.0f} |")
        ratios.append((summary["grpo_hf"][0] / summary["trl"][0], summary["grpo_hf"][1] / summary["trl"][1]))
        print(f"| {config} | grpo_hf / TRL | {ratios[-1][0]:.2f}x | {ratios[-1][1]:.2f}x |")
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    print(f"time_ratio={ratios[0][0]:.2f} memory_ratio={ratios[0][1]:.2f}")


if __name__ == "__main__":
    main()
