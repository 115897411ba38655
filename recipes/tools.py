"""A model learns to use a calculator tool: warm start -> GRPO with tool episodes, against the same run without tools.

Usage (offline, 2 CPU cores: `make demo-tools`; the timings measured are in docs/tools.md):

    python recipes/tools.py --config recipes/tools_cpu.yaml

SmolLM2-135M-Instruct, with TRL's Qwen2.5 chat template (which renders tools) set on its tokenizer, answers
multiplication word problems of two 2-digit numbers, which it cannot do in its head. Two arms, the same in everything
but the tool:

- `tools`: the prompt describes `multiply(a, b)`; the model may call it and answers after its reply (GRPO's
  `tools=[multiply]`: real multi-turn episodes);
- `no_tools`: the same prompt without the tool; the model answers at once.

Each arm: greedy evaluation of the base model -> a short supervised warm start (TRL's `SFTTrainer`, on generated
correct traces: a call and the answer with the tool, the answer alone without; `tools_support/warm_start.py`) ->
greedy evaluation -> GRPO rewarded only for the right final answer -> greedy evaluation. The held-out problems never
share a multiplication with the training ones (`tools_support/problems.py`). Evaluation runs real greedy episodes
through grpo_hf's `EpisodeRunner` (`tools_support/evaluation.py`).

Every key of the YAML file is a field of `ScriptArguments` below or of `grpo_hf.GRPOConfig`; the command line
overrides the file. Outputs in `output_dir`: `eval.json` (the table's numbers, timings and each arm's training log)
and `eval_samples.jsonl` (every evaluated episode). No model is saved.
"""

from __future__ import annotations

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
from grpo_hf.rollout.tools import tool_chat_template

from config_args import parse_config_args
from offline_model import OFFLINE_MODEL_ID, resolve_model_path
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
    digits: int = field(default=2, metadata={"help": "Digits of each factor of the generated problems."})
    num_train_examples: int = field(default=256, metadata={"help": "Generated training problems (GRPO's data)."})
    num_eval_examples: int = field(default=64, metadata={"help": "Generated held-out problems."})
    eval_batch_size: int = field(default=32, metadata={"help": "Episodes per batch in evaluation."})
    warm_start_examples: int = field(default=64, metadata={"help": "Traces of the warm start (first training rows)."})
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


def run_arm(arm: str, args: ScriptArguments, config: GRPOConfig, tokenizer, train, held_out, template_kwargs) -> dict:
    """Base -> warm start -> GRPO for one arm, with a greedy evaluation after each; the metrics and timings."""
    set_seed(config.seed)
    tools = [multiply] if arm == "tools" else []
    model = load_model(resolve_model_path(args.model_name_or_path), dtype="float32")
    stages, seconds = {}, {}

    def evaluate_as(stage: str, model) -> None:
        start = time.time()
        stages[stage] = evaluate(
            model,
            tokenizer,
            held_out,
            tools,
            max_completion_length=config.max_completion_length,
            template_kwargs=template_kwargs,
            batch_size=args.eval_batch_size,
            max_tool_calling_iterations=config.max_tool_calling_iterations,
        )
        seconds[f"eval {stage}"] = time.time() - start
        logger.info("%s, %s: accuracy %.3f, tool calls %.3f", arm, stage, stages[stage]["accuracy"],
                    stages[stage]["tool_call_rate"])  # fmt: skip

    evaluate_as("base", model)
    start = time.time()
    warm_log = warm_start(
        model,
        tokenizer,
        train.select(range(args.warm_start_examples)),
        with_tool=bool(tools),
        template_kwargs=template_kwargs,
        output_dir=os.path.join(config.output_dir, f"warm_start_{arm}"),
        max_completion_length=config.max_completion_length,
        learning_rate=args.warm_start_learning_rate,
        num_train_epochs=args.warm_start_epochs,
        per_device_train_batch_size=args.warm_start_batch_size,
        use_cpu=config.use_cpu,
        bf16=config.bf16,  # the same precision as GRPO: accelerate keeps one per process
        fp16=config.fp16,
        seed=config.seed,
    )
    seconds["warm start"] = time.time() - start
    evaluate_as("warm start", model)
    set_seed(config.seed)
    trainer = GRPOTrainer(
        model, [correct_answer], config, train_dataset=train, processing_class=tokenizer, tools=tools or None
    )
    start = time.time()
    trainer.train()
    seconds["GRPO"] = time.time() - start
    evaluate_as("GRPO", trainer.model)
    return {"stages": stages, "seconds": seconds, "warm_start_log": warm_log, "grpo_log": trainer.state.log_history}


def print_table(results: dict[str, dict]) -> None:
    header = "| arm | stage | accuracy | tool-call rate | n |\n|---|---|---:|---:|---:|"
    print(header)
    for arm, result in results.items():
        for stage, r in result["stages"].items():
            print(f"| {arm} | {stage} | {r['accuracy']:.3f} | {r['tool_call_rate']:.3f} | {r['n']} |")


def write_results(output_dir: str, results: dict, extra: dict) -> None:
    os.makedirs(output_dir, exist_ok=True)
    summary = {
        arm: {**{k: v for k, v in r.items() if k != "stages"},
              "stages": {s: {k: v for k, v in m.items() if k != "records"} for s, m in r["stages"].items()}}
        for arm, r in results.items()
    }  # fmt: skip
    with open(os.path.join(output_dir, "eval.json"), "w") as f:
        json.dump({**summary, **extra}, f, indent=1)
    with open(os.path.join(output_dir, "eval_samples.jsonl"), "w") as f:
        for arm, r in results.items():
            for stage, metrics in r["stages"].items():
                for record in metrics["records"]:
                    f.write(json.dumps({"arm": arm, "stage": stage, **record}) + "\n")


def main(argv: list[str] | None = None) -> dict:
    start = time.time()
    args, config = parse_args(argv)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    tokenizer = load_tokenizer(resolve_model_path(args.model_name_or_path))
    tokenizer.chat_template = Path(args.chat_template_path).read_text()
    template = tool_chat_template(tokenizer)  # checks the template, sets the tokenizer's response schema
    template_kwargs = {} if template is None else {"chat_template": template}
    train = to_conversational(make_problems(args.num_train_examples, "train", config.seed, args.digits))
    held_out = to_conversational(make_problems(args.num_eval_examples, "test", config.seed, args.digits))
    results = {arm: run_arm(arm, args, config, tokenizer, train, held_out, template_kwargs) for arm in args.arms}
    extra = {"model": args.model_name_or_path, "command": sys.argv, "runtime_s": time.time() - start}
    write_results(config.output_dir, results, extra)
    print_table(results)
    logger.info("Done in %.0f s; results in %s", extra["runtime_s"], config.output_dir)
    return results


if __name__ == "__main__":
    main()
