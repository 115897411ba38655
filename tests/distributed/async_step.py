"""Asynchronous GRPO under torchrun with 2 CPU processes (gloo): the producer thread at max_staleness 0 against the
synchronous run, a run at max_staleness 1, and one with dynamic sampling at max_staleness 1 (half the prompts get
the same reward for every completion: their groups are dropped and refilled, by every process alike).

    python -m torch.distributed.run --nproc_per_node=2 tests/distributed/async_step.py OUT.pt

Each process samples with the `loop` engine from its own producer (no collective call in it); everything collective
stays on the main thread. Writes each run's parameters and logs to OUT.pt (main process).
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for conftest's builders

from conftest import TRAINING, exit_without_teardown, make_trainer, tiny_run_args  # noqa: E402

from grpo_hf import AsyncGRPOTrainer, GRPOTrainer  # noqa: E402


def half_flat(prompts, completion_ids, **kwargs):
    numbers = [int(prompt.split()[1].rstrip(":")) for prompt in prompts]
    return [1.0 if n % 2 == 0 else float(sum(ids) % 7) for n, ids in zip(numbers, completion_ids, strict=True)]


def run(out_dir: Path, trainer_cls, reward=None, **overrides) -> dict:
    settings = {**TRAINING, "max_steps": 3, "rollout_engine": "loop", "per_device_train_batch_size": 2, **overrides}
    kwargs = {} if reward is None else {"reward": reward}
    trainer = make_trainer(tiny_run_args(out_dir, settings), trainer_cls=trainer_cls, **kwargs)
    trainer.train()
    params = {n: p.detach().clone() for n, p in trainer.accelerator.unwrap_model(trainer.model).named_parameters()}
    logs = [row for row in trainer.state.log_history if "loss" in row]
    trainer.accelerator.wait_for_everyone()
    return {"params": params, "logs": logs, "main": trainer.accelerator.is_main_process}


def main(out_path: str) -> None:
    out = Path(out_path).parent
    results = {
        "sync": run(out / "sync", GRPOTrainer),
        "producer0": run(out / "producer0", AsyncGRPOTrainer),
        "stale1": run(out / "stale1", GRPOTrainer, max_staleness=1),
        "dynamic1": run(
            out / "dynamic1",
            GRPOTrainer,
            half_flat,
            max_staleness=1,
            dynamic_sampling=True,
            dynamic_sampling_max_rounds=3,
        ),
    }
    if results["sync"]["main"]:
        torch.save({name: {k: v for k, v in r.items() if k != "main"} for name, r in results.items()}, out_path)


if __name__ == "__main__":
    main(sys.argv[1])
    exit_without_teardown()
