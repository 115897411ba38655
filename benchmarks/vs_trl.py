"""grpo_hf's GRPOTrainer against TRL's, side by side: time per optimizer step, throughput, peak memory, reward.

Both trainers get the same model (the offline SmolLM2-135M-Instruct), the same prompts (the built-in GSM8K-style
arithmetic set, chat-formatted, `####` answer format), the same reward functions (`accuracy_reward` +
`gsm8k_format_reward`), the same seed and every shared knob set explicitly (`_worker.common_config`). Each run is a
fresh subprocess (`benchmarks/_worker.py`); the two trainers alternate, and their order flips every repetition.

Configs (2 prompts x G=8 = 16 completions per optimizer step, max_completion_length=128, loss_type="grpo"):

    a: beta=0.04, num_iterations=1     b: as a, num_iterations=2     c: as a, beta=0

A run makes `--rollouts` rollouts, i.e. rollouts x num_iterations optimizer steps. Per config and trainer the table
gives the median seconds per optimizer step over the timed rollouts (all but each run's first; with
num_iterations=2, a rollout's two steps are averaged, as a step that generates and one that reuses alternate),
completion tokens generated per second, the median peak RSS (and peak CUDA memory on a GPU), the mean reward over all
rollouts of all runs, and the ratios. On CUDA both trainers use bf16 autocast; on CPU fp32 unless `--bf16`.

    python benchmarks/vs_trl.py                       # configs a,b,c; --reps 2 --rollouts 3
    python benchmarks/vs_trl.py --quick               # config a, 1 repetition
    python benchmarks/vs_trl.py --configs a --reps 3 --rollouts 5 --json results.json
    python benchmarks/vs_trl.py --configs a --ablate '{"share_prompt_prefix": false}'   # grpo_hf vs itself

The last line is `speedup=X.XX memory_ratio=Y.YY` for config a (the first config run when a is not): TRL's
seconds per step over grpo_hf's, and grpo_hf's peak memory (CUDA on a GPU, else RSS) over TRL's. With `--ablate`,
the same for grpo_hf with the given settings against grpo_hf without them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKER = Path(__file__).with_name("_worker.py")
NUM_ITERATIONS = {"a": 1, "b": 2, "c": 1}
DESCRIPTIONS = {"a": "beta=0.04, mu=1", "b": "beta=0.04, mu=2", "c": "beta=0, mu=1"}


def run_worker(impl: str, config: str, steps: int, seed: int, bf16: bool, threads: int | None, extra: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        command = [sys.executable, str(WORKER), "--impl", impl, "--config", config, "--steps", str(steps)]
        command += ["--seed", str(seed), "--out", out, "--extra", json.dumps(extra)]
        if bf16:
            command.append("--bf16")
        env = dict(os.environ)
        if threads is not None:
            env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
        result = subprocess.run(command, capture_output=True, text=True, env=env)
        if result.returncode != 0 or not os.path.exists(out):
            sys.stderr.write(result.stdout[-3000:] + result.stderr[-6000:])
            raise SystemExit(f"{impl} run of config {config} (seed {seed}) failed with exit code {result.returncode}")
        with open(out) as f:
            return json.load(f)


def timed_windows(run: dict, num_iterations: int) -> tuple[list[float], list[float]]:
    """Seconds per step and completion tokens of each window of `num_iterations` steps, the first window dropped."""
    seconds, tokens = run["step_seconds"], run["completion_tokens"]
    windows = [
        (sum(seconds[k : k + num_iterations]) / num_iterations, sum(tokens[k : k + num_iterations]))
        for k in range(0, len(seconds) - num_iterations + 1, num_iterations)
    ][1:]
    return [w[0] for w in windows], [w[1] for w in windows]


def summarise(runs: list[dict], num_iterations: int) -> dict:
    per_step, tokens = [], []
    for run in runs:
        s, t = timed_windows(run, num_iterations)
        per_step += s
        tokens += t
    rewards = [r for run in runs for r in run["rewards"]]
    cuda = [run["peak_cuda_mib"] for run in runs if run["peak_cuda_mib"] is not None]
    return {
        "s_per_step": statistics.median(per_step),
        "tokens_per_s": sum(tokens) / (sum(per_step) * num_iterations),
        "peak_rss_mib": statistics.median(run["peak_rss_mib"] for run in runs),
        "peak_cuda_mib": statistics.median(cuda) if cuda else None,
        "reward": statistics.fmean(rewards),
        "reward_se": statistics.stdev(rewards) / len(rewards) ** 0.5 if len(rewards) > 1 else float("nan"),
        "num_rollouts": len(rewards),
        "timed_steps": len(per_step) * num_iterations,
    }


def table(summaries: dict, labels: tuple[str, str], on_gpu: bool) -> str:
    memory = "peak CUDA MiB" if on_gpu else "peak RSS MiB"
    lines = [
        f"| config | trainer | s/step (median) | completion tok/s | {memory} | mean reward (± s.e.) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for config, by_label in summaries.items():
        for label in labels:
            s = by_label[label]
            mem = s["peak_cuda_mib"] if on_gpu else s["peak_rss_mib"]
            lines.append(
                f"| {config} ({DESCRIPTIONS[config]}) | {label} | {s['s_per_step']:.2f} | {s['tokens_per_s']:.1f} | "
                f"{mem:,.0f} | {s['reward']:.3f} ± {s['reward_se']:.3f} |"
            )
        r = ratios(by_label, labels, on_gpu)
        lines.append(
            f"| {config} | **{labels[1]} / {labels[0]}** | **{1 / r['speedup']:.2f}x time "
            f"({r['speedup']:.2f}x faster)** | {r['throughput']:.2f}x | **{r['memory_ratio']:.2f}x** | "
            f"{r['reward_delta']:+.3f} |"
        )
    return "\n".join(lines)


def ratios(by_label: dict, labels: tuple[str, str], on_gpu: bool) -> dict:
    """The second variant against the first: speedup (first's s/step over second's), memory ratio (second/first)."""
    base, other = by_label[labels[0]], by_label[labels[1]]
    key = "peak_cuda_mib" if on_gpu else "peak_rss_mib"
    return {
        "speedup": base["s_per_step"] / other["s_per_step"],
        "throughput": other["tokens_per_s"] / base["tokens_per_s"],
        "memory_ratio": other[key] / base[key],
        "reward_delta": other["reward"] - base["reward"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="a,b,c", help="Comma-separated subset of a,b,c.")
    parser.add_argument("--reps", type=int, default=2, help="Repetitions per trainer and config (default 2).")
    parser.add_argument(
        "--rollouts",
        type=int,
        default=3,
        help="Rollouts (generation batches) per run, the first untimed; a run is rollouts x num_iterations optimizer "
        "steps (default 3).",
    )
    parser.add_argument("--quick", action="store_true", help="Config a, one repetition (overrides --configs/--reps).")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast on CPU too (always on with CUDA).")
    parser.add_argument("--seed", type=int, default=0, help="Seed of repetition 0; repetition r uses seed + r.")
    parser.add_argument("--threads", type=int, default=None, help="OMP/MKL threads per run (default: torch's).")
    parser.add_argument("--grpo-hf-extra", default="{}", help="JSON dict of extra grpo_hf config fields.")
    parser.add_argument(
        "--ablate",
        default=None,
        help="JSON dict of grpo_hf config fields: compare grpo_hf with them (second) against grpo_hf without (first), "
        "instead of against TRL. E.g. '{\"share_prompt_prefix\": false}'.",
    )
    parser.add_argument("--json", default=None, help="Also write every run and the summary to this file.")
    args = parser.parse_args()

    configs = ["a"] if args.quick else [c.strip() for c in args.configs.split(",") if c.strip()]
    reps = 1 if args.quick else args.reps
    unknown = sorted(set(configs) - set(NUM_ITERATIONS))
    if unknown:
        raise SystemExit(f"Unknown config(s) {unknown}; choose from a, b, c.")
    if args.rollouts < 2:
        raise SystemExit("--rollouts must be at least 2: the first one is not timed.")

    import torch  # only to describe the hardware; the runs import their own

    on_gpu = torch.cuda.is_available()
    bf16 = args.bf16 or on_gpu
    device = torch.cuda.get_device_name() if on_gpu else f"CPU, {os.cpu_count()} cores"
    extra = json.loads(args.grpo_hf_extra)
    # (label, implementation, extra config fields); the ratios are the second against the first.
    if args.ablate is None:
        variants = (("TRL", "trl", {}), ("grpo_hf", "grpo_hf", extra))
    else:
        ablation = {**extra, **json.loads(args.ablate)}
        variants = (("grpo_hf", "grpo_hf", extra), (f"grpo_hf {json.dumps(ablation)}", "grpo_hf", ablation))
    labels = (variants[0][0], variants[1][0])
    print(
        f"# vs_trl: {device}, {'bf16 autocast' if bf16 else 'fp32'}, configs {','.join(configs)}, {reps} rep(s) "
        f"x {args.rollouts} rollouts per trainer, seeds {args.seed}..{args.seed + reps - 1}"
        + (f", grpo_hf extra {extra}" if extra else ""),
        flush=True,
    )

    started = time.perf_counter()
    runs: dict[str, dict[str, list[dict]]] = {c: {label: [] for label in labels} for c in configs}
    for config in configs:
        steps = args.rollouts * NUM_ITERATIONS[config]
        for rep in range(reps):
            for label, impl, fields in variants if rep % 2 == 0 else variants[::-1]:
                run = run_worker(impl, config, steps, args.seed + rep, bf16, args.threads, fields)
                runs[config][label].append(run)
                seconds = " ".join(f"{s:.1f}" for s in run["step_seconds"])
                print(
                    f"  config {config} rep {rep} {label}: step seconds [{seconds}], peak RSS "
                    f"{run['peak_rss_mib']:,.0f} MiB, rewards {[round(r, 3) for r in run['rewards']]}",
                    flush=True,
                )

    summaries = {c: {label: summarise(runs[c][label], NUM_ITERATIONS[c]) for label in labels} for c in configs}
    print(f"\n{table(summaries, labels, on_gpu)}\n")
    print(f"(total wall time {time.perf_counter() - started:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "bf16": bf16, "runs": runs, "summaries": summaries}, f, indent=1)
    headline = ratios(summaries["a" if "a" in summaries else configs[0]], labels, on_gpu)
    print(f"speedup={headline['speedup']:.2f} memory_ratio={headline['memory_ratio']:.2f}")


if __name__ == "__main__":
    main()
