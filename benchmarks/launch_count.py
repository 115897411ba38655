"""Operator calls in the training half of one optimizer step, TRL against each grpo_hf log-prob path: GPU kernel
launches, approximated on a CPU with `torch.profiler`.

Config J1 (`_worker.CONFIGS`: G=8, 256 completion tokens, beta=0.04, bf16, one micro-batch, the knobs `_worker.py`
sets) on shape "0.5B/8" (`_worker.SHAPES`: Qwen2.5-0.5B's 24 layers, 14 heads, 2 KV heads, tied embeddings and 151,936
tokens at 1/8 of its widths; counts do not see widths, and the vocabulary sets the log-softmax chunks). Each path is
one `_worker.build_trainer` run in a process of its own: two optimizer steps, the second profiled from `on_step_begin`
to `on_step_end`. An operator's phase is the innermost range it ran in: generation (`generate` of transformers and of
grpo_hf's `RolloutEngine`; not recorded) and rewards: dropped; no-grad log-probs (the reference forward: TRL's
`_get_per_token_logps_and_entropies` without grad, grpo_hf's `LogprobPath.no_grad`); rollout bookkeeping (the rest of
`_prepare_inputs`: masks, advantages, metrics; not in the total); loss fwd+bwd (the rest of `training_step`: a CPU
runs backward on the calling thread); optimizer and rest (clip, AdamW, zero_grad).

A launch is an `aten::` operator below which nothing counts (`aten::linear` launches nothing itself, its `aten::addmm`
does), but not one of `NO_KERNEL` (views, metadata, allocation, `.item()`); an operator whose only launches are a
CPU's `HELPERS` (casting a scalar input, filling a reduction's output: a GPU kernel does it itself) counts once; so
does a `_foreach_*` operator (a few fused launches on CUDA, a loop over the tensors on a CPU), and AdamW runs
`foreach=True`, CUDA's default. Host syncs apart: `_local_scalar_dense` (`.item()`, `.tolist()`, `bool(tensor)`; not
in `Optimizer.step`, whose step counts a GPU keeps on the CPU too), `nonzero`, `equal`. Not seen: copies of new
tensors to the device. TRL's fused LM head launches Triton kernels on a GPU and folds its tiles in torch on a CPU: path
`trl-triton` takes the GPU's branch (completion positions only) and counts each Triton launch and fp32-output addmm
once (`model_trl_triton`); path `trl` is TRL as it runs on a CPU.

    python benchmarks/launch_count.py --prompts 2              # the table of docs/benchmarks.md: 8 GB peak RSS
    python benchmarks/launch_count.py                          # J1's 8 prompts: 11 GB, about 20 GB on padded paths
    python benchmarks/launch_count.py --prompts 1 --length 16 --layers 2 --paths trl-triton,per-group --json c.json
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import resource
import subprocess
import sys
import tempfile
import types
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _worker  # noqa: E402  (the standard library only, at import time)


def grpo_hf(share: bool, per_group: bool, chunk: int | None = None) -> dict:
    """The fields whose defaults depend on the device, always passed."""
    return dict(share_prompt_prefix=share, backward_per_group=per_group, logprob_chunk_size=chunk)


GPU_CHUNK = 2**28 // _worker.VOCAB["0.5B/8"]  # positions per log-softmax chunk CUDA's default picks: 1,766
PATHS = {  # name: (label, trainer, grpo_hf's fields)
    "trl-triton": ("TRL 1.16, Triton LM head (as on a GPU)", "trl", {}),
    "trl": ("TRL 1.16, LM head folded in torch (as on a CPU)", "trl", {}),
    "per-group": ("grpo_hf: shared prefix, per-group backward", "grpo_hf", grpo_hf(True, True)),
    "shared": ("grpo_hf: shared prefix, one backward", "grpo_hf", grpo_hf(True, False)),
    "padded": ("grpo_hf: padded batch, one backward, 55-position chunks", "grpo_hf", grpo_hf(False, False)),
    "padded-gpu-chunk": (f"grpo_hf: padded batch, one backward, {GPU_CHUNK:,}-position chunks", "grpo_hf",
                         grpo_hf(False, False, GPU_CHUNK)),
}  # fmt: skip
PHASES = ["no-grad log-probs", "loss fwd+bwd", "optimizer and rest"]  # the training half
RANGES = {"count:generation": None, "count:rewards": None, "count:rollout": "rollout bookkeeping",
          "count:no-grad": "no-grad log-probs", "count:step": "loss fwd+bwd"}  # fmt: skip
UNITS = ("aten::_foreach_", "launch:")  # one launch each, whatever runs inside on a CPU
SYNCS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::equal"}
HELPERS = {"aten::to", "aten::fill_"}
NO_KERNEL = {f"aten::{name}" for name in (
    "view _unsafe_view _reshape_alias reshape view_as as_strided as_strided_ t t_ transpose transpose_ permute expand "
    "expand_as slice select unsqueeze unsqueeze_ squeeze squeeze_ unflatten flatten detach detach_ alias unbind split "
    "split_with_sizes chunk narrow diagonal movedim unfold resolve_conj resolve_neg _conj conj real empty empty_like "
    "empty_strided new_empty resize_ set_ lift_fresh contiguous to type_as result_type promote_types scalar_tensor "
    "item is_nonzero _local_scalar_dense is_same_size _has_compatible_shallow_copy_type broadcast_tensors"
).split()}  # fmt: skip


def tally(events) -> dict[str, Counter]:
    """Per phase: launches by operator, and `host syncs`."""
    counts = {phase: Counter() for phase in [*PHASES, "rollout bookkeeping"]}

    def launches(event) -> Counter:  # in the event's subtree; a range's go to its phase
        if event.name.startswith(UNITS):
            return Counter({event.name: 1})
        below, helpers = Counter(), 0
        for child in event.cpu_children:
            counted = launches(child)
            below.update(counted)
            helpers += counted.total() if child.name in HELPERS else 0
        if event.name in RANGES:
            if RANGES[event.name]:
                counts[RANGES[event.name]].update(below)
            return Counter()
        if event.name.startswith("aten::") and event.name not in NO_KERNEL and below.total() == helpers:
            return Counter({event.name: 1})
        return below

    for event in events:
        counts["optimizer and rest"].update(launches(event) if event.cpu_parent is None else {})
        scope = event.cpu_parent
        while scope is not None and scope.name not in RANGES and not scope.name.startswith("Optimizer.step#"):
            scope = scope.cpu_parent
        if event.name in SYNCS and (scope is None or RANGES.get(scope.name)):
            counts["optimizer and rest" if scope is None else RANGES[scope.name]]["host syncs"] += 1
    return counts


def in_range(name, fn, pause=None):
    """`fn` in a `record_function(name)` range (`name(args)`: chosen per call; None: none); `pause`: a profiler to
    stop recording while it runs."""
    import torch

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        chosen, cpu = name(args) if callable(name) else name, [torch.profiler.ProfilerActivity.CPU]
        with torch.profiler.record_function(chosen) if chosen else contextlib.nullcontext():
            if pause:
                pause.toggle_collection_dynamic(False, cpu)
            try:
                return fn(*args, **kwargs)
            finally:
                if pause:
                    pause.toggle_collection_dynamic(True, cpu)

    return wrapper


def model_trl_triton() -> None:
    """TRL's fused LM head takes its GPU branch; each Triton launch (a tile's fold, run by its torch version) and each
    fp32-output addmm (one kernel on CUDA, three operators here) counts as one launch."""
    import trl.kernels.chunked_logprob as kernels
    import trl.trainer.utils as utils

    kernels._use_triton = utils._use_triton = lambda device: True
    kernels.triton = types.SimpleNamespace(cdiv=lambda a, b: -(-a // b))
    for name, tile in (("_forward_kernel", kernels._forward_tile), ("_backward_kernel", kernels._backward_tile)):
        launch = in_range(f"launch: trl {name}", tile)
        setattr(kernels, name, type("Kernel", (), {"__getitem__": lambda self, grid, fn=launch: fn})())
    kernels._addmm_fp32 = in_range("launch: addmm(out_dtype=float32)", kernels._addmm_fp32)


def run(name: str, layers: int, prompts: int, length: int) -> dict:
    """Train two steps of one path, the second profiled: its counts, mean completion length and peak RSS."""
    import torch
    from transformers import GenerationMixin, TrainerCallback

    _, impl, fields = PATHS[name]
    profiler, lengths = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]), []
    foreach = {"__init__": functools.partialmethod(torch.optim.AdamW.__init__, foreach=True)}
    torch.optim.AdamW = type("AdamW", (torch.optim.AdamW,), foreach)  # Trainer imports it when it makes the optimizer
    if impl == "trl":
        from trl import GRPOTrainer

        no_grad = lambda args: None if torch.is_grad_enabled() else "count:no-grad"  # noqa: E731
        ranges = [(GenerationMixin, "generate", "count:generation"), (GRPOTrainer, "_calculate_rewards",
                  "count:rewards"), (GRPOTrainer, "_get_per_token_logps_and_entropies", no_grad)]  # fmt: skip
        if name == "trl-triton":
            model_trl_triton()
    else:
        import grpo_hf.experience as experience
        from grpo_hf import GRPOTrainer
        from grpo_hf.logprobs import LogprobPath
        from grpo_hf.rollout import RolloutEngine

        ranges = [(RolloutEngine, "generate", "count:generation"), (experience, "compute_rewards", "count:rewards"),
                  (LogprobPath, "no_grad", "count:no-grad")]  # fmt: skip
    ranges += [(GRPOTrainer, "_prepare_inputs", "count:rollout"), (GRPOTrainer, "training_step", "count:step")]
    for owner, attr, range_name in ranges:
        setattr(owner, attr, in_range(range_name, getattr(owner, attr), range_name == "count:generation" and profiler))

    class SecondStep(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 1:
                profiler.start()

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                profiler.stop()

        def on_log(self, args, state, control, logs=None, **kwargs):
            lengths.append((logs or {}).get("completions/mean_length"))

    with tempfile.TemporaryDirectory() as tmp:
        _worker.prepare("0.5B/8", f"{tmp}/model", "cpu", layers=layers)
        overrides, model = dict(prompts=prompts, max_completion_length=length), f"{tmp}/model"
        trainer = _worker.build_trainer(impl, "J1", 2, 0, "cpu", tmp, fields, model_dir=model, overrides=overrides)
        trainer.add_callback(SecondStep())
        trainer.train()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"counts": tally(profiler.events()), "mean_length": lengths[1], "peak_rss_mib": rss}


def table(records: dict[str, dict]) -> str:
    lines = ["| path | " + " | ".join(PHASES) + " | total | vs first row | host syncs | rollout bookkeeping (syncs) |",
             "|---|" + "---:|" * (len(PHASES) + 4)]  # fmt: skip
    base = None
    for name, record in records.items():
        n = {phase: sum(counts.values()) - counts.get("host syncs", 0) for phase, counts in record["counts"].items()}
        syncs = {phase: counts.get("host syncs", 0) for phase, counts in record["counts"].items()}
        total = sum(n[phase] for phase in PHASES)
        base = base or total
        cells = [f"{n[phase]:,}" for phase in PHASES] + [f"**{total:,}**", f"{total / base:.2f}x"]
        rollout = f"{n['rollout bookkeeping']:,} ({syncs['rollout bookkeeping']})"
        cells += [str(sum(syncs[phase] for phase in PHASES)), rollout]
        lines.append(f"| {PATHS[name][0]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--paths", default=",".join(PATHS), help=f"Comma-separated, of {', '.join(PATHS)}.")
    parser.add_argument("--layers", type=int, default=24, help="Decoder layers (default 24, Qwen2.5-0.5B's).")
    parser.add_argument("--prompts", type=int, default=8, help="Prompts per step, G=8 completions each (J1: 8).")
    parser.add_argument("--length", type=int, default=256, help="max_completion_length (J1: 256).")
    parser.add_argument("--json", default=None, help="Also write each path's counts, by operator, to this file.")
    parser.add_argument("--run", choices=list(PATHS), help=argparse.SUPPRESS)  # one path, in this process
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    shape = dict(layers=args.layers, prompts=args.prompts, length=args.length)
    if args.run:
        return Path(args.out).write_text(json.dumps(run(args.run, **shape)))
    if set(names := args.paths.split(",")) - set(PATHS):
        raise SystemExit(f"--paths: of {', '.join(PATHS)}")
    print(f"# launch_count: {args.layers} layers, {args.prompts} prompts x 8 completions of {args.length} tokens; "
          "the second of 2 steps", flush=True)  # fmt: skip
    records = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            out, options = f"{tmp}/{name}.json", [f"--{key}={value}" for key, value in shape.items()]
            command = [sys.executable, __file__, "--run", name, "--out", out, *options]
            done = subprocess.run(command, capture_output=True)
            if done.returncode != 0:
                raise SystemExit(f"{name} failed:\n{done.stderr.decode()[-4000:]}")
            records[name] = record = json.loads(Path(out).read_text())
            print(f"  {name}: mean length {record['mean_length']:.1f}, peak RSS {record['peak_rss_mib']:,.0f} MiB")
    print(f"\n{table(records)}")
    if args.json:
        Path(args.json).write_text(json.dumps({"shape": shape, "records": records}, indent=1))


if __name__ == "__main__":
    main()
