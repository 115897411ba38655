"""grpo_hf under DDP: per-process peak memory and seconds per step, fast log-prob paths on and off (issue 12).

(Named multi_process.py, not multiprocess.py: `multiprocess` is a package `datasets` imports, and a script's own
directory comes first on sys.path.)

    python benchmarks/multi_process.py [--steps 3] [--max-completion-length 64] [--json out.json]

Three layouts of config (a) of `benchmarks/vs_trl.py` (the offline SmolLM2-135M, 16 completions per process per
step, beta 0.04), each launched fresh with `torch.distributed.run` (gloo on CPU, NCCL on GPUs):

- 1 process, fast paths on (shared prompt prefix, per-group backward): the reference;
- 2 processes, fast paths on: one generation batch of 32 split across them, the same per-device batch;
- 2 processes, fast paths off (the padded path through DDP's forward);
- a control: two independent 1-process runs started together. On a 2-core machine two busy processes share the
  memory bandwidth and caches, so a process is slower next to another one whatever they do; the 2-process run
  divided by this control is what DDP itself costs (the gradient all-reduce and waiting for the slower process).

Every process gets one thread (`OMP_NUM_THREADS=1`), so that on a 2-core machine each process has a core of its
own and the per-process numbers compare: a process of the 2-process runs does the same work as the 1-process run.
Each process reports its peak RSS (`getrusage`) and the median wall time of its steps after the first (the first
step holds one-time setup). Run it on an idle machine.
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
LAYOUTS = [  # label, processes per run, fast paths, runs at once
    ("1 process, fast", 1, True, 1),
    ("2 processes, fast", 2, True, 1),
    ("2 processes, padded", 2, False, 1),
    ("control: 2 lone 1-process runs at once, fast", 1, True, 2),
]


def worker(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(HERE))
    import datasets
    import transformers
    from _worker import build_trainer
    from transformers import TrainerCallback

    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()
    seconds: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *_, **__):
            self.start = time.perf_counter()

        def on_step_end(self, *_, **__):
            seconds.append(time.perf_counter() - self.start)

    extra = {
        "share_prompt_prefix": args.fast,
        "backward_per_group": args.fast,
        "max_completion_length": args.max_completion_length,
    }
    with tempfile.TemporaryDirectory() as output_dir:
        trainer = build_trainer("grpo_hf", "a", args.steps, 0, False, output_dir, extra)
        trainer.add_callback(Timer())
        trainer.train()
        rank = trainer.accelerator.process_index
        fast = trainer.logps.blocker(trainer.model_wrapped) is None
        trainer.accelerator.wait_for_everyone()
        trainer.accelerator.end_training()
    record = {
        "rank": rank,
        "fast_path_used": fast,
        "step_seconds": seconds,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(record))


def launch(processes: int, fast: bool, runs: int, args: argparse.Namespace) -> list[dict]:
    """`runs` independent launches of `processes` processes each, started together; every process's record."""
    with tempfile.TemporaryDirectory() as root:
        outs = [Path(root, str(k)) for k in range(runs)]
        jobs = [_start(processes, fast, out, args) for out in outs]
        for job in jobs:
            if job.wait() != 0:
                raise subprocess.CalledProcessError(job.returncode, job.args)
        return [json.loads(Path(out, f"rank{k}.json").read_text()) for out in outs for k in range(processes)]


def _start(processes: int, fast: bool, out: Path, args: argparse.Namespace) -> subprocess.Popen:
    out.mkdir()
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}",
        __file__, "--worker", "--out", str(out), "--steps", str(args.steps),
        "--max-completion-length", str(args.max_completion_length), *(["--fast"] if fast else []),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.Popen(command, env=env)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3, help="Optimizer steps per run; the first is not timed.")
    parser.add_argument("--max-completion-length", type=int, default=64)
    parser.add_argument("--json", default=None, help="Also write every record to this file.")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--fast", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    results = {label: launch(processes, fast, runs, args) for label, processes, fast, runs in LAYOUTS}
    rows = []
    for label, records in results.items():
        rss = max(r["peak_rss_mib"] for r in records)
        step = max(statistics.median(r["step_seconds"][1:]) for r in records)
        rows.append((label, rss, step, all(r["fast_path_used"] for r in records)))
    print("| layout | peak RSS per process (MiB, max) | s/step (median, slowest process) | fast path used |")
    print("|---|---|---|---|")
    for label, rss, step, used in rows:
        print(f"| {label} | {rss:,.0f} | {step:.2f} | {used} |")
    (_, rss1, step1, _), (_, rss2, step2, _), (_, rss_pad, step_pad, _), (_, _, step_alone, _) = rows
    print(
        f"\n2 processes fast / 1 process: memory {rss2 / rss1:.2f}x, step time {step2 / step1:.2f}x; "
        f"2 processes padded / 1 process: memory {rss_pad / rss1:.2f}x, step time {step_pad / step1:.2f}x\n"
        f"2 processes fast / the control (what DDP itself costs, the machine's shared memory bandwidth taken out): "
        f"step time {step2 / step_alone:.2f}x"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
