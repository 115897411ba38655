"""grpo_hf's GRPOTrainer against TRL's, side by side, on a CPU or a GPU: time per step, generation, memory, reward.

Each run is one trainer, one config and one seed in a fresh process (`benchmarks/_worker.py`); the trainers alternate
and their order flips every repetition. Both get the same model, prompts, rewards and seed, and every shared knob set
explicitly (`_worker.common_config`: 2 prompts x G=8 per step unless a config says otherwise, one micro-batch, loss
"grpo", lr 1e-6). Configs (`_worker.CONFIGS`): a, b, c: SmolLM2-135M-Instruct (offline; fp32, bf16 autocast on CUDA)
on the built-in arithmetic problems, 128 tokens (a: beta=0.04; b: a with num_iterations=2; c: beta=0); J1-J4: Qwen2
models in Qwen2.5 shapes with random bf16 weights (no hub; every completion runs to the length limit, the worst case
for decoding); fam-qwen3, fam-qwen3_5, fam-gemma3, fam-qwen3_moe: a with a random fp32 model of SmolLM2-135M's size
(widths, 30 layers, tied embeddings, its tokenizer) in a family's shape: dense Qwen3 (the control), Qwen3.5 text
(Gated DeltaNet and full attention), Gemma 3 text (a sliding window of 64 tokens) and Qwen3-MoE (8 experts, the
router's auxiliary loss on, coefficient 0.001), each a row of a family table below the main one; tools: SmolLM2
with half the completions calling a tool that sleeps 0.2 s; vlm, vlm_frozen: a Qwen2-VL-shaped model from a config,
one image per prompt (vlm_frozen: the vision tower frozen for both).

A run makes `--rollouts` generation rounds (rounds x num_iterations optimizer steps), the first untimed. Per config and
trainer the table gives the median seconds per optimizer step over the timed rounds, the first step's (compiling
included), the seconds inside generation per step, completion tokens/s, ms per decoded token (prefill included), peak
memory (RSS; on a GPU also CUDA allocated and reserved, and GPU kernels and host-side launch calls per decoded token
of the last generation call, replayed), the mean reward, and each trainer against the first. A grpo_hf `cuda_graph`
run whose decode did not replay a CUDA graph fails, so that a lost graph cannot pass for a slow engine.

    python benchmarks/vs_trl.py                           # CPU: configs a,b,c, 2 reps x 3 rollouts
    python benchmarks/vs_trl.py --configs a --ablate '{"share_prompt_prefix": false}'   # grpo_hf against itself
    python benchmarks/vs_trl.py --configs tools --reps 1 --rollouts 4
    python benchmarks/vs_trl.py --configs fam-qwen3,fam-qwen3_5,fam-gemma3,fam-qwen3_moe --reps 2 --rollouts 3
    python benchmarks/vs_trl.py --device cuda             # J1-J4, 1 rep x 4 rollouts
    python benchmarks/vs_trl.py --device cuda --configs J1 --trainers trl,grpo_hf,ablated \\
        --ablate '{"fp32_master_weights": false}'         # also grpo_hf without fp32 master weights, like TRL
    python benchmarks/vs_trl.py --tiny --configs a,J3,tools,vlm --reps 1 --rollouts 2   # every path, tiny, on a CPU

The last line is `speedup=X.XX memory_ratio=Y.YY` for the first config: the first trainer's s/step over the second's,
and the second's peak memory (CUDA on a GPU, else RSS) over the first's ("nan" when a run failed).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _worker  # noqa: E402  (the standard library only, at import time)

WORKER = Path(__file__).with_name("_worker.py")


def call_worker(options: list[str], out: str) -> dict:
    """Run the worker with `options`; its record (status "error" with the output's tail if it wrote none)."""
    result = subprocess.run([sys.executable, str(WORKER), *options, "--out", out], capture_output=True, text=True)
    record = json.loads(Path(out).read_text()) if os.path.exists(out) else {"status": "error", "error": "no record"}
    if result.returncode != 0 and record["status"] in ("ok", "running"):
        record.update(status="error", error=f"exit code {result.returncode}")
    if record["status"] == "error" and "out of memory" in (record.get("error", "") + result.stderr).lower():
        record["status"] = "oom"  # e.g. cuBLAS failing to allocate, raised as another error
    if record["status"] == "error":
        sys.stderr.write(
            f"\n--- {' '.join(options[:4])} failed: {record.get('error')}\n{result.stderr[-6000:]}\n---\n"
        )
    return record


def windows(run: dict, key: str, num_iterations: int) -> list[float]:
    """Per generation round after the first: the sum of `key` over its `num_iterations` steps."""
    values = run[key][: len(run["step_seconds"])]
    return [sum(values[k : k + num_iterations]) for k in range(0, len(values), num_iterations)][1:]


def median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def per_token(run: dict, key: str) -> float | None:
    steps = run.get("replay_decode_steps")
    return run[key] / steps if steps and run.get(key) is not None else None


def summarise(runs: list[dict], num_iterations: int) -> dict:
    """One trainer's runs of one config: medians over the timed rounds and over runs (GiB: CUDA, MiB: RSS)."""
    ok = [run for run in runs if run["status"] == "ok"]
    if not ok:
        return {"status": "OOM" if any(run["status"] == "oom" for run in runs) else "error"}
    seconds = [s for run in ok for s in windows(run, "step_seconds", num_iterations)]
    generate = [s for run in ok for s in windows(run, "generate_seconds", num_iterations)]
    decoded = sum(n for run in ok for n in windows(run, "decode_steps", num_iterations))
    tokens = sum(t for run in ok for t in windows(run, "completion_tokens", num_iterations))
    rewards = [r for run in ok for r in run["rewards"]]
    gib = {key: median(run.get(f"peak_{key}_mib") for run in ok) for key in ("cuda", "cuda_reserved")}
    return {
        "status": "ok",
        "engine": ", ".join(sorted({str(run["engine"]) for run in ok})),
        "s_per_step": statistics.median(seconds) / num_iterations,
        "first_step_s": median(run["step_seconds"][0] for run in ok),
        "generate_s_per_step": statistics.median(generate) / num_iterations if decoded else None,
        "decode_ms_per_token": 1000 * sum(generate) / decoded if decoded else None,
        "tokens_per_s": tokens / sum(seconds) if tokens else None,
        "rss_mib": median(run["peak_rss_mib"] for run in ok),
        "cuda_gib": gib["cuda"] and gib["cuda"] / 1024,
        "reserved_gib": gib["cuda_reserved"] and gib["cuda_reserved"] / 1024,
        "kernels_per_token": median(per_token(run, "kernels") for run in ok),
        "launches_per_token": median(per_token(run, "launches") for run in ok),
        "reward": statistics.fmean(rewards) if rewards else None,
        "reward_se": statistics.stdev(rewards) / len(rewards) ** 0.5 if len(rewards) > 1 else None,
    }


def columns(cuda: bool) -> list[tuple[str, str, str, str]]:
    """(header, summary key, format, how trainers compare: "faster" = a time, the first's over this one's; "x" =
    this one's over the first's)."""
    cols = [("s/step", "s_per_step", ".2f", "faster"), ("first step s", "first_step_s", ".1f", "x"),
            ("gen s/step", "generate_s_per_step", ".2f", "x"), ("tok/s", "tokens_per_s", ".1f", "x"),
            ("decode ms/tok", "decode_ms_per_token", ".2f", "faster")]  # fmt: skip
    if not cuda:
        return [*cols, ("peak RSS MiB", "rss_mib", ",.0f", "x")]
    return [*cols, ("peak CUDA GiB", "cuda_gib", ".2f", "x"), ("reserved GiB", "reserved_gib", ".2f", "x"),
            ("peak RSS MiB", "rss_mib", ",.0f", "x"), ("kernels/tok", "kernels_per_token", ".0f", "x"),
            ("launches/tok", "launches_per_token", ".1f", "x")]  # fmt: skip


def num(value: float | None, fmt: str) -> str:
    """`value` formatted ("x" after the format: a ratio, "1.50x"); "n/a" for None."""
    return "n/a" if value is None else format(value, fmt.removesuffix("x")) + "x" * fmt.endswith("x")


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def compare(base: dict, other: dict, key: str, how: str) -> str:
    """'0.59x time (1.69x faster)' for a time, '0.45x' for the rest; n/a where either is missing."""
    x = ratio(other.get(key), base.get(key))
    return "n/a" if x is None else f"{x:.2f}x time ({1 / x:.2f}x faster)" if how == "faster" else f"{x:.2f}x"


def table(summaries: dict, labels: list[str], cuda: bool) -> str:
    cols = columns(cuda)
    lines = [
        "| config | trainer | " + " | ".join(c[0] for c in cols) + " | reward |",
        "|---|---|" + "---:|" * (len(cols) + 1),
    ]
    for config, by_label in summaries.items():
        base = by_label[labels[0]]
        for label in labels:
            s = by_label[label]
            cells = [num(s.get(key), fmt) for _, key, fmt, _ in cols] if s["status"] == "ok" else [s["status"]]
            reward = f"{num(s.get('reward'), '.3f')} ± {num(s.get('reward_se'), '.3f')}"
            lines.append(f"| {config} | {label} [{s.get('engine', '')}] | " + " | ".join([*cells, reward]) + " |")
        for label in labels[1:]:
            cells = [compare(base, by_label[label], key, how) for _, key, _, how in cols]
            lines.append(f"| {config} | **{label} / {labels[0]}** | " + " | ".join(cells) + " | |")
    return "\n".join(lines)


def family_table(summaries: dict, labels: list[str], cuda: bool) -> str:
    """One row per `fam-*` config: each trainer's s/step and peak memory (CUDA GiB on a GPU, else RSS MiB), the first
    trainer's s/step over the second's (speed) and the second's peak over the first's (memory)."""
    first, second = labels[:2]
    unit, key, fmt = ("peak GiB", "cuda_gib", ".2f") if cuda else ("peak MiB", "rss_mib", ",.0f")
    lines = [f"| family | {first} s/step | {second} s/step | speed vs {first} | {first} {unit} | {second} {unit} | "
             f"memory vs {first} |", "|---|" + "---:|" * 6]  # fmt: skip
    for config, by_label in summaries.items():
        if config.startswith("fam-"):
            a, b = by_label[first], by_label[second]
            speed, memory = ratio(a.get("s_per_step"), b.get("s_per_step")), ratio(b.get(key), a.get(key))
            cells = [num(a.get("s_per_step"), ".2f"), num(b.get("s_per_step"), ".2f"), num(speed, ".2fx")]
            cells += [num(a.get(key), fmt), num(b.get(key), fmt), num(memory, ".2fx")]
            lines.append(f"| {config.removeprefix('fam-')} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def progress(run: dict) -> str:
    if run["status"] != "ok":
        return f"{run['status'].upper()} {run.get('error', '')}"
    memory = f"peak CUDA {run['peak_cuda_mib']:,.0f} MiB" if run.get("peak_cuda_mib") else ""
    shared = ", shared prompt" if run.get("fast_path") else ""  # grpo_hf's shared-prompt training forward allowed
    return (
        f"[{run['engine']}{shared}] step seconds {' '.join(f'{s:.2f}' for s in run['step_seconds'])}, peak RSS "
        f"{run['peak_rss_mib']:,.0f} MiB {memory}, rewards {[round(r, 3) for r in run['rewards']]}"
        + (f", tool calls {run['tool_calls']}" if run["tool_calls"] else "")
    )


def prepare(config: str, args: argparse.Namespace, workdir: str) -> str | None:
    """The directory of the config's random model, built once for all runs (None: the config loads no such model)."""
    shape = _worker.settings(config, args.tiny)["shape"]
    directory = os.path.join(workdir, str(shape))
    if shape and not os.path.exists(directory + ".json"):
        options = ["--prepare", directory, "--config", config, "--device", args.device] + ["--tiny"] * args.tiny
        print(
            f"  model {shape}: {call_worker(options, directory + '.json').get('parameters', 0) / 1e6:,.1f}M parameters"
        )
    return directory if shape else None


def worker_options(args, impl: str, config: str, steps: int, seed: int, fields: dict, model_dir: str | None) -> list:
    options = ["--impl", impl, "--config", config, "--steps", str(steps), "--seed", str(seed), "--device", args.device]
    options += ["--extra", json.dumps(fields), "--engine-attrs", args.engine_attrs] + ["--tiny"] * args.tiny
    return (
        options + ["--bf16"] * (args.bf16 or args.device == "cuda") + (["--model-dir", model_dir] if model_dir else [])
    )


def print_tables(summaries: dict, runs: dict, labels: list[str], cuda: bool) -> None:
    """The table, the family table (`fam-*` configs), and the last trainer's engine log of each config's first run."""
    print(f"\n{table(summaries, labels, cuda)}\n")
    if len(labels) > 1 and any(config.startswith("fam-") for config in summaries):
        print(f"{family_table(summaries, labels, cuda)}\n")
    for config in summaries:
        for run in runs[config][labels[-1]][:1]:
            if run.get("engine_log"):
                print(f"{labels[-1]}'s engine log, {config}:\n  " + "\n  ".join(run["engine_log"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="Where both trainers run.")
    parser.add_argument("--configs", default=None, help="Comma-separated (default: a,b,c on CPU, J1-J4 on CUDA).")
    parser.add_argument("--reps", type=int, default=None, help="Runs per trainer and config (default 2; CUDA 1).")
    parser.add_argument("--rollouts", type=int, default=None, help="Rounds per run, the first untimed (3; CUDA 4).")
    parser.add_argument("--trainers", default=None, help="Of trl, grpo_hf, ablated (default trl,grpo_hf).")
    parser.add_argument("--ablate", default="{}", help="JSON grpo_hf fields of the 'ablated' trainer (then default "
                        "trainers grpo_hf,ablated: grpo_hf against itself).")  # fmt: skip
    parser.add_argument("--grpo-hf-extra", default="{}", help="JSON grpo_hf config fields of every grpo_hf run.")
    parser.add_argument("--engine-attrs", default="{}", help="JSON attributes set on grpo_hf's CUDAGraphEngine.")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast on CPU too (always on with CUDA).")
    parser.add_argument("--tiny", action="store_true", help="A tiny random model, G=2, 1/16 of the tokens.")
    parser.add_argument("--seed", type=int, default=0, help="Seed of repetition 0; repetition r uses seed + r.")
    parser.add_argument("--json", default=None, help="Also write every run and the summary to this file.")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    configs = (args.configs or ("J1,J2,J3,J4" if cuda else "a,b,c")).split(",")
    reps, rollouts = args.reps or (1 if cuda else 2), args.rollouts or (4 if cuda else 3)
    extra, ablate = json.loads(args.grpo_hf_extra), json.loads(args.ablate)
    variants = {"trl": ("TRL", "trl", {}), "grpo_hf": ("grpo_hf", "grpo_hf", extra)}
    variants["ablated"] = (f"grpo_hf {json.dumps(ablate)}", "grpo_hf", {**extra, **ablate})
    chosen = (args.trainers or ("grpo_hf,ablated" if ablate else "trl,grpo_hf")).split(",")
    if set(configs) - set(_worker.CONFIGS) or set(chosen) - set(variants) or rollouts < 2:
        raise SystemExit(f"--configs: of {', '.join(_worker.CONFIGS)}; --trainers: of {', '.join(variants)}; "
                         "--rollouts: at least 2 (the first is not timed)")  # fmt: skip
    labels = [variants[t][0] for t in chosen]
    print(f"# vs_trl: {args.device}, configs {','.join(configs)}, {reps} rep(s) x {rollouts} rollouts, trainers "
          f"{', '.join(labels)}{', tiny' * args.tiny}; load {os.getloadavg()[0]:.2f}", flush=True)  # fmt: skip

    started, workdir = time.perf_counter(), tempfile.mkdtemp(prefix="vs_trl-")
    runs: dict[str, dict[str, list[dict]]] = {c: {label: [] for label in labels} for c in configs}
    try:
        for config in configs:
            model_dir = prepare(config, args, workdir)
            steps = rollouts * _worker.settings(config, args.tiny)["num_iterations"]
            for rep in range(reps):
                for name in chosen if rep % 2 == 0 else chosen[::-1]:
                    label, impl, fields = variants[name]
                    options = worker_options(args, impl, config, steps, args.seed + rep, fields, model_dir)
                    run = call_worker(options, os.path.join(workdir, f"{config}-{name}-{rep}.json"))
                    runs[config][label].append(run)
                    print(f"  {config} rep {rep} {label}: {progress(run)}", flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    iterations = {c: _worker.settings(c, args.tiny)["num_iterations"] for c in configs}
    summaries = {c: {label: summarise(runs[c][label], iterations[c]) for label in labels} for c in configs}
    print_tables(summaries, runs, labels, cuda)
    print(f"(total wall time {time.perf_counter() - started:.0f} s, load average {os.getloadavg()[0]:.2f})")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "runs": runs, "summaries": summaries}, indent=1))
    first, memory = summaries[configs[0]], "cuda_gib" if cuda else "rss_mib"
    base, other = (first[labels[0]], first[labels[1]]) if len(labels) > 1 else ({memory: None}, {memory: None})
    speedup, memory_ratio = ratio(base.get("s_per_step"), other.get("s_per_step")), ratio(other[memory], base[memory])
    print(f"speedup={num(speedup, '.2f')} memory_ratio={num(memory_ratio, '.2f')}".replace("n/a", "nan"))
    if any(run["status"] == "error" for by_label in runs.values() for rs in by_label.values() for run in rs):
        sys.exit(1)


if __name__ == "__main__":
    main()
