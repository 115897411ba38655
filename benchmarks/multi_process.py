"""grpo_hf on several CPU processes (gloo): per-process peak memory and seconds per step, under DDP or FSDP2.

Each layout is launched fresh with `torch.distributed.run`, every process running `benchmarks/_worker.py` (grpo_hf,
one thread per process: on a 2-core machine each process has a core of its own) and reporting its peak RSS, its RSS
before the model was built, and its step times. Run it on an idle machine.

`--compare ddp` (the default): config (a) of `benchmarks/vs_trl.py` (SmolLM2-135M, 16 completions per process per
step, beta 0.04) with `--max-completion-length` tokens: 1 process with the fast paths on (shared prompt prefix,
per-group backward); 2 processes, fast paths on (one generation batch of 32 split across them); 2 processes, fast
paths off (the padded path through DDP's forward); and a control, two independent 1-process runs started together.
Two busy processes on a 2-core machine share its memory bandwidth, so the 2-process run over the control is what DDP
itself costs (the gradient all-reduce, waiting for the slower process). Per layout: the largest peak RSS of any
process and the median s/step (after the first step) of the slowest.

`--compare fsdp2`: DDP against FSDP2 on 2 processes, config `llama` (a 64M-parameter Llama from a config, fp32, beta
0.04 with its reference model, AdamW, 4 completions of 16 tokens per process): each process's peak RSS minus its RSS
before the model, what sharding saves. FSDP2 runs accelerate's own code, allowed on CPU by the test harness's patch
(`tests/distributed/sharded.py`, `allow_fsdp_on_cpu`).

    python benchmarks/multi_process.py --steps 4 --max-completion-length 64
    python benchmarks/multi_process.py --compare fsdp2 --steps 2

(Not multiprocess.py: `multiprocess` is a package `datasets` imports; a script's directory comes first on sys.path.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

WORKER = Path(__file__).with_name("_worker.py")
FSDP2 = {"fsdp": "full_shard", "fsdp_config": {"version": 2, "state_dict_type": "SHARDED_STATE_DICT"}}
DDP_LAYOUTS = [  # label, processes per run, fast paths, runs at once
    ("1 process, fast", 1, True, 1),
    ("2 processes, fast", 2, True, 1),
    ("2 processes, padded", 2, False, 1),
    ("control: 2 lone 1-process runs at once, fast", 1, True, 2),
]


def launch(processes: int, config: str, extra: dict, runs: int, args: argparse.Namespace) -> list[dict]:
    """`runs` independent launches of `processes` processes each, started together; every process's record."""
    with tempfile.TemporaryDirectory() as root:
        outs, jobs = [os.path.join(root, str(k)) for k in range(runs)], []
        for out in outs:
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
            command += [str(WORKER), "--impl", "grpo_hf", "--config", config, "--steps", str(args.steps)]
            command += ["--extra", json.dumps(extra), "--out", out] + ["--tiny"] * args.tiny
            env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
            jobs.append(subprocess.Popen(command, env=env))
        for job in jobs:
            if job.wait() != 0:
                raise subprocess.CalledProcessError(job.returncode, job.args)
        return [json.loads(Path(f"{out}.{rank}").read_text()) for out in outs for rank in range(processes)]


def compare_ddp(args: argparse.Namespace) -> None:
    rows = []
    for label, processes, fast, runs in DDP_LAYOUTS:
        extra = {"share_prompt_prefix": fast, "backward_per_group": fast}
        records = launch(processes, "a", {**extra, "max_completion_length": args.max_completion_length}, runs, args)
        step = max(statistics.median(r["step_seconds"][1:] or r["step_seconds"]) for r in records)
        rows.append((label, max(r["peak_rss_mib"] for r in records), step, all(r["fast_path"] for r in records)))
    print("| layout | peak RSS per process (MiB, max) | s/step (median, slowest process) | fast path used |")
    print("|---|---:|---:|---|")
    for label, rss, step, used in rows:
        print(f"| {label} | {rss:,.0f} | {step:.2f} | {used} |")
    (_, rss1, step1, _), (_, rss2, step2, _), (_, rss_pad, step_pad, _), (_, _, step_alone, _) = rows
    print(
        f"\n2 processes fast / 1 process: memory {rss2 / rss1:.2f}x, step time {step2 / step1:.2f}x; "
        f"2 processes padded / 1 process: memory {rss_pad / rss1:.2f}x, step time {step_pad / step1:.2f}x\n"
        f"2 processes fast / the control (what DDP itself costs): step time {step2 / step_alone:.2f}x"
    )


def compare_fsdp2(args: argparse.Namespace) -> None:
    print("| layout | process | RSS before the model, MiB | peak RSS MiB | peak - before |\n|---|---:|---:|---:|---:|")
    for layout, extra in (("DDP", {}), ("FSDP2", FSDP2)):
        for rank, record in enumerate(launch(2, "llama", extra, 1, args)):
            before, peak = record["rss_start_mib"], record["peak_rss_mib"]
            print(f"| {layout} | {rank} | {before:,.0f} | {peak:,.0f} | {peak - before:,.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compare", choices=["ddp", "fsdp2"], default="ddp")
    parser.add_argument("--steps", type=int, default=3, help="Optimizer steps per run; the first is not timed.")
    parser.add_argument("--max-completion-length", type=int, default=64, help="Tokens per completion (ddp).")
    parser.add_argument("--tiny", action="store_true", help="The tiny model: a check of the script, not a measure.")
    args = parser.parse_args()
    compare_ddp(args) if args.compare == "ddp" else compare_fsdp2(args)


if __name__ == "__main__":
    main()
