"""GRPO on GSM8K-style math: parse config -> load model and data -> evaluate -> train -> evaluate -> save.

Usage:

    # GPU cluster (Qwen2.5, openai/gsm8k from the Hub)
    accelerate launch --config_file recipes/accelerate/ddp.yaml recipes/gsm8k.py --config recipes/gsm8k.yaml
    # offline, 2 CPU cores (SmolLM2-135M-Instruct + built-in arithmetic problems): `make demo`
    python recipes/gsm8k.py --config recipes/gsm8k_cpu.yaml
    # evaluate a saved model only
    python recipes/gsm8k.py --config recipes/gsm8k_cpu.yaml --eval_only --model_name_or_path outputs/gsm8k-cpu

Every key of the YAML file is a field of `ScriptArguments` below or of `grpo_hf.GRPOConfig`; the command
line overrides the file (`--learning_rate 1e-5`). `--help` lists all of them.

A run stopped by SIGUSR1 (what recipes/slurm/grpo.sbatch has SLURM send before the time limit), SIGTERM or Ctrl-C
ends its step, writes a checkpoint, skips the final evaluation and save, and exits with `STOPPED_EXIT_CODE` (75);
`--resume_from_checkpoint true` (also `last`) continues from the newest complete checkpoint of `output_dir`, or
starts when there is none.

Outputs in `output_dir`: `eval.json` (greedy pass@1 before/after), `eval_samples.jsonl` (every evaluated
completion), `training_curves.png`, the model (or LoRA adapter, plus `merged/` with `--merge_adapter`) and
its tokenizer.

Beyond grpo_hf it needs the `recipes` extra (`pip install -e ".[recipes]"`: pyyaml, matplotlib). What only this
recipe uses (GSM8K data and prompts, greedy evaluation, the training-curves plot) sits next to it in
`recipes/gsm8k_support/`, which Python finds because the script's own directory is on `sys.path`.
"""

from __future__ import annotations

import argparse
import atexit
import json
import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field

import datasets
import torch
import transformers
from accelerate import PartialState
from accelerate.utils import gather_object
from transformers import set_seed
from transformers.utils import is_torch_bf16_gpu_available

from grpo_hf import GRPOConfig, GRPOTrainer, get_reward_funcs
from grpo_hf.checkpoint import STOPPED_EXIT_CODE
from grpo_hf.models import load_model, load_tokenizer
from grpo_hf.offline_model import OFFLINE_MODEL_ID, resolve_model_path
from grpo_hf.rewards import names_a_reward_model

from config_args import parse_config_args
from gsm8k_support.data import ARITHMETIC_DATASET, FORMAT_REWARD_NAMES, load_problems, to_conversational
from gsm8k_support.evaluation import evaluate_accuracy, summarize
from gsm8k_support.plotting import plot_training_curves

logger = logging.getLogger("recipes.gsm8k")


@dataclass
class ScriptArguments:
    """What the recipe loads and evaluates; `GRPOConfig` holds how it trains."""

    # ---- model --------------------------------------------------------------------------------------
    model_name_or_path: str = field(
        default="Qwen/Qwen2.5-0.5B-Instruct",
        metadata={"help": f"Hub id, local directory, or {OFFLINE_MODEL_ID!r} (the offline SmolLM2-135M-Instruct)."},
    )
    model_dtype: str = field(
        default="auto",
        metadata={"help": "Weights dtype: 'auto' (the checkpoint's), 'bfloat16', 'float16' or 'float32'."},
    )
    attn_implementation: str | None = field(
        default=None, metadata={"help": "e.g. 'sdpa', 'flash_attention_2'. None: the transformers default."}
    )

    # ---- data ---------------------------------------------------------------------------------------
    dataset_name: str = field(
        default="openai/gsm8k",
        metadata={"help": f"Hub dataset id, or {ARITHMETIC_DATASET!r} for the built-in offline arithmetic problems."},
    )
    dataset_path: str | None = field(
        default=None,
        metadata={
            "help": "Local jsonl/json/parquet file or directory (<split>.jsonl) with 'question' and 'answer' "
            "columns; replaces dataset_name. A single file is split into train and held-out eval rows."
        },
    )
    dataset_config: str | None = field(default="main", metadata={"help": "Hub dataset config name."})
    dataset_train_split: str = field(default="train", metadata={"help": "Split to train on."})
    dataset_test_split: str = field(default="test", metadata={"help": "Held-out split to evaluate on."})
    num_train_examples: int | None = field(
        default=None, metadata={"help": "Train on the first N problems (None: all; built-in data: 1000)."}
    )
    arithmetic_max_number: int = field(
        default=20, metadata={"help": "Largest number in the built-in arithmetic problems."}
    )
    answer_format: str = field(
        default="####",
        metadata={"help": "'####': final line '#### N' (GSM8K). 'tags': <think>...</think><answer>N</answer> (R1)."},
    )
    system_prompt: str | None = field(
        default=None, metadata={"help": "System prompt; None: the default one for answer_format."}
    )
    num_shots: int = field(
        default=0, metadata={"help": "Worked examples (0-2) shown as earlier chat turns before each question."}
    )
    reward_funcs: list[str] | None = field(
        default=None,
        metadata={
            "help": "Reward names (grpo_hf.rewards.REWARD_FUNCS and REWARD_FACTORIES, e.g. 'math_accuracy', "
            "'code'), 'module:function' paths or reward model paths; weights in reward_weights. "
            "None: 'accuracy' plus the format reward of answer_format."
        },
    )

    # ---- LoRA ---------------------------------------------------------------------------------------
    use_peft: bool = field(default=False, metadata={"help": "Train a LoRA adapter instead of all weights."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha (scale = alpha / r)."})
    lora_dropout: float = field(default=0.05, metadata={"help": "LoRA dropout."})
    lora_target_modules: list[str] | None = field(
        default=None, metadata={"help": "Modules to adapt; None: all linear layers except the LM head."}
    )
    merge_adapter: bool = field(
        default=False, metadata={"help": "Also save the base model with the adapter merged in, to output_dir/merged."}
    )

    # ---- evaluation ---------------------------------------------------------------------------------
    eval_only: bool = field(default=False, metadata={"help": "Only evaluate model_name_or_path; no training."})
    eval_before: bool = field(default=True, metadata={"help": "Evaluate before training."})
    eval_after: bool = field(default=True, metadata={"help": "Evaluate after training."})
    num_eval_examples: int = field(default=200, metadata={"help": "Held-out problems for greedy pass@1."})
    eval_batch_size: int = field(default=16, metadata={"help": "Prompts per generate call in evaluation."})
    eval_max_new_tokens: int | None = field(
        default=None, metadata={"help": "Token budget per evaluated answer; None: max_completion_length."}
    )

    def __post_init__(self):
        if self.answer_format not in FORMAT_REWARD_NAMES:
            raise ValueError(f"answer_format={self.answer_format!r} is not one of {list(FORMAT_REWARD_NAMES)}.")
        if self.reward_funcs is None:
            self.reward_funcs = ["accuracy", FORMAT_REWARD_NAMES[self.answer_format]]


# ------------------------------------------------------------------------------------------------------
# Arguments: YAML file, then command line
# ------------------------------------------------------------------------------------------------------


def _check_precision(namespace: argparse.Namespace, source: str) -> None:
    """Fail early, with what to change, when bf16/fp16 is asked for on hardware without it."""
    if namespace.use_cpu:
        return  # CPU autocast: bf16 works on any recent x86/ARM CPU (fp16 is slow but valid)
    has_accelerator = torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())
    device = "no GPU was found" if not has_accelerator else "this GPU has no bf16 support"
    if namespace.bf16 and not is_torch_bf16_gpu_available():
        raise ValueError(
            f"bf16=True (from {source}) needs a GPU with bf16 support, but {device} "
            f"(torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}). Pass `--bf16 false` "
            "(on older GPUs use `--fp16 true`), add `--use_cpu true` for bf16 autocast on the CPU, or run the "
            "offline CPU recipe: python recipes/gsm8k.py --config recipes/gsm8k_cpu.yaml"
        )
    if namespace.fp16 and not has_accelerator:
        raise ValueError(
            f"fp16=True (from {source}) needs a GPU, but no GPU was found (torch {torch.__version__}). Pass "
            "`--fp16 false`, or run the offline CPU recipe: python recipes/gsm8k.py --config recipes/gsm8k_cpu.yaml"
        )


def parse_args(argv: list[str] | None = None) -> tuple[ScriptArguments, GRPOConfig]:
    """`--config file.yaml` sets defaults for `ScriptArguments` and `GRPOConfig`; other flags override them."""
    script_args, config = parse_config_args((ScriptArguments, GRPOConfig), argv, "recipes/gsm8k.py", _check_precision)
    # Unknown reward names fail here, before the model loads, listing the known ones; names that build their reward
    # (e.g. `code` checks its sandbox) are built once here to fail early. Reward models: `names_a_reward_model`.
    get_reward_funcs([name for name in script_args.reward_funcs if not names_a_reward_model(name)])
    return script_args, config


# ------------------------------------------------------------------------------------------------------
# Steps
# ------------------------------------------------------------------------------------------------------


def load_datasets(args: ScriptArguments, seed: int, need_eval: bool, need_train: bool = True):
    """(train, eval) conversational datasets; eval is None when not needed."""
    source = args.dataset_path or args.dataset_name
    single_file = args.dataset_path is not None and os.path.isfile(args.dataset_path)
    kw = dict(config=args.dataset_config, seed=seed, max_number=args.arithmetic_max_number)
    train = eval_ = None
    if single_file:  # one file: hold out num_eval_examples rows for evaluation
        full = load_problems(source, **kw)
        if need_eval:
            parts = full.train_test_split(test_size=min(args.num_eval_examples, len(full) // 2), seed=seed)
            full, eval_ = parts["train"], parts["test"]
        train = full.select(range(min(args.num_train_examples or len(full), len(full))))
    else:
        if need_train:
            train = load_problems(source, split=args.dataset_train_split, num_examples=args.num_train_examples, **kw)
        if need_eval:
            eval_ = load_problems(source, split=args.dataset_test_split, num_examples=args.num_eval_examples, **kw)

    def convert(ds):
        if ds is None:
            return None
        return to_conversational(ds, args.answer_format, args.system_prompt, num_shots=args.num_shots)

    return convert(train if need_train else None), convert(eval_)


def run_evaluation(
    model, tokenizer, dataset, args: ScriptArguments, config: GRPOConfig, stage: str, synced_gpus: bool = False
):
    """Greedy pass@1, each process on its own slice of `dataset`; every process gets the full summary."""
    state = PartialState()
    n = len(dataset)
    per_process = math.ceil(n / state.num_processes)
    # Equal-sized slices (the last padded with repeats) keep the processes in lockstep.
    indices = [min(state.process_index * per_process + i, n - 1) for i in range(per_process)]
    result = evaluate_accuracy(
        model,
        tokenizer,
        dataset.select(indices),
        max_new_tokens=args.eval_max_new_tokens or config.max_completion_length,
        batch_size=args.eval_batch_size,
        answer_format=args.answer_format,
        synced_gpus=synced_gpus,
        desc=f"Evaluating ({stage})",
        disable_progress=not state.is_local_main_process,
    )
    records = result["records"]
    for i, record in zip(indices, records, strict=True):
        record["index"] = i
    if state.num_processes > 1:
        records = gather_object(records)
    unique = {r["index"]: r for r in records}
    return summarize([unique[i] for i in sorted(unique)])


def print_table(results: dict[str, dict]) -> None:
    header = f"{'':8} {'accuracy':>9} {'format':>8} {'length':>8} {'truncated':>10} {'n':>5}"
    print(header)
    print("-" * len(header))
    for stage, r in results.items():
        print(
            f"{stage:8} {r['accuracy']:9.3f} {r['format_rate']:8.3f} {r['mean_length']:8.1f} "
            f"{r['truncated_rate']:10.3f} {r['n']:5d}"
        )


def write_results(output_dir: str, results: dict, extra: dict) -> None:
    os.makedirs(output_dir, exist_ok=True)
    metrics = {stage: {k: v for k, v in r.items() if k != "records"} for stage, r in results.items()}
    with open(os.path.join(output_dir, "eval.json"), "w") as f:
        json.dump({**metrics, **extra}, f, indent=2)
    with open(os.path.join(output_dir, "eval_samples.jsonl"), "w") as f:
        for stage, r in results.items():
            for record in r["records"]:
                f.write(json.dumps({"stage": stage, **record}) + "\n")


def save(trainer: GRPOTrainer, tokenizer, args: ScriptArguments, output_dir: str) -> None:
    """The full model (or the LoRA adapter) and the tokenizer; with merge_adapter, also output_dir/merged."""
    trainer.save_model(output_dir)
    if trainer.is_world_process_zero():
        tokenizer.save_pretrained(output_dir)
        if args.use_peft and args.merge_adapter:
            merged_dir = os.path.join(output_dir, "merged")
            trainer.accelerator.unwrap_model(trainer.model).merge_and_unload().save_pretrained(merged_dir)
            tokenizer.save_pretrained(merged_dir)
            logger.info("Saved the merged model to %s", merged_dir)
    logger.info("Saved %s to %s", "the LoRA adapter" if args.use_peft else "the model", output_dir)


def configure_logging(config: GRPOConfig) -> None:
    """This script and grpo_hf log at INFO on the main process (`--log_level` changes it); transformers and
    datasets keep their own verbosity unless --log_level is given."""
    log_level = config.get_process_log_level()
    own_level = logging.INFO if config.should_log and config.log_level == "passive" else log_level
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=own_level)
    transformers.utils.logging.set_verbosity(log_level)
    datasets.utils.logging.set_verbosity(log_level)


def build_trainer(model, tokenizer, train_dataset, args: ScriptArguments, config: GRPOConfig) -> GRPOTrainer:
    """The `GRPOTrainer`: full fine-tuning, or a LoRA adapter with `--use_peft`."""
    peft_config = None
    if args.use_peft:
        from peft import LoraConfig

        peft_config = LoraConfig(
            r=args.lora_r,
            lora_alpha=args.lora_alpha,
            lora_dropout=args.lora_dropout,
            target_modules=args.lora_target_modules or "all-linear",
            task_type="CAUSAL_LM",
        )
    return GRPOTrainer(
        model=model,
        reward_funcs=args.reward_funcs,
        args=config,
        train_dataset=train_dataset,
        processing_class=tokenizer,
        peft_config=peft_config,
    )


def main(argv: list[str] | None = None) -> dict:
    start = time.time()
    args, config = parse_args(argv)
    configure_logging(config)
    set_seed(config.seed)
    _ = config.device  # initialises the process group under `accelerate launch` (gloo on CPU with use_cpu)
    state = PartialState()

    with state.local_main_process_first():  # the offline alias: converted once per node, into the node's cache
        model_path = resolve_model_path(args.model_name_or_path)
    logger.info("Loading %s", model_path)
    tokenizer = load_tokenizer(model_path, trust_remote_code=config.trust_remote_code)
    model_kwargs = {"attn_implementation": args.attn_implementation} if args.attn_implementation else {}
    model = load_model(model_path, dtype=args.model_dtype, trust_remote_code=config.trust_remote_code, **model_kwargs)

    need_eval = args.eval_only or args.eval_before or args.eval_after
    train_dataset, eval_dataset = load_datasets(args, config.seed, need_eval, need_train=not args.eval_only)
    results: dict[str, dict] = {}
    extra = {"model": args.model_name_or_path, "dataset": args.dataset_path or args.dataset_name, "command": sys.argv}

    if args.eval_only or args.eval_before:
        model.to(state.device)
        stage = "eval" if args.eval_only else "before"
        results[stage] = run_evaluation(model, tokenizer, eval_dataset, args, config, stage)
    if args.eval_only:
        if state.is_main_process:
            write_results(config.output_dir, results, {**extra, "runtime_s": time.time() - start})
            print_table(results)
        return results

    trainer = build_trainer(model, tokenizer, train_dataset, args, config)
    train_start = time.time()
    trainer.train(resume_from_checkpoint=config.resume_from_checkpoint)  # true / last: the newest checkpoint
    extra["train_runtime_s"] = time.time() - train_start
    if trainer.rollout is not None:  # vLLM: shut it down before the process group is destroyed at the end
        trainer.rollout.close()
    if trainer.stopped_by is not None:  # a checkpoint is written; what follows is for a finished run only
        raise TrainingStopped(trainer.stopped_by, trainer.state.global_step)

    if args.eval_after:
        sharded = trainer.is_fsdp_enabled or trainer.is_deepspeed_enabled
        results["after"] = run_evaluation(trainer.model, tokenizer, eval_dataset, args, config, "after", sharded)
    save(trainer, tokenizer, args, config.output_dir)
    if state.is_main_process:
        plot_training_curves(trainer.state.log_history, os.path.join(config.output_dir, "training_curves.png"))
        trainer.state.save_to_json(os.path.join(config.output_dir, "trainer_state.json"))  # every logged metric
        extra["runtime_s"] = time.time() - start
        write_results(config.output_dir, results, extra)
        if results:
            print_table(results)
        logger.info("Done in %.0f s; results in %s", extra["runtime_s"], config.output_dir)
    return results


class TrainingStopped(SystemExit):
    """`main` was stopped by a signal (SIGUSR1 before a time limit, SIGTERM, Ctrl-C) after the trainer wrote its
    checkpoint: the final evaluation and save are skipped, and the process exits with `STOPPED_EXIT_CODE` ("stopped,
    requeue me"), on which recipes/slurm/grpo.sbatch requeues the job. The same command then resumes the run."""

    def __init__(self, signal_name: str, step: int):
        super().__init__(STOPPED_EXIT_CODE)
        logger.warning(
            "Stopped by %s after step %d, checkpoint written: no final evaluation or save. Run the same command with "
            "--resume_from_checkpoint true to continue (exit code %d: stopped, requeue me).",
            signal_name, step, STOPPED_EXIT_CODE,
        )  # fmt: skip


def leave_together(code: int = 0) -> None:
    """End the run with exit status `code`. A multi-process run leaves once every rank is done: it leaves together and
    closes the process group (a rank that exits while the others still hold their gloo/NCCL connections can abort at
    interpreter shutdown), then runs the exit handlers (loggers, trackers) and skips the interpreter's teardown, where
    gloo's threads still abort a process now and then ("terminate called without an active exception", exit code -6)
    after every result is written."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        sys.exit(code)
    PartialState().wait_for_everyone()
    PartialState().destroy_process_group()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    try:
        main()
    except TrainingStopped as stopped:
        leave_together(stopped.code)
    leave_together()
