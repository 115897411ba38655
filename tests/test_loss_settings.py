"""`LossSettings`: the one home of the loss's settings. The keyword `grpo_loss` and the settings form
`grpo_loss_with` compute the same loss bit for bit; the settings are frozen, refuse impossible values with the
messages `grpo_loss` and `check_loss_settings` give, and `GRPOConfig` builds them once."""

import dataclasses
import inspect
import itertools
from functools import partial

import pytest
import torch
from conftest import tiny_run_args
from oracle import make_batch

from grpo_hf.core import (
    ALL_LOSS_TYPES,
    CLIPPED_LOSS_TYPES,
    IMPORTANCE_SAMPLING_LEVELS,
    LOSS_VARIANTS,
    LossSettings,
    check_loss_settings,
    group_advantages,
    grpo_loss,
    grpo_loss_with,
)
from grpo_hf.core.losses import _clipped_surrogate

# Every knob away from its default at least once, on top of each loss type x importance-sampling level.
KNOBS = [
    dict(),
    dict(beta=0.0),
    dict(epsilon=0.1, epsilon_high=0.3, delta=1.5, use_bias_correction_kl=True, off_policy_mask_threshold=0.5),
    dict(sapo_temperature_pos=0.7, sapo_temperature_neg=1.3, vespo_k_pos=1.5, vespo_lambda_neg=2.5, epsilon_high=4.0),
]


def _runs(loss_type, level):
    return not (level == "sequence_sum" and loss_type != "grpo")


@pytest.mark.parametrize(
    "loss_type, level",
    [(t, level) for t, level in itertools.product(ALL_LOSS_TYPES, IMPORTANCE_SAMPLING_LEVELS) if _runs(t, level)],
)
def test_keyword_form_and_settings_form_agree_exactly(loss_type, level):
    logps, old_logps, ref_logps, advantages, mask = make_batch()
    for knobs in KNOBS:
        kwargs = dict(loss_type=loss_type, importance_sampling_level=level, max_completion_length=9, **knobs)
        results = []
        for form in ("keywords", "settings"):
            x = logps.detach().clone().requires_grad_(True)
            if form == "keywords":
                loss, metrics = grpo_loss(x, old_logps, ref_logps, advantages, mask, num_items_in_batch=13, **kwargs)
            else:
                settings = LossSettings(**kwargs)
                loss, metrics = grpo_loss_with(x, old_logps, ref_logps, advantages, mask, settings, num_items=13)
            loss.backward()
            results.append((loss.detach(), x.grad, metrics))
        (loss_a, grad_a, metrics_a), (loss_b, grad_b, metrics_b) = results
        assert torch.equal(loss_a, loss_b) and torch.equal(grad_a, grad_b), knobs
        assert metrics_a == metrics_b and metrics_a.keys() == metrics_b.keys()


def test_settings_form_takes_the_policy_mask_and_sampling_weight_like_the_keyword_form():
    logps, old_logps, ref_logps, advantages, mask = make_batch()
    policy_mask = torch.rand(mask.shape, generator=torch.Generator().manual_seed(1)) > 0.4  # [N, T]
    weight = torch.rand(mask.shape[0], 1, generator=torch.Generator().manual_seed(2), dtype=logps.dtype)  # [N, 1]
    extra = dict(policy_mask=policy_mask, sampling_weight=weight)
    by_keywords = grpo_loss(logps, old_logps, ref_logps, advantages, mask, loss_type="dapo", **extra)
    by_settings = grpo_loss_with(
        logps, old_logps, ref_logps, advantages, mask, LossSettings(loss_type="dapo"), **extra
    )
    assert torch.equal(by_keywords[0], by_settings[0]) and by_keywords[1] == by_settings[1]


def test_the_keyword_form_takes_exactly_the_settings_and_the_per_call_tensors():
    keywords = [
        name
        for name, parameter in inspect.signature(grpo_loss).parameters.items()
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY
    ]
    per_call = {"num_items_in_batch", "policy_mask", "sampling_weight", "off_policy_logps"}
    assert set(keywords) - per_call == set(LossSettings.field_names())
    defaults = {f.name: f.default for f in dataclasses.fields(LossSettings)}
    assert {name: inspect.signature(grpo_loss).parameters[name].default for name in defaults} == defaults


def test_settings_are_frozen():
    settings = LossSettings()
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.beta = 0.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.loss_type = "dapo"
    assert settings == LossSettings() and hash(settings) == hash(LossSettings())


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(loss_type="ppo"), "loss_type must be one of 'grpo', 'bnpo', 'dr_grpo', 'dapo', .*'vespo'"),
        (dict(importance_sampling_level="seq"), "importance_sampling_level must be one of 'token', 'sequence'"),
        (dict(loss_type="sapo", importance_sampling_level="sequence_sum"), "sequence_sum.*loss_type='grpo'"),
        (dict(loss_type="bnpo", importance_sampling_level="sequence_sum"), "loss_type='bnpo'"),
        (dict(loss_type="sapo", sapo_temperature_neg=0.0), "must be > 0: SAPO's gate"),
        (dict(loss_type="cispo", epsilon_high=0.0), "caps the importance weight at epsilon_high=0.0, which must be"),
        (dict(loss_type="dr_grpo"), "max_completion_length"),
        (dict(beta=-0.1), r"beta=-0.1 must be >= 0"),
        (dict(epsilon=-0.1), r"epsilon=-0.1 must be >= 0"),
        (dict(epsilon=0.2, epsilon_high=0.1), r"epsilon_high=0.1 is smaller than epsilon=0.2"),
    ],
)
def test_bad_settings_are_refused_with_one_message_wherever_they_are_built(kwargs, match):
    messages = []
    logps, old_logps, ref_logps, advantages, mask = make_batch()
    for build in (
        lambda: LossSettings(**kwargs),
        lambda: check_loss_settings(**kwargs),
        lambda: grpo_loss(logps, old_logps, ref_logps, advantages, mask, **kwargs),
    ):
        with pytest.raises(ValueError, match=match) as error:
            build()
        messages.append(str(error.value))
    assert len(set(messages)) == 1, messages


def test_warnings_are_the_settings_own_and_check_loss_settings_returns_them():
    settings = LossSettings(loss_type="cispo", delta=4.0)
    assert check_loss_settings(loss_type="cispo", delta=4.0) == settings.warnings()
    assert len(settings.warnings()) == 2  # cispo's cap below 1, delta outside the clip family
    assert LossSettings().warnings() == []


def test_the_settings_know_every_loss_variant_and_its_family():
    assert tuple(LOSS_VARIANTS) == ALL_LOSS_TYPES
    clipped = tuple(name for name, variant in LOSS_VARIANTS.items() if variant.surrogate is _clipped_surrogate)
    assert clipped == CLIPPED_LOSS_TYPES


config = partial(tiny_run_args, preset={})  # GRPOConfig(**overrides), reporting nowhere


def test_the_config_builds_frozen_settings_from_its_fields():
    args = config(loss_type="dapo", epsilon_high=0.28, beta=0.0, max_completion_length=64, delta=4.0)
    settings = args.loss_settings()
    assert settings == LossSettings(loss_type="dapo", epsilon_high=0.28, beta=0.0, max_completion_length=64, delta=4.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.beta = 0.1  # the step's copy cannot change under it
    args.beta = 0.1  # a field set after construction: the next settings built (the trainer's) have it, checked
    assert args.loss_settings().beta == 0.1 and settings.beta == 0.0
    args.epsilon = -1.0
    with pytest.raises(ValueError, match=r"epsilon=-1.0 must be >= 0"):
        args.loss_settings()


def test_config_and_core_report_a_bad_choice_in_the_same_words():
    with pytest.raises(ValueError) as from_config:
        config(scale_rewards="mean")
    with pytest.raises(ValueError) as from_core:
        group_advantages(torch.zeros(4), 2, "mean")
    assert str(from_config.value) == str(from_core.value)
    assert "scale_rewards='mean' is not one of" in str(from_core.value)


def test_the_config_offers_the_choices_the_settings_accept():
    from typing import get_args

    from grpo_hf.config import ImportanceSamplingLevel, LossType

    assert set(get_args(LossType)) == set(ALL_LOSS_TYPES)
    assert set(get_args(ImportanceSamplingLevel)) == set(IMPORTANCE_SAMPLING_LEVELS)
