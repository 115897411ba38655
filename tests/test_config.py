"""GRPOConfig: defaults, derived batch sizes, and the errors a user meets (each names the field)."""

import dataclasses
import logging
from functools import partial

import pytest
from conftest import TRAINING, make_trainer, tiny_run_args

from grpo_hf import GRPOConfig
from grpo_hf.config import TRL_DEFAULTS

config = partial(tiny_run_args, preset={})  # GRPOConfig(**overrides), reporting nowhere


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


def test_the_command_line_help_renders():
    """argparse %-formats help strings: a bare "%" in a field's help breaks `--help` (`python recipes/gsm8k.py`)."""
    from transformers import HfArgumentParser

    text = HfArgumentParser(GRPOConfig).format_help()
    assert "--fp32_master_weights" in text and "--vllm_importance_sampling_clip_max" in text


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


def test_from_trl_defaults_and_the_defaults_that_differ(tmp_path, caplog):
    ours = GRPOConfig(output_dir=str(tmp_path), use_cpu=True)
    differing = ours.defaults_differing_from_trl()
    assert "loss_type='grpo' (TRL: 'dapo')" in differing and "beta=0.04 (TRL: 0.0)" in differing
    assert "gradient_checkpointing=False (TRL: True)" in differing  # declared None, used as False
    assert "gradient_checkpointing" not in " ".join(
        GRPOConfig(output_dir=str(tmp_path), use_cpu=True, gradient_checkpointing=True).defaults_differing_from_trl()
    )
    explicit = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, loss_type="dapo", beta=0.0)
    assert not any(d.startswith(("loss_type=", "beta=")) for d in explicit.defaults_differing_from_trl())
    chosen = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, loss_type="grpo", beta=0.04)  # grpo_hf's, on purpose
    assert not any(d.startswith(("loss_type=", "beta=")) for d in chosen.defaults_differing_from_trl())
    assert "disable_dropout=True (TRL: False)" in chosen.defaults_differing_from_trl()  # still left at grpo_hf's

    trl = GRPOConfig.from_trl_defaults(output_dir=str(tmp_path), use_cpu=True, beta=0.01)  # kwargs still win
    assert (trl.loss_type, trl.beta, trl.disable_dropout, trl.logging_steps) == ("dapo", 0.01, False, 10)
    assert trl.defaults_differing_from_trl() == []

    with caplog.at_level(logging.WARNING, logger="grpo_hf.config"):
        ours.log_defaults_differing_from_trl()
        trl.log_defaults_differing_from_trl()
    lines = [r.getMessage() for r in caplog.records if "differ from TRL" in r.getMessage()]
    assert len(lines) == 1 and "loss_type='grpo' (TRL: 'dapo')" in lines[0] and "beta=0.04 (TRL: 0.0)" in lines[0]
    assert "GRPOConfig.from_trl_defaults(...)" in lines[0] and "Pass a field" in lines[0]


def test_the_command_line_passes_every_field_so_only_the_values_tell(tmp_path):
    """HfArgumentParser builds the config with every field: which were typed is unknown, so a value equal to grpo_hf's
    default counts as left there; `parse_dict` passes only the keys given, which count as chosen."""
    from transformers import HfArgumentParser

    parser = HfArgumentParser(GRPOConfig)
    (typed,) = parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--use_cpu", "--beta", "0.04"])
    assert "beta=0.04 (TRL: 0.0)" in typed.defaults_differing_from_trl()
    (given,) = parser.parse_dict({"output_dir": str(tmp_path), "use_cpu": True, "beta": 0.04})
    assert not any(d.startswith("beta=") for d in given.defaults_differing_from_trl())
    assert "loss_type='grpo' (TRL: 'dapo')" in given.defaults_differing_from_trl()


def test_building_a_trainer_warns_once_about_the_defaults_left_that_differ_from_trls(tmp_path, caplog):
    """Shown at Python's default logging level (a warning), once per trainer built; a field the user set, to TRL's
    value or to grpo_hf's own, is not named; with every differing field set there is no warning at all."""

    def warnings_when_built(**settings):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            make_trainer(tiny_run_args(tmp_path, TRAINING, **settings))
        return [r.getMessage() for r in caplog.records if "Defaults that differ from TRL's" in r.getMessage()]

    (message,) = warnings_when_built()
    assert "loss_type='grpo' (TRL: 'dapo')" in message and "beta=0.04 (TRL: 0.0)" in message
    assert "max_completion_length" not in message  # TRAINING sets it
    for settings in ({"loss_type": "dapo", "beta": 0.0}, {"loss_type": "grpo", "beta": 0.04}):
        (message,) = warnings_when_built(**settings)
        assert "loss_type=" not in message and "beta=" not in message
    everything = {name: getattr(config(), name) for name in TRL_DEFAULTS}  # grpo_hf's values, each set on purpose
    assert warnings_when_built(**everything) == []


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"generation_kwargs": {"max_new_token": 4}}, r"'max_new_token'.*Did you mean 'max_new_tokens'\?"),
        ({"generation_kwargs": {"learning_rate": 1e-5}}, r"'learning_rate', which is not a GenerationConfig field"),
        ({"generation_kwargs": {"temperature": 0.5}}, r"generation_kwargs\['temperature'\]=0.5 differs from"),
        ({"generation_kwargs": {"max_new_tokens": 8}}, r"\['max_new_tokens'\]=8 differs from max_completion_length"),
        ({"generation_kwargs": {"do_sample": False}}, r"generation_kwargs\['do_sample'\]=False decodes greedily"),
        ({"generation_kwargs": {"num_return_sequences": 2}}, r"\['num_return_sequences'\]=2.*num_generations"),
        ({"generation_kwargs": "{top_k: 5}"}, r"generation_kwargs must be a dict or a JSON object string"),
        ({"chat_template_kwargs": "[1]"}, r"chat_template_kwargs must be a dict"),
        ({"model_init_kwargs": "nope"}, r"model_init_kwargs must be a dict or a JSON object string"),
    ],
)
def test_config_only_mistakes_are_refused_when_the_config_is_built(overrides, match):
    """Checks that need only the config run in GRPOConfig(...), not later in the trainer."""
    with pytest.raises(ValueError, match=match):
        config(**overrides)


def test_dict_fields_are_read_once_into_dicts():
    built = config(generation_kwargs='{"top_k": 5}', chat_template_kwargs=None, vllm_kwargs='{"seed": 1}')
    assert built.generation_kwargs == {"top_k": 5} and built.chat_template_kwargs == {}
    assert built.vllm_kwargs == {"seed": 1} and built.model_init_kwargs == {}
    assert built.generation_config_for(0, [1]).top_k == 5


def test_the_step_settings_are_frozen_and_built_from_the_fields():
    built = config(top_entropy_quantile=0.2, entropy_coef=0.01, use_vllm=True, vllm_importance_sampling_clip_max=2.0)
    entropy, correction = built.entropy_settings(), built.sampling_correction()
    assert entropy.masks_tokens and entropy.top_entropy_quantile == 0.2 and entropy.entropy_coef == 0.01
    assert (correction.mode, correction.clip_min, correction.clip_max) == ("sequence_mask", None, 2.0)
    for settings in (built.loss_settings(), entropy, correction):
        with pytest.raises(dataclasses.FrozenInstanceError):
            settings.__setattr__(dataclasses.fields(settings)[0].name, None)


def test_from_trl_defaults_works_without_a_gpu_and_says_why_bf16_is_off(tmp_path, caplog):
    """TRL's bf16 default is "on unless fp16", which TrainingArguments refuses on a machine without a bf16 accelerator
    unless use_cpu=True. from_trl_defaults follows TRL where the machine runs bf16 and turns it off, with a warning
    saying why, where it does not; a bf16 or use_cpu the caller passes is kept (this suite runs on a CPU)."""
    from grpo_hf.config import bf16_accelerator_available

    if bf16_accelerator_available():
        pytest.skip("this machine runs bf16: TRL's default applies as it is")
    with caplog.at_level(logging.WARNING, logger="grpo_hf.config"):
        trl = GRPOConfig.from_trl_defaults(output_dir=str(tmp_path))
    assert trl.bf16 is False and (trl.loss_type, trl.beta) == ("dapo", 0.0)
    (reason,) = [r.getMessage() for r in caplog.records if "from_trl_defaults" in r.getMessage()]
    assert "bf16=False, not TRL's bf16=True" in reason and "use_cpu=True" in reason
    assert trl.defaults_differing_from_trl() == []  # turned off for the machine, not left at grpo_hf's default
    from grpo_hf.async_config import AsyncGRPOConfig  # the same rule

    assert AsyncGRPOConfig.from_trl_defaults(output_dir=str(tmp_path), vllm_server_base_url=None).bf16 is False
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="grpo_hf.config"):
        assert GRPOConfig.from_trl_defaults(output_dir=str(tmp_path), use_cpu=True).bf16 is True  # CPU autocast
        assert GRPOConfig.from_trl_defaults(output_dir=str(tmp_path), bf16=False).bf16 is False
    assert not [r for r in caplog.records if "from_trl_defaults" in r.getMessage()]
