"""Server mode's network push: the weights go to the vLLM server through vLLM's own weight-transfer protocol.

vLLM (>= 0.32) has RL routes for a trainer that sends weights over a process group it shares with the server's
workers, and a registry of transports (`WeightTransferEngineFactory`; the server picks one with
`--weight-transfer-config '{"backend": ...}'`). grpo_hf drives the protocol from the trainer (process 0, rank 0 of
the group; the server's workers are ranks 1..W, as in vLLM's NCCL backend):

| when                  | HTTP route                                 | on the group                                   |
|-----------------------|--------------------------------------------|------------------------------------------------|
| connect (once)        | `/init_weight_transfer_engine` (init info) | the workers join rank 0 on `vllm_group_port`   |
| each push             | `/start_weight_update`                     |                                                |
|   each bucket         | `/update_weights` (names, dtypes, shapes)  | its bytes: packed in one broadcast (NCCL), or  |
|                       |                                            | a broadcast per tensor, no copy (gloo)         |
|                       | `/finish_weight_update`, `/reset_prefix_cache` |                                            |

The server loads the weights with vLLM's own load path (`model.load_weights` inside its layerwise reload). Two
transports, the same protocol:
- `nccl`: vLLM's NCCL engine (CUDA on both sides). The trainer opens its end with vLLM's own helper, so vLLM must be
  importable where the trainer runs; the buckets are packed as vLLM's packed NCCL consumer reads them (one
  broadcast per `/update_weights`, at most `bucket_bytes` or one larger tensor).
- `gloo`: a torch.distributed gloo group over TCP, for vLLM's CPU build and any machine without NCCL: grpo_hf's
  vLLM plugin (`grpo_hf.vllm_plugin`, an entry point of vLLM's `vllm.general_plugins`) registers its engine
  (`grpo_hf.rollout.vllm_gloo`) in every server process; `python -m grpo_hf.vllm_serve` selects it on CPUs.
`files` (safetensors shards and `reload_weights`, `vllm_server`) stays the fallback and what a user can pick.
`choose_transport` decides at connect and says why.

At connect the gloo engine also hands back the served checkpoint's parameters (names, dtypes, shapes, read where the
server loaded them), which `check_same_weights` compares with the policy's before any rollout.
"""

from __future__ import annotations

import datetime
import logging
import math
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

logger = logging.getLogger(__name__)

TRANSPORTS = ("auto", "nccl", "gloo", "files")
"""The values of `vllm_server_weight_transfer`."""
GLOO = "gloo"
"""The backend name grpo_hf's vLLM plugin registers its gloo engine under."""
SERVED_WEIGHTS_KEY = "grpo_hf/served_weights"
"""The group's store key under which the first worker puts the served checkpoint's parameters (JSON)."""
STORE_PREFIX = "grpo_hf/weights"

Bucket = list[tuple[str, torch.Tensor]]


def choose_transport(setting: str, server_backend: str | None, trainer_on_cuda: bool, nccl_importable: bool):
    """`(transport, why)`: the transport of `vllm_server_weight_transfer=setting` with a server whose weight-transfer
    backend is `server_backend` (None: the server has none). `auto`: NCCL where both sides can, else the gloo engine
    where the server has it, else files. A named network transport the server or the trainer cannot run is an error
    that says how to start the server."""
    if setting not in TRANSPORTS:
        raise ValueError(f"vllm_server_weight_transfer={setting!r} is not one of {list(TRANSPORTS)}.")
    if setting == "files":
        return "files", "vllm_server_weight_transfer='files'"
    if setting == "auto":
        if server_backend == "nccl" and trainer_on_cuda and nccl_importable:
            return (
                "nccl",
                "the server's weight-transfer backend is nccl and the trainer is on CUDA with vLLM installed",
            )
        if server_backend == GLOO:
            return GLOO, "the server's weight-transfer backend is grpo_hf's gloo engine"
        return "files", f"auto: {_why_not_network(server_backend, trainer_on_cuda, nccl_importable)}"
    if server_backend != setting:
        raise ValueError(
            f"vllm_server_weight_transfer={setting!r}, but the vLLM server's weight-transfer backend is "
            f'{server_backend!r}. Start the server with `--weight-transfer-config \'{{"backend": "{setting}"}}\'` '
            "(`python -m grpo_hf.vllm_serve` picks gloo on CPUs, nccl on GPUs), or set vllm_server_weight_transfer to "
            "'auto' or 'files'."
        )
    if setting == "nccl" and not (trainer_on_cuda and nccl_importable):
        raise ValueError(
            "vllm_server_weight_transfer='nccl' needs the trainer on CUDA with vLLM importable (its NCCL helpers open "
            f"the trainer's end); here: CUDA {'yes' if trainer_on_cuda else 'no'}, vLLM "
            f"{'yes' if nccl_importable else 'no'}. Install vLLM beside the trainer, or use 'gloo' or 'files'."
        )
    return setting, f"vllm_server_weight_transfer={setting!r}"


def _why_not_network(server_backend: str | None, trainer_on_cuda: bool, nccl_importable: bool) -> str:
    if server_backend is None:
        return "the server has no weight-transfer backend (start it with --weight-transfer-config)"
    if server_backend == "nccl":
        missing = "CUDA" if not trainer_on_cuda else "vLLM (for its NCCL helpers)"
        return f"the server's backend is nccl but the trainer has no {missing}"
    return f"the server's weight-transfer backend {server_backend!r} is not one grpo_hf drives"


# ---- the wire format (both sides) -------------------------------------------------------------------------------
def wire_buckets(weights: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[Bucket]:
    """Consecutive weights in buckets closed by the weight that takes them over `bucket_bytes` (or by the end): the
    chunks vLLM's packed NCCL consumer cuts from the same list, so each bucket is one broadcast on either side."""
    bucket, size = [], 0
    for name, tensor in weights:
        bucket.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
        if size > bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def update_info(bucket: Bucket) -> dict[str, list]:
    """The `/update_weights` body of one bucket: what the workers allocate and load (vLLM's NCCL fields)."""
    return {
        "names": [name for name, _ in bucket],
        "dtype_names": [str(tensor.dtype).removeprefix("torch.") for _, tensor in bucket],
        "shapes": [list(tensor.shape) for _, tensor in bucket],
    }


def pack(bucket: Bucket) -> torch.Tensor:
    """The bucket's tensors as one flat uint8 tensor, in order (a copy of at most one bucket)."""
    return torch.cat([tensor.detach().contiguous().view(-1).view(torch.uint8) for _, tensor in bucket])


def unpack(packed: torch.Tensor, names: list[str], dtype_names: list[str], shapes: list[list[int]]) -> Bucket:
    """`pack`'s inverse: views of `packed` under their names, dtypes and shapes (a copy of a tensor whose bytes do not
    start at a multiple of its element size)."""
    dtypes = [getattr(torch, name) for name in dtype_names]
    sizes = [_numel(shape) * dtype.itemsize for shape, dtype in zip(shapes, dtypes, strict=True)]
    if sum(sizes) != packed.numel():
        raise ValueError(
            f"A bucket of {packed.numel()} bytes does not hold the {sum(sizes)} bytes its metadata names."
        )
    parts = packed.split(sizes)
    return [
        (name, (part if part.storage_offset() % dtype.itemsize == 0 else part.clone()).view(dtype).view(shape))
        for name, part, dtype, shape in zip(names, parts, dtypes, shapes, strict=True)
    ]


def _numel(shape: list[int]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


# ---- the gloo group (both sides) --------------------------------------------------------------------------------
class GlooGroup:
    """A gloo process group of its own over a TCP store at `address:port` (rank 0, the trainer, hosts the store), next
    to any default group the process has (vLLM's workers have theirs). Every wait is bounded by `timeout` seconds."""

    def __init__(self, address: str, port: int, rank: int, world_size: int, timeout: float, interface_host: str):
        import torch.distributed as dist

        bound = datetime.timedelta(seconds=timeout)
        self.rank, self.world_size = rank, world_size
        self.store = dist.TCPStore(address, port, world_size, is_master=rank == 0, timeout=bound)
        options = dist.ProcessGroupGloo._Options()
        options._timeout = bound
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=interface_host)]
        self.group = dist.ProcessGroupGloo(dist.PrefixStore(STORE_PREFIX, self.store), rank, world_size, options)

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Rank 0's `tensor` into every rank's (a contiguous CPU tensor), as bytes: gloo has no float8 types."""
        import torch.distributed as dist

        if not tensor.is_contiguous():
            raise ValueError("GlooGroup.broadcast takes a contiguous tensor (it sends and fills its bytes in place).")
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.group.broadcast([tensor.reshape(-1).view(torch.uint8)], options).wait()


def address_towards(host: str) -> str:
    """This machine's address on the route to `host` (a UDP socket's local end: nothing is sent); 127.0.0.1 for a
    host on this machine or one without a route."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((host, 9))
            return probe.getsockname()[0]
        except OSError:
            return "127.0.0.1"


# ---- the trainer's side -----------------------------------------------------------------------------------------
class NetworkPush:
    """Process 0's end of the protocol: joins the server's workers at connect, then pushes the weights bucket by
    bucket. `request(route, body)` is the server client's HTTP call (`VLLMServer.request`); `communicator` (made by
    `connect`) is a `GlooGroup` or vLLM's NCCL communicator; anything with `broadcast(tensor)` does (tests)."""

    def __init__(self, request: Callable, transport: str, address: str, port: int, world_size: int, **options):
        self.request, self.transport = request, transport
        self.address, self.port, self.world_size = address, port, world_size
        self.bucket_bytes: int = options.get("bucket_bytes", 1 << 30)
        self.timeout: float = options.get("timeout", 240.0)
        self.communicator = options.get("communicator")
        self.pushes = 0
        # NCCL: each bucket packed into one broadcast (vLLM's packed consumer); gloo: a broadcast per tensor, straight
        # from the parameters, so that the trainer holds no copy of a bucket (CPU latency per broadcast is small)
        self.packed = transport == "nccl"
        self.served: list[list] | dict | None = None  # what `connect` returned: the served checkpoint's parameters
        self.checked = False  # whether `check_same_weights` passed (before the first push)

    def init_info(self) -> dict[str, Any]:
        """The workers' init info (`/init_weight_transfer_engine`): they are ranks 1..world_size - 1."""
        info = {"master_address": self.address, "master_port": self.port, "world_size": self.world_size}
        info["rank_offset"] = 1
        if self.transport == "nccl":  # vLLM's packed consumer, cut as `wire_buckets` cuts
            return {**info, "packed": True, "packed_buffer_size_bytes": self.bucket_bytes}
        return {**info, "timeout_s": self.timeout, "packed": False}

    def connect(self) -> list[list] | dict | None:
        """Set up the group with the server's workers (once). Returns what the gloo engine says the server serves
        (`[[name, dtype, shape], ...]`, or `{"error": why}`); None with NCCL, whose engine does not say."""
        body = {"init_info": self.init_info()}
        if self.communicator is not None:  # a stand-in, already made
            self.request("/init_weight_transfer_engine", body)
            return None
        try:
            self.communicator = concurrently(
                lambda: self.request("/init_weight_transfer_engine", body), self._open, timeout=self.timeout
            )[1]
        except Exception as error:
            if "EADDRINUSE" in str(error) or "address already in use" in str(error).lower():
                raise OSError(
                    f"vllm_group_port={self.port} is already in use on this machine (another run, or a trainer of "
                    "this process connected to another vLLM server, holds it), so the weight-transfer group cannot "
                    "listen there. Set vllm_group_port to a free port; the server needs no change (the port travels "
                    "in the group's init info)."
                ) from error
            raise
        if self.transport != GLOO:
            return None
        import json

        return json.loads(self.communicator.store.get(SERVED_WEIGHTS_KEY).decode())

    def _open(self):
        if self.transport == "nccl":
            from vllm.distributed.weight_transfer.nccl_common import trainer_init

            return trainer_init(
                {"master_address": self.address, "master_port": self.port, "world_size": self.world_size}
            )
        return GlooGroup(self.address, self.port, 0, self.world_size, self.timeout, self.address)

    def push(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """One update: start, every bucket (its metadata over HTTP while its bytes go over the group), finish, and
        the server's prefix cache dropped. Returns the bytes sent."""
        sent = 0
        self.request("/start_weight_update", {})
        for index, bucket in enumerate(wire_buckets(weights, self.bucket_bytes)):
            body = {"update_info": update_info(bucket)}
            payload = [pack(bucket)] if self.packed else [tensor.detach().contiguous() for _, tensor in bucket]
            try:
                concurrently(lambda b=body: self.request("/update_weights", b), lambda p=payload: self._send(p),
                             timeout=self.timeout)  # fmt: skip
            except Exception as error:
                raise ConnectionError(
                    f"The vLLM server stopped taking the weights over {self.transport} (push {self.pushes + 1}, "
                    f"bucket {index + 1}): {type(error).__name__}: {str(error).rstrip('.')}. Its log says why (a "
                    "server that died, or one that ran out of memory); the group's waits are bounded by "
                    "vllm_server_timeout."
                ) from error
            sent += sum(tensor.numel() * tensor.element_size() for tensor in payload)
            del payload, bucket
        self.pushes += 1
        self.request("/finish_weight_update", {"weight_version": str(self.pushes)})
        self.request("/reset_prefix_cache", {})
        return sent

    def close(self) -> None:
        """Leave the group (its port is free again); the server's workers leave it at the next init."""
        self.communicator = None

    def _send(self, payload: list[torch.Tensor]) -> None:
        for tensor in payload:
            self._broadcast(tensor)

    def _broadcast(self, packed: torch.Tensor) -> None:
        if self.transport == "nccl":  # vLLM's PyNcclCommunicator (a stand-in in tests: a CPU tensor, no stream)
            if packed.is_cuda:  # this runs in a thread of its own, whose current device is cuda:0
                torch.cuda.set_device(packed.device)
            stream = torch.cuda.current_stream() if packed.is_cuda else None
            self.communicator.broadcast(packed, src=0, stream=stream)
            if stream is not None:
                stream.synchronize()
        else:  # gloo: from the CPU (a trainer on CUDA copies one tensor at a time)
            self.communicator.broadcast(packed.cpu())


def concurrently(*calls: Callable[[], Any], timeout: float) -> list[Any]:
    """Run `calls` at once, each in a thread of its own; their results in order. The first to fail raises here at
    once (the others may be waiting for a peer that is gone: their daemon threads are left to their own timeouts),
    and so does a wait past `timeout` seconds (plus a margin for the calls' own bounds to speak first)."""
    done: queue.Queue = queue.Queue()
    results: list[Any] = [None] * len(calls)

    def run(index: int, call: Callable[[], Any]) -> None:
        try:
            results[index] = call()
            done.put((index, None))
        except BaseException as error:  # handed to the caller's thread
            done.put((index, error))

    for index, call in enumerate(calls):
        threading.Thread(target=run, args=(index, call), daemon=True, name="grpo_hf-weights").start()
    for _ in calls:
        try:
            _, error = done.get(timeout=timeout + 30)
        except queue.Empty:
            raise TimeoutError(f"A weight transfer step did not finish within {timeout:g} s.") from None
        if error is not None:
            raise error
    return results


# ---- the check at connect ---------------------------------------------------------------------------------------
def policy_weights(model) -> list[tuple[str, str, tuple[int, ...], bool]]:
    """`weights.weight_shapes(model)` (name, dtype, full shape, tied; nothing gathered), dtypes named as sent."""
    from grpo_hf.rollout.weights import weight_shapes

    return [
        (name, str(dtype).removeprefix("torch."), shape, tied) for name, dtype, shape, tied in weight_shapes(model)
    ]


def check_same_weights(policy: list[tuple[str, str, tuple[int, ...], bool]], served, url: str) -> None:
    """Raise a ValueError naming the first parameters that differ between the policy (`policy_weights`) and the
    served checkpoint (`[[name, dtype, shape], ...]`, or `{"error": why}` when the server could not read it: logged,
    the config check having passed). A dtype that differs is the server's to cast, as from files: logged once."""
    if served is None or isinstance(served, dict):
        why = "nothing was listed" if served is None else served.get("error")
        logger.info(f"The parameters of the vLLM server at {url} could not be listed ({why}): not compared.")
        return
    theirs = pool_experts({name: (dtype, tuple(shape)) for name, dtype, shape in served})
    ours = pool_experts({name: (dtype, tuple(shape)) for name, dtype, shape, _ in policy})
    tied = {name for name, _, _, is_tied in policy if is_tied}
    problems = [f"{name} {shape} is not in the server's model" for name, (_, shape) in ours.items()
                if name not in theirs and name not in tied]  # fmt: skip
    problems += [f"{name} is the server's but not the policy's" for name in theirs if name not in ours]
    problems += [
        f"{name} has shape {ours[name][1]} (server: {theirs[name][1]})"
        for name in theirs
        if name in ours and ours[name][1] != theirs[name][1]
    ]
    if problems:
        raise ValueError(
            f"The policy is not the model the vLLM server at {url} serves: {'; '.join(problems[:3])}"
            f"{f' (and {len(problems) - 3} more)' if len(problems) > 3 else ''}. Its weights cannot be pushed there. "
            "Start the server with the policy's model (`python -m grpo_hf.vllm_serve --model <the policy path>`)."
        )
    cast = sorted({(ours[n][0], theirs[n][0]) for n in theirs if n in ours and ours[n][0] != theirs[n][0]})
    if cast:
        logger.info(f"The policy's weights are {cast[0][0]}, the server's checkpoint {cast[0][1]}: vLLM casts them.")


def pool_experts(weights: dict[str, tuple[str, tuple[int, ...]]]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """`{name: (dtype, shape)}` with the weights under each MoE `experts` module pooled into one entry, `<module>.*`,
    of their total size: transformers 5 holds a module's experts fused (`experts.gate_up_proj` [E, 2I, H],
    `experts.down_proj` [E, H, I]), which is what the trainer pushes and vLLM loads, where a checkpoint has them one
    by one (`experts.{e}.gate_proj.weight` [I, H], ...)."""
    pooled: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name, (dtype, shape) in weights.items():
        module, found, _ = name.partition(".experts.")
        if not found:
            pooled[name] = (dtype, shape)
            continue
        key = f"{module}.experts.*"
        before = pooled[key][1][0] if key in pooled else 0
        pooled[key] = (dtype, (before + math.prod(shape),))
    return pooled


def checkpoint_weights(model: str, revision: str | None = None) -> list[list] | dict[str, str]:
    """`[[name, dtype, shape], ...]` of the safetensors checkpoint at `model` (a directory, or a Hub id in this
    machine's cache), read from the files' headers; `{"error": why}` where there is none to read (the server
    machine's side of `check_same_weights`)."""
    import glob
    import os

    directory = model
    if not os.path.isdir(directory):
        try:
            from huggingface_hub import snapshot_download

            directory = snapshot_download(model, revision=revision, local_files_only=True)
        except Exception as error:  # not in the cache, no hub client: nothing to compare
            return {"error": f"{model} is not a directory here, nor in the Hub cache ({type(error).__name__})"}
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not files:
        return {"error": f"no safetensors files in {directory}"}
    from safetensors import safe_open

    rows = []
    for path in files:
        with safe_open(path, framework="pt") as checkpoint:
            for name in checkpoint.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                piece = checkpoint.get_slice(name)
                rows.append([name, _dtype_name(piece.get_dtype()), list(piece.get_shape())])
    return rows


SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                      "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}  # fmt: skip


def _dtype_name(code: str) -> str:
    return SAFETENSORS_DTYPES.get(code, code.lower())
