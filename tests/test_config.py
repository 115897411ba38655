"""GRPOConfig: defaults, derived batch sizes, and the errors a user meets (each names the field)."""

import dataclasses

import pytest

from grpo_hf import GRPOConfig


def config(**overrides) -> GRPOConfig:
    return GRPOConfig(output_dir="unused", report_to="none", **overrides)


def test_defaults_follow_deepseekmath():
    c = config()
    assert (c.loss_type, c.beta, c.epsilon, c.scale_rewards, c.num_generations, c.learning_rate) == (
        "grpo",
        0.04,
        0.2,
        "group",
        8,
        1e-6,
    )
    assert c.epsilon_high is None and c.importance_sampling_level == "token" and c.num_iterations == 1


def test_every_field_has_help():
    own = [f for f in dataclasses.fields(GRPOConfig) if f.name in GRPOConfig.__annotations__]
    assert len(own) > 25
    assert [f.name for f in own if not f.metadata.get("help")] == []


def test_generation_batch_is_derived_from_accumulation():
    c = config(per_device_train_batch_size=8, gradient_accumulation_steps=3)
    assert (c.steps_per_generation, c.generation_batch_size) == (3, 24)
    c = config(per_device_train_batch_size=8, generation_batch_size=32)
    assert c.steps_per_generation == 4


def test_trl_boolean_scale_rewards():
    assert config(scale_rewards=True).scale_rewards == "group"
    assert config(scale_rewards=False).scale_rewards == "none"


@pytest.mark.parametrize(
    "overrides,field",
    [
        (dict(num_generations=1), "num_generations"),
        (dict(per_device_train_batch_size=6, num_generations=4), "num_generations"),
        (dict(generation_batch_size=12, per_device_train_batch_size=8), "generation_batch_size"),
        (dict(generation_batch_size=16, steps_per_generation=2), "steps_per_generation"),
        (dict(importance_sampling_level="sequence_sum", loss_type="dapo"), "loss_type"),
        (dict(epsilon=0.2, epsilon_high=0.1), "epsilon_high"),
        (dict(beta=-0.1), "beta"),
        (dict(temperature=0.0), "temperature"),
        (dict(loss_type="ppo"), "loss_type"),
        (dict(scale_rewards="std"), "scale_rewards"),
        (dict(importance_sampling_level="sentence"), "importance_sampling_level"),
        (dict(reward_error_policy="ignore"), "reward_error_policy"),
        (dict(top_p=0.0), "top_p"),
        (dict(max_completion_length=0), "max_completion_length"),
        (dict(reward_timeout=0), "reward_timeout"),
        (dict(auto_find_batch_size=True), "auto_find_batch_size"),
    ],
)
def test_invalid_settings_name_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        config(**overrides)
