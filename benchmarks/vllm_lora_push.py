"""A LoRA policy's push to a vLLM server, merged weights against the adapter alone (`vllm_server_lora_push`), on vLLM's
CPU build: seconds per push, bytes sent or written, and whether both sample the same.

Starts one `python -m grpo_hf.vllm_serve --enable-lora` of the model (fp32; grpo_hf's gloo weight-transfer engine),
builds a LoRA policy on it (r=16 on every attention and MLP projection, B drawn at random so the adapter matters),
then pushes it `--pushes` times as its adapter (the first push also sends the base weights; it is reported apart) and
`--pushes` times merged over gloo, and samples greedily and at temperature 1 (seeded) after each kind: the tokens
that agree and the largest log-prob gap between the two.

    .venv-vllm/bin/python benchmarks/vllm_lora_push.py                 # SmolLM2-135M (grpo_hf.offline_model_path)
    .venv-vllm/bin/python benchmarks/vllm_lora_push.py --tiny --pushes 1   # a tiny model: a check
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from vllm_server_push import free_port, start_server  # the same server start, with --enable-lora

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_policy(model_dir: str, rank: int):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    policy = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS))
    for name, param in policy.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0, 0.02)
    return policy


def client(url: str, lora_push: str, scratch: str):
    from grpo_hf import GRPOConfig
    from grpo_hf.rollout.vllm_server import VLLMServer

    args = GRPOConfig(output_dir=tempfile.mkdtemp(dir=scratch), use_vllm=True, vllm_mode="server",
                      vllm_server_base_url=url, vllm_group_port=free_port(), vllm_server_lora_push=lora_push,
                      use_cpu=True, report_to=[])  # fmt: skip
    return VLLMServer(args, None, [0])


def sample(server, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    rows = []
    for temperature in (0.0, 1.0):
        torch.manual_seed(7)  # the requests' seeds
        settings = {"temperature": temperature, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}
        counts = [1 if temperature == 0 else 2] * len(prompts)  # vLLM's greedy sampling takes n = 1
        rows += [(ids, logps) for ids, logps, *_ in server.generate(prompts, counts, {**settings, "max_tokens": 32})]
    return rows


def agreement(a, b) -> dict:
    same = sum(x == y for (x, _), (y, _) in zip(a, b, strict=True))
    gaps = [abs(p - q) for (x, lp), (y, lq) in zip(a, b, strict=True) if x == y for p, q in zip(lp, lq, strict=True)]
    return {"rows_equal": same, "rows": len(a), "max_logp_gap_on_equal_rows": max(gaps, default=0.0)}


def measure(url: str, model_dir: str, pushes: int, rank: int, scratch: str) -> dict:
    from grpo_hf.rollout.weights import named_weights

    policy = lora_policy(model_dir, rank)
    prompts = [[1, 50, 120, 28, 104], [1, 22, 131, 214, 60], [1, 73, 153, 30, 253, 105]]  # ids of any vocabulary
    adapter = client(url, "adapter", scratch)
    first = adapter.push(policy)  # the base weights over gloo, then the adapter
    adapter_seconds = [adapter.push(policy) for _ in range(pushes)]
    through_adapter = sample(adapter, prompts)
    merged = client(url, "merged", scratch)
    merged_seconds = [merged.push(policy) for _ in range(pushes)]
    through_merged = sample(merged, prompts)
    return {
        "model": model_dir, "lora_rank": rank, "targets": TARGETS,
        "first_adapter_push_with_base_s": first,
        "adapter_push_s": adapter_seconds, "adapter_push_median_s": statistics.median(adapter_seconds),
        "adapter_bytes_written": adapter.adapter.bytes,
        "merged_push_s": merged_seconds, "merged_push_median_s": statistics.median(merged_seconds),
        "merged_bytes_sent": sum(t.numel() * t.element_size() for _, t in named_weights(policy)),
        **agreement(through_adapter, through_merged),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pushes", type=int, default=3)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--tiny", action="store_true", help="a tiny model instead of SmolLM2-135M")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        if args.tiny:
            sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
            from conftest import build_tiny_model, build_tiny_tokenizer

            model_dir, tokenizer = str(Path(scratch) / "tiny"), build_tiny_tokenizer()
            build_tiny_model(tokenizer, hidden_size=128, seed=3).save_pretrained(model_dir)
            tokenizer.save_pretrained(model_dir)
        else:
            from grpo_hf import offline_model_path

            model_dir = str(offline_model_path())
        url, server = start_server(
            model_dir, Path(scratch) / "server.log", ("--enable-lora", "--max-lora-rank", str(args.rank))
        )
        try:
            print(json.dumps(measure(url, model_dir, args.pushes, args.rank, scratch), indent=1))
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=60)


if __name__ == "__main__":
    main()
