"""The `TrainerCallback`s a `GRPOTrainer` installs on itself: what happens around Trainer's optimizer step.

Each is given the objects it acts on when it is built, never the trainer:

- `SkipNonfiniteUpdates`: drops a step's update when a non-finite value was met (`on_nonfinite="skip_step"`,
  `guards.NonfiniteGuard`).
- `StopTogether`: stops every process at the same step on SIGTERM / Ctrl-C (`checkpoint.StopRequest`).
- `RefreshRolloutWeights`: tells the rollout engine that the policy's weights changed (and at the start of
  training, for a resumed run's); at the end of training, releases what the engine holds (vLLM's engine and its
  memory), so that a second trainer in the process starts from the memory the first one started from.
- `AnnounceStart`: at the start of training, logs the rollout engine and the log-prob path (one line) and aligns the
  precision guard's step count (a resumed run measures at the same steps as an unbroken one).
- `SyncReference`: TR-DPO's reference update (`sync_ref_model`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from torch import nn
from transformers import TrainerCallback

from grpo_hf.checkpoint import StopRequest, load_run_state
from grpo_hf.guards import NonfiniteGuard
from grpo_hf.parallel import is_zero3, mix_parameters_, sum_over_processes

logger = logging.getLogger(__name__)


class SkipNonfiniteUpdates(TrainerCallback):
    """Before the optimizer step: no update at all when `guard` met a non-finite value in this step."""

    def __init__(self, guard: NonfiniteGuard, metrics: dict[str, list[float]]):
        self.guard, self.metrics = guard, metrics  # metrics: the train mode's values

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if self.guard.drop_update(model):
            self.metrics["nonfinite/skipped_steps"].append(float(self.guard.skipped_steps))


class StopTogether(TrainerCallback):
    """At each step end: when one process received a stop signal (`request`), every process saves and stops here."""

    def __init__(self, request: StopRequest, accelerator):
        self.request, self.accelerator = request, accelerator

    def on_step_end(self, args, state, control, **kwargs):
        if sum_over_processes(self.accelerator, int(self.request.received is not None)) > 0:
            self.request.received = self.request.received or "a stop signal to another process"  # `stopped_by`
            control.should_save = args.save_strategy != "no"
            control.should_training_stop = True


class RefreshRolloutWeights(TrainerCallback):
    """The rollout engine follows the policy: `weights_updated(model)` (unwrapped) after every optimizer step, and
    at the start of training (a resumed run's weights came from a checkpoint); `release()` at the end of training
    (`ExperienceMaker.release_engine`: a later rollout, e.g. an evaluation, starts the engine again)."""

    def __init__(self, weights_updated: Callable[[nn.Module], None], accelerator, release: Callable[[], None]):
        self.weights_updated, self.accelerator, self.release = weights_updated, accelerator, release

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.weights_updated(self.accelerator.unwrap_model(model))

    def on_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.weights_updated(self.accelerator.unwrap_model(model))

    def on_train_end(self, args, state, control, **kwargs):
        self.release()


class AnnounceStart(TrainerCallback):
    """At the start of training: log `describe()` (one line: the rollout engine and the log-prob path, each with why
    a faster one was not taken), and give the precision guard, if there is one
    by then (`guard()`), the step count training starts from."""

    def __init__(self, describe: Callable[[], str], guard: Callable[[], object]):
        self.describe, self.guard = describe, guard

    def on_train_begin(self, args, state, control, **kwargs):
        logger.info(self.describe())
        guard = self.guard()
        if guard is not None:
            guard.steps = state.global_step


class SyncReference(TrainerCallback):
    """TR-DPO (`sync_ref_model`): after every `ref_model_sync_steps`-th optimizer step, the reference model becomes
    alpha x policy + (1 - alpha) x reference (`mix_parameters_`), parameter by parameter, as TRL does it."""

    def __init__(self, policy: Callable[[], nn.Module], reference: nn.Module | None, accelerator, alpha: float):
        if reference is None:  # LoRA: the reference is the policy (`peft_utils.reference_adapter`)
            raise NotImplementedError(
                "sync_ref_model=True with a PEFT model: the reference is the policy with its adapters disabled, not "
                "a separate model, so there is nothing to synchronize (TRL does not support it either). Use "
                "sync_ref_model=False, or full fine-tuning."
            )
        self.policy, self.reference, self.accelerator, self.alpha = policy, reference, accelerator, alpha

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % args.ref_model_sync_steps == 0:
            self.sync()

    def state(self) -> dict:
        """For the run state: the reference weights, from process 0 only (the same on every process)."""
        if not self.accelerator.is_main_process:
            return {}
        return {"ref_model": self.accelerator.unwrap_model(self.reference).state_dict()}

    def load_state(self, path: str, state: dict | None) -> None:
        """The reference weights process 0 saved with its run state in checkpoint `path`, so that a resumed run mixes
        into the same reference as the unbroken one."""
        saved = (state or {}).get("ref_model")
        if saved is None:  # saved by process 0 only
            saved = (load_run_state(path, 0, self.accelerator.device) or {}).get("ref_model")
        if saved is None:
            logger.warning(
                f"{path} holds no reference weights (sync_ref_model): the reference restarts from the initial model, "
                "so the resumed run does not repeat the original one exactly."
            )
            return
        self.accelerator.unwrap_model(self.reference).load_state_dict(saved)

    def sync(self) -> None:
        """Reference <- alpha x policy + (1 - alpha) x reference, in place. Under DeepSpeed ZeRO-3 the shards are
        gathered and process 0 mixes them (as TRL does)."""
        policy = self.accelerator.unwrap_model(self.policy())
        reference = self.accelerator.unwrap_model(self.reference)
        targets, sources = list(reference.parameters()), list(policy.parameters())
        if is_zero3(self.accelerator):
            import deepspeed

            with deepspeed.zero.GatheredParameters(targets + sources, modifier_rank=0):
                if self.accelerator.is_main_process:
                    mix_parameters_(targets, sources, self.alpha)
        else:
            mix_parameters_(targets, sources, self.alpha)
