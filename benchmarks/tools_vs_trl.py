"""Tool episodes, grpo_hf against TRL 1.16: seconds per step when half the completions call a tool that sleeps 0.2 s.

Both trainers train the offline SmolLM2-135M-Instruct (real weights) with TRL's Qwen2.5 chat template on its
tokenizer, the built-in arithmetic prompts, one tool (`lookup`, which sleeps 0.2 s), the same seed and every shared
knob set explicitly (`_worker.common_config`: 2 prompts x G=8 = 16 completions per step). Generation is real; only the
*reading* of a model turn is scripted, the same way in both trainers, so that about half the rows call the tool:
TRL's `trl.trainer.grpo_trainer.parse_response` and grpo_hf's `EpisodeRunner.parse` are replaced by `scripted_parse`,
which reads every other first turn (in the order they are read) that ended with its EOS as a call of `lookup`, and
every other turn as plain text. The prompts ask for one short sentence (the CPU demo's), so that first turns end: a
turn cut at max_completion_length calls nothing in grpo_hf. Each trainer logs `tools/call_frequency`, printed beside
its time.

TRL runs the calls one after another (8 calls: 1.6 s per step); grpo_hf runs them at the same time and samples the
next turns of the episodes whose tools have returned. Each trainer runs in a fresh process (this file with
`--worker`), one after the other; a step is Trainer's `on_step_begin` -> `on_step_end`. The first step is a warm-up
and is not timed.

    python benchmarks/tools_vs_trl.py                 # 1 warm-up + 3 timed steps per trainer
    python benchmarks/tools_vs_trl.py --steps 5

The last line is `time_ratio=X.XX` (grpo_hf's median seconds per step over TRL's; the goal is at most 0.5).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent))  # _worker: the shared config
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))  # the arithmetic prompts, the offline model

TOOL_SECONDS = 0.2
SYSTEM_PROMPT = (
    "Answer the math question. Write one short sentence with the calculation, then the final line '#### <number>'."
)
MAX_COMPLETION_LENGTH = 96
_FIRST_TURNS = itertools.count()  # first turns read so far, in row order: the row's parity


def lookup() -> str:
    """Look up the reference value (a slow service: it takes 0.2 seconds)."""
    time.sleep(TOOL_SECONDS)
    return "42"


def brevity(completions, **_) -> list[float]:
    """A reward that varies within a group: shorter last messages score higher."""
    return [-len(str(c[-1].get("content") or "")) / 100 for c in completions]


def scripted_parse(tokenizer, ids, prefix=None, tools=None) -> dict:
    """Read a turn (`ids` after the context `prefix`) for both trainers alike: every other first turn read, ended by
    the EOS, calls `lookup`; everything else is text."""
    first_turn = "<tool_response>" not in tokenizer.decode(list(prefix or []))
    if first_turn:
        if next(_FIRST_TURNS) % 2 == 0 and len(ids) > 0 and ids[-1] == tokenizer.eos_token_id:
            call = {"type": "function", "function": {"name": "lookup", "arguments": {}}}
            return {"role": "assistant", "content": "", "tool_calls": [call]}
    return {"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)}


def build_trainer(impl: str, steps: int, seed: int, output_dir: str):
    import torch
    import trl
    from _worker import common_config, grpo_hf_only_config, trl_only_config

    from grpo_hf.models import load_tokenizer

    from gsm8k_support.data import make_arithmetic_dataset, to_conversational
    from offline_model import offline_model_path

    kwargs = common_config("c", steps, seed, False, not torch.cuda.is_available(), output_dir)  # beta=0, mu=1
    kwargs.update(max_completion_length=MAX_COMPLETION_LENGTH, reward_weights=[1.0], max_tool_calling_iterations=1)
    tokenizer = load_tokenizer(offline_model_path())
    tokenizer.chat_template = (Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja").read_text()
    if impl == "trl":
        import trl.trainer.grpo_trainer as trl_grpo

        trl_grpo.parse_response = scripted_parse
        config, trainer_class = trl.GRPOConfig(**kwargs, **trl_only_config()), trl.GRPOTrainer
    else:
        from grpo_hf import GRPOConfig, GRPOTrainer

        config, trainer_class = GRPOConfig(**kwargs, **grpo_hf_only_config()), GRPOTrainer
    # The CPU demo's short-answer prompts (recipes/gsm8k_cpu.yaml): first turns that end with their EOS, so that the
    # scripted reading can make half of them call the tool
    dataset = to_conversational(
        make_arithmetic_dataset(64, seed=0), answer_format="####", system_prompt=SYSTEM_PROMPT, num_shots=2
    )
    trainer = trainer_class(
        model=offline_model_path(),
        reward_funcs=[brevity],
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        tools=[lookup],
    )
    if impl == "grpo_hf":
        trainer.experience.sampler.episodes.parse = scripted_parse
    return trainer


def worker(impl: str, steps: int, seed: int, out: str) -> None:
    """Train `steps` steps with one trainer and write each step's seconds and tool-call frequency to `out`."""
    import datasets
    import transformers
    from transformers import TrainerCallback

    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()
    record = {"step_seconds": [], "call_frequency": [], "mean_length": []}

    class Timer(TrainerCallback):
        def on_step_begin(self, *_, **__):
            self.start = time.perf_counter()

        def on_step_end(self, *_, **__):
            record["step_seconds"].append(time.perf_counter() - self.start)

        def on_log(self, _args, _state, _control, logs=None, **__):
            if logs and "tools/call_frequency" in logs:
                record["call_frequency"].append(logs["tools/call_frequency"])
                record["mean_length"].append(logs.get("completions/mean_length"))

    with tempfile.TemporaryDirectory() as output_dir:
        trainer = build_trainer(impl, steps, seed, output_dir)
        trainer.add_callback(Timer())
        trainer.train()
    with open(out, "w") as f:
        json.dump(record, f)


def run(impl: str, steps: int, seed: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        command = [sys.executable, __file__, "--worker", impl, "--steps", str(steps), "--seed", str(seed)]
        result = subprocess.run([*command, "--out", out], capture_output=True, text=True)
        if result.returncode != 0 or not os.path.exists(out):
            sys.stderr.write(result.stdout[-3000:] + result.stderr[-6000:])
            raise SystemExit(f"the {impl} run failed with exit code {result.returncode}")
        return json.loads(Path(out).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4, help="Steps per trainer, the first untimed (default 4).")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--worker", choices=["trl", "grpo_hf"], default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        return worker(args.worker, args.steps, args.seed, args.out)
    if args.steps < 2:
        raise SystemExit("--steps must be at least 2: the first one is not timed.")
    started = time.perf_counter()
    print(
        f"# tools_vs_trl: CPU, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at the start", flush=True
    )
    medians = {}
    print("| trainer | s/step (median of timed steps) | step seconds | tools/call_frequency |\n|---|---:|---|---|")
    for label, impl in (("TRL", "trl"), ("grpo_hf", "grpo_hf")):
        record = run(impl, args.steps, args.seed)
        medians[label] = statistics.median(record["step_seconds"][1:])
        seconds = " ".join(f"{s:.1f}" for s in record["step_seconds"])
        print(f"| {label} | {medians[label]:.2f} | {seconds} | {record['call_frequency']} |", flush=True)
    ratio = medians["grpo_hf"] / medians["TRL"]
    print(
        f"\n(total wall time {time.perf_counter() - started:.0f} s, load average {os.getloadavg()[0]:.2f} at the end)"
    )
    print(f"time_ratio={ratio:.2f}")


if __name__ == "__main__":
    sys.exit(main())
