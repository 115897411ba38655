"""Probe the `cuda_graph` engine on one GPU, without a trainer: does its decode step compile and replay as a CUDA
graph, how fast is it, and what does it cost? One fresh Qwen2 model in the Qwen2.5-0.5B shape (random bf16
weights), one batch of left-padded prompt rows, the engine called directly.

Each variant runs in this process after `torch._dynamo.reset()` and prints one line; the full record (and any error's
traceback) goes to `--json`:

- `compile`: the engine as shipped (inductor, mode="reduce-overhead", fullgraph); `inductor`: inductor without CUDA
  graphs; `dynamo`: Dynamo alone (backend="eager"); `eager`: no compile. Others can be given by name (`VARIANTS`).
- per variant: whether every bucket compiled (`fell_back`: a bucket left eager), the first call's seconds (compile),
  median ms per decoded token over `--calls` timed calls, Inductor's cudagraph skip counter, graph partitions,
  launches and kernels per token (one profiled call), peak allocated and reserved memory, and, for the variants that
  keep the engine's weights in place, whether an in-place weight update changes the tokens without re-recording.

    python benchmarks/gpu_probe.py --variants compile,inductor,dynamo --json probe.json
    python benchmarks/gpu_probe.py --device cpu --shape smoke --variants dynamo,eager   # a CPU check of the script
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))

import _gpu_worker  # noqa: E402
import torch  # noqa: E402

VARIANTS = {
    "compile": {},  # the engine's own compile_kwargs
    "inductor": {"mode": None},
    "dynamo": {"backend": "eager", "mode": None},
    "eager": None,
    "top_p": {},  # as compile, with top_p=0.95
    "no_gqa": {},  # as compile, with grouped-query decode attention off (repeat_kv)
}


class _Lines(logging.Handler):
    def __init__(self, lines: list[str]):
        super().__init__(logging.DEBUG)
        self.lines = lines

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.name}: {self.format(record)}"[:8000])


def build_model(shape: str, device: str):
    from transformers import AutoModelForCausalLM, Qwen2Config

    vocab = _gpu_worker.SMOKE_VOCAB_SIZE if shape == "smoke" else _gpu_worker.QWEN_VOCAB_SIZE
    config = Qwen2Config(
        vocab_size=vocab,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        rope_theta=1_000_000.0,
        max_position_embeddings=32_768,
        use_sliding_window=False,
        eos_token_id=vocab - 1,
        pad_token_id=0,
        **_gpu_worker.SHAPES[shape],
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    return model.eval()


def prompts(rows: int, group: int, length: int, vocab: int, device: str):
    """Left-padded prompt rows, `group` identical rows per prompt, lengths from length/2 to length."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(1, vocab - 2, (rows // group, length), generator=generator)
    mask = torch.ones_like(ids)
    for i in range(ids.size(0)):
        pad = (i * length // 2) // max(ids.size(0) - 1, 1)
        ids[i, :pad], mask[i, :pad] = 0, 0
    return ids.repeat_interleave(group, 0).to(device), mask.repeat_interleave(group, 0).to(device)


def counters() -> dict:
    from torch._dynamo.utils import counters as dynamo_counters

    inductor = dict(dynamo_counters["inductor"])
    return {
        "cudagraph_skips": int(inductor.get("cudagraph_skips", 0)),
        "graph_partitions": {k: v for k, v in inductor.items() if "partition" in k},
        "recompiles": int(dynamo_counters["stats"].get("unique_graphs", 0)),
        "graph_breaks": sum(dynamo_counters["graph_break"].values()),
    }


def launches(engine, model, ids, mask) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        out = engine.sample(model, ids, mask)
        torch.cuda.synchronize()
    kernels, launch_names = _gpu_worker.kernels_and_launches(prof)
    host = sum(launch_names.values())
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=15)
    return {"kernels_per_token": kernels / out.size(1), "launches_per_token": host / out.size(1), "kernels": table}


def run_variant(name: str, model, ids, mask, args, log_lines: list[str]) -> dict:
    from transformers import GenerationConfig

    from grpo_hf.rollout.cuda_graph import CUDAGraphEngine

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    cuda = args.device == "cuda"
    settings = {"top_p": 0.95} if name == "top_p" else {}
    config = GenerationConfig(
        do_sample=True, max_new_tokens=args.tokens, pad_token_id=0, eos_token_id=[-1], top_k=0, **settings
    )
    engine = CUDAGraphEngine(config, [model.config.vocab_size - 1], compile=VARIANTS[name] is not None)
    if VARIANTS[name]:
        engine.compile_kwargs = {**engine.compile_kwargs, **VARIANTS[name]}
    if name == "no_gqa":
        engine.grouped_query_attention = False
    record: dict = {"variant": name, "compile_kwargs": engine.compile_kwargs if VARIANTS[name] is not None else None}
    first = len(log_lines)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    try:
        start = time.perf_counter()
        engine.sample(model, ids, mask)
        if cuda:
            torch.cuda.synchronize()
        record["first_call_s"] = time.perf_counter() - start
        times = []
        for _ in range(args.calls):
            start = time.perf_counter()
            out = engine.sample(model, ids, mask)
            if cuda:
                torch.cuda.synchronize()
            times.append((time.perf_counter() - start) / out.size(1))
        record["ms_per_token"] = 1000 * statistics.median(times)
        record["ms_per_token_mean"] = 1000 * statistics.fmean(times)
        record["fell_back"] = any(b.eager for b in engine._buckets.values())
        record.update(counters())
        if name == "compile":
            record["weight_update"] = weight_update(engine, model, ids, mask)
        if cuda:
            record["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
            record["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
            if not record["fell_back"]:  # an eager decode makes ~10^5 events per call: minutes of profiling
                record.update(launches(engine, model, ids, mask))

    except Exception as error:  # the probe goes on to the next variant
        record["error"] = f"{type(error).__name__}: {error}"[:2000]
        record["traceback"] = traceback.format_exc()[-12000:]
    record["log"] = log_lines[first:]
    return record


def weight_update(engine, model, ids, mask) -> dict:
    """An in-place update of the weights: the next call draws other tokens and records no new graph."""
    torch.manual_seed(5)
    before = engine.sample(model, ids, mask)
    from torch._dynamo.utils import counters as dynamo_counters

    graphs = int(dynamo_counters["stats"].get("unique_graphs", 0))
    with torch.no_grad():
        model.lm_head.weight.mul_(1.5)
    torch.manual_seed(5)
    after = engine.sample(model, ids, mask)
    with torch.no_grad():
        model.lm_head.weight.div_(1.5)
    return {
        "tokens_changed": bool((before != after).any()),
        "new_graphs": int(dynamo_counters["stats"].get("unique_graphs", 0)) - graphs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default="compile,no_gqa,top_p", help=f"Comma-separated: {', '.join(VARIANTS)}")
    parser.add_argument("--shape", default="0.5B", choices=sorted(_gpu_worker.SHAPES))
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--prompt-length", type=int, default=160)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    log_lines: list[str] = []
    handler = _Lines(log_lines)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger("grpo_hf")
    logger.setLevel(logging.DEBUG)
    logger.addHandler(handler)
    model = build_model(args.shape, args.device)
    ids, mask = prompts(args.rows, args.group, args.prompt_length, model.config.vocab_size, args.device)
    import transformers

    info = {"torch": torch.__version__, "transformers": transformers.__version__, "device": args.device}
    if args.device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    print(f"# gpu_probe: {info}; {args.rows} rows x {args.tokens} tokens, prompts up to {args.prompt_length}")
    records = []
    for name in [v.strip() for v in args.variants.split(",") if v.strip()]:
        record = run_variant(name, model, ids, mask, args, log_lines)
        records.append(record)
        keys = ("first_call_s", "ms_per_token", "fell_back", "cudagraph_skips", "launches_per_token", "weight_update")
        print(f"{name}: " + ", ".join(f"{k}={record[k]}" for k in (*keys, "error") if k in record), flush=True)
        if "traceback" in record:
            print(record["traceback"][-4000:], flush=True)
        if args.json:  # after every variant: a probe stopped by a time limit keeps what it measured
            with open(args.json, "w") as f:
                json.dump({"info": info, "args": vars(args), "records": records}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
