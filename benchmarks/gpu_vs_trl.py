"""grpo_hf's GRPOTrainer against TRL's on one GPU, at Qwen2.5 sizes: time per step, decoding, peak memory, launches.

No hub and no internet: the models are Qwen2 models in the shapes of Qwen2.5-0.5B and Qwen2.5-1.5B (hidden size,
layers, heads, 2 KV heads, tied embeddings, rope theta 1e6, 151,936-token vocabulary) with random bf16 weights, and
the tokenizer is a byte-level one with a ChatML template padded to that vocabulary, both built and saved once per
shape (`_gpu_worker.prepare`). Both trainers load the same files (`dtype=bfloat16`, `bf16=True`), get the same chat
prompts, the same reward (`even_id_fraction`: the share of even token ids, which differs within every group) and
every shared knob set explicitly (`_worker.common_config`, as `vs_trl.py`); TRL generates with `model.generate`
(`use_vllm=False`, dynamic cache), grpo_hf with its `rollout_engine` (`--engine`, default "auto": "cuda_graph" on
CUDA). Random weights almost never sample EOS (about 1 in 152k per token), so every completion runs to
max_completion_length: the worst case for decoding (the "mean len" column shows it). Each run is a fresh subprocess
(`_gpu_worker.py`), so peak CUDA memory is per trainer; the two trainers alternate, their order flipping every
repetition.

Jobs (one optimizer step per rollout, one micro-batch, learning rate 1e-6, gradient checkpointing off on both sides
although TRL defaults it on; grpo_hf otherwise keeps its defaults, e.g. fp32 master weights for bf16 parameters, 4
bytes per trainable parameter that TRL does not spend: `--grpo-hf-extra '{"fp32_master_weights": false}'` compares
like for like):

    J1: 0.5B shape, 8 prompts x G=8 = 64 completions, 256 tokens, beta=0.04
    J2: 0.5B shape, 16 prompts x 8 = 128 completions, 512 tokens, beta=0.04
    J3: as J1, LoRA r=16 on every linear layer of the blocks (peft LoraConfig as peft_config)
    J4: 1.5B shape, as J1

On a GPU machine with torch, transformers, datasets (and trl, peft) installed, no hub needed, from the repository
root; wheels carried over (e.g. trl, peft, accelerate, or a grpo_hf wheel) go to a side directory:

    pip install --no-index --no-deps --target /tmp/site wheels/*.whl
    export PYTHONPATH=/tmp/site:$PWD
    python benchmarks/gpu_vs_trl.py                                   # J1-J4, 4 steps each (first untimed), 1 rep
    python benchmarks/gpu_vs_trl.py --jobs J1,J3 --reps 2 --json gpu_vs_trl.json
    python benchmarks/gpu_vs_trl.py --jobs J1 --engine generate_static
    python benchmarks/gpu_vs_trl.py --jobs J1 --trainers grpo_hf --steps 3   # a first check of the engine (~2 min)
    python benchmarks/gpu_vs_trl.py --smoke --device cpu --jobs J1,J3 --steps 2   # tiny shapes, end to end on CPU

Reading the table (one row per job and trainer, then grpo_hf / TRL):

- `first step s`: the first optimizer step, not timed otherwise: it includes compiling and capturing CUDA graphs;
- `s/step`: median seconds per optimizer step over the other steps (generation, reward, reference forward,
  loss forward/backward, optimizer); `gen s/step`: of which inside generation;
- `decode ms/tok`: time inside generation (prefill included) over the decode steps made (tokens per row), first
  step excluded; the floor for the 0.5B shape on an H100 is ~0.3 ms (weights read once);
- `mean len`: mean completion length (equal to max_completion_length when no completion stopped early);
- `peak CUDA GiB`: `torch.cuda.max_memory_allocated` over the training; `peak RSS GiB`: the process's;
- `kernels/tok`, `launches/tok`, `syncs/tok`: one more generation call after training (the last one, replayed),
  over its decode steps: GPU kernels seen by `torch.profiler` (inside CUDA graphs too, where CUPTI reports them),
  host-side kernel/graph launch calls (a CUDA graph replay is one), and synchronising operations reported by
  `torch.cuda.set_sync_debug_mode("warn")` (`.item()`, `nonzero()`, blocking copies to the host; not event waits).

CUDA-only columns print "n/a" on CPU. A trainer that runs out of memory prints "OOM" (it does not stop the
benchmark). `--json` keeps every run's per-step numbers. The last line is `speedup=X.XX memory_ratio=Y.YY` for J1
(the first job run when J1 is not): TRL's seconds per step over grpo_hf's, and grpo_hf's peak CUDA memory over TRL's
(peak RSS on CPU); "nan" when either trainer did not finish.
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

import _gpu_worker  # noqa: E402  (standard library only at import time)

WORKER = Path(__file__).with_name("_gpu_worker.py")
# trainer -> (the worker's --impl, its extra grpo_hf config); grpo_hf_bf16: without fp32 master weights, whose fp32
# copies and fp32 Adam states cost memory that TRL's bf16 parameters and Adam do not (like for like with TRL)
TRAINERS = {
    "trl": ("trl", {}),
    "grpo_hf": ("grpo_hf", {}),
    "grpo_hf_bf16": ("grpo_hf", {"fp32_master_weights": False}),
}
LABELS = {"trl": "TRL", "grpo_hf": "grpo_hf", "grpo_hf_bf16": "grpo_hf, no fp32 masters"}
MIN_GRAPH_LAUNCHES_PER_TOKEN = 0.9  # a decode replayed from a CUDA graph launches it once per token (the 1st is eager)
GIB = 2**30


def call_worker(options: list[str], out: str) -> tuple[dict | None, str]:
    """Run `_gpu_worker.py` with `options`; its JSON result (None if it wrote none) and the tail of its output."""
    result = subprocess.run([sys.executable, str(WORKER), *options, "--out", out], capture_output=True, text=True)
    tail = (result.stdout[-2000:] + result.stderr[-6000:]).strip()
    if not os.path.exists(out):
        return None, tail
    with open(out) as f:
        record = json.load(f)
    if result.returncode != 0 and record.get("status") == "ok":  # died in the replays after training (profiler)
        record.setdefault("measure_errors", {})["exit"] = f"died after training, exit code {result.returncode}"
    elif result.returncode != 0 and record.get("status") not in ("oom", "error"):
        record.update(status="error", error=f"exit code {result.returncode}")
    return record, tail


def run_trainer(trainer: str, job: str, model_dir: str, args, seed: int, workdir: str) -> dict:
    impl, extra = TRAINERS[trainer]
    extra = {**json.loads(args.grpo_hf_extra), **extra}
    options = ["--impl", impl, "--job", job, "--model-dir", model_dir, "--steps", str(args.steps)]
    options += ["--seed", str(seed), "--engine", args.engine, "--device", args.device, "--extra", json.dumps(extra)]
    if args.smoke:
        options.append("--smoke")
    if args.profile_step and impl == "grpo_hf":
        options.append("--profile-step")
    record, tail = call_worker(options, os.path.join(workdir, f"{job}-{trainer}-{seed}.json"))
    if record is None:
        record = {"impl": impl, "job": job, "status": "error", "error": "the worker wrote no result"}
    if record["status"] == "error" and "out of memory" in (record.get("error", "") + tail).lower():
        record["status"] = "oom"  # e.g. cuBLAS failing to allocate: raised as another error type
    lost = lost_graph(record, args.device)
    if lost:
        record.update(status="error", error=f"the CUDA graph was lost: {lost}")
    if record["status"] == "error":
        sys.stderr.write(f"\n--- {LABELS[trainer]} run of {job} failed: {record.get('error', '')}\n{tail}\n---\n")
    return record


def lost_graph(record: dict, device: str) -> str | None:
    """Why a grpo_hf run of the `cuda_graph` engine did not decode from a replayed CUDA graph, or None: Inductor
    skipped CUDA graphs, a bucket fell back to eager (the engine's warning), or the replayed generation call launched
    a graph for fewer than `MIN_GRAPH_LAUNCHES_PER_TOKEN` of its decoded tokens. (All launches per token would not
    do: the same call's eager prefill adds ~1,600 kernel launches, ~6 per token over 256 tokens.) Without this, a
    lost graph would read as a slow engine."""
    if record.get("status") != "ok" or record.get("engine") != "cuda_graph" or device != "cuda":
        return None
    reasons = []
    skips = record.get("compile", {}).get("cudagraph_skips", 0)
    if skips:
        reasons.append(f"Inductor skipped CUDA graphs {skips} time(s)")
    reasons += [line for line in record.get("engine_log", []) if "runs eagerly" in line][:1]
    graph_launches = sum(n for name, n in record.get("launch_names", {}).items() if "GraphLaunch" in name)
    steps = record.get("replay_decode_steps")
    if record.get("launch_names") and steps and graph_launches / steps < MIN_GRAPH_LAUNCHES_PER_TOKEN:
        reasons.append(f"{graph_launches} CUDA graph launches for {steps} decoded tokens")
    return "; ".join(reasons) or None


def per_token(run: dict, key: str) -> float | None:
    count, steps = run.get(key), run.get("replay_decode_steps")
    return count / steps if count is not None and steps else None


def median_of(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarise(runs: list[dict]) -> dict:
    """One trainer's runs of one job: medians over the timed steps (all but each run's first) and over runs."""
    if not runs:
        return {"status": "not run", "runs": 0, "oom_runs": 0, "failed_runs": 0}
    ok = [run for run in runs if run["status"] == "ok"]
    summary = {
        "status": "ok" if ok else ("OOM" if any(run["status"] == "oom" for run in runs) else "error"),
        "runs": len(runs),
        "oom_runs": sum(run["status"] == "oom" for run in runs),
        "failed_runs": sum(run["status"] == "error" for run in runs),
    }
    if not ok:
        return summary
    timed = [s for run in ok for s in run["step_seconds"][1:]]
    generate = [s for run in ok for s in run["generate_seconds"][1:]]
    decode_steps = sum(sum(run["decode_steps"][1:]) for run in ok)
    lengths = [n for run in ok for n in run["mean_length"]]
    summary.update(
        engine=", ".join(sorted({str(run["engine"]) for run in ok})),
        first_step_s=median_of(run["step_seconds"][0] for run in ok if run["step_seconds"]),
        s_per_step=median_of(timed),
        generate_s_per_step=median_of(generate),
        decode_ms_per_token=1000 * sum(generate) / decode_steps if decode_steps else None,
        decode_ms_per_token_median=median_of(
            1000 * seconds / steps
            for run in ok
            for seconds, steps in zip(run["generate_seconds"][1:], run["decode_steps"][1:], strict=True)
            if steps
        ),
        mean_length=statistics.fmean(lengths) if lengths else None,
        peak_cuda_gib=median_of(run["peak_cuda_bytes"] / GIB for run in ok if run.get("peak_cuda_bytes")),
        peak_reserved_gib=median_of(
            run["peak_cuda_reserved_bytes"] / GIB for run in ok if run.get("peak_cuda_reserved_bytes")
        ),
        cudagraph_skips=max(run.get("compile", {}).get("cudagraph_skips", 0) for run in ok),
        cudagraph_partitions=max(run.get("compile", {}).get("cudagraph_partitions", 0) for run in ok),
        unique_graphs=max(run.get("compile", {}).get("unique_graphs", 0) for run in ok),
        peak_rss_gib=median_of(run["peak_rss_mib"] / 1024 for run in ok),
        kernels_per_token=median_of(per_token(run, "kernels") for run in ok),
        launches_per_token=median_of(per_token(run, "launches") for run in ok),
        syncs_per_token=median_of(per_token(run, "syncs") for run in ok),
        mean_reward=statistics.fmean(r for run in ok for r in run["rewards"]) if ok[0]["rewards"] else None,
    )
    return summary


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


def ratios(trl: dict, ours: dict, on_gpu: bool) -> dict:
    """grpo_hf against TRL: speedups are TRL's time over grpo_hf's; the rest grpo_hf's over TRL's."""
    get = dict.get
    memory = "peak_cuda_gib" if on_gpu else "peak_rss_gib"
    return {
        "speedup": ratio(get(trl, "s_per_step"), get(ours, "s_per_step")),
        "decode_speedup": ratio(get(trl, "decode_ms_per_token"), get(ours, "decode_ms_per_token")),
        "first_step_ratio": ratio(get(ours, "first_step_s"), get(trl, "first_step_s")),
        "generate_ratio": ratio(get(ours, "generate_s_per_step"), get(trl, "generate_s_per_step")),
        "memory_ratio": ratio(get(ours, memory), get(trl, memory)),
        "peak_cuda_ratio": ratio(get(ours, "peak_cuda_gib"), get(trl, "peak_cuda_gib")),
        "peak_reserved_ratio": ratio(get(ours, "peak_reserved_gib"), get(trl, "peak_reserved_gib")),
        "peak_rss_ratio": ratio(get(ours, "peak_rss_gib"), get(trl, "peak_rss_gib")),
        "kernels_ratio": ratio(get(ours, "kernels_per_token"), get(trl, "kernels_per_token")),
        "launches_ratio": ratio(get(ours, "launches_per_token"), get(trl, "launches_per_token")),
        "syncs_ratio": ratio(get(ours, "syncs_per_token"), get(trl, "syncs_per_token")),
    }


def num(value: float | None, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


def times(value: float | None, faster: bool = False) -> str:
    """A ratio of grpo_hf's to TRL's, e.g. '0.54x' or, for a speedup, '0.54x time (1.85x faster)'."""
    if value is None:
        return "n/a"
    return f"{1 / value:.2f}x time ({value:.2f}x faster)" if faster else f"{value:.2f}x"


def table(summaries: dict, smoke: bool) -> str:
    lines = [
        "| job | trainer | engine | first step s | s/step | gen s/step | decode ms/tok (mean / median) | mean len "
        "| peak CUDA GiB (allocated / reserved) | peak RSS GiB | kernels/tok | launches/tok | syncs/tok "
        "| graph skips / partitions / graphs |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for job, by_trainer in summaries.items():
        description = _gpu_worker.describe(job, smoke)
        for trainer in TRAINERS:
            s = by_trainer[trainer]
            if s["status"] == "not run":
                continue
            if s["status"] != "ok":
                lines.append(f"| {job} ({description}) | {LABELS[trainer]} | | **{s['status']}** |" + " |" * 10)
                continue
            note = f" ({s['oom_runs']} of {s['runs']} runs OOM)" if s["oom_runs"] else ""
            graphs = f"{s['cudagraph_skips']} / {s['cudagraph_partitions']} / {s['unique_graphs']}"
            lines.append(
                f"| {job} ({description}) | {LABELS[trainer]}{note} | {s['engine']} "
                f"| {num(s['first_step_s'], '.1f')} | {num(s['s_per_step'], '.2f')} "
                f"| {num(s['generate_s_per_step'], '.2f')} "
                f"| {num(s['decode_ms_per_token'], '.2f')} / {num(s['decode_ms_per_token_median'], '.2f')} "
                f"| {num(s['mean_length'], '.0f')} "
                f"| {num(s['peak_cuda_gib'], '.2f')} / {num(s['peak_reserved_gib'], '.2f')} "
                f"| {num(s['peak_rss_gib'], '.2f')} | {num(s['kernels_per_token'], '.0f')} "
                f"| {num(s['launches_per_token'], '.1f')} | {num(s['syncs_per_token'], '.2f')} | {graphs} |"
            )
        for trainer, r in by_trainer["ratios"].items():
            lines.append(
                f"| {job} | **{LABELS[trainer]} / TRL** | | {times(r['first_step_ratio'])} "
                f"| **{times(r['speedup'], True)}** | {times(r['generate_ratio'])} "
                f"| {times(r['decode_speedup'], True)} | "
                f"| **{times(r['peak_cuda_ratio'])}** / {times(r['peak_reserved_ratio'])} "
                f"| {times(r['peak_rss_ratio'])} | {times(r['kernels_ratio'])} | {times(r['launches_ratio'])} "
                f"| {times(r['syncs_ratio'])} | |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", default="J1,J2,J3,J4", help="Comma-separated subset of J1,J2,J3,J4.")
    parser.add_argument("--steps", type=int, default=4, help="Optimizer steps per run, the first untimed (default 4).")
    parser.add_argument("--reps", type=int, default=1, help="Runs per trainer and job, alternating (default 1).")
    parser.add_argument(
        "--engine",
        default="auto",
        help="grpo_hf's rollout_engine: auto (default; cuda_graph on CUDA), cuda_graph, generate_static, loop, "
        "generate.",
    )
    parser.add_argument(
        "--trainers",
        default="trl,grpo_hf,grpo_hf_bf16",
        help="Which trainers run, comma-separated: trl, grpo_hf, grpo_hf_bf16 (grpo_hf with fp32_master_weights=False,"
        " like for like with TRL's bf16 Adam); default all three. One alone is a first check of grpo_hf's engine on a "
        "new machine (the ratios are then n/a).",
    )
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="Where both trainers run.")
    parser.add_argument("--smoke", action="store_true", help="Tiny shapes (2 layers, hidden 64, 2 prompts x 2, ...).")
    parser.add_argument("--seed", type=int, default=0, help="Seed of repetition 0; repetition r uses seed + r.")
    parser.add_argument("--grpo-hf-extra", default="{}", help="JSON dict of extra grpo_hf config fields.")
    parser.add_argument("--json", default=None, help="Also write every run and the summary to this file.")
    parser.add_argument(
        "--profile-step",
        action="store_true",
        help="grpo_hf runs one more step, untimed, under torch.profiler; its operator table is printed and kept.",
    )
    parser.add_argument("--workdir", default=None, help="Where the models are saved (default: a temporary dir).")
    args = parser.parse_args()

    jobs = [j.strip() for j in args.jobs.split(",") if j.strip()]
    unknown = sorted(set(jobs) - set(_gpu_worker.JOBS))
    if unknown or not jobs:
        raise SystemExit(f"Unknown job(s) {unknown}; choose from {', '.join(_gpu_worker.JOBS)}.")
    trainers = [t.strip() for t in args.trainers.split(",") if t.strip()]
    if not trainers or set(trainers) - set(TRAINERS):
        raise SystemExit(f"--trainers {args.trainers!r}: name some of {', '.join(TRAINERS)}, comma-separated.")
    if args.steps < 2:
        raise SystemExit("--steps must be at least 2: the first one is not timed.")
    json.loads(args.grpo_hf_extra)  # fail here, not in every worker

    started = time.perf_counter()
    workdir = args.workdir or tempfile.mkdtemp(prefix="gpu_vs_trl-")
    os.makedirs(workdir, exist_ok=True)
    info: dict = {}
    models: dict[str, str] = {}  # shape -> directory
    runs: dict[str, dict[str, list[dict]]] = {job: {trainer: [] for trainer in TRAINERS} for job in jobs}
    try:
        for job in jobs:
            shape = _gpu_worker.job_settings(job, args.smoke)["shape"]
            if shape not in models:
                directory = os.path.join(workdir, f"model-{shape}")
                t0 = time.perf_counter()
                options = ["--prepare", directory, "--shape", shape, "--device", args.device, "--seed", "0"]
                prepared, tail = call_worker(options, os.path.join(workdir, f"prepare-{shape}.json"))
                if prepared is None:
                    sys.stderr.write(tail + "\n")
                    raise SystemExit(f"building the {shape} model failed")
                models[shape] = directory
                if not info:
                    info = {k: v for k, v in prepared.items() if k not in ("parameters", "vocab_size")}
                    print(
                        f"# gpu_vs_trl: {info['device']}, torch {info['torch']}, transformers {info['transformers']}, "
                        f"trl {info['trl']}, peft {info['peft']}; jobs {','.join(jobs)}; {args.reps} rep(s) x "
                        f"{args.steps} steps (first untimed); grpo_hf rollout_engine={args.engine}; bf16 weights"
                        + (f"; grpo_hf extra {args.grpo_hf_extra}" if args.grpo_hf_extra != "{}" else "")
                        + ("; SMOKE (tiny shapes)" if args.smoke else ""),
                        flush=True,
                    )
                print(
                    f"  model {shape}: {prepared['parameters'] / 1e6:,.1f}M parameters, vocabulary "
                    f"{prepared['vocab_size']:,}, random bf16 weights ({time.perf_counter() - t0:.0f} s to build)",
                    flush=True,
                )
            for rep in range(args.reps):
                order = [t for t in TRAINERS if t in trainers]
                for trainer in order if rep % 2 == 0 else order[::-1]:
                    run = run_trainer(trainer, job, models[shape], args, args.seed + rep, workdir)
                    runs[job][trainer].append(run)
                    print(f"  {job} rep {rep} {LABELS[trainer]}: {run_line(run)}", flush=True)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)

    on_gpu = args.device == "cuda"
    summaries: dict[str, dict] = {}
    for job in jobs:
        summaries[job] = {trainer: summarise(runs[job][trainer]) for trainer in TRAINERS}
        summaries[job]["ratios"] = {
            trainer: ratios(summaries[job]["trl"], summaries[job][trainer], on_gpu)
            for trainer in TRAINERS
            if trainer != "trl" and summaries[job][trainer]["status"] != "not run"
        }
    print(f"\n{table(summaries, args.smoke)}\n")
    for job in jobs:
        for run in (runs[job]["grpo_hf"] or runs[job]["grpo_hf_bf16"])[:1]:
            if run.get("step_profile"):
                print(f"grpo_hf's profiled step, {job} (first run):\n{run['step_profile']}")
            if run.get("engine_log"):
                print(f"grpo_hf's engine log, {job} (first run):\n  " + "\n  ".join(run["engine_log"]))
    print(
        "Random weights: completions run to max_completion_length (no EOS sampled; see mean len), the worst case "
        "for decoding. Time ratios are grpo_hf's over TRL's ('faster' = TRL's over grpo_hf's); first step includes "
        "any compile."
    )
    print(f"(total wall time {time.perf_counter() - started:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"info": info, "args": vars(args), "runs": runs, "summaries": summaries}, f, indent=1)
    failed = [f"{job} {LABELS[t]}" for job in jobs for t in TRAINERS if summaries[job][t]["failed_runs"]]
    if failed:
        print(f"FAILED runs (not OOM): {', '.join(failed)}; their output is above.")
    headline = summaries["J1" if "J1" in summaries else jobs[0]]["ratios"].get("grpo_hf", {})
    speedup, memory_ratio = (num(headline.get(k), ".2f").replace("n/a", "nan") for k in ("speedup", "memory_ratio"))
    print(f"speedup={speedup} memory_ratio={memory_ratio}")
    if failed:
        sys.exit(1)


def run_line(run: dict) -> str:
    """One run as a line of the progress log."""
    if run["status"] != "ok":
        return f"{run['status'].upper()} {run.get('error', '')}".strip()
    steps = run["step_seconds"]
    decode = sum(run["decode_steps"][1:])
    ms = f"{1000 * sum(run['generate_seconds'][1:]) / decode:.2f}" if decode else "n/a"
    peak = f"{run['peak_cuda_bytes'] / GIB:.2f} GiB" if run.get("peak_cuda_bytes") else "n/a"
    lengths = run["mean_length"]
    return (
        f"[{run['engine']}] step seconds {steps[0]:.1f} | {' '.join(f'{s:.2f}' for s in steps[1:])}, decode {ms} "
        f"ms/tok, mean len {statistics.fmean(lengths) if lengths else float('nan'):.0f}, peak CUDA {peak}, "
        f"syncs/launches/kernels per tok {num(per_token(run, 'syncs'), '.2f')}/"
        f"{num(per_token(run, 'launches'), '.1f')}/{num(per_token(run, 'kernels'), '.0f')}"
        + (f", measure errors {run['measure_errors']}" if run.get("measure_errors") else "")
    )


if __name__ == "__main__":
    main()
