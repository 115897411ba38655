"""grpo_hf is a drop-in for the installed TRL: read `trl.GRPOConfig` and `trl.GRPOTrainer` and compare.

Every field of TRL's config exists in grpo_hf's with TRL's default, every argument of TRL's trainer in grpo_hf's in
the same order, except the entries of two tables, each with its reason, that docs/porting.md shows: the defaults that
differ (`config.TRL_DEFAULTS`) and what grpo_hf does not take yet (`config.TRL_DIFFERENCES`). A TRL release that adds
a field or an argument makes these tests fail until it is handled or listed. TRL's public helper methods that grpo_hf
defines keep TRL's contract: they read only their arguments and the accelerator (TRL's own tests call them on a
`Mock(spec=GRPOTrainer)`).
"""

import dataclasses
import inspect
import re
from pathlib import Path
from unittest.mock import Mock

import torch
import trl
from oracle import naive_quantile_mask

import grpo_hf
from grpo_hf.config import TRL_DEFAULTS, TRL_DIFFERENCES

PORTING = Path(__file__).parent.parent / "docs" / "porting.md"


def default_of(f: dataclasses.Field):
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def test_every_trl_field_exists_with_trls_default(tmp_path):
    ours = {f.name: f for f in dataclasses.fields(grpo_hf.GRPOConfig)}
    theirs = trl.GRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    problems = []
    for f in dataclasses.fields(trl.GRPOConfig):
        if f.name in TRL_DIFFERENCES:
            continue
        if f.name not in ours:
            problems.append(f"{f.name}: missing (TRL's default {default_of(f)!r})")
        elif f.name in TRL_DEFAULTS:  # the table of differing defaults must hold TRL's real value
            if getattr(theirs, f.name) != TRL_DEFAULTS[f.name]:
                problems.append(
                    f"{f.name}: TRL_DEFAULTS says {TRL_DEFAULTS[f.name]!r}, TRL has {getattr(theirs, f.name)!r}"
                )
        elif default_of(ours[f.name]) != default_of(f):
            problems.append(f"{f.name}: ours {default_of(ours[f.name])!r}, TRL's {default_of(f)!r}")
    assert not problems, "GRPOConfig differs from TRL's:\n" + "\n".join(problems)


def test_the_trainer_takes_trls_arguments_in_trls_order():
    theirs = [name for name in inspect.signature(trl.GRPOTrainer.__init__).parameters if name != "self"]
    ours = [name for name in inspect.signature(grpo_hf.GRPOTrainer.__init__).parameters if name != "self"]
    assert ours == theirs


def test_the_tables_list_only_real_differences_and_porting_shows_them():
    trl_fields = {f.name for f in dataclasses.fields(trl.GRPOConfig)}
    trl_arguments = set(inspect.signature(trl.GRPOTrainer.__init__).parameters)
    ours = {f.name for f in dataclasses.fields(grpo_hf.GRPOConfig)}
    for name in TRL_DIFFERENCES:  # a handled entry must leave the table
        assert name in trl_fields | trl_arguments, f"{name} is not TRL's"
        if name in trl_fields:
            assert name not in ours, f"{name} is a field now: remove it from TRL_DIFFERENCES"
    text = PORTING.read_text()
    for name in [*TRL_DEFAULTS, *TRL_DIFFERENCES]:
        assert re.search(rf"^\| `{name}` \|", text, re.M), f"docs/porting.md has no row for `{name}`"


def test_trls_public_methods_need_only_their_arguments_and_the_accelerator():
    """TRL's tests build `Mock(spec=GRPOTrainer)` with an accelerator whose gather and pad_across_processes pass the
    tensor through, and call the methods unbound: grpo_hf's keep working that way."""
    trainer = Mock(spec=grpo_hf.GRPOTrainer)
    trainer.accelerator = Mock()
    trainer.accelerator.gather = lambda tensor: tensor
    trainer.accelerator.pad_across_processes = lambda tensor, dim=0, pad_index=0: tensor
    entropies = torch.tensor([[0.1, 0.9, 0.4, 0.7, 0.6], [0.3, 0.8, 0.2, 5.0, 0.5]])
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 1]])
    for threshold in (0.0, 0.3, 0.5, 0.8, 1.0):
        got = grpo_hf.GRPOTrainer.get_high_entropy_mask(trainer, entropies, mask, threshold)
        assert got.tolist() == naive_quantile_mask(entropies, mask, threshold), threshold
    empty = grpo_hf.GRPOTrainer.get_high_entropy_mask(trainer, entropies, torch.zeros_like(mask), 0.5)
    assert not empty.any()
    advantages, mask = torch.tensor([[-1.0], [1.0]]), torch.ones(2, 3)
    logps, sampling = torch.full((2, 3), -3.0), torch.zeros(2, 3)  # mean log(pi_old / pi) = 3 on both rows
    off_policy = grpo_hf.GRPOTrainer.get_off_policy_mask(advantages, logps, sampling, mask, 1.0)
    assert off_policy.tolist() == [[0.0], [1.0]]  # only the negative-advantage row is dropped


def test_the_checked_methods_are_every_trl_method_grpo_hf_defines_outside_trainers_hooks():
    """The public methods of trl.GRPOTrainer that grpo_hf's class defines, besides Trainer's own hooks (which read
    the trainer's state in TRL too): exactly the ones the test above calls on a Mock."""
    from transformers import Trainer

    defined = {
        attr
        for attr in vars(trl.GRPOTrainer)
        if not attr.startswith("_")
        and callable(getattr(trl.GRPOTrainer, attr))
        and not hasattr(Trainer, attr)
        and attr in vars(grpo_hf.GRPOTrainer)
    }
    assert defined == {"get_high_entropy_mask", "get_off_policy_mask"}
