"""Two machines on one host: the same short runs under one `torch.distributed.run` of 2 processes, or two of 1 process
each (`--nnodes 2 --node_rank 0|1`, rendezvous on 127.0.0.1), each "machine" with its own working directory,
TMPDIR and caches (tests/test_nodes.py sets them):

    python -m torch.distributed.run --nnodes 2 --node_rank R --nproc_per_node 1 --master_addr 127.0.0.1 \
        --master_port P tests/distributed/nodes.py RESULTS_DIR SHARED_DIR

Cases, each 2 steps of the tiny model with a checkpoint at step 2 and the completions log on: DDP, FSDP2, the
asynchronous producer at max_staleness=1, and recipes/gsm8k.py (its offline model alias, converted per node into the
node's cache by a stand-in for the GGUF conversion; its curve PNG and trainer_state.json). Every process writes
RESULTS_DIR/rank<R>.pt: its node, each case's logs and final parameters, the files it opened for writing under
SHARED_DIR and its node's directories (a `sys.addaudithook` hook), and the conversions it made.
"""

import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for conftest's builders

from conftest import (  # noqa: E402
    TRAINING,
    build_tiny_model,
    build_tiny_tokenizer,
    exit_without_teardown,
    fresh_accelerator,
    load_recipe,
)

RANK = int(os.environ.get("RANK", "0"))
CASES = {
    "ddp": {},
    "fsdp2": dict(fsdp="full_shard", fsdp_config={"version": 2, "state_dict_type": "SHARDED_STATE_DICT"}),
    "async1": dict(max_staleness=1),
}
SAVING = dict(save_strategy="steps", save_steps=2, log_completions=True, num_completions_to_print=0)


def text_reward(completions, **kwargs):
    """Varies within a group on a random model (the recipe's rewards are all 0 there)."""
    return [sum(map(ord, c[0]["content"])) % 7 / 7 for c in completions]


def record_writes(roots: list[str]) -> list[str]:
    """Every file this process opens for writing under `roots`, in order (audit event "open")."""
    writes: list[str] = []
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND

    def hook(event, args):
        if event != "open" or not isinstance(args[0], str | bytes):
            return
        path, mode, flags = os.fsdecode(args[0]), args[1], args[2] or 0
        if (mode and any(c in mode for c in "wax+")) or (not mode and flags & write_flags):
            path = os.path.abspath(path)
            if any(path.startswith(root + os.sep) for root in roots):
                writes.append(path)

    sys.addaudithook(hook)
    save = torch.save

    def audited_save(obj, f, *args, **kwargs):  # a path goes to torch's C++ writer, which raises no audit event
        if isinstance(f, str | os.PathLike):
            sys.audit("open", os.fspath(f), "wb", 0)
        return save(obj, f, *args, **kwargs)

    torch.save = audited_save
    return writes


def full_parameters(trainer) -> torch.Tensor:
    """[N] every parameter of the trained policy, gathered whole (FSDP2 shards are DTensors)."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    parts = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
    return torch.cat([p.detach().reshape(-1).float() for p in parts])


def train_case(name: str, shared: Path) -> dict:
    from conftest import make_trainer, tiny_run_args

    from grpo_hf import GRPOTrainer

    fresh_accelerator()
    settings = {**TRAINING, "rollout_engine": "loop", **SAVING, **CASES[name]}
    trainer = make_trainer(tiny_run_args(shared / name, settings), trainer_cls=GRPOTrainer, model_seed=5)
    trainer.train()
    params = full_parameters(trainer)
    logs = [row for row in trainer.state.log_history if "loss" in row]
    trainer.accelerator.wait_for_everyone()
    return {"logs": logs, "params": params}


def run_recipe(shared: Path) -> tuple[dict, list[str]]:
    """recipes/gsm8k.py on the offline alias, the GGUF model read replaced by the tiny model (each call recorded):
    what runs once per node is seen without converting 135M parameters."""
    fresh_accelerator()
    recipe = load_recipe("gsm8k")
    from grpo_hf import offline_model

    conversions: list[str] = []

    def dequantized(gguf_dir, gguf_file):  # the conversion's reading part; its writing part runs as it is
        conversions.append(str(offline_model.default_cache_dir()))
        time.sleep(2)  # as long as a real conversion takes against the other processes' start: unguarded, all convert
        tokenizer = build_tiny_tokenizer()
        return build_tiny_model(tokenizer, "qwen2", seed=5, tied=True), tokenizer

    offline_model.dequantized_model = dequantized
    argv = ["--model_name_or_path", offline_model.OFFLINE_MODEL_ID, "--dataset_name", "builtin:arithmetic"]
    argv += ["--num_train_examples", "4", "--eval_before", "false", "--eval_after", "false", "--max_steps", "2"]
    argv += ["--per_device_train_batch_size", "4", "--num_generations", "2", "--max_completion_length", "8"]
    argv += ["--learning_rate", "1e-2", "--use_cpu", "true", "--report_to", "none", "--disable_tqdm", "true"]
    argv += ["--reward_funcs", "nodes:text_reward", "--output_dir", str(shared / "recipe"), "--seed", "0"]
    argv += ["--save_strategy", "steps", "--save_steps", "2", "--log_completions", "true"]
    argv += ["--num_completions_to_print", "0", "--logging_steps", "1"]
    recipe.main(argv)
    torch.distributed.barrier()  # process 0 wrote trainer_state.json last
    state = json.loads((shared / "recipe" / "trainer_state.json").read_text())
    return {"logs": [row for row in state["log_history"] if "loss" in row]}, conversions


def main(results_dir: str, shared_dir: str) -> None:
    from sharded import allow_fsdp_on_cpu

    shared = Path(shared_dir)
    node_dirs = [os.environ[key] for key in ("NODE_DIR",) if key in os.environ]
    writes = record_writes([str(shared), *node_dirs])
    allow_fsdp_on_cpu()
    cases = {name: train_case(name, shared) for name in CASES}
    cases["recipe"], conversions = run_recipe(shared)
    result = {
        "node": int(os.environ.get("GROUP_RANK", "0")),
        "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
        "cases": cases,
        "writes": writes,
        "conversions": conversions,
    }
    torch.save(result, Path(results_dir) / f"rank{RANK}.pt")
    torch.distributed.barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    exit_without_teardown()
