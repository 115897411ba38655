"""Asynchronous GRPO against the synchronous loop: optimizer steps per second, side by side in one process.

Trains the real SmolLM2-135M-Instruct weights (the demos' offline model) for `--steps` steps per run, at
`max_staleness` 0 (synchronous), 1 and 2, on two workloads:

- `latency`: every completion's reward comes from a service that answers after `--latency` seconds (a judge or a
  sandbox elsewhere; simulated by a sleep, so the producer waits on something that is not this CPU). `--latency auto`
  (the default) makes it as long as the training part of one step (the step minus its sampling and scoring),
  measured first, in this run, on the compute-bound workload.
- `compute`: instant rewards; sampling and training compete for the same CPU cores, so overlap cannot win here; the
  ratio says what the producer thread costs.

Reported per run: steps per second (the first step, which builds the engines, excluded), the ratio to the synchronous
run of the same workload, the mean staleness, and the fractions of wall time the trainer waited for samples and the
producer waited for admission (docs/async.md).

    python benchmarks/async_overlap.py                 # the table in docs/async.md
    python benchmarks/async_overlap.py --steps 4 --tiny  # a quick check on a tiny random model
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "recipes"))
sys.path.insert(0, str(ROOT / "tests"))


class StepClock:
    """A TrainerCallback recording the wall time of each optimizer step's end."""

    def __new__(cls):
        from transformers import TrainerCallback

        class _Clock(TrainerCallback):
            def __init__(self):
                self.ends = []

            def on_train_begin(self, *_, **__):
                self.ends = [time.perf_counter()]

            def on_step_end(self, *_, **__):
                self.ends.append(time.perf_counter())

        return _Clock()


def dataset(n: int):
    from datasets import Dataset

    questions = [f"What is {7 * k % 50} plus {3 * k % 40}? Answer briefly." for k in range(n)]
    prompts = [[{"role": "user", "content": question}] for question in questions]
    return Dataset.from_dict({"prompt": prompts})


def model_and_tokenizer(tiny: bool):
    if tiny:
        from conftest import build_tiny_model, build_tiny_tokenizer

        tokenizer = build_tiny_tokenizer()
        return build_tiny_model(tokenizer, seed=0), tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_hf import offline_model_path

    path = offline_model_path()
    return AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)


def timed_production():
    """Times `ExperienceMaker.sample_round` and `score_round` (sampling and scoring a generation batch, whichever
    threads run them): one entry per batch, its seconds in both."""
    from grpo_hf.experience import ExperienceMaker

    seconds = []

    def timed(method, first: bool):
        def wrapper(self, *args, **kwargs):
            start = time.perf_counter()
            try:
                return method(self, *args, **kwargs)
            finally:
                spent = time.perf_counter() - start
                if first:
                    seconds.append(spent)
                else:
                    seconds[-1] += spent  # the scorer runs the batches in order, after their sampling

        return wrapper

    ExperienceMaker.sample_round = timed(ExperienceMaker.sample_round, first=True)
    ExperienceMaker.score_round = timed(ExperienceMaker.score_round, first=False)
    return seconds


PRODUCE_SECONDS = timed_production()


def run(args, staleness: int, latency: float) -> dict:
    from transformers import PrinterCallback

    from grpo_hf import GRPOConfig, GRPOTrainer

    def served_reward(completion_ids, **_):
        time.sleep(latency)  # one request for the batch, answered after `latency` seconds
        return [float(len(ids) % 5) for ids in completion_ids]

    model, tokenizer = model_and_tokenizer(args.tiny)
    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(
            output_dir=out,
            report_to="none",
            use_cpu=True,
            save_strategy="no",
            logging_steps=1,
            disable_tqdm=True,
            per_device_train_batch_size=8,
            num_generations=4,
            max_completion_length=args.tokens,
            beta=0.0,
            learning_rate=1e-6,
            max_steps=args.steps,
            rollout_engine="loop",
            seed=0,
            max_staleness=staleness,
        )
        clock = StepClock()
        trainer = GRPOTrainer(model, served_reward, config, train_dataset=dataset(64), processing_class=tokenizer)
        trainer.add_callback(clock)
        trainer.remove_callback(PrinterCallback)  # no log rows on stdout: the table is the output
        PRODUCE_SECONDS.clear()
        trainer.train()
    steps = [b - a for a, b in zip(clock.ends[1:-1], clock.ends[2:], strict=True)]  # the first step excluded
    logs = [row for row in trainer.state.log_history if "loss" in row]
    mean = lambda key: statistics.mean(row.get(key, 0.0) for row in logs[1:])  # noqa: E731
    return {
        "steps_per_second": 1.0 / statistics.mean(steps),
        "step_seconds": statistics.mean(steps),
        "produce_seconds": statistics.mean(PRODUCE_SECONDS[1:]),
        "staleness": mean("async/staleness_mean"),
        "trainer_wait": mean("async/trainer_wait_fraction"),
        "producer_wait": mean("async/producer_wait_fraction"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8, help="Steps per run (default 8; first excluded).")
    parser.add_argument("--tokens", type=int, default=32, help="max_completion_length (default 32).")
    parser.add_argument("--latency", default="auto", help="Seconds per reward request, or 'auto' (see above).")
    parser.add_argument("--tiny", action="store_true", help="A tiny random model instead of SmolLM2 (a quick check).")
    args = parser.parse_args()
    logging.disable(logging.WARNING)

    rows = []
    compute_sync = run(args, 0, 0.0)
    rows.append(("compute", 0, 0.0, compute_sync))
    rows.append(("compute", 1, 0.0, run(args, 1, 0.0)))
    training = compute_sync["step_seconds"] - compute_sync["produce_seconds"]
    latency = training if args.latency == "auto" else float(args.latency)
    for staleness in (0, 1, 2):
        rows.append(("latency", staleness, latency, run(args, staleness, latency)))

    model = "a tiny random model" if args.tiny else "SmolLM2-135M"
    print(f"{model}, CPU, {args.steps} steps of 8 completions of <= {args.tokens} tokens")
    print("| workload | reward latency (s) | max_staleness | steps/s | vs synchronous | staleness | trainer waited "
          "| producer waited |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    base = {}
    for workload, staleness, latency, result in rows:
        base.setdefault(workload, result["steps_per_second"])
        ratio = result["steps_per_second"] / base[workload]
        print(
            f"| {workload} | {latency:.2f} | {staleness} | {result['steps_per_second']:.3f} | {ratio:.2f}x | "
            f"{result['staleness']:.2f} | {result['trainer_wait']:.2f} | {result['producer_wait']:.2f} |"
        )


if __name__ == "__main__":
    main()
