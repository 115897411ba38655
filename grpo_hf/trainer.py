"""`GRPOTrainer`: GRPO on `transformers.Trainer`.

One optimizer step (docs/design.md, "One training step")::

    dataloader rows    this process's share of a generation batch, a prompt's G copies together (RepeatSampler)
    _prepare_inputs    once per generation batch: experience.train_batches(rows) -> [MicroBatch], buffered
      rollout engine     Rollout: completion_ids, completion_mask [B, T], is_truncated [B]
      rewards            rewards [B, R], gathered [N, R], combined [N] (NaN = no reward)
      core               group_advantages over whole groups -> this process's advantages [B]
      rollout.batching   micro-batches of per_device_train_batch_size rows, trimmed and padded once
      logprobs           old_logps / ref_logps per micro-batch, without gradient, only when needed
      (max_staleness > 0: a producer thread samples and scores ahead, `producer.Producing`; docs/async.md)
    compute_loss       the policy's log-probs -> Objective: core.grpo_loss_with, entropy bonus, MoE aux loss
    Trainer            backward, clip, optimizer step (callbacks: skip a non-finite step, stop, sync), log

The trainer wires the pieces, each in its own module, given what it uses when built (`_init_state`), none reading
the trainer back: `experience` (the rollout half of a step), `rollout` (engines, batching), `rewards`, `core` (the
maths), `logprobs`, `objective`, `guards`, `metrics`, `callbacks`, `precision` and `checkpoint`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from transformers import PreTrainedModel, Trainer, TrainerCallback
from transformers.trainer_utils import set_seed

from grpo_hf import checkpoint, streams, validation  # validation: the input checks, and when each runs
from grpo_hf.callbacks import AnnounceStart, RefreshRolloutWeights, SkipNonfiniteUpdates, StopTogether, SyncReference
from grpo_hf.checkpoint import AtomicCheckpoints
from grpo_hf.completion_log import CompletionLog
from grpo_hf.config import GRPOConfig, config_or_default
from grpo_hf.core import off_policy_mask
from grpo_hf.experience import ExperienceMaker, Models, RewardSet
from grpo_hf.guards import NonfiniteGuard
from grpo_hf.heads import cast_lm_head_to_fp32, router_aux_loss_coef
from grpo_hf.logprobs import LogprobPath, backward_per_group, completion_logps, watch_logps
from grpo_hf.metrics import Metrics
from grpo_hf.models import build_models, tokenizer_of
from grpo_hf.objective import Objective, gathered_clip_extremes, gathered_high_entropy_mask
from grpo_hf.parallel import average_gradients, check_same_dataset, is_zero3, prepare_reference
from grpo_hf.precision import PrecisionGuard
from grpo_hf.producer import Producing
from grpo_hf.rewards.reward_models import reward_processing_classes_of, reward_sources
from grpo_hf.rollout import MicroBatch, RepeatSampler, RolloutEngine, eos_token_ids_of
from grpo_hf.rollout.sampler import Generation, Sampler, ToolSetup
from grpo_hf.tooling import train_rows

logger = logging.getLogger(__name__)

RewardFunc = Callable[..., list] | str | PreTrainedModel


class GRPOTrainer(AtomicCheckpoints, Producing, Trainer):
    """Group Relative Policy Optimization (Shao et al., 2024) as a `transformers.Trainer`.

    Args (TRL 1.16's, in TRL's order; docs/design.md, "The public contract"):
        model: a Hub id or local path (`AutoModelForCausalLM`; a VLM's `AutoModelForImageTextToText`;
            `args.model_init_kwargs`), a `PreTrainedModel`, or a `PeftModel`.
        reward_funcs: one or a list of: a callable with TRL's reward signature `fn(prompts, completions,
            completion_ids, trainer_state, **columns) -> list[float | None]`, a registry name
            (`grpo_hf.rewards.REWARD_FUNCS`) or `"package.module:function"`, a reward model or its path / Hub id.
        args: a `GRPOConfig`.
        train_dataset, eval_dataset: `datasets.Dataset`s (or streams, `grpo_hf.streams`) with a `prompt` column,
            text or chat messages; every other column reaches the reward functions. eval_dataset may be a dict.
        processing_class, reward_processing_classes: the tokenizer or VLM processor (None: `model`'s), one per reward.
        callbacks, optimizers: as for `transformers.Trainer`. peft_config, quantization_config: LoRA / QLoRA (TRL's).
        tools, environment_factory: functions the model may call in multi-turn episodes; a class (or a dict name ->
            class) of stateful environments, one per episode, whose methods are tools (docs/tools.md).
        rollout_func: TRL's `rollout_func(prompts, trainer) -> dict`, which replaces sampling (`rollout.custom`).
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
        callbacks: list[TrainerCallback] | None = None,
        optimizers=(None, None),
        quantization_config=None,
        peft_config=None,
        tools: list[Callable] | None = None,
        rollout_func=None,
        environment_factory=None,
    ):
        args = config_or_default(args, model)
        args.log_defaults_differing_from_trl()
        set_seed(args.seed)  # before LoRA adapters and reward heads are initialised: alike on every process (FSDP)
        model, ref_model, processing_class = build_models(
            model,
            processing_class,
            peft_config,
            with_reference=args.beta != 0.0,
            disable_dropout=args.disable_dropout,
            model_init_kwargs=args.model_load_kwargs(),
            gradient_checkpointing=args.gradient_checkpointing,
            quantization_config=quantization_config,  # QLoRA: loaded quantized, adapters bf16 (TRL)
        )
        self.agentic = ToolSetup.build(tools, environment_factory, processing_class)  # None: no tools, no environments
        self.tools = [] if self.agentic is None else self.agentic.all_tools()  # TRL's: every tool, environments' too
        train_dataset = train_rows(train_dataset, environment_factory, args)
        envs = self.agentic is not None and self.agentic.environments is not None  # their reset() writes prompts
        columns = validation.check_inputs(
            model, processing_class, peft_config, train_dataset, eval_dataset, args, environments=envs
        )
        self._init_rewards(reward_funcs, reward_processing_classes, args, columns)

        if args.should_save:  # Trainer creates output_dir here: say what is wrong with it, before anything runs
            checkpoint.check_writable(args.output_dir)
        super().__init__(  # data_collator=list: rows stay dicts, prompts are tokenized per generation batch
            model=model,
            args=args,
            data_collator=list,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
        )
        self.model_accepts_loss_kwargs = False

        self.ref_model = self._place_models(ref_model)

        self._init_state(args, rollout_func)

    # ---- construction helpers --------------------------------------------------------------------------------
    def _init_rewards(self, reward_funcs, reward_processing_classes, args: GRPOConfig, columns: dict) -> None:
        """The reward functions, their names and weights [R] (`reward_models.reward_sources`): `reward_funcs`, then
        the reward of each environment that owns one."""
        owned, added = (self.agentic.reward_funcs(), ["environments"]) if self.agentic is not None else ([], [])
        funcs, names, weights = reward_sources(reward_funcs, reward_processing_classes, args, owned)
        self.reward_funcs, self.reward_func_names, self.reward_weights = funcs, names, weights
        columns = {name: [*dataset_columns, *added] for name, dataset_columns in columns.items()}
        validation.check_reward_funcs(self.reward_funcs, self.reward_func_names, columns)

    def _init_state(self, args: GRPOConfig, rollout_func=None) -> None:
        """What a run carries from step to step, each piece given what it needs: the metrics, the non-finite guard,
        the log-prob path, the objective, the rollouts (`experience`), the buffered micro-batches; and the callbacks
        around the optimizer step."""
        tokenizer = tokenizer_of(self.processing_class)  # a VLM's processor's own
        self.eos_token_ids = eos_token_ids_of(self.accelerator.unwrap_model(self.model), tokenizer)
        self.generation_config = args.generation_config_for(tokenizer.pad_token_id, self.eos_token_ids)
        self.chat_template_kwargs, self.rollout_func = args.chat_template_kwargs, rollout_func  # TRL's attributes
        self.router_aux_loss_coef = router_aux_loss_coef(self.model, args.router_aux_loss_coef)  # 0.0: off
        self._metrics = Metrics()
        self.completion_log = CompletionLog(args)  # log_completions: TRL's files, the table, trackers, the Hub
        self.guard = NonfiniteGuard(self.accelerator, args.on_nonfinite, self.reward_func_names, self.reward_weights)
        forwards = {"temperature": args.temperature, "chunk_size": args.logprob_chunk_size}  # every forward's
        sharded, aux = self.is_fsdp_enabled or self.is_deepspeed_enabled, self.router_aux_loss_coef
        self.logps = LogprobPath(
            self.accelerator, forwards, args.per_device_train_batch_size, args.share_prompt_prefix, aux, sharded,
            args.backward_per_group, self.accelerator.unwrap_model(self.model),
        )  # fmt: skip
        settings = (args.loss_settings(), args.entropy_settings(), args.sampling_correction(self.uses_producer))
        self.objective = Objective(self.accelerator, *settings, router_aux_loss_coef=self.router_aux_loss_coef)
        self.experience = self._experience_maker(rollout_func)
        self._init_producer(rollout_func)  # `producer.Producing`: asynchronous GRPO (max_staleness > 0)
        self._micro_step, self._buffer = 0, []  # micro-steps taken, the current rollout's [MicroBatch] (each `train`)
        self.precision_guard: PrecisionGuard | None = None  # set with the optimizer (`create_optimizer`)
        self._average_gradients = False  # set when the fast path bypasses DDP's forward (`compute_loss`)
        self.reference_sync = None  # TR-DPO (`sync_ref_model`)
        if args.sync_ref_model:
            alpha = args.ref_model_mixup_alpha
            self.reference_sync = SyncReference(lambda: self.model, self.ref_model, self.accelerator, alpha)
            self.add_callback(self.reference_sync)
        describe = lambda: f"{self.experience.sampler.describe()} | {self.logps.describe(self.model_wrapped)}"  # noqa: E731
        for callback in (
            SkipNonfiniteUpdates(self.guard, self._metrics["train"]),
            StopTogether(self.stop_request, self.accelerator),
            RefreshRolloutWeights(self.experience.weights_updated, self.accelerator, self.experience.release_engine),
            AnnounceStart(describe, lambda: self.precision_guard),
        ):
            self.add_callback(callback)

    def _experience_maker(self, rollout_func) -> ExperienceMaker:
        """The rollouts, given what they use: the trainer's own state is read through these functions only."""
        sharded = self.is_fsdp_enabled or is_zero3(self.accelerator)
        generation = Generation(self.generation_config, self.eos_token_ids, self.chat_template_kwargs, sharded)
        bound = None if rollout_func is None else (lambda prompts: rollout_func(prompts, self))
        wrapped = lambda: self.model_wrapped  # noqa: E731
        sampler = Sampler(self.args, self.accelerator, self.processing_class, generation, wrapped, bound, self.agentic)
        return ExperienceMaker(
            self.args, self.accelerator, self.processing_class,
            rewards=RewardSet(self.reward_funcs, self.reward_func_names, self.reward_weights),
            models=Models(policy=lambda: self.model, reference=self.ref_model),
            logps=self.logps, guard=self.guard, metrics=self._metrics, state=lambda: self.state, sampler=sampler,
            train_rows=lambda: self._remove_unused_columns(self.train_dataset, description="training"),
        )  # fmt: skip

    def _place_models(self, ref_model):
        """Reward models and the reference model prepared like the policy (`parallel.prepare_reference`); the
        reference returned, or None. With `cast_lm_head_to_fp32`, both LM heads are made fp32 first."""
        if self.args.cast_lm_head_to_fp32:
            for model in (self.model, ref_model):
                if model is not None:
                    cast_lm_head_to_fp32(model)
        for func in self.reward_funcs:  # placed as the reference is: partitioned under DeepSpeed / FSDP (TRL)
            if hasattr(func, "model") and isinstance(func.model, PreTrainedModel):
                func.model = prepare_reference(func.model, self.accelerator)
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
        if self._signature_columns is None:  # remove_unused_columns=True keeps the prompt and its images
            self._signature_columns = ["prompt", "image", "images"]

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
        G = self.args.num_generations_eval or self.args.num_generations
        return RepeatSampler(num_prompts=len(eval_dataset), num_generations=G, prompts_per_batch=1, shuffle=False)

    def _get_dataloader(self, dataset, description, batch_size, sampler_fn=None, is_training=False, **kwargs):
        """Trainer's, and for a stream (`datasets.IterableDataset`, `grpo_hf.streams`) the samplers' order made on
        the stream itself (`RepeatedStream`), read by one worker."""
        if not streams.is_stream(dataset):
            return super()._get_dataloader(dataset, description, batch_size, sampler_fn, is_training, **kwargs)
        checked = streams.eval_splits(self.eval_dataset)  # at construction
        if not is_training and not any(dataset is known for known in checked):  # first seen by `evaluate(stream)`
            validation.check_dataset(dataset, "eval_dataset", self.processing_class, self.args, None, is_train=False)
        collate = self._get_collator_with_removed_columns(self.data_collator, description=description)
        return streams.loader(dataset, self.args, self.accelerator, batch_size, is_training, collate)

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

    # ---- rollouts (`grpo_hf.experience`) --------------------------------------------------------------------
    @property
    def rollout(self) -> RolloutEngine | None:
        """The rollout engine (`args.rollout_engine`), chosen at the first rollout."""
        return self.experience.engine

    # TRL's attribute: the environment instances of the last rollout, one per row (None before it, or without any)
    environments = property(lambda self: self.experience.sampler.environments_in_use)

    @property
    def num_generate_calls(self) -> int:
        """How many rollout rounds were generated (evaluation and dynamic sampling's extra rounds included)."""
        return self.experience.num_generate_calls

    def _prepare_inputs(self, inputs: list[dict[str, Any]]) -> MicroBatch:
        """Trainer's hook before `compute_loss`: the next micro-batch of the buffered rollout. A new rollout is made
        from `inputs` (this process's share of a generation batch) once the last one has served its
        steps_per_generation x num_iterations micro-steps; the sampler serves the same rows to each of them."""
        args = self.args
        per_batch = args.steps_per_generation * args.num_iterations
        if self._micro_step % per_batch == 0:  # a producer's batch was sampled and scored from the same rows
            self._buffer = self._produced(self._micro_step // per_batch) or self.experience.train_batches(inputs)
        batch = self._buffer[self._micro_step % args.steps_per_generation]
        self._micro_step += 1
        return batch

    # ---- loss ------------------------------------------------------------------------------------------------
    def compute_loss(self, model, inputs: MicroBatch, return_outputs=False, num_items_in_batch=None):
        """The GRPO loss of one micro-batch (`objective.Objective`), from the policy's log-probs by the path planned
        for it (`forward_plan`): the shared-prefix forward, backpropagating one group at a time or at once, or one
        padded forward."""
        if return_outputs:
            raise ValueError("GRPOTrainer.compute_loss does not return model outputs.")
        batch, objective = inputs, self.objective
        plan = self.logps.plan(model, batch)
        kwargs = self.experience.loss_kwargs(plan, batch)  # pi_prox replayed (`ProxReplay`), MoE routes (`replay`)
        share_prefix, routing = kwargs.pop("share_prefix"), kwargs.get("routing")
        # The bare module: a DDP wrapper's forward is bypassed, and `training_step` averages the gradients (when the
        # last micro-step of the optimizer step took this path: the plan may change between steps)
        self._average_gradients = share_prefix and self.accelerator.num_processes > 1
        model = self.accelerator.unwrap_model(model) if share_prefix else model
        kwargs["entropy_grad"] = objective.entropy.applied != 0  # the bonus is differentiated; else a metric
        steps, policy_mask, logps = self.current_gradient_accumulation_steps, None, None
        router_aux = objective.router_aux(kwargs)  # MoE: the forwards' load-balancing loss goes here
        with self.accelerator.autocast():
            # top_entropy_quantile < 1: a group's token mask depends on every group's entropy, so one backward
            if share_prefix and plan.per_group and self.args.top_entropy_quantile == 1.0:
                loss_fn = watch_logps(routing, objective.loss_of(batch, steps))  # its logps kept: `record_routing`
                loss, metrics, entropy = backward_per_group(
                    model, batch, loss_fn, self._backward_early, entropy_in_loss=True, **kwargs
                )
            else:
                logps, entropy = completion_logps(model, batch, share_prefix=share_prefix, with_entropy=True, **kwargs)
                policy_mask = objective.policy_mask(entropy, batch.completion_mask)  # [B, T] or None: all
                loss, metrics = objective(
                    logps, batch, entropy, policy_mask, accumulation_steps=steps, router_aux=router_aux
                )
        step = self.state.global_step + 1
        if batch.nonfinite or self.guard.loss(loss, batch, self.accelerator.unwrap_model(self.model), step):
            self.guard.skip_update = True
        train_metrics = self._metrics["train"]
        for key, value in gathered_clip_extremes(self.accelerator, metrics).items():
            train_metrics[key].append(value)
        objective.record_entropy(entropy, batch.completion_mask, policy_mask, train_metrics)
        self.experience.record_routing(routing, batch, logps)  # MoE: rollout vs training (`replay.RouterReplay`)
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
            self.guard.pre_clip_norms = [(name, norm) for (name, _), norm in zip(params, norms, strict=True)]
        return super()._clip_grad_norm(model)

    def _get_grad_norm(self, model, grad_norm=None):
        grad_norm = super()._get_grad_norm(model, grad_norm)
        if grad_norm is not None:
            self.guard.gradient_norm(grad_norm, self.accelerator.unwrap_model(model), self.state.global_step + 1)
        return grad_norm

    def get_high_entropy_mask(self, entropies: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
        """TRL's method: bool [B, T], the completion tokens whose entropy is at least the `threshold` quantile of the
        completion tokens of this micro-batch on every process (TRL passes 1 - top_entropy_quantile). As TRL's, it
        reads only its arguments and `self.accelerator`."""
        return gathered_high_entropy_mask(self.accelerator, entropies, mask, 1.0 - threshold)

    @staticmethod
    def get_off_policy_mask(advantages, per_token_logps, sampling_per_token_logps, mask, off_policy_threshold):
        """TRL's method: DeepSeek-V3.2's off-policy sequence mask [B, 1] (`core`, `off_policy_mask_threshold`), 0 where
        A < 0 and the mean log(pi_old / pi) over the completion exceeds the threshold. NaN log-probs count as 0."""
        log_ratio = torch.nan_to_num(per_token_logps.detach() - sampling_per_token_logps)  # log(pi / pi_old)
        return off_policy_mask(log_ratio, advantages, mask, off_policy_threshold).to(mask.dtype)

    @property
    def entropy_coef(self) -> float:
        """The entropy bonus's coefficient now (TRL's attribute; `use_adaptive_entropy` moves it every step)."""
        return self.objective.entropy.entropy_coef

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
        batch = self.experience.eval_batch(inputs)
        if batch is None:  # the batch cut a group: no advantages, no loss
            return None, None, None
        objective, kwargs = self.objective, {}
        router_aux = objective.router_aux(kwargs)
        logps = self.logps.no_grad(self.model, batch, with_entropy=objective.needs_entropy, **kwargs)  # [B, T]
        logps, entropy = logps if objective.needs_entropy else (logps, None)
        policy_mask = objective.policy_mask(entropy, batch.completion_mask)
        loss, _ = objective(logps, batch, entropy, policy_mask, router_aux=router_aux)
        return loss.detach(), None, None

    # ---- logging ---------------------------------------------------------------------------------------------
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Trainer's log row, with the means of the metrics recorded since the last row (`metrics.Metrics`)."""
        mode = self._metrics.add_means(logs, self.accelerator)
        tr_loss = getattr(self, "_tr_loss", None)  # Trainer zeroes it by subtraction, which leaves a NaN as NaN
        if mode == "train" and tr_loss is not None and not bool(torch.isfinite(tr_loss)):
            tr_loss.zero_()  # so a skipped step's NaN is logged once, not at every later step
        if self.args.log_completions and (rows := self.experience.completion_rows[mode]):
            self.experience.completion_rows[mode] = []  # the main process writes them: files, table, trackers, Hub
            self.completion_log.write(rows, self.state.global_step, mode, main=self.accelerator.is_main_process)
        super().log(logs, start_time)

    # ---- checkpoints and resume: `checkpoint.AtomicCheckpoints`, with this run state ---------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None, ignore_keys_for_eval=None, **kwargs):
        """`Trainer.train`, resumable exactly (`checkpoint.AtomicCheckpoints.train`), every process on one dataset."""
        check_same_dataset(self.train_dataset, self.accelerator)
        self._micro_step, self._buffer, self._saved_producer_weights = 0, [], None  # none of an earlier train()'s
        return super().train(resume_from_checkpoint, trial, ignore_keys_for_eval, **kwargs)

    def _run_state(self) -> dict[str, Any]:
        state = {
            "micro_step": self._micro_step,
            "buffer": [vars(batch) for batch in self._buffer],  # plain dicts of tensors: torch.load(weights_only)
            "num_tokens": self.experience.num_tokens,
            "entropy_control": self.objective.entropy.state(),
            "metrics": self._metrics.state(),
        }
        if self.async_rollouts is not None:  # the producer's weights the batches not yet trained on are sampled by
            state["producer_weights"] = self.async_rollouts.saved_weights()
        if self.reference_sync is not None:
            state.update(self.reference_sync.state())
        return state

    def _load_run_state(self, path: str, state: dict[str, Any] | None) -> None:
        if self.reference_sync is not None:
            self.reference_sync.load_state(path, state)
        if state is not None:
            self._micro_step, self._buffer = state["micro_step"], [MicroBatch(**part) for part in state["buffer"]]
            self.experience.num_tokens = state["num_tokens"]
            self._metrics.load_state(state["metrics"])
            self.objective.entropy.load_state(state.get("entropy_control"))  # None in older checkpoints
            self._saved_producer_weights = state.get("producer_weights") or None
