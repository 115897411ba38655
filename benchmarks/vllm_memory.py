"""Peak memory of vLLM colocate on this CPU, and TRL's vLLM training scripts one after another in one process.

    python benchmarks/vllm_memory.py table [--steps 3]   # needs vllm (.venv-vllm/bin/python)
    python benchmarks/vllm_memory.py trl-scripts [--steps 3]

`table`: the demo config (recipes/gsm8k_cpu.yaml: SmolLM2-135M-Instruct, 16 completions of up to 40 tokens per
step), `--steps` optimizer steps without the evaluations, once per row in a fresh process
(`recipes/gsm8k.py`), with the `loop` engine and with `use_vllm=True` at two KV-cache sizes
(`vllm_cpu_kvcache_space`). Peak RSS of each process from `os.wait4`.

`trl-scripts`: TRL 1.16's vLLM training tests (`test_train_vllm`, `test_train_vllm_and_peft`, the three
`test_train_vllm_importance_sampling_correction` cases, `test_train_vllm_with_additional_generation_kwargs`) in
their shape, run one after another in this process: their settings (learning rate 0.1, 3 completions of 8 tokens
per step, `use_vllm=True`), with the offline SmolLM2-135M-Instruct for TRL's Qwen2.5-0.5B-Instruct, a reward
function for TRL's tiny reward model (neither Hub model is reachable here), `--steps` steps each and a 1 GiB KV
cache. For each: its outcome (passed, or the message it stopped with) and its peak and final RSS (VmHWM reset
before each through /proc/self/clear_refs).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def table(steps: int) -> None:
    rows = [
        ("loop", {"rollout_engine": "loop"}),
        ("vllm, vllm_cpu_kvcache_space=2 (default)", {"use_vllm": "true"}),
        ("vllm, vllm_cpu_kvcache_space=1", {"use_vllm": "true", "vllm_cpu_kvcache_space": "1"}),
    ]
    for name, flags in rows:
        with tempfile.TemporaryDirectory() as output_dir, tempfile.TemporaryFile("w+") as log:
            command = [sys.executable, "recipes/gsm8k.py", "--config", "recipes/gsm8k_cpu.yaml"]
            command += ["--max_steps", str(steps), "--eval_before", "false", "--eval_after", "false"]
            command += [
                "--output_dir",
                output_dir,
                *[part for item in flags.items() for part in ("--" + item[0], item[1])],
            ]
            process = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=log)
            _, status, usage = os.wait4(process.pid, 0)  # this child's own peak RSS (KiB)
            process.returncode = os.waitstatus_to_exitcode(status)
            log.seek(0)
            tail = log.read()[-3000:]
        print(json.dumps({"row": name, "ok": process.returncode == 0, "peak_rss_mib": usage.ru_maxrss // 1024}))
        if process.returncode != 0:
            print(tail, file=sys.stderr)


def _memory() -> dict[str, int]:
    status = Path("/proc/self/status").read_text()
    return {key: int(re.search(key + r":\s+(\d+)", status).group(1)) // 1024 for key in ("VmRSS", "VmHWM")}


def trl_scripts(steps: int) -> None:
    import torch
    from datasets import Dataset
    from peft import LoraConfig

    from grpo_hf import GRPOConfig, GRPOTrainer, offline_model_path

    model_path = offline_model_path()
    prompts = ["The sky is", "The sun is", "Beautiful is better than", "Explicit is better than", "Simple is better"]
    dataset = Dataset.from_dict({"prompt": prompts * 4})

    def reward(completions, **kwargs):
        return [float(len(set(completion))) for completion in completions]

    peft = LoraConfig(target_modules="all-linear", modules_to_save=["embed_tokens", "lm_head"])
    scripts = [
        ("test_train_vllm", {}, None),
        ("test_train_vllm_and_peft", {}, peft),
        ("test_train_vllm_importance_sampling_correction[None-3.0]", {"vllm_importance_sampling_clip_max": 3.0}, None),
        ("test_train_vllm_importance_sampling_correction[0.5-None]",
         {"vllm_importance_sampling_clip_min": 0.5, "vllm_importance_sampling_clip_max": None}, None),
        ("test_train_vllm_importance_sampling_correction[0.5-5.0]",
         {"vllm_importance_sampling_clip_min": 0.5, "vllm_importance_sampling_clip_max": 5.0}, None),
        ("test_train_vllm_with_additional_generation_kwargs",
         {"top_p": 0.9, "top_k": 10, "min_p": 0.01, "repetition_penalty": 1.1}, None),
    ]  # fmt: skip
    print(json.dumps({"script": "(start)", **_memory()}), flush=True)
    for name, settings, peft_config in scripts:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        before = _memory()["VmRSS"]
        outcome = "passed"
        with tempfile.TemporaryDirectory() as output_dir:
            args = GRPOConfig(
                output_dir=output_dir, learning_rate=0.1, per_device_train_batch_size=3, num_generations=3,
                max_completion_length=8, report_to="none", use_vllm=True, max_steps=steps, use_cpu=True,
                vllm_cpu_kvcache_space=1, save_strategy="no", **settings,
            )  # fmt: skip
            try:
                trainer = GRPOTrainer(model_path, reward, args, train_dataset=dataset, peft_config=peft_config)
                previous = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
                trainer.train()
                assert trainer.state.log_history[-1]["train_loss"] is not None
                unchanged = [n for n, p in previous.items() if torch.equal(p, trainer.model.get_parameter(n))]
                if unchanged:
                    outcome = f"failed: {len(unchanged)} trained parameters unchanged, e.g. {unchanged[0]}"
            except Exception as error:  # the script stops: its message is the outcome
                outcome = f"stopped: {type(error).__name__}: {str(error)[:300]}"
            trainer = previous = None
            gc.collect()
        print(json.dumps({"script": name, "outcome": outcome, "before": before, "peak": _memory()["VmHWM"],
                          "after": _memory()["VmRSS"]}), flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["table", "trl-scripts"])
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    table(args.steps) if args.what == "table" else trl_scripts(args.steps)


if __name__ == "__main__":
    main()
