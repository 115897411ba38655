"""The private `transformers.Trainer` methods grpo_hf overrides or calls, checked when its trainer is imported.

`GRPOTrainer` changes the Trainer's behaviour through a few of its private methods (the sampler that keeps a prompt's
completions together, the dataloader of prompts, the gradient norm and clipping that skip a non-finite step, the
atomic checkpoint directory). A release that renames one of them, or its arguments, would leave grpo_hf's override
uncalled and the run silently wrong, so `check_trainer_hooks` compares the installed Trainer with `TRAINER_HOOKS`
when `grpo_hf.checkpoint` (the trainer's first base) is imported, and raises an ImportError that names what changed
and where the tested versions are (docs/versions.md).
"""

from __future__ import annotations

import inspect

import transformers
from transformers import Trainer

TRAINER_HOOKS: dict[str, tuple[str, ...]] = {
    # overridden
    "_set_signature_columns_if_needed": (),
    "_get_train_sampler": ("train_dataset",),
    "_get_eval_sampler": ("eval_dataset",),
    "_get_dataloader": ("dataset", "description", "batch_size", "sampler_fn", "is_training"),
    "_prepare_inputs": ("inputs",),
    "_clip_grad_norm": ("model",),
    "_get_grad_norm": ("model", "grad_norm"),
    "_get_output_dir": ("trial",),
    "_save_checkpoint": ("model", "trial"),
    "_load_from_checkpoint": ("resume_from_checkpoint", "model"),
    "_load_best_model": (),
    # called
    "_get_collator_with_removed_columns": ("data_collator", "description"),
    "_remove_unused_columns": ("dataset", "description"),
    "_save": ("output_dir", "state_dict"),
    "_get_num_items_in_batch": ("batch_samples", "device"),
}
"""Each private Trainer method grpo_hf relies on -> the names of its leading parameters (after self), in order, as
grpo_hf passes them."""


def trainer_hook_problems(trainer_class: type = Trainer) -> list[str]:
    """What differs between `trainer_class` and `TRAINER_HOOKS`: a method missing, or its leading parameters renamed
    or reordered; empty when every hook is as grpo_hf expects."""
    problems = []
    for name, expected in TRAINER_HOOKS.items():
        method = getattr(trainer_class, name, None)
        if not callable(method):
            problems.append(f"Trainer.{name} is gone")
            continue
        parameters = [p.name for p in inspect.signature(method).parameters.values() if p.name != "self"]
        if tuple(parameters[: len(expected)]) != expected:
            problems.append(f"Trainer.{name} takes ({', '.join(parameters)}), not ({', '.join(expected)}, ...)")
    return problems


def check_trainer_hooks(trainer_class: type = Trainer) -> None:
    """Raise ImportError if the installed Trainer lacks a method grpo_hf overrides or calls (`TRAINER_HOOKS`)."""
    problems = trainer_hook_problems(trainer_class)
    if problems:
        raise ImportError(
            f"grpo_hf's trainer does not work with transformers {transformers.__version__}: {'; '.join(problems)}. "
            "Install the versions its suite passed on (`pip install -c requirements/main.lock ...`, or `make "
            "install`); docs/versions.md lists the tested range."
        )
