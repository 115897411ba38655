"""grpo_hf's vLLM plugin: an entry point of vLLM's `vllm.general_plugins` group (pyproject.toml), which vLLM calls in
each of its processes (the API server, the engine core, every worker) before it builds anything. It registers
grpo_hf's gloo weight-transfer engine (`grpo_hf.rollout.vllm_gloo`) with vLLM's `WeightTransferEngineFactory` under
the name "gloo", imported only when a server is started with `--weight-transfer-config '{"backend": "gloo"}'`.

vLLM may call a plugin more than once in one process; a second call, or a vLLM that has a "gloo" of its own, leaves
the registry as it is.
"""

from __future__ import annotations

ENGINE = ("grpo_hf.rollout.vllm_gloo", "GlooWeightTransferEngine")
"""The module and class of the engine, imported lazily by vLLM's factory."""


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine("gloo", *ENGINE)
    except ValueError:  # registered already (this process called us before, or vLLM has one)
        pass
