"""`GRPOTrainer`: GRPO on `transformers.Trainer`.

One optimizer step (DESIGN.md §3)::

    dataloader: one generation batch of prompts, each repeated G times (RepeatSampler)
      -> rollout engine .generate    completion_ids [N, T], completion_mask [N, T], is_truncated [N]
      -> rewards.compute_rewards     [N, R] (NaN = no reward), gathered over processes
      -> core.group_advantages       over whole groups, then this process's rows are kept
      -> old_logps / ref_logps       once per generation batch, only when they are needed
      -> compute_loss (per slice)    policy logps -> core.grpo_loss
      -> Trainer                     backward, clip, optimizer step, log

The trainer only wires pieces together: the maths lives in `core`, generation in `rollout`,
log-probs in `logprobs`, scoring in `rewards`, fp32 master weights in `precision`.
The loss is the one in DESIGN.md §5 exactly; the one place where the
trainer touches it is the gradient-accumulation / data-parallel rescaling of `dapo` (see
`compute_loss`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from accelerate.utils import gather_object
from torch import nn
from transformers import GenerationConfig, PreTrainedModel, Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from grpo_hf import checkpoint, streams, validation  # validation: the input checks, and when each runs
from grpo_hf.completion_log import completion_rows, write_completions
from grpo_hf.config import GRPOConfig, as_dict
from grpo_hf.core import (
    LOSS_VARIANTS,
    EntropyControl,
    _off_policy_mask,
    check_finite_rewards,
    combine_rewards,
    decoupled_advantages,
    entropy_bonus,
    group_advantages,
    grpo_loss,
    high_entropy_mask,
    mix_parameters_,
    reward_metrics,
)
from grpo_hf.guards import explain_advantages, explain_gradients, explain_loss
from grpo_hf.logprobs import (
    backward_per_group,
    completion_logps,
    logps_in_chunks,
    supports_shared_prefix,
)
from grpo_hf.models import build_models, cast_lm_head_to_fp32, router_aux_loss_coef
from grpo_hf.parallel import average_gradients, check_same_dataset, stop_together
from grpo_hf.precision import PrecisionGuard
from grpo_hf.reward_models import build_reward_funcs, reward_processing_classes_of, reward_weights
from grpo_hf.rewards import compute_rewards, reward_func_name
from grpo_hf.rewards.calling import RewardLogs
from grpo_hf.rollout import (
    RepeatedStream,
    RepeatSampler,
    RolloutEngine,
    eos_token_ids_of,
    is_conversational,
    make_engine,
    split_into_slices,
    tokenize_prompts,
)
from grpo_hf.rollout.custom import pad_to_multiple, rollout_from_func
from grpo_hf.rollout.dynamic import FreshPrompts, GroupPool, gather_rows, take_rows

logger = logging.getLogger(__name__)

RewardFunc = Callable[..., list] | str | PreTrainedModel


def _config_or_default(args: GRPOConfig | None, model) -> GRPOConfig:
    """`args`, checked to be a GRPOConfig, or TRL's default when None: output_dir `<model name>-GRPO`."""
    if args is None:
        name = model if isinstance(model, str) else model.config._name_or_path
        args = GRPOConfig(output_dir=f"{os.path.basename(str(name)) or 'model'}-GRPO")
    if not isinstance(args, GRPOConfig):
        raise TypeError(f"args must be a GRPOConfig, got {type(args).__name__}.")
    return args


class _AfterOptimizerStep(TrainerCallback):
    """Tells the rollout engine that the weights changed (engines that keep a copy or a graph refresh it)."""

    def __init__(self, trainer: GRPOTrainer):
        self.trainer = trainer

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        trainer = self.trainer
        if trainer._skip_update:  # a non-finite value this step, with on_nonfinite="skip_step": no update at all
            for param in trainer.model.parameters():
                param.grad = None  # optimizers leave parameters without a gradient (and their state) untouched
            trainer._skip_update = False
            trainer._skipped_steps += 1
            trainer._metrics["train"]["nonfinite/skipped_steps"].append(float(trainer._skipped_steps))

    def on_step_end(self, args, state, control, **kwargs):
        request = self.trainer._stop_request
        if request is not None:
            stop = request.received is not None
            if self.trainer.accelerator.num_processes > 1:  # one process signalled: all stop at this same step
                stop = self.trainer._sum_processes(int(stop)) > 0
            if stop:
                control.should_save = args.save_strategy != "no"
                control.should_training_stop = True

    def on_train_begin(self, args, state, control, **kwargs):
        blocker = self.trainer._shared_prefix_blocker(self.trainer.model_wrapped)
        logger.info(
            "log-prob path: shared prompt prefix"
            + (", one group's backward at a time" if args.backward_per_group else "")
            if blocker is None
            else f"log-prob path: one padded forward over prompt + completion rows ({blocker})"
        )
        if self.trainer.precision_guard is not None:  # a resumed run measures at the same steps as an unbroken one
            self.trainer.precision_guard.steps = state.global_step

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self.trainer.rollout is not None:
            self.trainer.rollout.on_weights_updated(self.trainer.accelerator.unwrap_model(self.trainer.model))


class _SyncReference(TrainerCallback):
    """TR-DPO (`sync_ref_model`): after every `ref_model_sync_steps`-th optimizer step, the reference model becomes
    alpha x policy + (1 - alpha) x reference (`core.mix_parameters_`), parameter by parameter, as TRL does it."""

    def __init__(self, trainer: GRPOTrainer):
        if trainer.ref_model is None:  # LoRA: the reference is the base model with the adapters off
            raise NotImplementedError(
                "sync_ref_model=True with a PEFT model: the reference is the policy with its adapters disabled, not "
                "a separate model, so there is nothing to synchronize (TRL does not support it either). Use "
                "sync_ref_model=False, or full fine-tuning."
            )
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % args.ref_model_sync_steps == 0:
            self.trainer._sync_reference()


class GRPOTrainer(Trainer):
    """Group Relative Policy Optimization (Shao et al., 2024) as a `transformers.Trainer`.

    Args:
        model: a Hub id or local path (loaded with `AutoModelForCausalLM`, `args.model_init_kwargs`),
            or a `PreTrainedModel`.
        reward_funcs: one or a list of: a callable with the TRL reward signature
            `fn(prompts, completions, completion_ids, trainer_state, **columns) -> list[float | None]`,
            a registry name (`grpo_hf.rewards.REWARD_FUNCS`) or `"package.module:function"`, a
            sequence-classification `PreTrainedModel`, or a path/Hub id of one.
        args: a `GRPOConfig`.
        train_dataset: a `datasets.Dataset` with a `prompt` column (text, or a list of chat
            messages); every other column reaches the reward functions as a keyword argument. A stream
            (`datasets.IterableDataset`) works too, with `max_steps` set (`grpo_hf.streams`).
        eval_dataset: same format, or a dict of them; evaluated by sampling `num_generations_eval` completions per
            prompt.
        processing_class: the tokenizer; loaded from `model` when None.
        reward_processing_classes: tokenizers for reward models (one per reward function, None
            entries load the reward model's own).
        peft_config: a `peft.LoraConfig` (or any PEFT config): train adapters only. The reference
            model is then the same model with its adapters disabled, not a second copy.
        callbacks, optimizers: as for `transformers.Trainer`.
        rollout_func: TRL's `rollout_func(prompts, trainer) -> dict` with `prompt_ids`, `completion_ids` and
            `logprobs` (one list per prompt row) and extra fields for the reward functions: it replaces the
            rollout engine (`grpo_hf.rollout.custom`).
    """

    _tag_names = ["grpo", "grpo_hf"]
    # Our loss is a per-micro-batch quantity: let Trainer divide it by the accumulation steps.
    loss_is_scaled_for_ga = False

    def __init__(
        self,
        model: str | PreTrainedModel,
        reward_funcs: RewardFunc | list[RewardFunc] | None = None,
        args: GRPOConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        reward_processing_classes=None,
        peft_config=None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers=(None, None),
        rollout_func=None,
    ):
        args = _config_or_default(args, model)
        args.log_defaults_differing_from_trl()
        validation.check_generation_kwargs(as_dict(args.generation_kwargs, "generation_kwargs"), args)
        model, ref_model, processing_class = build_models(
            model,
            processing_class,
            peft_config,
            with_reference=args.beta != 0.0,
            disable_dropout=args.disable_dropout,
            model_init_kwargs=args.model_load_kwargs(),
            gradient_checkpointing=args.gradient_checkpointing,
        )
        validation.check_policy_model(model, processing_class, peft_config)
        max_positions = validation.model_max_positions(model)
        columns = validation.check_datasets(train_dataset, eval_dataset, processing_class, args, max_positions)
        streams.configure_args(args, train_dataset, eval_dataset)  # before Trainer builds the accelerator

        self.reward_funcs = build_reward_funcs(reward_funcs, reward_processing_classes, args.trust_remote_code)
        self.reward_func_names = [reward_func_name(f) for f in self.reward_funcs]
        validation.check_reward_funcs(self.reward_funcs, self.reward_func_names, columns)
        self.reward_weights = reward_weights(args.reward_weights, self.reward_func_names)

        if args.should_save:  # Trainer creates output_dir here: say what is wrong with it, before anything runs
            checkpoint.check_writable(args.output_dir)
        super().__init__(
            model=model,
            args=args,
            data_collator=list,  # rows stay dicts: prompts are tokenized per generation batch
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
        )
        self.model_accepts_loss_kwargs = False

        self.ref_model = self._place_models(ref_model)

        self.eos_token_ids = eos_token_ids_of(self.accelerator.unwrap_model(self.model), processing_class)
        self.generation_config = self._build_generation_config(args, processing_class, self.eos_token_ids)
        self.chat_template_kwargs = as_dict(args.chat_template_kwargs, "chat_template_kwargs")

        self._init_state(args, rollout_func)

    # ---- construction helpers --------------------------------------------------------------------------------
    def _init_state(self, args: GRPOConfig, rollout_func=None) -> None:
        """The rollout buffer, counters and metrics a run carries from step to step; `rollout_func`, the MoE
        auxiliary-loss weight and the reference sync (TR-DPO)."""
        self.rollout_func = rollout_func  # TRL's: completions from a function of the user's (`rollout.custom`)
        self.router_aux_loss_coef = router_aux_loss_coef(self.model, args.router_aux_loss_coef)  # 0.0: off
        if args.sync_ref_model:
            self.add_callback(_SyncReference(self))
        # Old log-probs differ from the current policy's only if an optimizer step happens between
        # generation and the last use of the batch: i.e. unless all steps_per_generation x
        # num_iterations micro-steps of one rollout fall inside one accumulation window.
        uses_per_rollout = args.steps_per_generation * args.num_iterations
        self._needs_old_logps = args.gradient_accumulation_steps % uses_per_rollout != 0
        self._micro_step = 0
        self._buffer: list[dict[str, Any]] = []
        self._metrics: dict[str, dict[str, list[float]]] = {"train": defaultdict(list), "eval": defaultdict(list)}
        self._completion_rows: list[dict[str, Any]] = []
        self._last_train_metrics: dict[str, float] = {}  # the last logged train means, for the end-of-training row
        self._num_tokens = 0
        self.num_generate_calls = 0  # how many rollouts were generated (tests count reuse with it)
        self._refill_dataset = None  # the train dataset as the dataloader serves it, for dynamic sampling's prompts
        self._staging_dir: str | None = None  # set while a checkpoint is written (`_save_checkpoint`)
        self._skip_update = False  # a non-finite value was met in this optimizer step (on_nonfinite="skip_step")
        self._skipped_steps = 0
        self._stop_request: checkpoint.StopRequest | None = None  # SIGTERM / Ctrl-C handling during `train`
        self._pre_clip_norms: list[tuple[str, torch.Tensor]] | None = None  # per-tensor gradient norms, pre-clip
        self.rollout: RolloutEngine | None = None  # chosen at the first rollout (`_rollout_engine`)
        self.precision_guard: PrecisionGuard | None = None  # set with the optimizer (`create_optimizer`)
        self._average_gradients = False  # set when the fast path bypasses DDP's forward (`compute_loss`)
        self._entropy = EntropyControl(**args.entropy_kwargs())  # the entropy bonus's coefficient, adaptive or not
        self.add_callback(_AfterOptimizerStep(self))

    def _place_models(self, ref_model):
        """Reward models to the device; the reference model prepared like the policy (DeepSpeed / FSDP / device
        placement) and returned, or None. With `cast_lm_head_to_fp32`, both LM heads are made fp32 first."""
        if self.args.cast_lm_head_to_fp32:
            for model in (self.model, ref_model):
                if model is not None:
                    cast_lm_head_to_fp32(model)
        for func in self.reward_funcs:
            if hasattr(func, "model") and isinstance(func.model, PreTrainedModel):
                func.model.to(self.accelerator.device)
        if ref_model is None:
            return None
        if self.is_deepspeed_enabled:
            from trl.models.utils import prepare_deepspeed

            return prepare_deepspeed(ref_model, self.accelerator)
        if self.is_fsdp_enabled:
            from trl.models.utils import prepare_fsdp

            return prepare_fsdp(ref_model, self.accelerator)
        return self.accelerator.prepare_model(ref_model, evaluation_mode=True)

    @property
    def aux_loss_enabled(self) -> bool:
        """TRL's attribute: whether the MoE load-balancing loss is in the training loss (`router_aux_loss_coef`)."""
        return self.router_aux_loss_coef != 0.0

    @property
    def reward_processing_classes(self) -> list:
        """TRL's attribute: one entry per reward function, the tokenizer of each reward model, None for the others."""
        return reward_processing_classes_of(self.reward_funcs)

    def _sync_reference(self) -> None:
        """TR-DPO (`sync_ref_model`): reference <- alpha x policy + (1 - alpha) x reference, in place. Under
        DeepSpeed ZeRO-3 the shards are gathered and process 0 mixes them (as TRL does)."""
        policy = self.accelerator.unwrap_model(self.model)
        reference = self.accelerator.unwrap_model(self.ref_model)
        targets, sources = list(reference.parameters()), list(policy.parameters())
        alpha = self.args.ref_model_mixup_alpha
        if self.is_deepspeed_enabled and self.accelerator.state.deepspeed_plugin.zero_stage == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(targets + sources, modifier_rank=0):
                if self.accelerator.is_main_process:
                    mix_parameters_(targets, sources, alpha)
        else:
            mix_parameters_(targets, sources, alpha)

    def _build_generation_config(self, args: GRPOConfig, processing_class, eos_token_ids) -> GenerationConfig:
        """The sampling settings of the config, then `generation_kwargs` over them."""
        generation_kwargs = {
            "max_new_tokens": args.max_completion_length,
            "do_sample": True,
            "temperature": args.temperature,
            "top_p": args.top_p,
            "top_k": args.top_k,
            "min_p": args.min_p,
            "repetition_penalty": args.repetition_penalty,
            "pad_token_id": processing_class.pad_token_id,
            "eos_token_id": eos_token_ids,
            "use_cache": True,
        }
        generation_kwargs.update(as_dict(args.generation_kwargs, "generation_kwargs"))
        return GenerationConfig(**generation_kwargs)

    def create_optimizer(self, model=None):
        """Trainer's optimizer, with fp32 master weights for bf16/fp16 parameters and the lost-update guard
        (`precision.PrecisionGuard`; DeepSpeed and fp16 loss scaling manage precision themselves)."""
        optimizer = super().create_optimizer(model)
        if self.precision_guard is None:
            args = self.args
            managed = self.is_deepspeed_enabled or self.accelerator.scaler is not None
            optim = str(getattr(args.optim, "value", args.optim))
            self.precision_guard = PrecisionGuard(
                optimizer,
                master_weights=args.fp32_master_weights and not managed,
                learning_rate=args.learning_rate,
                adam_like="adam" in optim or "lion" in optim,
                check_every=args.lost_update_check_steps,
                threshold=args.lost_update_threshold,
                action=args.on_lost_updates,
                record=lambda fraction: self._metrics["train"]["precision/lost_updates"].append(fraction),
            )
            logger.info(self.precision_guard.describe())
        return optimizer

    # ---- data ------------------------------------------------------------------------------------------------
    def _set_signature_columns_if_needed(self):
        # With remove_unused_columns=True keep only the prompt (the model's forward signature is irrelevant here).
        if self._signature_columns is None:
            self._signature_columns = ["prompt"]

    def _get_train_sampler(self, train_dataset=None) -> RepeatSampler:
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        args = self.args
        return RepeatSampler(
            num_prompts=len(dataset),
            num_generations=args.num_generations,
            prompts_per_batch=args.generation_batch_size // args.num_generations,
            repeat_count=args.steps_per_generation * args.num_iterations,
            shuffle=args.shuffle_dataset,
            seed=args.seed,
        )

    def _get_eval_sampler(self, eval_dataset) -> RepeatSampler:
        return RepeatSampler(
            num_prompts=len(eval_dataset),
            num_generations=self.args.num_generations_eval or self.args.num_generations,
            prompts_per_batch=1,
            shuffle=False,
        )

    def _get_dataloader(self, dataset, description, batch_size, sampler_fn=None, is_training=False, **kwargs):
        """Trainer's, and for a stream (`datasets.IterableDataset`, `grpo_hf.streams`) the samplers' order made on
        the stream itself (`RepeatedStream`), read by one worker."""
        if not streams.is_stream(dataset):
            return super()._get_dataloader(dataset, description, batch_size, sampler_fn, is_training, **kwargs)
        args = self.args
        self.accelerator.dataloader_config.dispatch_batches = False
        if is_training:
            stream = dataset.shuffle(seed=args.seed) if args.shuffle_dataset else dataset
            per_generation = args.steps_per_generation * args.num_iterations
            G = args.num_generations
            dataset = RepeatedStream(stream, G, args.generation_batch_size // G, per_generation, cycle=True)
        else:
            checked = self.eval_dataset.values() if isinstance(self.eval_dataset, dict) else [self.eval_dataset]
            if not any(dataset is known for known in checked):  # first seen by `evaluate(eval_dataset=stream)`
                validation.check_dataset(dataset, "eval_dataset", self.processing_class, args, None, is_train=False)
            dataset = RepeatedStream(dataset, args.num_generations_eval or args.num_generations)
        with streams.one_worker(args):
            return super()._get_dataloader(dataset, description, batch_size, sampler_fn, is_training, **kwargs)

    def get_train_dataloader(self):
        # Each dataloader batch is this process's share of a whole generation batch; the sampler
        # repeats it once per micro-step it serves (see RepeatSampler).
        return self._get_dataloader(
            dataset=self.train_dataset,
            description="Training",
            batch_size=self.args.per_device_train_batch_size * self.args.steps_per_generation,
            sampler_fn=self._get_train_sampler,
            is_training=True,
        )

    # ---- rollouts --------------------------------------------------------------------------------------------
    def _generate_and_score(self, inputs: list[dict[str, Any]], mode: str) -> dict[str, Any]:
        """Generate completions for this process's rows, score them, and compute advantages.

        Returns tensors for this process's rows: prompt_ids/prompt_mask [B, P],
        completion_ids/completion_mask [B, T], advantages [B] (whenever the batch holds whole groups).
        With `dynamic_sampling`, the rows are those of the groups with signal (`_keep_groups_with_signal`).
        """
        args = self.args
        G = args.num_generations if mode == "train" else (args.num_generations_eval or args.num_generations)
        rollout, kept = self._rollout_round(inputs, mode, G), None
        if mode == "train" and args.dynamic_sampling:
            rollout, kept = self._keep_groups_with_signal(rollout, G)
        batch = {key: rollout[key] for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")}
        B, total = len(rollout["prompts"]), rollout["total"]  # total: [N], the whole generation batch
        start = self.accelerator.process_index * B
        if total.numel() % G == 0:  # whole groups (always in training; evaluation batches may cut a group)
            if kept is None:
                advantages = self._advantages(total, rollout["all_rewards"], G)  # [N]
            else:  # the group statistics (and a "batch" std) of the kept groups only
                advantages = torch.zeros_like(total)
                if bool(kept.any()):
                    advantages[kept] = self._advantages(total[kept], rollout["all_rewards"][kept], G)
            batch["advantages"] = advantages[start : start + B]  # [B]
            if mode == "train" and self._nonfinite("advantages", advantages, rollout, G):
                batch["nonfinite"] = True  # every optimizer step this rollout feeds is skipped
        if mode != "train":
            return batch
        if kept is not None:  # rows of dropped groups that fill an incomplete batch carry no loss
            batch["completion_mask"] = batch["completion_mask"] * kept[start : start + B].unsqueeze(1).long()
        tokens = int(batch["prompt_mask"].sum() + batch["completion_mask"].sum())
        self._num_tokens += self._sum_processes(tokens)
        self._metrics["train"]["num_tokens"].append(float(self._num_tokens))
        if args.mask_truncated_completions:
            batch["completion_mask"] = batch["completion_mask"] * (~rollout["is_truncated"]).unsqueeze(1).long()
        if args.log_completions:
            rows = completion_rows(
                self.state.global_step,
                rollout["prompts"],
                rollout["texts"],
                self.reward_func_names,
                rollout["rewards"],
                batch["advantages"],
                rollout["extra"],
            )
            self._completion_rows = gather_object(rows) if self.accelerator.num_processes > 1 else rows
        return batch

    def _rollout_round(self, inputs: list[dict[str, Any]], mode: str, G: int) -> dict[str, Any]:
        """Tokenize, generate and score this process's rows; record the round's metrics.

        Returns this process's prompt/completion tensors [B, ...], `is_truncated` [B], `rewards` [B, R], the
        `prompts`, completion `texts` and `extra` (per row, the columns reward functions logged with `log_extra`),
        and of the whole generation batch the rewards `all_rewards` [N, R] and their combination `total` [N].
        """
        device = self.accelerator.device
        prompts = [row["prompt"] for row in inputs]
        columns = {key: [row[key] for row in inputs] for key in inputs[0] if key != "prompt"}
        sample, is_prompt_truncated = self._sample(prompts, columns)  # [B, ...]; may add columns (rollout_func)
        completion_ids, is_truncated = sample["completion_ids"], sample["is_truncated"]  # [B, T], [B]

        lengths = sample["completion_mask"].sum(dim=1)  # [B]
        failure = None
        try:
            rewards, texts, errors, logs = self._score(prompts, columns, completion_ids, lengths)  # [B, R]
        except Exception as error:  # reported by every process (`stop_together`), not only by this one
            failure = error
        stop_together(failure, self.accelerator, "computing rewards")
        # Whole groups may straddle processes: gather, normalise over the full batch.
        all_rewards = self.accelerator.gather(rewards)  # [N, R]
        total = combine_rewards(all_rewards, self.reward_weights.to(device))  # [N]

        metrics = self._metrics[mode]
        self._record_rollout_metrics(metrics, all_rewards, total, errors, G)
        self._record_logged_metrics(metrics, logs.metrics)
        float_lengths = self.accelerator.gather(lengths).float()  # [N]
        metrics["completions/mean_length"].append(float_lengths.mean().item())
        metrics["completions/min_length"].append(float_lengths.min().item())
        metrics["completions/max_length"].append(float_lengths.max().item())
        metrics["completions/clipped_ratio"].append(self.accelerator.gather(is_truncated).float().mean().item())
        metrics["prompts/num_truncated"].append(float(self._sum_processes(int(is_prompt_truncated.sum()))))
        extra = [{column: values[i] for column, values in logs.extra.items()} for i in range(len(prompts))]
        return {
            **sample,
            "rewards": rewards,
            "prompts": prompts,
            "texts": texts,
            "extra": extra,
            "all_rewards": all_rewards,
            "total": total,
        }

    def _sample(self, prompts: list, columns: dict[str, list]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """This process's rollout tensors, `prompt_ids`/`prompt_mask` [B, P], `completion_ids`/`completion_mask`
        [B, T] and `is_truncated` [B], padded to `pad_to_multiple_of`; and which prompts were truncated [B]. From the
        rollout engine, or from `rollout_func` (TRL's contract, `rollout.custom`): its extra fields join `columns`."""
        args, device, pad = self.args, self.accelerator.device, self.processing_class.pad_token_id
        if self.rollout_func is not None:
            sample, extra = rollout_from_func(
                self.rollout_func, prompts, self, pad_token_id=pad, eos_token_ids=self.eos_token_ids, device=device
            )
            columns.update(extra)
            is_prompt_truncated = torch.zeros(len(prompts), dtype=torch.bool)
        else:
            prompt_ids, prompt_mask, is_prompt_truncated = tokenize_prompts(
                self.processing_class, prompts, args.max_prompt_length, self.chat_template_kwargs
            )
            prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)  # [B, P]
            with self._model_for_generation() as unwrapped:
                completion_ids, completion_mask, is_truncated = self._rollout_engine(unwrapped).generate(
                    unwrapped, prompt_ids, prompt_mask
                )  # [B, T], [B, T], [B]
            sample = {
                "prompt_ids": prompt_ids,
                "prompt_mask": prompt_mask,
                "completion_ids": completion_ids,
                "completion_mask": completion_mask,
                "is_truncated": is_truncated,
            }
        self.num_generate_calls += 1
        return pad_to_multiple(sample, self._pad_multiple(), pad), is_prompt_truncated

    def _pad_multiple(self) -> int | None:
        """`pad_to_multiple_of`, with "auto" resolved as TRL resolves it: 128 on Neuron, no padding elsewhere."""
        value = self.args.pad_to_multiple_of
        if value == "auto":
            return 128 if self.accelerator.device.type == "neuron" else None
        return value

    def _advantages(self, total: torch.Tensor, all_rewards: torch.Tensor, G: int) -> torch.Tensor:
        """Advantages [N] of a generation batch from its combined rewards `total` [N] ("sum_then_normalize":
        `core.group_advantages` with `scale_rewards`) or from each function's rewards `all_rewards` [N, R]
        ("normalize_then_sum", GDPO: `core.decoupled_advantages`), per `multi_objective_aggregation`."""
        if self.args.multi_objective_aggregation == "normalize_then_sum":
            return decoupled_advantages(all_rewards, G, self.reward_weights.to(all_rewards.device))
        return group_advantages(total, G, self.args.scale_rewards)

    def _keep_groups_with_signal(self, first: dict[str, Any], G: int) -> tuple[dict[str, Any], torch.Tensor]:
        """DAPO's dynamic sampling (`rollout.dynamic`): drop the groups of `first` whose rewards are all equal and
        generate for fresh prompts, at most `dynamic_sampling_max_rounds` more rounds, until the batch is full.

        Returns this process's share of the new batch (as `_rollout_round`), and `kept` [N] (bool), False on the
        rows of dropped groups that fill the batch when the rounds ran out.
        """
        B, pad = len(first["prompts"]), self.processing_class.pad_token_id
        pool = GroupPool(num_groups=first["total"].numel() // G, num_generations=G)
        rollout, rounds, fresh = first, 0, None
        while True:
            local = {key: value for key, value in rollout.items() if key not in ("total", "all_rewards")}  # global
            pool.add({**gather_rows(local, self.accelerator, pad), "total": rollout["total"]})
            if pool.full or rounds == self.args.dynamic_sampling_max_rounds:
                break
            if fresh is None:
                if self._refill_dataset is None:  # the rows as the dataloader serves them
                    self._refill_dataset = self._remove_unused_columns(self.train_dataset, description="training")
                fresh = FreshPrompts(self._refill_dataset, self.args.seed, self.state.global_step)
            rounds += 1
            rollout = self._rollout_round(self._fresh_inputs(fresh, pool.seen, B, G), "train", G)
        rows, kept = pool.batch(pad)
        metrics = self._metrics["train"]
        metrics["dynamic_sampling/dropped_groups"].append(float(pool.num_dropped))
        metrics["dynamic_sampling/extra_rounds"].append(float(rounds))
        unfilled = pool.num_groups - min(pool.num_kept, pool.num_groups)
        metrics["dynamic_sampling/unfilled_groups"].append(float(unfilled))
        if not pool.full:
            logger.warning(
                f"Dynamic sampling: {pool.num_kept} of {pool.num_groups} groups have rewards that differ after "
                f"{rounds} extra rounds (dynamic_sampling_max_rounds); this step trains on those only. Raise "
                "dynamic_sampling_max_rounds, or check that the rewards can tell completions apart."
            )
        start = self.accelerator.process_index * B
        local = take_rows(rows, torch.arange(start, start + B))
        return {**local, "total": rows["total"], "all_rewards": rows["rewards"]}, kept.to(rows["total"].device)

    def _fresh_inputs(self, fresh: FreshPrompts, seen: set[str], B: int, G: int) -> list[dict[str, Any]]:
        """This process's rows of a generation batch of fresh prompts, G copies of each."""
        rows = [row for row in fresh.take(B * self.accelerator.num_processes // G, seen) for _ in range(G)]
        start = self.accelerator.process_index * B
        return rows[start : start + B]

    def _score(self, prompts, columns, completion_ids, lengths):
        """Rewards [B, R] (NaN = None) of each completion, its text, the error counts of skipped rewards, and what the
        reward functions logged through `log_extra` / `log_metric` (`rewards.calling.RewardLogs`).

        Reward functions see the text (and ids) of each completion up to and including its EOS; with
        conversational prompts the completion is one assistant message.
        """
        args = self.args
        completion_id_lists = [ids[:n].tolist() for ids, n in zip(completion_ids, lengths.tolist(), strict=True)]
        texts = self.processing_class.batch_decode(completion_id_lists, skip_special_tokens=True)
        completions = texts
        if is_conversational(prompts[0]):
            completions = [[{"role": "assistant", "content": t}] for t in texts]
        reward_rows, errors = compute_rewards(
            self.reward_funcs,
            prompts,
            completions,
            completion_id_lists,
            columns=columns,
            trainer_state=self.state,
            timeout=args.reward_timeout,
            error_policy=args.reward_error_policy,
            logs=(logs := RewardLogs(len(completions))),
        )
        device = self.accelerator.device
        rewards = torch.tensor(reward_rows, dtype=torch.float32, device=device).view(len(prompts), -1)  # [B, R]
        check_finite_rewards(rewards, self.reward_func_names)
        no_reward = torch.isnan(rewards).all(dim=1)  # [B]
        if bool(no_reward.any()):  # TRL's warning, about the first such completion
            row = int(no_reward.nonzero()[0])
            kw = {"prompt": prompts[row], "completion": completions[row], **{k: c[row] for k, c in columns.items()}}
            logger.warning(
                f"All reward functions returned None for the following kwargs: {kw}. Please ensure that at least "
                "one reward function returns a valid reward (a completion without any reward gets advantage 0)."
            )
        return rewards, texts, errors, logs

    def _record_logged_metrics(self, metrics, logged: dict[str, list[float]]) -> None:
        """The values reward functions passed to `log_metric` this round: one mean per metric name over every value
        of every process (TRL), recorded under that name; `log` then averages these means over the logging steps."""
        names = sorted(logged)
        if self.accelerator.num_processes > 1:  # every process takes part in the reduction of every name
            names = sorted({name for part in gather_object([names]) for name in part})
        if not names:
            return
        stats = [[sum(logged.get(name, [])), len(logged.get(name, []))] for name in names]
        stats = torch.tensor(stats, dtype=torch.float64, device=self.accelerator.device)  # [M, 2]: sum, count
        if self.accelerator.num_processes > 1:
            stats = self.accelerator.reduce(stats, "sum")
        for name, (total, count) in zip(names, stats.tolist(), strict=True):
            metrics[name].append(total / count)

    def _record_rollout_metrics(self, metrics, all_rewards, total, errors, G: int) -> None:
        """Reward metrics of a whole generation batch: all_rewards [N, R], their weighted sum `total` [N]."""
        for key, value in reward_metrics(all_rewards, total, self.reward_func_names, G).items():
            metrics[key].append(value)
        if self.args.reward_error_policy == "skip":
            for name in self.reward_func_names:
                metrics[f"rewards/{name}/errors"].append(float(self._sum_processes(errors.get(name, 0))))

    def _rollout_engine(self, model: nn.Module) -> RolloutEngine:
        """The rollout engine (`args.rollout_engine`), chosen at the first rollout, with the model on its device."""
        if self.rollout is None:
            sharded = self.is_fsdp_enabled or (
                self.is_deepspeed_enabled and self.accelerator.state.deepspeed_plugin.zero_stage == 3
            )
            self.rollout, why = make_engine(
                self.args.rollout_engine, model, self.generation_config, self.eos_token_ids, sharded=sharded
            )
            logger.info(why)
        return self.rollout

    @contextlib.contextmanager
    def _model_for_generation(self):
        """The bare model for `generate`. Under DeepSpeed ZeRO-3 its shards are gathered first (TRL's helper).

        Gradient checkpointing needs no switching off: `generate` runs in eval mode, where it is inactive.
        """
        if self.is_deepspeed_enabled and self.accelerator.state.deepspeed_plugin.zero_stage == 3:
            from trl.models.utils import unwrap_model_for_generation

            with unwrap_model_for_generation(self.model_wrapped, self.accelerator) as unwrapped:
                yield unwrapped
        else:
            yield self.accelerator.unwrap_model(self.model_wrapped)

    def _sum_processes(self, value: int) -> int:
        if self.accelerator.num_processes == 1:
            return value
        return int(self.accelerator.reduce(torch.tensor(value, device=self.accelerator.device), "sum").item())

    def _reference_logps(self, batch: dict[str, Any]) -> torch.Tensor | None:
        """The reference model's log-probs [B, T] (None when beta = 0); under LoRA, the model with adapters off."""
        if self.args.beta == 0.0:
            return None
        if self.ref_model is not None:
            return self._logps_in_chunks(self.ref_model, batch)
        with self.accelerator.unwrap_model(self.model).disable_adapter():
            return self._logps_in_chunks(self.model, batch)

    def _prepare_rollout(self, inputs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """One generation batch -> scored, with old/ref log-probs -> micro-batch slices."""
        batch = self._generate_and_score(inputs, "train")
        with torch.no_grad():
            batch["old_logps"] = self._logps_in_chunks(self.model, batch) if self._needs_old_logps else None
            batch["ref_logps"] = self._reference_logps(batch)
        slices = split_into_slices(batch, self.args.per_device_train_batch_size)  # trimmed: padded again below
        pad = self.processing_class.pad_token_id
        slices = [pad_to_multiple(part, self._pad_multiple(), pad) for part in slices]  # pad_to_multiple_of
        # dapo normalises by the completion tokens of the whole optimizer step (all processes and
        # accumulation slices). Count them per slice over all processes.
        tokens = torch.stack([s["completion_mask"].sum() for s in slices]).float()  # [S]
        tokens = self.accelerator.reduce(tokens, "sum") if self.accelerator.num_processes > 1 else tokens
        ga, S = self.args.gradient_accumulation_steps, len(slices)
        for k, part in enumerate(slices):
            if S % ga == 0:  # exact: the optimizer step covers slices [w*ga, (w+1)*ga)
                window = (k // ga) * ga
                part["num_items_in_batch"] = tokens[window : window + ga].sum()
            else:  # an optimizer step spans several rollouts: use this rollout's average
                part["num_items_in_batch"] = tokens.sum() * ga / S
        return slices

    # ---- log-probabilities -----------------------------------------------------------------------------------
    def _logprob_kwargs(self, model: nn.Module) -> dict[str, Any]:
        args = self.args
        return {
            "share_prefix": self._can_share_prefix(model),
            "temperature": args.temperature,
            "chunk_size": args.logprob_chunk_size,
        }

    def _can_share_prefix(self, model: nn.Module) -> bool:
        return self._shared_prefix_blocker(model) is None

    def _shared_prefix_blocker(self, model: nn.Module) -> str | None:
        """Why `logprobs.shared_prefix_logps` does not apply, or None when it does: the option is on, the model is
        the bare module or wrapped by DDP only (whose forward the fast path bypasses: `training_step` then averages
        the gradients itself; FSDP and ZeRO-3 shard the weights), it is not gradient-checkpointed (checkpointed
        layers drop the KV cache) and its architecture qualifies (`supports_shared_prefix`)."""
        if not self.args.share_prompt_prefix:
            return "share_prompt_prefix=False"
        if self.router_aux_loss_coef != 0.0:
            return (
                f"router_aux_loss_coef={self.router_aux_loss_coef}: the MoE load-balancing loss needs the router "
                "logits of every row's prompt, which the shared-prefix forward computes once per group"
            )
        if self.is_fsdp_enabled or self.is_deepspeed_enabled:
            return (
                "FSDP and DeepSpeed ZeRO-3 shard the weights, which only the wrapper's own forward gathers; under "
                "ZeRO-1/2 the engine reduces and partitions the gradients, untested with the bare module's forward"
            )
        module = self.accelerator.unwrap_model(model)
        if module is not model and not isinstance(model, nn.parallel.DistributedDataParallel):
            return f"the model is wrapped by {type(model).__name__}"
        if module.training and any(getattr(layer, "gradient_checkpointing", False) for layer in module.modules()):
            return "gradient checkpointing drops the prompt's cached keys/values"
        if not supports_shared_prefix(module):
            return f"{type(module).__name__} is not a decoder-only model the shared-prefix forward supports"
        return None

    def _logps_in_chunks(self, model: nn.Module, batch: dict[str, Any], **kwargs) -> torch.Tensor:
        """No-grad log-probs [B, T] of a whole generation batch, one micro-batch at a time (under autocast: the fast
        path calls the decoder and LM head directly, not the autocast-wrapped forward)."""
        size, kwargs = self.args.per_device_train_batch_size, {**self._logprob_kwargs(model), **kwargs}
        with self.accelerator.autocast():
            return logps_in_chunks(model, batch, size, **kwargs)

    # ---- loss ------------------------------------------------------------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs:
            raise ValueError("GRPOTrainer.compute_loss does not return model outputs.")
        args = self.args
        period = args.steps_per_generation * args.num_iterations
        if self._micro_step % period == 0:
            self._buffer = self._prepare_rollout(inputs)
        batch = self._buffer[self._micro_step % args.steps_per_generation]
        self._micro_step += 1

        kwargs = self._logprob_kwargs(model)
        if kwargs["share_prefix"]:  # the bare module: a DDP wrapper's forward is bypassed (see `training_step`)
            model = self.accelerator.unwrap_model(model)
            self._average_gradients = self.accelerator.num_processes > 1
        kwargs["entropy_grad"] = self._entropy.applied != 0  # the bonus is differentiated; else entropy is a metric
        with self.accelerator.autocast():
            # top_entropy_quantile < 1: a group's token mask depends on every group's entropy, so one backward
            if args.backward_per_group and kwargs["share_prefix"] and args.top_entropy_quantile == 1.0:
                del kwargs["share_prefix"]
                policy_mask, loss_fn = None, lambda logps, entropy: self._loss(logps, batch, entropy)
                loss, loss_metrics, entropy = backward_per_group(
                    model, batch, loss_fn, self._backward_early, entropy_in_loss=True, **kwargs
                )
            else:
                router_aux = self._router_aux(kwargs)  # MoE: the padded forward's load-balancing loss goes here
                logps, entropy = completion_logps(model, batch, with_entropy=True, **kwargs)  # [B, T]
                policy_mask = self._high_entropy_mask(entropy, batch["completion_mask"])  # [B, T] or None: all
                loss, loss_metrics = self._loss(logps, batch, entropy, policy_mask, router_aux=router_aux)
        if batch.get("nonfinite") or self._nonfinite("loss", loss, batch):
            self._skip_update = True
        mask = batch["completion_mask"]
        metrics = self._metrics["train"]
        for key, value in loss_metrics.items():
            metrics[key].append(value)
        mask_f = mask.float()
        metrics["entropy"].append(((entropy.detach() * mask_f).sum() / mask_f.sum().clamp(min=1)).item())
        self._track_entropy(entropy, mask if policy_mask is None else mask * policy_mask)
        return loss

    def training_step(self, model, inputs, num_items_in_batch=None):
        """Trainer's step; when the fast path bypassed DDP's forward (so its reducer saw no backward), the gradients
        are averaged over the processes here, once per optimizer step, before Trainer clips them."""
        loss = super().training_step(model, inputs, num_items_in_batch)
        if self._average_gradients and self.accelerator.sync_gradients:
            average_gradients(self.accelerator.unwrap_model(model).parameters())
        return loss

    def _clip_grad_norm(self, model):
        # Clipping by a NaN/inf norm makes every gradient NaN: keep each tensor's norm from before (one fused
        # kernel, no sync) so that a non-finite norm can name the parameters it came from.
        named = self.accelerator.unwrap_model(model).named_parameters()
        params = [(name, p.grad) for name, p in named if p.grad is not None]
        if params:
            norms = torch._foreach_norm([grad for _, grad in params])
            self._pre_clip_norms = [(name, norm) for (name, _), norm in zip(params, norms, strict=True)]
        return super()._clip_grad_norm(model)

    def _get_grad_norm(self, model, grad_norm=None):
        grad_norm = super()._get_grad_norm(model, grad_norm)
        if grad_norm is not None and self._nonfinite("gradient norm", torch.as_tensor(grad_norm), model):
            self._skip_update = True
        self._pre_clip_norms = None
        return grad_norm

    def _nonfinite(self, what: str, value: torch.Tensor, *context) -> bool:
        """True when `value` is NaN/inf on any process; then raise (on_nonfinite="raise") or warn, with the cause
        (`grpo_hf.guards`) found from `context`: the rollout and group size, the micro-batch, or the model."""
        bad = not bool(torch.isfinite(value).all())
        if what == "loss" and self.accelerator.num_processes > 1:  # the others: every process decides alike
            bad = self._sum_processes(int(bad)) > 0
        if not bad:
            return False
        step = self.state.global_step + 1
        if what == "advantages":
            rollout, G = context
            all_rewards = self.accelerator.gather(rollout["rewards"])
            cause = explain_advantages(value, all_rewards, self.reward_weights, self.reward_func_names, G)
        elif what == "loss":
            cause = explain_loss(value, context[0], self.accelerator.unwrap_model(self.model).named_parameters())
        else:
            norms = self._pre_clip_norms or [
                (name, p.grad) for name, p in self.accelerator.unwrap_model(context[0]).named_parameters()
            ]
            cause = explain_gradients(float(value), norms)
        message = f"Non-finite {what} at optimizer step {step}: {cause}"
        if self.args.on_nonfinite == "raise":
            raise FloatingPointError(
                f"{message} Training stopped before this step updated the weights (on_nonfinite='raise'); "
                "on_nonfinite='skip_step' skips such steps instead."
            )
        logger.warning(f"{message} This optimizer step is skipped (on_nonfinite='skip_step').")
        return True

    def _loss(
        self,
        logps: torch.Tensor,
        batch: dict[str, Any],
        entropy=None,
        policy_mask=None,
        train: bool = True,
        router_aux: list[torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """`core.grpo_loss` of the policy log-probs `logps` [B, T] on this micro-batch, with the config's settings: the
        policy term on the tokens of `policy_mask` [B, T] (None: all), minus the entropy bonus of `entropy` [B, T]
        when it is on (`core.entropy_bonus`), plus `router_aux_loss_coef` x the mean of the MoE load-balancing losses
        `router_aux` of its forwards (TRL). Evaluation (`train=False`): on-policy, nothing accumulated."""
        args, mask = self.args, batch["completion_mask"]
        loss, metrics = grpo_loss(
            logps,
            batch.get("old_logps"),
            batch["ref_logps"],
            batch["advantages"],
            mask,
            num_items_in_batch=batch["num_items_in_batch"] if train else mask.sum(),
            policy_mask=policy_mask,
            **args.loss_kwargs(),
        )
        if train and LOSS_VARIANTS[args.loss_type].aggregation == "dapo":  # dapo, cispo, vespo: global tokens
            # dapo's loss is a sum over the whole optimizer step divided by its token count. Trainer
            # divides each micro-batch loss by the accumulation steps and data parallelism averages
            # gradients over processes; undo both so the gradient is exactly that sum / count.
            loss = loss * self.current_gradient_accumulation_steps * self.accelerator.num_processes
        if self._entropy.enabled:  # TRL: loss = policy loss - coef x mean entropy, the same for every loss type
            metrics["policy_loss"] = loss.item()
            tokens = mask if policy_mask is None else mask * policy_mask  # the policy term's tokens
            loss = loss - entropy_bonus(entropy, tokens, self._entropy.applied)
        if router_aux:  # after the dapo rescaling: Trainer's division by the accumulation steps applies to it (TRL)
            aux_loss = torch.stack(router_aux).mean()
            metrics["aux_loss"] = aux_loss.item()
            loss = loss + self.router_aux_loss_coef * aux_loss
        return loss, metrics

    def _router_aux(self, kwargs: dict[str, Any]) -> list[torch.Tensor] | None:
        """With the MoE load-balancing loss on (`router_aux_loss_coef` != 0): an empty list, put in the log-prob
        `kwargs` as `router_aux` for the padded forward to fill (`logprobs.padded_logps`); else None."""
        if self.router_aux_loss_coef == 0.0:
            return None
        kwargs["router_aux"] = []
        return kwargs["router_aux"]

    def _high_entropy_mask(self, entropy: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor | None:
        """The policy term's tokens [B, T] for `top_entropy_quantile` (`get_high_entropy_mask`); None at 1.0: all."""
        if self.args.top_entropy_quantile == 1.0:
            return None
        return self.get_high_entropy_mask(entropy, mask, 1.0 - self.args.top_entropy_quantile)

    def get_high_entropy_mask(self, entropies: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
        """TRL's method: bool [B, T], the completion tokens whose entropy is at least the `threshold` quantile of the
        completion tokens of this micro-batch on every process (TRL passes 1 - top_entropy_quantile)."""
        entropy = entropies.detach()
        pool = entropy[mask.bool()]  # [n] this process's completion tokens
        if self.accelerator.num_processes > 1:
            pool = self.accelerator.gather(self.accelerator.pad_across_processes(pool, dim=0, pad_index=-1.0))
            pool = pool[pool >= 0]  # entropies are >= 0: drop the padding
        return high_entropy_mask(entropy, mask, 1.0 - threshold, pool)

    @staticmethod
    def get_off_policy_mask(advantages, per_token_logps, sampling_per_token_logps, mask, off_policy_threshold):
        """TRL's method: DeepSeek-V3.2's off-policy sequence mask [B, 1] (`core`, `off_policy_mask_threshold`), 0 where
        A < 0 and the mean log(pi_old / pi) over the completion exceeds the threshold. NaN log-probs count as 0."""
        log_ratio = torch.nan_to_num(per_token_logps.detach() - sampling_per_token_logps)  # log(pi / pi_old)
        return _off_policy_mask(log_ratio, advantages, mask, off_policy_threshold).to(mask.dtype)

    @property
    def entropy_coef(self) -> float:
        """The entropy bonus's coefficient now (TRL's attribute; `use_adaptive_entropy` moves it every step)."""
        return self._entropy.entropy_coef

    def _track_entropy(self, entropy: torch.Tensor, mask: torch.Tensor) -> None:
        """Adaptive entropy control (`core.EntropyControl`): this micro-batch's entropy over its policy-term tokens
        `mask` joins the window; at an optimizer step, the window's entropy over every process updates the coefficient.
        `entropy_coef` is logged once per optimizer step while the bonus is on (TRL)."""
        control, accelerator = self._entropy, self.accelerator
        if control.use_adaptive_entropy:
            control.accumulate(entropy, mask)
            if accelerator.sync_gradients:
                window = control.window
                control.step(accelerator.reduce(window, "sum") if accelerator.num_processes > 1 else window)
        if control.enabled and accelerator.sync_gradients:
            self._metrics["train"]["entropy_coef"].append(control.entropy_coef)

    def _backward_early(self, loss: torch.Tensor) -> None:
        """Backpropagate one group's share of the loss (`logprobs.backward_per_group`) as Trainer would."""
        with torch.autocast(self.accelerator.device.type, enabled=False):
            # Trainer divides the loss it backpropagates by the accumulation steps: so do we.
            self.accelerator.backward(loss / self.current_gradient_accumulation_steps)

    # ---- evaluation ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """Sample `num_generations_eval` completions per eval prompt, record their rewards, and return their GRPO loss
        under the current policy (on-policy, ratio 1; the KL to the reference when beta != 0; the high-entropy mask
        and the entropy bonus as in training, the adaptive coefficient left unchanged): `eval_loss`."""
        batch = self._generate_and_score(inputs, "eval")
        if "advantages" not in batch:  # the batch cut a group: no advantages, no loss
            return None, None, None
        batch["ref_logps"] = self._reference_logps(batch)
        with_entropy, kwargs = self._entropy.enabled or self.args.top_entropy_quantile < 1.0, {}
        router_aux = self._router_aux(kwargs)
        logps = self._logps_in_chunks(self.model, batch, with_entropy=with_entropy, **kwargs)  # [B, T] (+ entropy)
        logps, entropy = logps if with_entropy else (logps, None)
        policy_mask = self._high_entropy_mask(entropy, batch["completion_mask"])
        loss, _ = self._loss(logps, batch, entropy, policy_mask, train=False, router_aux=router_aux)
        return loss.detach(), None, None

    # ---- logging ---------------------------------------------------------------------------------------------
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "eval" if any(key.startswith("eval_") for key in logs) else "train"
        collected = self._metrics[mode]
        keys = sorted(key for key, values in collected.items() if values)
        if mode == "train" and "train_runtime" in logs and not keys:
            # Trainer's end-of-training row: with every step already logged (logging_steps=1), it repeats the last
            # step's metrics, as TRL's does (logging_steps=10 leaves metrics unlogged there), for log_history[-1].
            logs.update(self._last_train_metrics)
        if keys:
            means = torch.tensor(
                [sum(collected[k]) / len(collected[k]) for k in keys], dtype=torch.float64, device=self.args.device
            )
            if self.accelerator.num_processes > 1:  # every process logs at the same step
                means = self.accelerator.reduce(means, "mean")
            # Evaluation metrics take Trainer's prefix: "eval_", or "eval_<split>_" for a dict of eval datasets.
            runtime = next(
                (key for key in logs if key.startswith("eval_") and key.endswith("_runtime")), "eval_runtime"
            )
            prefix = runtime.removesuffix("runtime") if mode == "eval" else ""
            logs.update({f"{prefix}{k}": v for k, v in zip(keys, means.tolist(), strict=True)})
            if mode == "train":
                self._last_train_metrics = dict(zip(keys, means.tolist(), strict=True))
        collected.clear()
        tr_loss = getattr(self, "_tr_loss", None)  # Trainer zeroes it by subtraction, which leaves a NaN as NaN
        if mode == "train" and tr_loss is not None and not bool(torch.isfinite(tr_loss)):
            tr_loss.zero_()  # so a skipped step's NaN is logged once, not at every later step
        if mode == "train" and self.args.log_completions and self._completion_rows:
            rows, self._completion_rows = self._completion_rows, []
            if self.accelerator.is_main_process:
                write_completions(
                    rows, self.args.output_dir, self.state.global_step, self.args.num_completions_to_print
                )
        super().log(logs, start_time)

    # ---- checkpoints and resume (`grpo_hf.checkpoint`) -------------------------------------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None, ignore_keys_for_eval=None, **kwargs):
        """`Trainer.train`. `output_dir` is checked for writing again; `resume_from_checkpoint=True`
        takes the newest *complete* checkpoint; the GRPO run state (mid-rollout buffer, micro-step, token count,
        unlogged metrics) is restored with Trainer's, so the resumed run repeats the unbroken one exactly."""
        if self.args.should_save:  # checked at construction too; it may have changed since
            checkpoint.check_writable(self.args.output_dir)
        check_same_dataset(self.train_dataset, self.accelerator)
        resume = checkpoint.resolve_resume(resume_from_checkpoint, self.args.output_dir)
        if resume is not None:
            self._load_run_state(resume)
        with checkpoint.StopRequest() as self._stop_request:
            output = super().train(
                resume_from_checkpoint=resume, trial=trial, ignore_keys_for_eval=ignore_keys_for_eval, **kwargs
            )
        if self._stop_request.received:
            logger.warning(
                f"Training stopped by {self._stop_request.received} after step {self.state.global_step}, checkpoint "
                "saved: resume with trainer.train(resume_from_checkpoint=True)."
            )
        return output

    def _get_output_dir(self, trial) -> str:
        return self._staging_dir or super()._get_output_dir(trial)

    def _save_checkpoint(self, model, trial) -> None:
        """Trainer's checkpoint, plus this process's run state, written under `output_dir/.saving/` and renamed
        into place once every process has written its part: a `checkpoint-N` directory is always complete."""
        if self.args.push_to_hub:  # the Hub upload reads the directory Trainer wrote: keep Trainer's layout
            super()._save_checkpoint(model, trial)
            checkpoint.save_run_state(self._checkpoint_path(trial), self.accelerator.process_index, self._run_state())
            return
        final = self._checkpoint_path(trial)
        run_dir, name = os.path.split(final)
        staging = checkpoint.staging_run_dir(run_dir)
        staged = os.path.join(staging, name)
        if self.args.should_save and os.path.isdir(staged):  # left by a run killed while saving
            shutil.rmtree(staged)
        self.accelerator.wait_for_everyone()
        self._staging_dir = staging
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._staging_dir = None
        os.makedirs(staged, exist_ok=True)
        checkpoint.save_run_state(staged, self.accelerator.process_index, self._run_state())
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            best = self.state.best_model_checkpoint
            if best is not None and best.startswith(staging + os.sep):  # Trainer recorded the staged path
                self.state.best_model_checkpoint = os.path.join(run_dir, os.path.basename(best))
                self.state.save_to_json(os.path.join(staged, "trainer_state.json"))
            checkpoint.publish(staged, final)
            rotate_checkpoints(run_dir, self.args.save_total_limit, self.state.best_model_checkpoint, use_mtime=True)
        self.accelerator.wait_for_everyone()

    def _checkpoint_path(self, trial) -> str:
        return os.path.join(self._get_output_dir(trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")

    def _run_state(self) -> dict[str, Any]:
        state = {
            "num_processes": self.accelerator.num_processes,
            "micro_step": self._micro_step,
            "buffer": self._buffer,
            "num_tokens": self._num_tokens,
            "entropy_control": self._entropy.state(),
            "metrics": {key: list(values) for key, values in self._metrics["train"].items()},
        }
        if self.args.sync_ref_model and self.accelerator.is_main_process:  # the same on every process: saved once
            state["ref_model"] = self.accelerator.unwrap_model(self.ref_model).state_dict()
        return state

    def _load_reference(self, path: str, state: dict[str, Any] | None) -> None:
        """sync_ref_model: the reference weights process 0 saved with its run state (`_run_state`), so that a resumed
        run mixes into the same reference as the unbroken one."""
        if not self.args.sync_ref_model:
            return
        saved = (state or {}).get("ref_model")
        if saved is None:  # saved by process 0 only
            saved = (checkpoint.load_run_state(path, 0, self.accelerator.device) or {}).get("ref_model")
        if saved is None:
            logger.warning(
                f"{path} holds no reference weights (sync_ref_model): the reference restarts from the initial model, "
                "so the resumed run does not repeat the original one exactly."
            )
            return
        self.accelerator.unwrap_model(self.ref_model).load_state_dict(saved)

    def _load_run_state(self, path: str) -> None:
        state = checkpoint.load_run_state(path, self.accelerator.process_index, self.accelerator.device)
        self._load_reference(path, state)
        if state is not None and state.get("num_processes") != self.accelerator.num_processes:
            state = None  # the buffered rollout was cut for another number of processes
        if state is None:
            logger.warning(
                f"{path} has no grpo_hf run state ({checkpoint.RUN_STATE.format(rank=self.accelerator.process_index)}"
                "): it was not written by this version of grpo_hf, or by another number of processes. Training "
                "resumes from its weights with a fresh rollout, so it does not repeat the original run exactly."
            )
            return
        self._micro_step, self._buffer, self._num_tokens = state["micro_step"], state["buffer"], state["num_tokens"]
        self._metrics["train"] = defaultdict(list, state["metrics"])
        self._entropy.load_state(state.get("entropy_control"))  # adaptive entropy_coef; None in older checkpoints
