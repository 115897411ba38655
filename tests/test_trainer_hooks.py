"""The private `transformers.Trainer` methods grpo_hf relies on are checked at import (`grpo_hf.trainer_hooks`):
the list is complete, the installed Trainer has them, and a Trainer that renamed one is refused, naming it."""

import inspect

import pytest
import transformers
from transformers import Trainer

from grpo_hf import AsyncGRPOTrainer, GRPOTrainer
from grpo_hf.trainer_hooks import TRAINER_HOOKS, check_trainer_hooks, trainer_hook_problems


def _overridden(trainer_class: type) -> set[str]:
    """The private methods grpo_hf's classes in `trainer_class`'s MRO define over a Trainer method of that name."""
    names = set()
    for cls in trainer_class.__mro__:
        if cls.__module__.startswith("grpo_hf"):
            names |= {name for name in vars(cls) if name.startswith("_") and not name.startswith("__")}
    return {name for name in names if hasattr(Trainer, name)}


@pytest.mark.parametrize("trainer_class", [GRPOTrainer, AsyncGRPOTrainer])
def test_every_trainer_method_grpo_hf_overrides_is_checked(trainer_class):
    assert _overridden(trainer_class) <= set(TRAINER_HOOKS)


def test_every_private_trainer_method_grpo_hf_calls_is_checked():
    import grpo_hf

    called = set()
    for module in (grpo_hf.trainer, grpo_hf.producer, grpo_hf.checkpoint):
        source = inspect.getsource(module)
        called |= {name for name in TRAINER_HOOKS if f"._{name[1:]}(" in source}
        for token in set(source.replace("(", " ").split()):
            name = token.rsplit(".", 1)[-1]
            if token.startswith(("self._", "super()._")) and hasattr(Trainer, name) and not name.startswith("__"):
                assert name in TRAINER_HOOKS or not callable(getattr(Trainer, name)), f"{module.__name__}: {name}"
    assert {"_get_collator_with_removed_columns", "_get_num_items_in_batch"} <= called


def test_the_installed_trainer_has_every_hook():
    assert trainer_hook_problems() == []
    check_trainer_hooks()


def test_a_trainer_that_renamed_a_hook_is_refused_by_name():
    class Renamed(Trainer):
        _get_grad_norm = None

        def _get_dataloader(self, dataset, name, batch_size, sampler_fn=None, is_training=False):
            return None

    problems = trainer_hook_problems(Renamed)
    assert problems == [
        "Trainer._get_dataloader takes (dataset, name, batch_size, sampler_fn, is_training), not (dataset, "
        "description, batch_size, sampler_fn, is_training, ...)",
        "Trainer._get_grad_norm is gone",
    ]
    with pytest.raises(ImportError, match=rf"transformers {transformers.__version__}: Trainer\._get_dataloader"):
        check_trainer_hooks(Renamed)
