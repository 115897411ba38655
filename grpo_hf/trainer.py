"""`GRPOTrainer`: GRPO on `transformers.Trainer`.

One optimizer step (docs/design.md ("One training step"))::

    dataloader: one generation batch of prompts, each repeated G times (RepeatSampler)
      -> rollout engine .generate    completion_ids [N, T], completion_mask [N, T], is_truncated [N]
      -> rewards.compute_rewards     [N, R] (NaN = no reward), gathered over processes
      -> core.group_advantages       over whole groups, then this process's rows are kept
      -> old_logps / ref_logps       once per generation batch, only when they are needed
      -> compute_loss (per slice)    policy logps -> core.grpo_loss
      -> Trainer                     backward, clip, optimizer step, log

The trainer wires pieces together; each lives in its own module:

- `experience`: the rollout half of a step: generate (`rollout` engines), score (`rewards`), advantages
  (`core`), dynamic sampling (`rollout.dynamic`), old/ref log-probs, micro-batch slices;
- `logprobs`: model -> completion log-probs (shared prompt prefix, length buckets, per-group backward);
- `core`: the maths; `precision`: fp32 master weights and the lost-update guard; `guards`: why a value is not
  finite; `metrics`: what a log row averages; `callbacks`: what happens around the optimizer step;
  `checkpoint`: whole-or-absent checkpoints and the run state that makes a resume exact.

The loss is the one in docs/design.md ("The maths") exactly; the one place where the trainer touches it is the
gradient-accumulation / data-parallel rescaling of `dapo` (see `_loss`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel, Trainer, TrainerCallback
from transformers.trainer_utils import set_seed

from grpo_hf import checkpoint, streams, validation  # validation: the input checks, and when each runs
from grpo_hf.callbacks import AfterOptimizerStep, SyncReference
from grpo_hf.checkpoint import AtomicCheckpoints
from grpo_hf.completion_log import write_completions
from grpo_hf.config import GRPOConfig, as_dict
from grpo_hf.core import (
    LOSS_VARIANTS,
    EntropyControl,
    _off_policy_mask,
    entropy_bonus,
    grpo_loss_with,
    high_entropy_mask,
)
from grpo_hf.experience import ExperienceMaker
from grpo_hf.guards import explain_advantages, explain_gradients, explain_loss
from grpo_hf.logprobs import backward_per_group, completion_logps, logps_in_chunks, shared_prefix_blocker
from grpo_hf.metrics import Metrics
from grpo_hf.models import build_models, cast_lm_head_to_fp32, router_aux_loss_coef
from grpo_hf.parallel import average_gradients, check_same_dataset, prepare_reference, sum_over_processes
from grpo_hf.precision import PrecisionGuard
from grpo_hf.reward_models import build_reward_funcs, reward_processing_classes_of, reward_weights
from grpo_hf.rewards import reward_func_name
from grpo_hf.rollout import RepeatSampler, RolloutEngine, eos_token_ids_of
from grpo_hf.vllm_config import vllm_sampling_weight

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


class GRPOTrainer(AtomicCheckpoints, Trainer):
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
        set_seed(args.seed)  # before LoRA adapters and reward heads are initialised: alike on every process (FSDP)
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
        self.generation_config = args.generation_config_for(processing_class.pad_token_id, self.eos_token_ids)
        self.chat_template_kwargs = as_dict(args.chat_template_kwargs, "chat_template_kwargs")

        self._init_state(args, rollout_func)

    # ---- construction helpers --------------------------------------------------------------------------------
    def _init_state(self, args: GRPOConfig, rollout_func=None) -> None:
        """The rollout buffer, counters and metrics a run carries from step to step; `rollout_func`, the MoE
        auxiliary-loss weight and the reference sync (TR-DPO)."""
        self.rollout_func = rollout_func  # TRL's: completions from a function of the user's (`rollout.custom`)
        self.router_aux_loss_coef = router_aux_loss_coef(self.model, args.router_aux_loss_coef)  # 0.0: off
        if args.sync_ref_model:
            self.add_callback(SyncReference(self))
        # Old log-probs differ from the current policy's only if an optimizer step happens between
        # generation and the last use of the batch: i.e. unless all steps_per_generation x
        # num_iterations micro-steps of one rollout fall inside one accumulation window.
        uses_per_rollout = args.steps_per_generation * args.num_iterations
        self._needs_old_logps = args.gradient_accumulation_steps % uses_per_rollout != 0
        self._micro_step = 0
        self._buffer: list[dict[str, Any]] = []  # the micro-batch slices of the current rollout
        self._metrics = Metrics()
        self.experience = ExperienceMaker(self)  # rollouts: generate, score, advantages, slices
        self._skip_update = False  # a non-finite value was met in this optimizer step (on_nonfinite="skip_step")
        self._skipped_steps = 0
        self._pre_clip_norms: list[tuple[str, torch.Tensor]] | None = None  # per-tensor gradient norms, pre-clip
        self.precision_guard: PrecisionGuard | None = None  # set with the optimizer (`create_optimizer`)
        self._average_gradients = False  # set when the fast path bypasses DDP's forward (`compute_loss`)
        self._entropy = EntropyControl(**args.entropy_kwargs())  # the entropy bonus's coefficient, adaptive or not
        self.add_callback(AfterOptimizerStep(self))

    def _place_models(self, ref_model):
        """Reward models to the device; the reference model prepared like the policy (`parallel.prepare_reference`)
        and returned, or None. With `cast_lm_head_to_fp32`, both LM heads are made fp32 first."""
        if self.args.cast_lm_head_to_fp32:
            for model in (self.model, ref_model):
                if model is not None:
                    cast_lm_head_to_fp32(model)
        for func in self.reward_funcs:
            if hasattr(func, "model") and isinstance(func.model, PreTrainedModel):
                func.model.to(self.accelerator.device)
        return None if ref_model is None else prepare_reference(ref_model, self.accelerator)

    @property
    def aux_loss_enabled(self) -> bool:
        """TRL's attribute: whether the MoE load-balancing loss is in the training loss (`router_aux_loss_coef`)."""
        return self.router_aux_loss_coef != 0.0

    @property
    def reward_processing_classes(self) -> list:
        """TRL's attribute: one entry per reward function, the tokenizer of each reward model, None for the others."""
        return reward_processing_classes_of(self.reward_funcs)

    def create_optimizer(self, model=None):
        """Trainer's optimizer, with fp32 master weights for bf16/fp16 parameters and the lost-update guard
        (`precision.PrecisionGuard`; DeepSpeed and fp16 loss scaling manage precision themselves)."""
        optimizer = super().create_optimizer(model)
        if self.precision_guard is None:
            record = lambda fraction: self._metrics["train"]["precision/lost_updates"].append(fraction)  # noqa: E731
            deepspeed, scaler = self.is_deepspeed_enabled, self.accelerator.scaler
            self.precision_guard = PrecisionGuard.from_config(optimizer, self.args, deepspeed, scaler, record=record)
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
        checked = streams.eval_splits(self.eval_dataset)  # at construction
        if not is_training and not any(dataset is known for known in checked):  # first seen by `evaluate(stream)`
            validation.check_dataset(dataset, "eval_dataset", self.processing_class, args, None, is_train=False)
        with streams.one_worker(args):
            ordered = streams.in_sampler_order(dataset, args, is_training)
            return super()._get_dataloader(ordered, description, batch_size, sampler_fn, is_training, **kwargs)

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

    # ---- rollouts (`grpo_hf.experience`) and log-probabilities -----------------------------------------------
    @property
    def rollout(self) -> RolloutEngine | None:
        """The rollout engine (`args.rollout_engine`), chosen at the first rollout."""
        return self.experience.engine

    @property
    def num_generate_calls(self) -> int:
        """How many rollout rounds were generated (evaluation and dynamic sampling's extra rounds included)."""
        return self.experience.num_generate_calls

    def _reference_logps(self, batch: dict[str, Any]) -> torch.Tensor | None:
        """The reference model's log-probs [B, T] (None when beta = 0); under LoRA, the model with adapters off."""
        if self.args.beta == 0.0:
            return None
        if self.ref_model is not None:
            return self._logps_in_chunks(self.ref_model, batch)
        with self.accelerator.unwrap_model(self.model).disable_adapter():
            return self._logps_in_chunks(self.model, batch)

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
        """Why the shared-prefix forward does not apply to `model` (`logprobs.shared_prefix_blocker`), or None."""
        return shared_prefix_blocker(
            model,
            self.accelerator.unwrap_model(model),
            share_prompt_prefix=self.args.share_prompt_prefix,
            router_aux_loss_coef=self.router_aux_loss_coef,
            sharded=self.is_fsdp_enabled or self.is_deepspeed_enabled,
        )

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
            self._buffer = self.experience.slices(inputs)
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
        if what == "loss":  # the others: every process decides alike
            bad = sum_over_processes(self.accelerator, int(bad)) > 0
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
        sampling_weight, sampling_metrics = vllm_sampling_weight(args, logps, batch) if train else (None, {})
        loss, metrics = grpo_loss_with(
            logps,
            batch.get("old_logps"),
            batch["ref_logps"],
            batch["advantages"],
            mask,
            args.loss_settings(),
            num_items=batch["num_items_in_batch"] if train else mask.sum(),
            policy_mask=policy_mask,
            sampling_weight=sampling_weight,
        )
        metrics.update(sampling_metrics)
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
        batch = self.experience.make(inputs, "eval")
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
        """Trainer's log row, with the means of the metrics recorded since the last row (`metrics.Metrics`)."""
        mode = "eval" if any(key.startswith("eval_") for key in logs) else "train"
        means = self._metrics.pop_means(mode, self.accelerator)
        if mode == "train" and "train_runtime" in logs and not means:
            # Trainer's end-of-training row: with every step already logged (logging_steps=1), it repeats the last
            # step's metrics, as TRL's does (logging_steps=10 leaves metrics unlogged there), for log_history[-1].
            means = self._metrics.last_train
        # Evaluation metrics take Trainer's prefix: "eval_", or "eval_<split>_" for a dict of eval datasets.
        runtime = next((key for key in logs if key.startswith("eval_") and key.endswith("_runtime")), "eval_runtime")
        prefix = runtime.removesuffix("runtime") if mode == "eval" else ""
        logs.update({f"{prefix}{key}": value for key, value in means.items()})
        tr_loss = getattr(self, "_tr_loss", None)  # Trainer zeroes it by subtraction, which leaves a NaN as NaN
        if mode == "train" and tr_loss is not None and not bool(torch.isfinite(tr_loss)):
            tr_loss.zero_()  # so a skipped step's NaN is logged once, not at every later step
        if mode == "train" and self.args.log_completions and self.experience.completion_rows:
            rows, self.experience.completion_rows = self.experience.completion_rows, []
            if self.accelerator.is_main_process:
                write_completions(
                    rows, self.args.output_dir, self.state.global_step, self.args.num_completions_to_print
                )
        super().log(logs, start_time)

    # ---- checkpoints and resume: `checkpoint.AtomicCheckpoints`, with this run state ---------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None, ignore_keys_for_eval=None, **kwargs):
        """`Trainer.train`, resumable exactly (`checkpoint.AtomicCheckpoints.train`), after checking that every
        process holds the same train dataset."""
        check_same_dataset(self.train_dataset, self.accelerator)
        return super().train(resume_from_checkpoint, trial, ignore_keys_for_eval, **kwargs)

    def _run_state(self) -> dict[str, Any]:
        state = {
            "micro_step": self._micro_step,
            "buffer": self._buffer,
            "num_tokens": self.experience.num_tokens,
            "entropy_control": self._entropy.state(),
            "metrics": self._metrics.state(),
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

    def _load_run_state(self, path: str, state: dict[str, Any] | None) -> None:
        self._load_reference(path, state)
        if state is not None:
            self._micro_step, self._buffer = state["micro_step"], state["buffer"]
            self.experience.num_tokens = state["num_tokens"]
            self._metrics.load_state(state["metrics"])
            self._entropy.load_state(state.get("entropy_control"))  # adaptive entropy_coef; None in older checkpoints
