"""The `TrainerCallback`s a `GRPOTrainer` installs on itself: what happens around Trainer's optimizer step.

- `AfterOptimizerStep`: drops a step's update when a non-finite value was met (`on_nonfinite="skip_step"`), stops
  every process at the same step on SIGTERM / Ctrl-C (`checkpoint.StopRequest`), logs the log-prob path and aligns
  the precision guard's step count (for a resumed run) at the start of training, and tells the rollout engine that
  the weights changed.
- `SyncReference`: TR-DPO's reference update (`sync_ref_model`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from transformers import TrainerCallback

from grpo_hf.parallel import is_zero3, mix_parameters_, sum_over_processes

if TYPE_CHECKING:
    from grpo_hf.trainer import GRPOTrainer

logger = logging.getLogger(__name__)


class AfterOptimizerStep(TrainerCallback):
    """Skipped updates, stop requests, the log-prob path's log line, and the rollout engine's weight refresh."""

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
            # one process signalled: all stop at this same step
            if sum_over_processes(self.trainer.accelerator, int(request.received is not None)) > 0:
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
        if self.trainer.rollout is not None:  # a resumed run's weights came from a checkpoint: an engine re-syncs
            self.trainer.rollout.on_weights_updated(self.trainer.accelerator.unwrap_model(self.trainer.model))

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self.trainer.rollout is not None:
            self.trainer.rollout.on_weights_updated(self.trainer.accelerator.unwrap_model(self.trainer.model))


class SyncReference(TrainerCallback):
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
            self.sync()

    def sync(self) -> None:
        """Reference <- alpha x policy + (1 - alpha) x reference, in place. Under DeepSpeed ZeRO-3 the shards are
        gathered and process 0 mixes them (as TRL does)."""
        trainer = self.trainer
        policy = trainer.accelerator.unwrap_model(trainer.model)
        reference = trainer.accelerator.unwrap_model(trainer.ref_model)
        targets, sources = list(reference.parameters()), list(policy.parameters())
        alpha = trainer.args.ref_model_mixup_alpha
        if is_zero3(trainer.accelerator):
            import deepspeed

            with deepspeed.zero.GatheredParameters(targets + sources, modifier_rank=0):
                if trainer.accelerator.is_main_process:
                    mix_parameters_(targets, sources, alpha)
        else:
            mix_parameters_(targets, sources, alpha)
