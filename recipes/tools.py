"""A model learns to use a calculator tool: warm start -> GRPO with tool episodes, against the same run without tools.

Usage (offline, 2 CPU cores: `make demo-tools`; the timings measured are in docs/tools.md):

    python recipes/tools.py --config recipes/tools_cpu.yaml

SmolLM2-135M-Instruct, with TRL's Qwen2.5 chat template (which renders tools) set on its tokenizer, answers
multiplication word problems (by default a 3-digit by a 2-digit number), which it cannot do in its head. Two arms, the
same in everything but the tool:

- `tools`: the prompt describes `multiply(a, b)`; the model may call it and answers after its reply (GRPO's
  `tools=[multiply]`: real multi-turn episodes);
- `no_tools`: the same prompt without the tool; the model answers at once.

Each arm: greedy evaluation of the base model -> a short supervised warm start (TRL's `SFTTrainer`, on generated
correct traces; with the tool only a share of them call it, the others answer at once; `tools_support/warm_start.py`)
-> greedy evaluation -> for each of `seeds`, GRPO rewarded only for the right final answer -> greedy evaluation. The
warm start runs once per arm; each seed's GRPO trains a freshly loaded model given the warm-started weights, with
`set_seed(seed)` just before its `GRPOTrainer`, so every seed starts from the same model and the seed alone draws its
training problems and samples. The warm start is sized to leave the model calling the tool now and then, not solving
the task: what GRPO adds is the reward's teaching. The held-out problems never share a multiplication with the
training ones (`tools_support/problems.py`) and are the same for every seed. Evaluation runs real greedy episodes
through grpo_hf's `EpisodeRunner` (`tools_support/evaluation.py`): accuracy, tool-call rate, failed-call rate, mean
turns.

Every key of the YAML file is a field of `ScriptArguments` below or of `grpo_hf.GRPOConfig`; the command line
overrides the file. Outputs in `output_dir`: `eval.json` (the tables' numbers, the mean, min and max over the seeds,
timings and every training log), `eval_samples.jsonl` (every evaluated episode) and `training_curves.png` (reward,
tool calls, failed calls and turns per GRPO step, one line per arm and seed; the GSM8K demo's plot). No model is saved.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import trl
from transformers import set_seed

from grpo_hf import GRPOConfig, GRPOTrainer
from grpo_hf.models import load_model, load_tokenizer
from grpo_hf.offline_model import OFFLINE_MODEL_ID, resolve_model_path
from grpo_hf.rollout.tools import tool_chat_template

from config_args import parse_config_args
from gsm8k_support.plotting import plot_training_curves
from tools_support.evaluation import evaluate
from tools_support.problems import correct_answer, make_problems, multiply, to_conversational
from tools_support.warm_start import warm_start

logger = logging.getLogger("recipes.tools")

QWEN_TEMPLATE = Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja"
ARMS = ("tools", "no_tools")


@dataclass
class ScriptArguments:
    """What the demo loads, warm-starts and evaluates; `GRPOConfig` holds how GRPO trains."""

    model_name_or_path: str = field(
        default=OFFLINE_MODEL_ID, metadata={"help": f"Local directory or {OFFLINE_MODEL_ID!r}."}
    )
    chat_template_path: str = field(
        default=str(QWEN_TEMPLATE), metadata={"help": "A chat template that renders tools, set on the tokenizer."}
    )
    arms: list[str] = field(default_factory=lambda: list(ARMS), metadata={"help": f"Which of {ARMS} to run."})
    seeds: list[int] = field(
        default_factory=lambda: [42],
        metadata={"help": "One GRPO run per seed, each from the warm start (run once, with the first seed)."},
    )
    digits: list[int] = field(
        default_factory=lambda: [2, 2], metadata={"help": "Digits of the two factors of the generated problems."}
    )
    num_train_examples: int = field(default=256, metadata={"help": "Generated training problems (GRPO's data)."})
    num_eval_examples: int = field(default=64, metadata={"help": "Generated held-out problems."})
    eval_seed: int = field(default=0, metadata={"help": "Draws the held-out problems, the same for every seed."})
    eval_batch_size: int = field(default=32, metadata={"help": "Episodes per batch in evaluation."})
    warm_start_examples: int = field(default=64, metadata={"help": "Traces of the warm start (first training rows)."})
    warm_start_tool_fraction: float = field(
        default=1.0, metadata={"help": "With the tool: the share of warm-start traces that call it (the rest answer)."}
    )
    warm_start_epochs: float = field(default=1.0, metadata={"help": "Epochs over the warm-start traces."})
    warm_start_learning_rate: float = field(default=5e-5, metadata={"help": "Learning rate of the warm start."})
    warm_start_batch_size: int = field(default=8, metadata={"help": "Traces per warm-start step."})

    def __post_init__(self):
        unknown = sorted(set(self.arms) - set(ARMS))
        if unknown or not self.arms:
            raise ValueError(f"arms={self.arms}: choose one or more of {list(ARMS)}.")


def parse_args(argv: list[str] | None = None) -> tuple[ScriptArguments, GRPOConfig]:
    """`--config file.yaml` sets defaults for `ScriptArguments` and `GRPOConfig`; other flags override them."""
    return parse_config_args((ScriptArguments, GRPOConfig), argv, "recipes/tools.py")


def evaluate_stage(model, tokenizer, held_out, tools, args, config, template_kwargs) -> dict:
    """A greedy evaluation of `model` on the held-out problems, with its wall time."""
    start = time.time()
    metrics = evaluate(
        model,
        tokenizer,
        held_out,
        tools,
        max_completion_length=config.max_completion_length,
        template_kwargs=template_kwargs,
        batch_size=args.eval_batch_size,
        max_tool_calling_iterations=config.max_tool_calling_iterations,
        episode_cache_gb=config.episode_cache_gb,
    )
    return {**metrics, "seconds": time.time() - start}


def arm_tools(arm: str) -> list:
    """The tools an arm's prompts list and its episodes call."""
    return [multiply] if arm == "tools" else []


def run_arm(arm: str, args: ScriptArguments, config: GRPOConfig, tokenizer, held_out, template_kwargs) -> dict:
    """Base -> warm start -> GRPO once per seed for one arm, with a greedy evaluation after each; the metrics, logs
    and timings. The warm start runs once (with the first seed); each seed's GRPO trains a freshly loaded model given
    the warm-started weights, so every seed starts from the same model. Each seed's GRPO draws its own training
    problems and samples; the held-out problems are the same throughout."""
    tools = arm_tools(arm)
    model = load_model(resolve_model_path(args.model_name_or_path), dtype="float32")
    stages = {"base": evaluate_stage(model, tokenizer, held_out, tools, args, config, template_kwargs)}
    start = time.time()
    warm_log = warm_start(
        model,
        tokenizer,
        training_problems(args, args.seeds[0]).select(range(args.warm_start_examples)),
        with_tool=arm == "tools",
        template_kwargs=template_kwargs,
        output_dir=os.path.join(config.output_dir, f"{arm}_warm_start"),
        max_completion_length=config.max_completion_length,
        tool_fraction=args.warm_start_tool_fraction,
        learning_rate=args.warm_start_learning_rate,
        num_train_epochs=args.warm_start_epochs,
        per_device_train_batch_size=args.warm_start_batch_size,
        use_cpu=config.use_cpu,
        bf16=config.bf16,  # the same precision as GRPO: accelerate keeps one per process
        fp16=config.fp16,
        seed=args.seeds[0],
    )
    seconds = {"warm start": time.time() - start}
    stages["warm start"] = evaluate_stage(model, tokenizer, held_out, tools, args, config, template_kwargs)
    for stage, metrics in stages.items():
        seconds[f"eval {stage}"] = metrics.pop("seconds")
        logger.info("%s, %s: %s", arm, stage, _summary(metrics))
    warm_weights = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    del model
    runs = {}
    for seed in args.seeds:
        model = load_model(resolve_model_path(args.model_name_or_path), dtype="float32")
        model.load_state_dict(warm_weights)
        runs[seed] = run_grpo(arm, seed, model, args, config, tokenizer, held_out, template_kwargs)
    return {"stages": stages, "seconds": seconds, "warm_start_log": warm_log, "runs": runs}


def training_problems(args: ScriptArguments, seed: int):
    return to_conversational(make_problems(args.num_train_examples, "train", seed, args.digits))


def run_grpo(arm: str, seed: int, model, args, config: GRPOConfig, tokenizer, held_out, template_kwargs) -> dict:
    """One seed's GRPO from the warm-started `model`, then its greedy evaluation."""
    tools = arm_tools(arm)
    config = copy.copy(config)  # this run's seed and folder (`dataclasses.replace` would re-derive the batch sizes)
    config.seed, config.output_dir = seed, os.path.join(config.output_dir, f"{arm}_seed{seed}")
    set_seed(seed)
    trainer = GRPOTrainer(
        model,
        [correct_answer],
        config,
        train_dataset=training_problems(args, seed),
        processing_class=tokenizer,
        tools=tools or None,
    )
    start = time.time()
    trainer.train()
    seconds = {"GRPO": time.time() - start}
    metrics = evaluate_stage(trainer.model, tokenizer, held_out, tools, args, config, template_kwargs)
    seconds["eval GRPO"] = metrics.pop("seconds")
    logger.info("%s, seed %d, GRPO: %s", arm, seed, _summary(metrics))
    return {"GRPO": metrics, "seconds": seconds, "grpo_log": trainer.state.log_history}


METRICS = ("accuracy", "tool_call_rate", "failed_call_rate", "mean_turns")
STAGES = ("base", "warm start", "GRPO")


def _summary(metrics: dict) -> str:
    return ", ".join(f"{name} {metrics[name]:.3f}" for name in METRICS)


def seed_summary(result: dict) -> dict[str, dict[str, dict[str, float]]]:
    """Per stage and metric of one arm: mean, min and max over the seeds (one value for base and warm start)."""
    values = {stage: [metrics] for stage, metrics in result["stages"].items()}
    values["GRPO"] = [run["GRPO"] for run in result["runs"].values()]
    return {
        stage: {
            name: {"mean": sum(v) / len(v), "min": min(v), "max": max(v)}
            for name in METRICS
            for v in [[m[name] for m in runs]]
        }
        for stage, runs in values.items()
    }


def print_tables(results: dict[str, dict], n: int) -> None:
    """One markdown table: per arm, base, warm start, each seed's GRPO and the mean [min, max] over the seeds."""
    print(f"Greedy, {n} held-out problems:")
    print("| arm | stage | accuracy | tool-call rate | failed-call rate | mean turns |\n|---|---|---:|---:|---:|---:|")
    for arm, result in results.items():
        seeds = [(f"GRPO seed {seed}", run["GRPO"]) for seed, run in result["runs"].items()]
        rows = [*result["stages"].items(), *seeds]
        for stage, metrics in rows:
            print(f"| {arm} | {stage} | " + " | ".join(f"{metrics[name]:.3f}" for name in METRICS) + " |")
        spread = result["over_seeds"]["GRPO"]
        cells = (f"{m['mean']:.3f} [{m['min']:.3f}, {m['max']:.3f}]" for m in spread.values())
        print(f"| {arm} | GRPO mean [min, max] over {len(result['runs'])} seeds | " + " | ".join(cells) + " |")
    for arm, result in results.items():
        gain = result["over_seeds"]["GRPO"]["accuracy"]["mean"] - result["stages"]["warm start"]["accuracy"]
        print(f"{arm}: GRPO's held-out accuracy minus the warm start's, mean over the seeds: {gain:+.3f}")


def write_results(output_dir: str, results: dict, extra: dict) -> None:
    """`eval.json`: the metrics (no episodes), timings and logs; `eval_samples.jsonl`: every evaluated episode."""
    os.makedirs(output_dir, exist_ok=True)

    def without_records(metrics):
        return {k: v for k, v in metrics.items() if k != "records"}

    summary = {
        arm: {
            **r,
            "stages": {stage: without_records(m) for stage, m in r["stages"].items()},
            "runs": {seed: {**run, "GRPO": without_records(run["GRPO"])} for seed, run in r["runs"].items()},
        }
        for arm, r in results.items()
    }
    with open(os.path.join(output_dir, "eval.json"), "w") as f:
        json.dump({**summary, **extra}, f, indent=1)
    with open(os.path.join(output_dir, "eval_samples.jsonl"), "w") as f:
        for arm, r in results.items():
            evaluated = [(None, stage, m) for stage, m in r["stages"].items()]
            evaluated += [(seed, "GRPO", run["GRPO"]) for seed, run in r["runs"].items()]
            for seed, stage, metrics in evaluated:
                for record in metrics["records"]:
                    f.write(json.dumps({"arm": arm, "stage": stage, "seed": seed, **record}) + "\n")


def plot_runs(results: dict, path: str) -> str | None:
    """The GRPO training curves of every arm and seed in one PNG (the GSM8K demo's plot)."""
    logs = {f"{arm} seed {seed}": run["grpo_log"] for arm, r in results.items() for seed, run in r["runs"].items()}
    return plot_training_curves(logs, path, title="Tool demo: GRPO training curves")


def main(argv: list[str] | None = None) -> dict:
    start = time.time()
    args, config = parse_args(argv)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    tokenizer = load_tokenizer(resolve_model_path(args.model_name_or_path))
    tokenizer.chat_template = Path(args.chat_template_path).read_text()
    template = tool_chat_template(tokenizer)  # checks the template, sets the tokenizer's response schema
    template_kwargs = {} if template is None else {"chat_template": template}
    held_out = to_conversational(make_problems(args.num_eval_examples, "test", args.eval_seed, args.digits))
    results = {}
    for arm in args.arms:
        results[arm] = run_arm(arm, args, config, tokenizer, held_out, template_kwargs)
        results[arm]["over_seeds"] = seed_summary(results[arm])
    plot = plot_runs(results, os.path.join(config.output_dir, "training_curves.png"))
    extra = {"model": args.model_name_or_path, "command": sys.argv, "runtime_s": time.time() - start}
    write_results(config.output_dir, results, {**extra, "plot": plot})
    print_tables(results, len(held_out))
    logger.info("Done in %.0f s; results in %s", extra["runtime_s"], config.output_dir)
    return results


if __name__ == "__main__":
    main()
