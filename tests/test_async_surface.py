"""`AsyncGRPOConfig` / `AsyncGRPOTrainer` take TRL 1.16's `trl.experimental.async_grpo` fields and arguments: read the
installed TRL and compare, and run a script in the shape of TRL's own async tests by changing only its import.

TRL's async trainer samples on a vLLM server through NCCL (CUDA only); its tests swap in a stub rollout worker. A
TRL script here keeps its config and trainer calls as they are and samples with grpo_hf's default engine on the CPU:
no server is needed, which is the point of porting it. Tiny models, CPU, offline.
"""

import dataclasses
import inspect
import logging
import re
from pathlib import Path

import pytest
import torch
import trl.experimental.async_grpo as trl_async
from conftest import build_tiny_model, make_trainer, train_logs
from transformers import HfArgumentParser

import grpo_hf
from grpo_hf import AsyncGRPOConfig, AsyncGRPOTrainer, GRPOConfig, GRPOTrainer
from grpo_hf.async_config import IGNORED_FIELDS, TRL_ASYNC_DEFAULTS, TRL_ASYNC_SAME_MEANING
from grpo_hf.async_trainer import refuse_what_the_producer_cannot_run
from grpo_hf.config import config_reference_markdown

PORTING = Path(__file__).parent.parent / "docs" / "porting.md"
CPU = dict(report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True)


def default_of(f: dataclasses.Field):
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


# ---- the config -----------------------------------------------------------------------------------------------------
def test_every_trl_async_field_is_accepted_with_trls_default(tmp_path):
    ours = {f.name: f for f in dataclasses.fields(AsyncGRPOConfig)}
    theirs = trl_async.AsyncGRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    problems = []
    for f in dataclasses.fields(trl_async.AsyncGRPOConfig):
        table = TRL_ASYNC_DEFAULTS if f.name in TRL_ASYNC_DEFAULTS else TRL_ASYNC_SAME_MEANING
        if f.name not in ours:
            problems.append(f"{f.name}: missing (TRL's default {default_of(f)!r})")
        elif f.name in table:  # the tables must hold TRL's real value
            if getattr(theirs, f.name) != table[f.name]:
                problems.append(f"{f.name}: the table says {table[f.name]!r}, TRL has {getattr(theirs, f.name)!r}")
        elif default_of(ours[f.name]) != default_of(f):
            problems.append(f"{f.name}: ours {default_of(ours[f.name])!r}, TRL's {default_of(f)!r}")
    assert not problems, "AsyncGRPOConfig differs from TRL's:\n" + "\n".join(problems)
    assert default_of(ours["max_staleness"]) == 4 and default_of(ours["lr_scheduler_type"]) == "constant"


def test_the_tables_name_real_fields_and_what_trl_does_without_one():
    trl_fields = {f.name for f in dataclasses.fields(trl_async.AsyncGRPOConfig)}
    ours = {f.name for f in dataclasses.fields(AsyncGRPOConfig)}
    assert set(TRL_ASYNC_SAME_MEANING) | set(IGNORED_FIELDS) <= trl_fields
    assert set(IGNORED_FIELDS).isdisjoint({f.name for f in dataclasses.fields(GRPOConfig)})  # new fields only
    # TRL's async trainer has no beta, loss_type or disable_dropout: the table holds what it does (no KL, a token mean)
    assert set(TRL_ASYNC_DEFAULTS) - trl_fields == {"beta", "loss_type", "disable_dropout"}
    assert set(TRL_ASYNC_DEFAULTS) <= ours


def test_from_trl_defaults_starts_from_trls_async_values(tmp_path):
    config = AsyncGRPOConfig.from_trl_defaults(output_dir=str(tmp_path), use_cpu=True, bf16=False, max_steps=1)
    assert (config.loss_type, config.beta, config.max_completion_length, config.ignore_data_skip) == (
        "dapo",
        0.0,
        2048,
        True,
    )
    assert config.bf16 is False  # a keyword wins over the table
    assert config.defaults_differing_from_trl() == []  # bf16=False was passed: a choice, not a default left
    assert "beta=0.04 (TRL: 0.0)" in AsyncGRPOConfig(output_dir=str(tmp_path)).defaults_differing_from_trl()


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"dtype": "fp32"}, "dtype='fp32' is not one of the choices"),
        ({"max_inflight_tasks": 0}, "max_inflight_tasks=0 would let no generation request run"),
        ({"max_inflight_tasks": -2}, "max_inflight_tasks=-2 must be an int >= -1"),
        ({"weight_sync_steps": 0}, "weight_sync_steps=0 must be an int >= 1"),
        ({"queue_maxsize": -1}, "queue_maxsize=-1 must be an int >= 0"),
        ({"fork_threshold_tokens": 1.5}, "fork_threshold_tokens=1.5 must be an int >= 0"),
        ({"token_budget": "4096"}, "token_budget='4096' must be an int"),
        ({"request_timeout": 0}, "request_timeout=0 must be a number of seconds > 0"),
        ({"weight_sync_timeout": -1}, "weight_sync_timeout=-1 must be a number of seconds > 0"),
        ({"heartbeat_stale_after_s": True}, "heartbeat_stale_after_s=True must be a number of seconds > 0"),
        ({"max_staleness": -1}, "max_staleness=-1 must be an int >= 0"),  # GRPOConfig's check, kept
    ],
)
def test_bad_values_of_trls_async_fields_are_refused(settings, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        AsyncGRPOConfig(output_dir="unused", **settings)


def test_dtype_loads_a_path_model_in_float32_unless_model_init_kwargs_says(tmp_path, tokenizer):
    """TRL's `dtype`, default "float32", for a model given as a path; a dtype in `model_init_kwargs` wins (TRL's
    test_model_init_kwargs). GRPOConfig has no such field: it loads the checkpoint's own dtype."""
    path = tmp_path / "tiny"
    build_tiny_model(tokenizer).to(torch.bfloat16).save_pretrained(path)
    tokenizer.save_pretrained(path)

    def dtypes(config_cls, **settings):
        args = config_cls(output_dir=str(tmp_path / "out"), max_steps=1, **CPU, **settings)
        trainer = make_trainer(args, model=str(path), tokenizer=tokenizer, trainer_cls=GRPOTrainer)
        return {p.dtype for p in trainer.model.parameters()}

    assert dtypes(AsyncGRPOConfig) == {torch.float32}
    assert dtypes(AsyncGRPOConfig, model_init_kwargs={"dtype": "bfloat16"}) == {torch.bfloat16}
    assert dtypes(AsyncGRPOConfig, dtype="auto") == {torch.bfloat16}
    assert dtypes(GRPOConfig) == {torch.bfloat16}


def test_ignored_fields_are_named_in_one_warning_per_run(tmp_path, caplog):
    args = AsyncGRPOConfig(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=4,
        max_staleness=0,
        weight_sync_steps=2,
        queue_maxsize=16,
        heartbeat_stale_after_s=60.0,
        request_timeout=600,  # TRL's default: not named
        **CPU,
    )
    with caplog.at_level(logging.WARNING, logger="grpo_hf"):
        trainer = make_trainer(args, trainer_cls=AsyncGRPOTrainer)
        trainer.train()
    warnings = [r.getMessage() for r in caplog.records if "accepted but ignored" in r.getMessage()]
    assert len(warnings) == 1, warnings  # once per run, not per step
    named = re.findall(r"(\w+)=\S+ \(", warnings[0])
    assert named == ["queue_maxsize", "weight_sync_steps", "heartbeat_stale_after_s"]


SERVER = "http://10.1.2.3:8123"


def sampler(config) -> tuple:
    return config.use_vllm, config.vllm_mode, config.rollout_engine, config.vllm_server_base_url


def test_vllm_server_base_url_samples_on_that_server_as_in_trl():
    """TRL's async trainer always samples on the vLLM server at vllm_server_base_url: a URL set here does too. No
    server is reached: the config is resolved, and the producer's check takes it (before any model loads)."""
    server = (True, "server", "vllm", SERVER)
    for settings in ({}, {"use_vllm": True}, {"vllm_mode": "server"}, {"rollout_engine": "vllm"}):
        assert sampler(AsyncGRPOConfig(output_dir="unused", vllm_server_base_url=SERVER, **settings)) == server
    args = HfArgumentParser(AsyncGRPOConfig).parse_args_into_dataclasses(
        ["--output_dir", "unused", "--vllm_server_base_url", SERVER]
    )[0]
    assert sampler(args) == server  # a recipe's command line too
    assert refuse_what_the_producer_cannot_run(args, None) is None
    # no URL: grpo_hf's own engines, no server; GRPOConfig keeps TRL's GRPOConfig meaning (a URL alone changes nothing)
    assert sampler(AsyncGRPOConfig(output_dir="unused")) == (False, "colocate", "auto", None)
    assert sampler(GRPOConfig(output_dir="unused", vllm_server_base_url=SERVER)) == (False, "colocate", "auto", SERVER)
    assert (
        "vllm_server_base_url=None (TRL: 'http://localhost:8000')"
        in AsyncGRPOConfig(output_dir="unused").defaults_differing_from_trl()
    )
    # TRL's defaults: its default URL, so a server there; None opts out
    trl = AsyncGRPOConfig.from_trl_defaults(output_dir="unused", bf16=False)
    assert sampler(trl) == (True, "server", "vllm", "http://localhost:8000")
    assert not AsyncGRPOConfig.from_trl_defaults(output_dir="unused", bf16=False, vllm_server_base_url=None).use_vllm


@pytest.mark.parametrize(
    ("settings", "named", "sampler_named"),
    [
        ({"vllm_mode": "colocate"}, "vllm_mode='colocate'", "a vLLM engine in this process"),
        ({"use_vllm": True, "vllm_mode": "colocate"}, "vllm_mode='colocate'", "a vLLM engine in this process"),
        ({"rollout_engine": "generate"}, "rollout_engine='generate'", "grpo_hf's 'generate' engine"),
        ({"use_model_generate": True}, "use_model_generate=True", "grpo_hf's 'generate' engine"),
        (
            {"use_transformers_continuous_batching": True},
            "use_transformers_continuous_batching=True",
            "grpo_hf's 'continuous_batching' engine",
        ),
        ({"cache_implementation": "static"}, "cache_implementation='static'", "grpo_hf's 'generate' engine"),
    ],
)
def test_a_url_with_another_sampler_is_refused_naming_both(settings, named, sampler_named):
    with pytest.raises(ValueError) as raised:
        AsyncGRPOConfig(output_dir="unused", vllm_server_base_url=SERVER, **settings)
    message = str(raised.value)
    assert message.startswith(f"vllm_server_base_url={SERVER!r} samples the rollouts on the vLLM server at that URL")
    assert f"but {named} asks for {sampler_named}." in message
    assert f"Remove vllm_server_base_url to sample with {sampler_named}, or remove {named}" in message
    AsyncGRPOConfig(output_dir="unused", **settings)  # each setting alone is fine


def test_a_config_at_trls_defaults_warns_of_nothing(tmp_path, caplog):
    args = AsyncGRPOConfig(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, num_generations=2)
    assert args.ignored_fields() == {}
    with caplog.at_level(logging.WARNING, logger="grpo_hf"):
        make_trainer(args, trainer_cls=AsyncGRPOTrainer)
    assert not [r for r in caplog.records if "accepted but ignored" in r.getMessage()]


# ---- the trainer ----------------------------------------------------------------------------------------------------
def test_the_trainer_takes_trls_arguments_in_trls_order():
    theirs = [name for name in inspect.signature(trl_async.AsyncGRPOTrainer.__init__).parameters if name != "self"]
    parameters = list(inspect.signature(AsyncGRPOTrainer.__init__).parameters.values())[1:]
    assert [p.name for p in parameters[: len(theirs)]] == theirs
    extra = parameters[len(theirs) :]  # GRPOTrainer's other arguments, after TRL's and by keyword only
    assert {p.name for p in extra} == {
        "eval_dataset",
        "reward_processing_classes",
        "quantization_config",
        "rollout_func",
    }
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in extra)
    ours = set(inspect.signature(GRPOTrainer.__init__).parameters)
    assert {p.name for p in parameters} - ours == {"rollout_worker", "weight_transfer"}


@pytest.mark.parametrize(
    ("argument", "message"),
    [
        ("rollout_worker", "grpo_hf has no separate rollout worker"),
        ("weight_transfer", "grpo_hf keeps the sampler's weights up to date itself"),
    ],
)
def test_trls_rollout_worker_and_weight_transfer_are_refused_with_what_to_use(argument, message):
    class Stub:
        pass

    with pytest.raises(ValueError, match=message) as raised:
        AsyncGRPOTrainer("unused", None, **{argument: Stub()})
    assert f"{argument}=Stub(...)" in str(raised.value) and f"Remove {argument}" in str(raised.value)


@pytest.mark.parametrize(
    ("settings", "rollout_func", "reason"),
    [
        ({"use_vllm": True, "vllm_mode": "colocate"}, None, "vLLM in colocate mode shares this process"),
        ({}, lambda prompts, trainer: {}, "a rollout_func samples with the trainer's own model"),
    ],
)
def test_what_the_producer_cannot_run_is_refused_naming_grpo_trainer(settings, rollout_func, reason):
    """Even at max_staleness=0 (the producer takes turns with the trainer), before any model loads: "unused" is not
    a model anyone could load."""
    args = AsyncGRPOConfig(output_dir="unused", max_staleness=0, report_to="none", **settings)
    with pytest.raises(ValueError, match="producer thread at every max_staleness") as raised:
        AsyncGRPOTrainer("unused", None, args, rollout_func=rollout_func)
    assert reason in str(raised.value) and "use GRPOTrainer, which runs no producer at max_staleness=0" in str(
        raised.value
    )


def test_trls_config_object_is_refused_with_the_import_to_change(tmp_path):
    theirs = trl_async.AsyncGRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    with pytest.raises(
        TypeError, match=r"args is trl\..*AsyncGRPOConfig, not grpo_hf's config: .*from grpo_hf import"
    ):
        AsyncGRPOTrainer("unused", None, theirs)


def test_no_args_is_trls_default_config(tmp_path, tokenizer, monkeypatch):
    """TRL's test_init_minimal: model, reward and dataset only; the config is AsyncGRPOConfig('<name>-AsyncGRPO')."""
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "models" / "tiny-llama"
    build_tiny_model(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    trainer = AsyncGRPOTrainer(model=str(path), reward_funcs=char_code_reward, train_dataset=conversational_dataset())
    assert type(trainer.args) is AsyncGRPOConfig and trainer.args.output_dir == "tiny-llama-AsyncGRPO"
    assert trainer.args.max_staleness == 4


def test_the_async_trainer_is_grpo_trainer_with_the_configs_max_staleness(tmp_path):
    """Same settings, same seed: AsyncGRPOTrainer at max_staleness=0 runs its producer thread (taking turns with the
    trainer, docs/async.md) and trains GRPOTrainer's parameters, with GRPOTrainer's logs besides its async/ ones."""
    settings = dict(
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        max_steps=2,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        max_staleness=0,
        rollout_engine="loop",
        seed=0,
        **CPU,
    )
    runs = []
    for config_cls, trainer_cls in ((GRPOConfig, GRPOTrainer), (AsyncGRPOConfig, AsyncGRPOTrainer)):
        trainer = make_trainer(
            config_cls(output_dir=str(tmp_path / config_cls.__name__), **settings), trainer_cls=trainer_cls
        )
        trainer.train()
        runs.append((trainer, train_logs(trainer)))
    (sync, sync_logs), (async_, async_logs) = runs
    assert type(async_) is AsyncGRPOTrainer and async_.args.max_staleness == 0
    for (name, param), other in zip(sync.model.named_parameters(), async_.model.parameters(), strict=True):
        assert torch.equal(param, other), name
    assert all(log["async/staleness_max"] == 0.0 for log in async_logs)  # the producer ran
    assert not [k for log in sync_logs for k in log if k.startswith("async/")]  # GRPOTrainer at 0 runs none
    timing = ("train_runtime", "train_samples_per_second", "train_steps_per_second")
    strip = [
        [{k: v for k, v in log.items() if k not in timing and not k.startswith("async/")} for log in logs]
        for logs in (sync_logs, async_logs)
    ]
    assert len(strip[0]) == 2 and strip[0] == strip[1]


# ---- a TRL async script, its import changed -------------------------------------------------------------------------
def char_code_reward(completions, **kwargs):
    """A TRL async reward: conversational completions, extra columns as keyword arguments."""
    return [sum(map(ord, completion[0]["content"])) % 100 / 100.0 for completion in completions]


def trl_async_script(module, output_dir: str, model_path: str, dataset, **overrides):
    """TRL's async test_train, as a user writes it: `module` is what `AsyncGRPOConfig` and `AsyncGRPOTrainer` are
    imported from. Returns the trainer and the parameters before training (None when `module` is TRL's: its
    trainer needs a vLLM server, so only its config is built)."""
    training_args = module.AsyncGRPOConfig(
        output_dir=output_dir,
        learning_rate=0.1,
        per_device_train_batch_size=3,
        num_generations=3,
        max_completion_length=8,
        vllm_server_timeout=5.0,
        max_steps=2,
        report_to="none",
        **overrides,
    )
    if module is trl_async:
        return training_args, None
    trainer = module.AsyncGRPOTrainer(
        model=model_path, reward_funcs=char_code_reward, args=training_args, train_dataset=dataset
    )
    previous = {n: p.clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    return trainer, previous


def conversational_dataset(n=4):
    from datasets import Dataset

    return Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": f"What colour is the number {i}?"}] for i in range(n)],
            "completion": [[{"role": "assistant", "content": f"It is {i}."}] for i in range(n)],
        }
    )


@pytest.mark.parametrize("max_staleness", [0, 1])
def test_a_trl_async_script_trains_by_changing_the_import(tmp_path, tokenizer, max_staleness):
    path = tmp_path / "tiny"
    build_tiny_model(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    settings = dict(max_staleness=max_staleness, use_cpu=True, save_strategy="no", disable_tqdm=True)
    trl_args, _ = trl_async_script(trl_async, str(tmp_path / "trl"), str(path), conversational_dataset(), **settings)
    assert isinstance(trl_args, trl_async.AsyncGRPOConfig)  # the same call is TRL's, unchanged
    trainer, previous = trl_async_script(
        grpo_hf, str(tmp_path / "ours"), str(path), conversational_dataset(), **settings
    )
    assert trainer.state.log_history[-1]["train_loss"] is not None
    assert len(train_logs(trainer)) == 2 and trainer.args.max_staleness == max_staleness
    assert all(log["async/staleness_max"] <= max_staleness for log in train_logs(trainer))  # the producer sampled
    for name, param in previous.items():
        assert not torch.equal(param, trainer.model.get_parameter(name)), f"{name} has not changed"


# ---- docs -----------------------------------------------------------------------------------------------------------
def test_porting_shows_every_difference_and_the_fields_table():
    text = PORTING.read_text().split("\n## From TRL's AsyncGRPOTrainer\n", 1)[1].split("\n## ", 1)[0]
    for name in [*TRL_ASYNC_DEFAULTS, *TRL_ASYNC_SAME_MEANING, *IGNORED_FIELDS, "rollout_worker", "weight_transfer"]:
        assert re.search(rf"^\| `{name}` \|", text, re.M), f"docs/porting.md's async section has no row for `{name}`"
    assert config_reference_markdown(AsyncGRPOConfig) in text, "regenerate: config_reference_markdown(AsyncGRPOConfig)"
