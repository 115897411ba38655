"""Peak memory per process, DDP against FSDP2, on 2 CPU processes (gloo): what sharding saves.

    python benchmarks/sharded_memory.py [--hidden 768] [--layers 12] [--steps 2]

Each layout is launched fresh with `torch.distributed.run --nproc_per_node 2`: a Llama-shaped model built from a
config (random weights, the tests' byte-level tokenizer; `--hidden 768 --layers 12` is about 85M parameters, fp32),
beta 0.04 (a separate reference model), AdamW, one group of 4 completions of 16 tokens per process, `--steps`
optimizer steps. Each process reports its peak RSS (`getrusage`) and its RSS before the model was built (Python,
torch and the libraries), so the difference is what the model, its reference, gradients, optimizer state and the
step's activations cost. FSDP2 runs through accelerate's own FSDP2 code path, allowed on CPU by the test harness's
patch (`tests/distributed/sharded.py`, `allow_fsdp_on_cpu`): accelerate enables FSDP only on accelerator devices.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(layout: str, hidden: int, layers: int, steps: int, out: str) -> None:
    """One process of one layout: train, then write this process's memory figures to `out`.<rank>.json."""
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "distributed")]
    import torch
    from conftest import build_tiny_model, build_tiny_tokenizer
    from datasets import Dataset
    from sharded import FSDP2, allow_fsdp_on_cpu, reward

    from grpo_hf import GRPOConfig, GRPOTrainer

    allow_fsdp_on_cpu()
    tokenizer = build_tiny_tokenizer()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    model = build_tiny_model(tokenizer, hidden_size=hidden, num_layers=layers)
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(),
        num_generations=4,
        per_device_train_batch_size=4,
        max_completion_length=16,
        max_steps=steps,
        beta=0.04,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        **(FSDP2 if layout == "fsdp2" else {}),
    )
    dataset = Dataset.from_dict({"prompt": [f"Prompt number {i}" for i in range(8)]})
    trainer = GRPOTrainer(model, reward, args, train_dataset=dataset, processing_class=tokenizer)
    trainer.train()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    params = sum(p.numel() for p in model.parameters()) if layout == "ddp" else None
    rank = torch.distributed.get_rank()
    found = {"before_mib": before / 1024, "peak_mib": peak / 1024, "params": params}
    Path(f"{out}.{rank}.json").write_text(json.dumps(found))
    torch.distributed.barrier()
    os._exit(0)  # as tests/conftest.exit_without_teardown: gloo's threads can abort at interpreter teardown


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--child", nargs=2, metavar=("LAYOUT", "OUT"), help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.child:
        child(options.child[0], options.hidden, options.layers, options.steps, options.child[1])
        return
    sizes = ["--hidden", str(options.hidden), "--layers", str(options.layers), "--steps", str(options.steps)]
    print(f"Llama from a config, hidden {options.hidden}, {options.layers} layers, 2 CPU processes (gloo)")
    print(f"{'layout':8} {'process':>7} {'before model MiB':>17} {'peak MiB':>9} {'peak - before':>14}")
    with tempfile.TemporaryDirectory() as tmp:
        for layout in ("ddp", "fsdp2"):
            out = os.path.join(tmp, layout)
            launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__]
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            subprocess.run([*launch, *sizes, "--child", layout, out], check=True, env=env, capture_output=True)
            for rank in (0, 1):
                found = json.loads(Path(f"{out}.{rank}.json").read_text())
                if found["params"]:
                    print(f"(the model has {found['params'] / 1e6:.1f}M parameters)")
                growth = found["peak_mib"] - found["before_mib"]
                print(f"{layout:8} {rank:>7} {found['before_mib']:>17.0f} {found['peak_mib']:>9.0f} {growth:>14.0f}")


if __name__ == "__main__":
    main()
