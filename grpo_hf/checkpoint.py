"""Checkpoints that are whole or absent, and the trainer state that makes a resume exact.

- **Atomic saves.** `Trainer` writes a checkpoint file by file, so a kill half-way would leave a
  `checkpoint-N` that looks like any other. The trainer writes it under `output_dir/.saving/`
  and renames it into place when every process has written its part (`publish`): a directory
  named `checkpoint-N` is complete.
- **Resume picks a complete checkpoint.** `last_complete_checkpoint` skips, with a warning, any
  `checkpoint-N` that lacks the files a resume reads (one written by another tool, or by a run
  killed while saving before this scheme), and takes the newest complete one.
- **The run state.** What `Trainer` does not save but a GRPO step depends on, one file per process
  (`RUN_STATE`): the micro-step inside the generation batch, the buffered rollout (completions,
  advantages, old and reference log-probs), the token count and the metrics not yet logged. With
  Trainer's own state (weights, optimizer, scheduler, RNG, step, epoch) it makes a resumed run
  repeat the uninterrupted one exactly, wherever the checkpoint falls.
- **A final model, always.** Under FSDP with a sharded state dict (accelerate's FSDP2 default), `Trainer.save_model`
  writes nothing; here it gathers the full weights to process 0, one tensor at a time, and writes a model that
  `from_pretrained` loads (or the LoRA adapter). Checkpoints stay sharded, for resuming.
- **Stopping cleanly.** `StopRequest`: on SIGUSR1, SIGTERM or Ctrl-C the trainer finishes the step, saves and
  stops (`stopped_by` says which signal), so a preempted run loses nothing even between `save_steps`; a script then
  exits with `STOPPED_EXIT_CODE`, which a batch script reads as "requeue me".
- **Resume by itself.** `resume_from_checkpoint=True` (or 'true', 'last': `normalize_resume`) is the newest complete
  checkpoint, or a fresh run when there is none, so one command starts a run and continues it after a requeue.

`AtomicCheckpoints` is the `Trainer` mixin that puts these together; `GRPOTrainer` supplies its run state.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import tempfile
import threading
from typing import Any

import safetensors
import torch
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from grpo_hf.parallel import name_lost_peers, start_heartbeat, watching_peers
from grpo_hf.trainer_hooks import check_trainer_hooks

logger = logging.getLogger(__name__)
# GRPOTrainer (this module's AtomicCheckpoints among its bases) overrides private Trainer methods: still there?
check_trainer_hooks()

STAGING_DIR = ".saving"
RUN_STATE = "grpo_hf_state_rank{rank}.pt"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
_ADAPTERS = ("adapter_model.safetensors", "adapter_model.bin")


def check_writable(output_dir: str) -> None:
    """Create `output_dir` if needed and write a file in it: fail at start-up, not at the first save hours in."""
    try:
        os.makedirs(output_dir, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=output_dir, prefix=".write-test-"):
            pass
    except OSError as error:
        raise ValueError(
            f"output_dir={output_dir!r} is not a writable directory ({error.strerror or error}): checkpoints, logs "
            "and the final model go there. Pass a directory you can write to, or fix its permissions."
        ) from error


def missing_files(checkpoint: str) -> list[str]:
    """What a resume needs from `checkpoint` and it lacks: the trainer state and the weights (or adapters)."""
    missing = []
    if not os.path.isfile(os.path.join(checkpoint, "trainer_state.json")):
        missing.append("trainer_state.json")
    names = set(os.listdir(checkpoint)) if os.path.isdir(checkpoint) else set()
    deepspeed = any(name.startswith("global_step") for name in names)
    if not (names & set(_WEIGHTS + _ADAPTERS)) and not deepspeed and not any("fsdp" in n for n in names):
        missing.append("model weights")
    return missing


def last_complete_checkpoint(output_dir: str) -> str | None:
    """The newest `checkpoint-N` of `output_dir` that a resume can read; newer incomplete ones are skipped with a
    warning naming what they lack."""
    if not os.path.isdir(output_dir):
        return None
    steps = sorted(
        (int(match.group(1)), name) for name in os.listdir(output_dir) if (match := _CHECKPOINT.match(name))
    )
    for _, name in reversed(steps):
        path = os.path.join(output_dir, name)
        if missing := missing_files(path):
            logger.warning(
                f"Skipping {path}: it is incomplete (no {', '.join(missing)}), e.g. a run killed while saving it. "
                "Resuming from the newest complete checkpoint instead; delete the directory to silence this."
            )
            continue
        return path
    return None


RESUME_LAST = ("true", "last")
"""`resume_from_checkpoint` values (any case) that mean the newest complete checkpoint of `output_dir`, as `True`
does: what a command line passes (`--resume_from_checkpoint true`)."""


def normalize_resume(resume_from_checkpoint: str | bool | None) -> str | bool | None:
    """True for `True`, 'true' or 'last'; None for `False`, 'false', 'none' or ''; a path otherwise."""
    if isinstance(resume_from_checkpoint, str):
        word = resume_from_checkpoint.strip().lower()
        if word in RESUME_LAST:
            return True
        if word in ("false", "none", ""):
            return None
        return resume_from_checkpoint
    if resume_from_checkpoint is True:
        return True
    return None if resume_from_checkpoint in (None, False) else resume_from_checkpoint


def resolve_resume(resume_from_checkpoint: str | bool | None, output_dir: str) -> str | None:
    """`Trainer.train`'s argument -> a checkpoint path. True ('true', 'last') means the newest complete checkpoint
    in `output_dir`, or a fresh run (None) when there is none: the same command starts a run and continues it."""
    resume_from_checkpoint = normalize_resume(resume_from_checkpoint)
    if resume_from_checkpoint is True:
        found = last_complete_checkpoint(output_dir)
        if found is None:
            logger.info(f"resume_from_checkpoint: output_dir={output_dir!r} holds no complete checkpoint; starting.")
        return found
    if resume_from_checkpoint is None:
        return None
    if not os.path.isdir(resume_from_checkpoint):
        raise ValueError(
            f"resume_from_checkpoint={resume_from_checkpoint!r} is not a directory. Pass a checkpoint-N directory, "
            "or true (also 'last') for the newest complete checkpoint of output_dir."
        )
    if missing := missing_files(resume_from_checkpoint):
        raise ValueError(
            f"resume_from_checkpoint={resume_from_checkpoint!r} is incomplete (no {', '.join(missing)}). Pass "
            "resume_from_checkpoint=True to take the newest complete checkpoint of output_dir."
        )
    return resume_from_checkpoint


def staging_run_dir(run_dir: str) -> str:
    return os.path.join(run_dir, STAGING_DIR)


def publish(staged: str, final: str) -> None:
    """Move the fully written checkpoint `staged` to `final` (replacing an older one of the same step)."""
    if os.path.isdir(final):
        shutil.rmtree(final)
    os.replace(staged, final)
    try:  # the staging directory is left only when empty
        os.rmdir(os.path.dirname(staged))
    except OSError:
        pass


def _to(value: Any, device: torch.device | str) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {key: _to(item, device) for key, item in value.items()}
    if isinstance(value, list):
        return [_to(item, device) for item in value]
    return value


def saved_weight_names(checkpoint: str) -> set[str] | None:
    """The names of the weights in `checkpoint`'s safetensors file (or index); None when it has neither."""
    single, index = os.path.join(checkpoint, "model.safetensors"), os.path.join(checkpoint, _WEIGHTS[1])
    if os.path.isfile(single):
        with safetensors.safe_open(single, framework="pt") as weights:
            return set(weights.keys())
    if os.path.isfile(index):
        with open(index) as file:
            return set(json.load(file)["weight_map"])
    return None


def load_converted_weights(checkpoint: str, model: torch.nn.Module) -> bool:
    """Load `checkpoint`'s weights into `model` as `from_pretrained` reads them, where the checkpoint names weights
    the model does not have and lacks some it has; False (nothing done) otherwise, or for a PEFT model (its
    checkpoint holds the adapters alone).

    transformers 5 writes a Mixture-of-Experts model in the Hub's layout, one tensor per expert, through its weight
    conversion (`save_pretrained`), and `Trainer._load_from_checkpoint` reads a checkpoint with a plain
    `load_state_dict(strict=False)`, which finds none of the fused expert weights (`experts.gate_up_proj`,
    `experts.down_proj`) and leaves them as they were before the resume, with a warning (transformers issue 48805):
    a resumed MoE run trained different experts from the checkpoint's. `from_pretrained` converts them back."""
    saved = saved_weight_names(checkpoint)
    own = set(model.state_dict())
    if saved is None or hasattr(model, "peft_config") or not (saved - own and own - saved):
        return False
    weights = model.state_dict()
    loaded = type(model).from_pretrained(checkpoint, dtype=next(iter(weights.values())).dtype).state_dict()
    missing = sorted(own - set(loaded))
    if missing:
        raise RuntimeError(
            f"{checkpoint} does not hold {missing[:5]} ({len(missing)} weights of {type(model).__name__}), not even "
            "through transformers' conversion of its layout: it was written for another model. Resume from a "
            "checkpoint of this model."
        )
    with torch.no_grad():
        for name, tensor in weights.items():
            tensor.copy_(loaded[name])
    logger.info(
        "Loaded %s's weights through transformers' layout conversion (%d renamed)", checkpoint, len(own - saved)
    )
    return True


def save_run_state(checkpoint: str, rank: int, state: dict[str, Any]) -> None:
    torch.save(_to(state, "cpu"), os.path.join(checkpoint, RUN_STATE.format(rank=rank)))


def load_run_state(checkpoint: str, rank: int, device: torch.device) -> dict[str, Any] | None:
    """The run state this process saved in `checkpoint`, on `device`; None for a checkpoint without one."""
    path = os.path.join(checkpoint, RUN_STATE.format(rank=rank))
    if not os.path.isfile(path):
        return None
    return _to(torch.load(path, map_location="cpu", weights_only=True), device)


STOPPED_EXIT_CODE = 75
"""The exit status of a run that a stop signal ended after its checkpoint: "stopped, requeue me", not "done" (0)
nor "failed" (anything else). 75 is sysexits.h's EX_TEMPFAIL ("try again later"). `recipes/gsm8k.py` exits with it;
`recipes/slurm/grpo.sbatch` requeues the job on it."""


def nested_samplers(loader, depth: int = 6) -> list[Any]:
    """Every sampler with a `set_epoch` under a data loader, through its `batch_sampler` / `sampler` wrappers."""
    found, frontier = [], [loader]
    for _ in range(depth):
        frontier = [
            child
            for item in frontier
            for child in (getattr(item, "batch_sampler", None), getattr(item, "sampler", None))
            if child is not None and child is not item
        ]
        found += [child for child in frontier if hasattr(child, "set_epoch") and all(child is not f for f in found)]
    return found


class StopRequest:
    """SIGUSR1 (what a batch script asks SLURM to send before the time limit), SIGTERM (a scheduler's preemption
    notice) or a first Ctrl-C during `train`: finish the optimizer step, save a checkpoint and stop, instead of dying
    with everything since the last `save_steps` lost. A second Ctrl-C interrupts at once. Outside the main thread
    (where handlers cannot be set) it does nothing.

    The handler only records the signal, so whatever the process is doing when it lands (a rollout, a request to a
    vLLM server, a weight push, a collective) goes on to the end of the step: Python resumes an interrupted system
    call after the handler returns (PEP 475)."""

    SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.received: str | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum, frame) -> None:
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = signal.Signals(signum).name
        logger.warning(f"{self.received}: finishing this optimizer step, saving a checkpoint and stopping.")

    def __enter__(self) -> StopRequest:
        self.received = None  # armed anew for each `train`
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()


class AtomicCheckpoints:
    """A `transformers.Trainer` mixin (list it before `Trainer`): whole-or-absent checkpoints with a run state per
    process, resume from the newest complete checkpoint, and a clean stop on SIGUSR1 / SIGTERM / Ctrl-C.

    The subclass returns its run state from `_run_state()` and restores it in `_load_run_state(path, state)`
    (`state` None: the checkpoint has none for this number of processes); it stops at a step end when
    `stop_request.received` is set (`callbacks.StopTogether`).
    """

    _staging_dir: str | None = None  # set while a checkpoint is written: Trainer's output_dir for it

    def __init__(self, *args, **kwargs):
        self.stop_request = StopRequest()  # armed during `train`
        super().__init__(*args, **kwargs)

    def _run_state(self) -> dict[str, Any]:
        return {}

    def _load_run_state(self, path: str, state: dict[str, Any] | None) -> None:
        pass

    def _saved_run_state(self, path: str) -> dict[str, Any] | None:
        """This process's run state in checkpoint `path`; None, with a warning, when it has none written by this
        number of processes (the buffered rollout is cut per process)."""
        accelerator = self.accelerator
        state = load_run_state(path, accelerator.process_index, accelerator.device)
        if state is not None and state.get("num_processes") == accelerator.num_processes:
            return state
        logger.warning(
            f"{path} has no grpo_hf run state ({RUN_STATE.format(rank=accelerator.process_index)}): it was not "
            "written by this version of grpo_hf, or by another number of processes. Training resumes from its "
            "weights with a fresh rollout, so it does not repeat the original run exactly."
        )
        return None

    def _run_state_to_save(self) -> dict[str, Any]:
        return {"num_processes": self.accelerator.num_processes, **self._run_state()}

    @property
    def stopped_by(self) -> str | None:
        """The signal that stopped the last `train` after its checkpoint ('SIGUSR1', 'SIGTERM', 'SIGINT'), or None
        when it ran to its end: a caller skips its end-of-training work and exits with `STOPPED_EXIT_CODE`."""
        return self.stop_request.received

    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None, ignore_keys_for_eval=None, **kwargs):
        """`Trainer.train`. `output_dir` is checked for writing again; `resume_from_checkpoint=True` (or 'true',
        'last'; without the argument, `args.resume_from_checkpoint`) takes the newest *complete* checkpoint, or
        starts afresh when there is none; the run state is restored with Trainer's, so the resumed run repeats the
        unbroken one exactly."""
        if self.args.should_save:  # checked at construction too; it may have changed since
            check_writable(self.args.output_dir)
        if resume_from_checkpoint is None:
            resume_from_checkpoint = self.args.resume_from_checkpoint
        resume = resolve_resume(resume_from_checkpoint, self.args.output_dir)
        if resume is not None:
            self._load_run_state(resume, self._saved_run_state(resume))
        start_heartbeat(self.accelerator)  # so that a process that dies without a word is named by the others
        with self.stop_request, watching_peers(self.args.fault_timeout):  # a silent peer ends this process
            try:
                output = super().train(
                    resume_from_checkpoint=resume, trial=trial, ignore_keys_for_eval=ignore_keys_for_eval, **kwargs
                )
            except Exception as error:
                if lost := name_lost_peers(error):
                    logger.error(f"A process of this run is gone: {lost}")
                    raise RuntimeError(f"Training failed because a process of this run is gone: {lost}") from error
                raise
        if self.stop_request.received:
            logger.warning(
                f"Training stopped by {self.stop_request.received} after step {self.state.global_step}, checkpoint "
                "saved: resume with trainer.train(resume_from_checkpoint=True)."
            )
        return output

    def get_resumed_dataloader(self, dataloader, num_batches: int):
        """Trainer's (accelerate's `skip_first_batches`), whose `set_epoch` (Trainer calls it next) reaches the sampler
        however deep it sits. On several processes the skipped loader holds `SkipBatchSampler(BatchSamplerShard(
        BatchSampler(sampler)))`, a level deeper than Trainer and accelerate look, so a run resumed inside epoch k >= 1
        read that epoch's rest in epoch 0's prompt order. (Trainer calls this hook from transformers 5.2x on.)"""
        skipped = super().get_resumed_dataloader(dataloader, num_batches)
        set_epoch = skipped.set_epoch

        def set_epoch_everywhere(epoch: int) -> None:
            set_epoch(epoch)
            for sampler in nested_samplers(skipped):
                sampler.set_epoch(epoch)

        skipped.set_epoch = set_epoch_everywhere
        return skipped

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """`Trainer.save_model`; under FSDP with a sharded state dict, where Trainer writes nothing (checkpoints hold
        the shards), the full model is gathered and written all the same (`accelerator.get_state_dict`: process 0
        gathers one tensor at a time into CPU memory, the others keep none), or the LoRA adapter of a PEFT model."""
        plugin = getattr(self.accelerator.state, "fsdp_plugin", None)
        if _internal_call or plugin is None or "FULL_STATE_DICT" in str(plugin.state_dict_type):
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        state_dict = self.accelerator.get_state_dict(self.model)  # every process takes part in the gather
        self._save(output_dir, state_dict=state_dict)
        if self.args.should_save:
            logger.info(
                f"Saved the full model gathered from the FSDP shards ({plugin.state_dict_type}) to {output_dir}"
            )

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """`Trainer._load_from_checkpoint`, then the weights it leaves out of a model whose checkpoint is written in
        another layout (`load_converted_weights`: a Mixture-of-Experts model's experts)."""
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        self._load_converted_weights(resume_from_checkpoint)

    def _load_best_model(self) -> None:
        """`Trainer._load_best_model` (`load_best_model_at_end`), then the weights it leaves out as resume does: it
        reads the best checkpoint with the same plain `load_state_dict`, so an MoE model kept its last experts."""
        super()._load_best_model()
        self._load_converted_weights(self.state.best_model_checkpoint)

    def _load_converted_weights(self, checkpoint: str) -> None:
        """`load_converted_weights` into the unwrapped model; not under FSDP or DeepSpeed (they load their own)."""
        if not (self.is_fsdp_enabled or self.is_deepspeed_enabled):
            load_converted_weights(checkpoint, self.accelerator.unwrap_model(self.model))

    def _get_output_dir(self, trial) -> str:
        return self._staging_dir or super()._get_output_dir(trial)

    def _checkpoint_path(self, trial) -> str:
        return os.path.join(self._get_output_dir(trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")

    def _save_checkpoint(self, model, trial) -> None:
        """Trainer's checkpoint, plus this process's run state, written under `output_dir/.saving/` and renamed
        into place once every process has written its part: a `checkpoint-N` directory is always complete."""
        accelerator, should_save = self.accelerator, self.args.should_save
        if self.args.push_to_hub:  # the Hub upload reads the directory Trainer wrote: keep Trainer's layout
            super()._save_checkpoint(model, trial)
            save_run_state(self._checkpoint_path(trial), accelerator.process_index, self._run_state_to_save())
            return
        final = self._checkpoint_path(trial)
        run_dir, name = os.path.split(final)
        staging = staging_run_dir(run_dir)
        staged = os.path.join(staging, name)
        if should_save and os.path.isdir(staged):  # left by a run killed while saving
            shutil.rmtree(staged)
        accelerator.wait_for_everyone()
        self._staging_dir = staging
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._staging_dir = None
        os.makedirs(staged, exist_ok=True)
        save_run_state(staged, accelerator.process_index, self._run_state_to_save())
        accelerator.wait_for_everyone()
        if should_save:
            best = self.state.best_model_checkpoint
            if best is not None and best.startswith(staging + os.sep):  # Trainer recorded the staged path
                self.state.best_model_checkpoint = os.path.join(run_dir, os.path.basename(best))
                self.state.save_to_json(os.path.join(staged, "trainer_state.json"))
            publish(staged, final)
            rotate_checkpoints(run_dir, self.args.save_total_limit, self.state.best_model_checkpoint, use_mtime=True)
        accelerator.wait_for_everyone()
