"""`AsyncGRPOConfig`: `GRPOConfig` under the name and fields of TRL 1.16's `trl.experimental.async_grpo`.

A TRL async script ports by changing its import. The promises:

- every field of TRL's `AsyncGRPOConfig` is accepted, with TRL's default, except those in `TRL_ASYNC_DEFAULTS` (a
  grpo_hf default that differs, for the reason docs/porting.md gives; `from_trl_defaults` starts from TRL's) and
  `TRL_ASYNC_SAME_MEANING` (a TRL default grpo_hf reaches another way);
- `max_staleness` is `GRPOConfig`'s (how many optimizer steps older than the trained policy the weights that sampled
  a batch may be; docs/async.md), with TRL's default, 4; `lr_scheduler_type` defaults to TRL's `"constant"`;
- `dtype` (TRL's, `"float32"`) is the dtype a model given as a path or Hub id loads in, unless
  `model_init_kwargs` sets one (TRL's precedence);
- the fields that mean nothing here (`IGNORED_FIELDS`: TRL's rollout queue, its NCCL weight transfer, its token
  budget, its conversation re-tokenization) are accepted, checked as TRL's values, and named, with why, in one
  warning when a trainer is built with them set to a value other than TRL's default. `vllm_server_base_url` is named
  there too when it is set but the rollouts are not sampled on a vLLM server (`use_vllm=True, vllm_mode="server"`).

Everything else is `GRPOConfig`'s: every loss type, `beta`, PEFT, processors, tools and environments, DDP and ZeRO.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from grpo_hf.config import _USED_AS, GRPOConfig, _check_int
from grpo_hf.core import check_choice

logger = logging.getLogger(__name__)

ModelDtype = Literal["auto", "bfloat16", "float16", "float32"]

# Why each TRL async field that means nothing in grpo_hf is ignored; named in one warning when set (`ignored_fields`).
IGNORED_FIELDS: dict[str, str] = {
    "fork_threshold_tokens": "a tool episode keeps the token ids it sampled turn after turn and never re-tokenizes "
    "the conversation, so there is no drift to reconcile and no row to fork",
    "request_timeout": "vllm_server_timeout bounds each request to a vLLM server",
    "weight_sync_timeout": "vllm_server_timeout bounds each weight push to a vLLM server",
    "token_budget": "micro-batches hold per_device_train_batch_size completions (logprob_chunk_size bounds the "
    "log-prob forward's memory)",
    "max_inflight_tasks": "one producer thread samples one generation batch at a time, admitted at most "
    "max_staleness optimizer steps ahead of the trainer",
    "queue_maxsize": "admission control keeps the producer at most max_staleness optimizer steps ahead, which bounds "
    "what waits to be trained",
    "weight_sync_steps": "the trainer publishes its weights at every optimizer step, and the producer samples each "
    "generation batch with the weights of exactly max_staleness steps before the batch is trained on",
    "heartbeat_stale_after_s": "generation runs in a thread of the training process: its error stops training, and a "
    "trainer kept waiting for a batch warns after 300 s, naming what the producer is doing",
}


@dataclass
class AsyncGRPOConfig(GRPOConfig):
    r"""Configuration of [`AsyncGRPOTrainer`]: `GRPOConfig` with TRL 1.16's `AsyncGRPOConfig` fields and defaults.

    Defaults that differ from `GRPOConfig`'s, as TRL's async config: `max_staleness=4`, `lr_scheduler_type="constant"`.
    Defaults that differ from TRL's `AsyncGRPOConfig`: `TRL_ASYNC_DEFAULTS` (docs/porting.md, "From TRL's
    AsyncGRPOTrainer", says why); `AsyncGRPOConfig.from_trl_defaults(...)` starts from TRL's values instead.
    """

    # ---- defaults of TRL's async config --------------------------------------------------------------------------
    max_staleness: int = field(
        default=4,
        metadata={
            "help": "GRPOConfig's max_staleness with TRL AsyncGRPOConfig's default: how many optimizer steps older "
            "than the trained policy the weights that sampled a batch may be (0: synchronous GRPO). No sample is "
            "dropped for being stale: generation of batch k waits until k - max_staleness steps are taken "
            "(docs/async.md)."
        },
    )
    lr_scheduler_type: str = field(
        default="constant",
        metadata={"help": "Learning-rate schedule; 'constant' as TRL's AsyncGRPOConfig (GRPOConfig: 'linear')."},
    )

    # ---- TRL's async fields that GRPOConfig lacks ----------------------------------------------------------------
    dtype: str = field(
        default="float32",
        metadata={
            "help": "Dtype a model given as a path or Hub id loads in: 'auto' (the checkpoint's), 'bfloat16', "
            "'float16' or 'float32' (TRL's default). A dtype in model_init_kwargs wins. Not applied to a model "
            "object passed in."
        },
    )
    fork_threshold_tokens: int = field(
        default=1024,
        metadata={"help": "TRL's re-tokenization drift threshold for multi-turn rows. Accepted and ignored."},
    )
    request_timeout: int = field(
        default=600,
        metadata={"help": "TRL's per-request vLLM timeout. Accepted, ignored: vllm_server_timeout bounds requests."},
    )
    weight_sync_timeout: int = field(
        default=1800,
        metadata={"help": "TRL's NCCL weight-sync timeout. Accepted, ignored: vllm_server_timeout bounds pushes."},
    )
    token_budget: int | None = field(
        default=None,
        metadata={"help": "TRL's token-budgeted micro-batching. Accepted and ignored (per_device_train_batch_size)."},
    )
    max_inflight_tasks: int = field(
        default=-1,
        metadata={"help": "TRL's limit on concurrent vLLM requests (-1: auto). Accepted and ignored (max_staleness)."},
    )
    queue_maxsize: int = field(
        default=1024,
        metadata={"help": "TRL's rollout queue size. Accepted and ignored: max_staleness bounds the queue."},
    )
    weight_sync_steps: int = field(
        default=1,
        metadata={"help": "TRL's steps between weight syncs. Accepted and ignored: weights follow every step."},
    )
    heartbeat_stale_after_s: float = field(
        default=300.0,
        metadata={"help": "TRL's rollout-worker heartbeat limit, seconds. Accepted and ignored (no worker process)."},
    )

    def __post_init__(self):
        super().__post_init__()
        self._check_async_fields()

    def _check_async_fields(self) -> None:
        """TRL's async fields: the values TRL could run with, refused with the fix otherwise (ignored ones too, so a
        script that is wrong for TRL is not silently accepted here)."""
        check_choice("dtype", self.dtype, get_args(ModelDtype))
        _check_int("fork_threshold_tokens", self.fork_threshold_tokens, 0, "a drift size in tokens")
        _check_int("weight_sync_steps", self.weight_sync_steps, 1, "optimizer steps between two weight syncs")
        _check_int("queue_maxsize", self.queue_maxsize, 0, "rollout samples the queue may hold")
        _check_int("max_inflight_tasks", self.max_inflight_tasks, -1, "-1 (auto) or the requests in flight at once")
        if self.max_inflight_tasks == 0:
            raise ValueError(
                "max_inflight_tasks=0 would let no generation request run (TRL would wait forever on an empty "
                "queue). Use -1 (auto) or a count >= 1."
            )
        if self.token_budget is not None:
            _check_int("token_budget", self.token_budget, None, "tokens per row (<= 0: no budget), or None")
        for name in ("request_timeout", "weight_sync_timeout", "heartbeat_stale_after_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"{name}={value!r} must be a number of seconds > 0.")

    # ---- what differs from TRL, said once ------------------------------------------------------------------------
    def ignored_fields(self) -> dict[str, str]:
        """`{field: why}` for each TRL async field set to a value other than TRL's default that means nothing here,
        and `vllm_server_base_url` when set while the rollouts are not sampled on a vLLM server."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        ignored = {name: reason for name, reason in IGNORED_FIELDS.items() if getattr(self, name) != defaults[name]}
        if self.vllm_server_base_url is not None and not (self.use_vllm and self.vllm_mode == "server"):
            ignored["vllm_server_base_url"] = (
                f"the rollouts are sampled by this process's rollout engine (rollout_engine={self.rollout_engine!r}), "
                "not on a vLLM server: use_vllm=True with vllm_mode='server' samples on one (the producer sends its "
                "requests there, docs/async.md)"
            )
        return ignored

    def defaults_differing_from_trl(self) -> list[str]:
        """`name=value (TRL: value)` for every field still at grpo_hf's default where TRL's async default differs."""
        ours = {f.name: _USED_AS.get(f.name, f.default) for f in dataclasses.fields(self)}
        return [
            f"{name}={getattr(self, name)!r} (TRL: {trl!r})"
            for name, trl in TRL_ASYNC_DEFAULTS.items()
            if getattr(self, name) == ours[name] and getattr(self, name) != trl
        ]

    def log_defaults_differing_from_trl(self) -> None:
        """Called once by the trainer when it is built: one log line naming the defaults that differ from TRL's
        `AsyncGRPOConfig`, and one warning naming the TRL fields set here that mean nothing in grpo_hf, with why."""
        if differing := self.defaults_differing_from_trl():
            logger.info(
                "Defaults that differ from TRL's AsyncGRPOConfig (AsyncGRPOConfig.from_trl_defaults(...) starts from "
                "TRL's): %s",
                ", ".join(differing),
            )
        if ignored := self.ignored_fields():
            logger.warning(
                "AsyncGRPOConfig: these TRL AsyncGRPOConfig settings are accepted but ignored by grpo_hf: %s.",
                "; ".join(f"{name}={getattr(self, name)!r} ({why})" for name, why in ignored.items()),
            )

    @classmethod
    def from_trl_defaults(cls, **kwargs) -> AsyncGRPOConfig:
        """A config that starts from TRL's `AsyncGRPOConfig` defaults (`TRL_ASYNC_DEFAULTS`, including what TRL's
        async trainer does without a field: no KL term, its token-mean loss) where grpo_hf's differ."""
        return cls(**{**TRL_ASYNC_DEFAULTS, **kwargs})

    def model_load_kwargs(self) -> dict[str, Any]:
        """`GRPOConfig.model_load_kwargs` with `dtype` unless `model_init_kwargs` sets one (TRL's precedence)."""
        kwargs = super().model_load_kwargs()
        if "dtype" in kwargs or "torch_dtype" in kwargs:
            return kwargs
        return {**kwargs, "dtype": self.dtype}


# TRL 1.16's AsyncGRPOConfig defaults, and what its trainer does without a field, where AsyncGRPOConfig's defaults
# differ; docs/porting.md ("From TRL's AsyncGRPOTrainer") gives each reason. `from_trl_defaults` applies them.
TRL_ASYNC_DEFAULTS: dict[str, Any] = {
    "loss_type": "dapo",  # TRL async: one loss, summed over tokens and divided by the global token count
    "beta": 0.0,  # TRL async: no KL term, no reference model
    "disable_dropout": False,  # TRL async leaves dropout as the model's config has it
    "max_completion_length": 2048,
    "gradient_checkpointing": True,
    "bf16": True,  # TRL: True unless fp16 is set
    "logging_nan_inf_filter": True,  # TrainingArguments' default
    "ignore_data_skip": True,  # TRL async forces it: its rollout queue cannot replay the data
}

# TRL 1.16's AsyncGRPOConfig defaults that grpo_hf does not take, because its own default does what TRL's does there.
TRL_ASYNC_SAME_MEANING: dict[str, Any] = {
    # TRL's rollout worker reads the dataset itself and passes every column to the reward functions, which is what
    # remove_unused_columns=False does here (True here would keep the columns from the reward functions).
    "remove_unused_columns": True,
    # None reaches vllm_server_host:vllm_server_port, 0.0.0.0:8000: the same server as TRL's default URL, while
    # leaving vllm_server_host and vllm_server_port in force.
    "vllm_server_base_url": "http://localhost:8000",
}
