"""Server mode with a LoRA policy: push the adapter alone (`vllm_server_lora_push="adapter"`), not merged weights.

The default (`"merged"`) pushes the base weights with the LoRA deltas merged in (`weights.weight_buckets`), the
whole model at every push, through the server's weight transport. With `"adapter"` the server keeps its base
weights (the checkpoint it started from, which must be the policy's base) and samples through vLLM's own LoRA
support: at each push process 0 writes the active adapter as PEFT saves it (`adapter_config.json`,
`adapter_model.safetensors`: the A and B matrices only, a few MB) into a fresh directory the server reads, and has the
server load it in place under `ADAPTER_NAME` (`POST /v1/load_lora_adapter`, `load_inplace`), then drops its prefix
cache. Every completion request names the adapter as its model. The previous push's directory is removed once the
new one is loaded (vLLM reads the path again if it ever evicts the adapter from its cache).

The server needs vLLM's LoRA support and its runtime loading: `--enable-lora --max-lora-rank R` (R at least the
adapter's rank) and `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True` (`python -m grpo_hf.vllm_serve` sets the latter when
`--enable-lora` is given). Both are checked at connect (`check_lora_server`), before any rollout. The directory is
`vllm_server_weights_dir` (default /dev/shm: the server on this machine; on another machine, a directory both read,
for a few MB per push). What vLLM's LoRA layers cannot run is refused with the reason (`adapter_push_refusal`):
DoRA, LoRA biases, `modules_to_save`, several active adapters.

A sharded policy's adapter (FSDP2, ZeRO-3) is gathered on every process (`weights.gathered`: a collective), at once:
it is the adapter's size, not the model's.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from typing import Any

from grpo_hf.peft_utils import active_adapters
from grpo_hf.rollout.weights import gathered

ADAPTER_NAME = "grpo_hf-policy"
"""The name the server serves the pushed adapter under (the completions requests' `model`)."""


def adapter_push_refusal(model) -> str | None:
    """Why `model`'s adapter cannot be served by vLLM's LoRA layers, or None."""
    if not hasattr(model, "peft_config"):
        return "the policy has no LoRA adapter (pass peft_config=LoraConfig(...) or a PeftModel)"
    adapters = active_adapters(model)
    if len(adapters) != 1:
        return f"{len(adapters)} adapters are active ({adapters}); vLLM serves one per request"
    config = model.peft_config[adapters[0]]
    if getattr(config, "peft_type", None) is not None and str(config.peft_type.value) != "LORA":
        return f"the adapter is {config.peft_type.value}, not LoRA"
    for setting, why in (("use_dora", "DoRA"), ("modules_to_save", "modules_to_save (whole trained modules)")):
        if getattr(config, setting, None):
            return f"its LoraConfig uses {why}, which vLLM's LoRA layers do not load"
    if getattr(config, "lora_bias", False) or getattr(config, "bias", "none") != "none":
        return "its LoraConfig trains biases, which vLLM's LoRA layers do not load"
    return None


def check_adapter_push(model) -> None:
    """Raise unless `model`'s adapter can be pushed alone (`adapter_push_refusal`), saying what to do instead."""
    why = adapter_push_refusal(model)
    if why is not None:
        raise ValueError(
            f"vllm_server_lora_push='adapter' pushes the policy's LoRA adapter alone, but {why}. Use "
            "vllm_server_lora_push='merged' (the default: the base weights with the deltas merged in)."
        )


def check_lora_server(server_info: dict[str, Any], model, url: str) -> None:
    """Raise unless the server at `url` (its `/server_info`) runs LoRA with room for `model`'s adapter's rank."""
    config = server_info.get("vllm_config") if isinstance(server_info.get("vllm_config"), dict) else {}
    lora = config.get("lora_config")
    rank = model.peft_config[active_adapters(model)[0]].r
    start = (
        f"start it with `--enable-lora --max-lora-rank {max(rank, 8)}` (`python -m grpo_hf.vllm_serve` then sets "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True), or set vllm_server_lora_push='merged'"
    )
    if not isinstance(lora, dict):
        raise ValueError(
            f"vllm_server_lora_push='adapter' has the vLLM server at {url} sample through the policy's LoRA adapter, "
            f"but the server runs without LoRA support: {start}."
        )
    if int(lora.get("max_lora_rank") or 0) < rank:
        raise ValueError(
            f"The policy's LoRA rank is {rank}, but the vLLM server at {url} takes ranks up to "
            f"{lora.get('max_lora_rank')}: {start}."
        )


def adapter_state(model) -> dict[str, Any]:
    """The active adapter's tensors as PEFT saves them (`lora_A.weight`, ..., no adapter name), full (a sharded one
    gathered: every process calls this), as CPU copies."""
    from peft.utils import get_peft_model_state_dict

    adapter = active_adapters(model)[0]
    named = [(name, p) for name, p in model.named_parameters() if "lora_" in name and f".{adapter}." in name]
    with gathered([p for _, p in named]) as full:
        state = {name: full[id(p)].to("cpu", copy=True).contiguous() for name, p in named}
    return get_peft_model_state_dict(model, state_dict=state, adapter_name=adapter, save_embedding_layers=False)


class AdapterPush:
    """Process 0's adapter pushes to one server: `request(route, body)` is the server client's HTTP call."""

    def __init__(self, request, weights_dir: str | None):
        self.request, self.weights_dir = request, weights_dir
        self.directory: str | None = None  # the last pushed adapter's, which the server may read again
        self.bytes = 0  # the last push's adapter_model.safetensors

    def push(self, model, state: dict[str, Any]) -> int:
        """Write `state` (`adapter_state`) with the adapter's config, have the server load it; the bytes written."""
        from safetensors.torch import save_file

        root = self.weights_dir or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
        directory = tempfile.mkdtemp(prefix="grpo_hf_adapter_", dir=root)
        try:
            model.peft_config[active_adapters(model)[0]].save_pretrained(directory)  # adapter_config.json
            save_file(state, os.path.join(directory, "adapter_model.safetensors"))
            os.chmod(directory, 0o755)  # a server running as another user can read it
            body = {"lora_name": ADAPTER_NAME, "lora_path": directory, "load_inplace": True}
            self.request("/v1/load_lora_adapter", body)
            self.request("/reset_prefix_cache", {})
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise
        self.close()
        self.directory = directory
        self.bytes = os.path.getsize(os.path.join(directory, "adapter_model.safetensors"))
        return self.bytes

    def close(self) -> None:
        """Remove the last pushed adapter's directory."""
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None


def served_name(args, model_id: str) -> str:
    """The completions requests' `model`: the pushed adapter (`ADAPTER_NAME`), or the server's model."""
    return ADAPTER_NAME if getattr(args, "vllm_server_lora_push", "merged") == "adapter" else model_id


def push_adapter(server, model) -> float:
    """`VLLMServer.push` with vllm_server_lora_push='adapter': every process gathers the adapter (a collective where
    it is sharded), process 0 checks the server (at its first push, so before any rollout) and pushes it; a failure
    stops every process with its message. The first push also pushes the base weights (unmerged, through the
    server's weight transport): the server then holds the policy's base, whatever it loaded or was pushed before.
    Returns the seconds it took."""
    start, failure = time.perf_counter(), None
    if not getattr(server, "base_pushed", False):  # every process: the base push is collective
        check_adapter_push(model)
        server.push(model, merge_lora=False)
        server.base_pushed = True
    try:
        check_adapter_push(model)
        state = adapter_state(model)
        if server.is_main:
            if getattr(server, "adapter", None) is None:
                check_lora_server(server.server_info, model, server.url)
                server.adapter = AdapterPush(server.request, server.args.vllm_server_weights_dir)
            server.adapter.push(model, state)
    except Exception as error:
        failure = error
    server._together(failure, "pushing the LoRA adapter to the vLLM server")
    return time.perf_counter() - start
