"""`AsyncGRPOConfig`: `GRPOConfig` under the name and fields of TRL 1.16's `trl.experimental.async_grpo`.

A TRL async script ports by changing its import. The promises:

- every field of TRL's `AsyncGRPOConfig` is accepted, with TRL's default, except those in `TRL_ASYNC_DEFAULTS` (a
  grpo_hf default that differs, for the reason docs/porting.md gives; `from_trl_defaults` starts from TRL's) and
  `TRL_ASYNC_SAME_MEANING` (a TRL default grpo_hf reaches another way);
- `max_staleness` is `GRPOConfig`'s (how many optimizer steps older than the trained policy the weights that sampled
  a batch may be; docs/async.md), with TRL's default, 4; `lr_scheduler_type` defaults to TRL's `"constant"`;
- `dtype` (TRL's, `"float32"`) is the dtype a model given as a path or Hub id loads in, unless
  `model_init_kwargs` sets one (TRL's precedence);
- `vllm_server_base_url`, when set, is where the rollouts are sampled, as in TRL's async trainer (which always samples
  on the vLLM server at that URL): it turns on `use_vllm=True, vllm_mode="server"`, and a setting that asks for
  another sampler beside it (`vllm_mode="colocate"`, a non-vLLM `rollout_engine` or its switches) is refused at
  construction. Unset (grpo_hf's default, None), grpo_hf's own engines sample and no server is needed; TRL's default
  URL is in `TRL_ASYNC_DEFAULTS`, so `from_trl_defaults` samples on a server at `http://localhost:8000` as TRL does;
- the fields that mean nothing here (`IGNORED_FIELDS`: TRL's rollout queue, its NCCL weight transfer, its token
  budget, its conversation re-tokenization) are accepted, checked as TRL's values, and named, with why, in one
  warning when a trainer is built with them set to a value other than TRL's default.

Everything else is `GRPOConfig`'s: every loss type, `beta`, PEFT, processors, tools and environments, DDP and ZeRO.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from grpo_hf.config import (
    GRPOConfig,
    _check_int,
    defaults_left_differing,
    warn_defaults_differing,
    with_trl_precision,
)
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

    Defaults that differ from `GRPOConfig`'s, as TRL's async config: `max_staleness=4`, `lr_scheduler_type="constant"`;
    and `vllm_mode=None`, resolved at construction: 'server' when `vllm_server_base_url` is set, else 'colocate'.
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
    vllm_mode: str | None = field(
        default=None,
        metadata={
            "help": "GRPOConfig's vllm_mode, resolved at construction. None: 'server' when vllm_server_base_url is "
            "set (TRL's async trainer samples on the vLLM server at that URL; use_vllm=True follows), else "
            "'colocate'. 'colocate' with vllm_server_base_url set is refused."
        },
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
        self._resolve_server()
        super().__post_init__()
        self._check_async_fields()

    def _resolve_server(self) -> None:
        """`vllm_server_base_url` set: sample on that vLLM server (`use_vllm=True, vllm_mode="server"`), as TRL's async
        trainer does; a setting that names another sampler is refused. Unset: `vllm_mode` None becomes 'colocate'."""
        url = self.vllm_server_base_url
        if url is None:
            self.vllm_mode = "colocate" if self.vllm_mode is None else self.vllm_mode
            return
        aliases = {"use_model_generate": "generate", "use_transformers_continuous_batching": "continuous_batching"}
        aliases["use_transformers_paged"] = "continuous_batching"
        others = {  # setting: (the sampler it asks for, whether it is set)
            "vllm_mode='colocate'": ("a vLLM engine in this process", self.vllm_mode == "colocate"),
            f"rollout_engine={self.rollout_engine!r}": (
                f"grpo_hf's {self.rollout_engine!r} engine",
                self.rollout_engine not in ("auto", "vllm"),
            ),
            **{f"{flag}=True": (f"grpo_hf's {name!r} engine", getattr(self, flag)) for flag, name in aliases.items()},
            f"cache_implementation={self.cache_implementation!r}": (
                "grpo_hf's 'generate' engine",
                self.cache_implementation is not None,
            ),
        }
        for setting, (sampler, conflicts) in others.items():
            if conflicts:
                raise ValueError(
                    f"vllm_server_base_url={url!r} samples the rollouts on the vLLM server at that URL (as TRL's "
                    f"AsyncGRPOTrainer, which always samples on a server), but {setting} asks for {sampler}. Remove "
                    f"vllm_server_base_url to sample with {sampler}, or remove {setting} to sample on the server."
                )
        self.use_vllm, self.vllm_mode = True, "server"

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
        """`{field: why}` for each TRL async field set to a value other than TRL's default that means nothing here."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        return {name: reason for name, reason in IGNORED_FIELDS.items() if getattr(self, name) != defaults[name]}

    def defaults_differing_from_trl(self) -> list[str]:
        """`name=value (TRL: value)` for every field left at grpo_hf's default where TRL's async default differs
        (`TRL_ASYNC_DEFAULTS`; `config.defaults_left_differing`)."""
        return defaults_left_differing(self, TRL_ASYNC_DEFAULTS)

    def log_defaults_differing_from_trl(self) -> None:
        """Called once by the trainer when it is built: one warning naming the defaults left that differ from TRL's
        `AsyncGRPOConfig`, and one naming the TRL fields set here that mean nothing in grpo_hf, with why."""
        warn_defaults_differing(self.defaults_differing_from_trl(), "AsyncGRPOConfig")
        if ignored := self.ignored_fields():
            logger.warning(
                "AsyncGRPOConfig: these TRL AsyncGRPOConfig settings are accepted but ignored by grpo_hf: %s.",
                "; ".join(f"{name}={getattr(self, name)!r} ({why})" for name, why in ignored.items()),
            )

    @classmethod
    def from_trl_defaults(cls, **kwargs) -> AsyncGRPOConfig:
        """A config that starts from TRL's `AsyncGRPOConfig` defaults (`TRL_ASYNC_DEFAULTS`, including what TRL's
        async trainer does without a field: no KL term, its token-mean loss) where grpo_hf's differ; bf16 as
        `GRPOConfig.from_trl_defaults` sets it (`config.with_trl_precision`)."""
        return cls(**with_trl_precision(TRL_ASYNC_DEFAULTS, kwargs))

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
    # TRL async always samples on the vLLM server at this URL; unset here, grpo_hf's own engines sample (no server)
    "vllm_server_base_url": "http://localhost:8000",
}

# TRL 1.16's AsyncGRPOConfig defaults that grpo_hf does not take, because its own default does what TRL's does there.
TRL_ASYNC_SAME_MEANING: dict[str, Any] = {
    # TRL's rollout worker reads the dataset itself and passes every column to the reward functions, which is what
    # remove_unused_columns=False does here (True here would keep the columns from the reward functions).
    "remove_unused_columns": True,
}
