"""One GRPO step with dynamic sampling, run under torchrun with 1 or 2 CPU processes (gloo).

    python tests/distributed/dynamic_sampling_step.py OUT_DIR MAX_ROUNDS [MAX_ROUNDS ...]

Half the prompts are "flat": every completion of theirs gets the same reward, so their groups carry no
signal and dynamic sampling must drop them and refill with fresh prompts. Completions are a deterministic
function of the prompt and the copy inside its group, so every process layout sees the same ones; the
rest (rewards, gather, selection, refill, advantages, loss, backward, optimizer step) is the real trainer.
Each MAX_ROUNDS trains its own trainer, one after the other in this launch; each writes the trained rows (prompt,
reward, advantage), the dynamic-sampling metrics, the loss and the parameters to `OUT_DIR/rounds_MAX_ROUNDS.pt`.
"""

import json
import os
import sys
from pathlib import Path

import torch
from datasets import Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for conftest's builders

from conftest import exit_without_teardown, fresh_accelerator, make_trainer, tiny_run_args  # noqa: E402

from grpo_hf import GRPOTrainer  # noqa: E402
from grpo_hf.rollout import RolloutEngine, register_engine  # noqa: E402

GLOBAL_BATCH, G, T = 16, 4, 6


class PromptCopyEngine(RolloutEngine):
    """Completion k of a group of the prompt with ids p: tokens depend on (sum(p), k) only, so the same prompt gives
    the same group wherever it lands (process, round, position)."""

    def sample(self, model, prompt_ids, prompt_mask):
        seed = (prompt_ids * prompt_mask).sum(dim=1, keepdim=True)  # [B, 1]
        copy = torch.zeros_like(seed)
        for i in range(1, seed.size(0)):  # the copies of one prompt are consecutive rows
            copy[i] = copy[i - 1] + 1 if bool((prompt_ids[i] == prompt_ids[i - 1]).all()) else 0
        completion_ids = (seed * 5 + copy * 11 + torch.arange(T) * 3) % 200 + 10  # [B, T] ordinary byte tokens
        rows = torch.arange(seed.size(0))
        completion_ids[rows, T - 1 - copy.flatten() % 3] = self.eos_token_ids[0]  # lengths 6, 5, 4, 6, ...
        return completion_ids


def reward(prompts, completion_ids, kind, **kwargs):
    """Flat prompts: 1.0 for every completion. Others: a number that differs between the copies of a group."""
    pairs = zip(kind, completion_ids, strict=True)
    return [1.0 if k == "flat" else float(len(ids) + sum(ids) % 3) for k, ids in pairs]


def build_trainer(out_dir: str, max_rounds: int, kinds: list[str], world_size: int = 1, **overrides) -> GRPOTrainer:
    register_engine("prompt_copy", PromptCopyEngine)
    fresh_accelerator()  # per trainer of the launch
    dataset = Dataset.from_dict({"prompt": [f"Prompt {i} {k}" for i, k in enumerate(kinds)], "kind": kinds})
    settings = dict(
        per_device_train_batch_size=GLOBAL_BATCH // world_size,
        num_generations=G,
        max_completion_length=T,
        max_steps=1,
        optim="sgd",
        learning_rate=10.0,
        loss_type="dapo",
        beta=0.04,
        shuffle_dataset=False,
        dynamic_sampling=True,
        dynamic_sampling_max_rounds=max_rounds,
        log_completions=True,
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        rollout_engine="prompt_copy",
    )
    return make_trainer(tiny_run_args(out_dir, settings, **overrides), reward, dataset, model_seed=5)


def train_and_save(out_dir: Path, max_rounds: int, world_size: int) -> GRPOTrainer:
    kinds = ["flat" if i % 2 == 0 else "varied" for i in range(12)]
    run_dir = out_dir / f"run_{world_size}_{max_rounds}"
    trainer = build_trainer(str(run_dir), max_rounds, kinds, world_size)
    trainer.train()
    if trainer.accelerator.is_main_process:
        logs = next(h for h in trainer.state.log_history if "loss" in h)
        params = {n: p.detach().clone() for n, p in trainer.accelerator.unwrap_model(trainer.model).named_parameters()}
        logged = [json.loads(line) for line in (run_dir / "completions.jsonl").read_text().splitlines()]
        rows = [(row["prompt"], row["rewards"]["reward"], row["advantage"]) for row in logged]
        torch.save({"rows": rows, "logs": logs, "params": params}, out_dir / f"rounds_{max_rounds}.pt")
    trainer.accelerator.wait_for_everyone()
    return trainer


def main(out_dir: str, rounds: list[int]) -> None:
    # PartialState is a singleton: the Trainer creates it (use_cpu -> gloo); the world size comes from torchrun.
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    for max_rounds in rounds:
        trainer = train_and_save(Path(out_dir), max_rounds, world_size)
    # Leave together: a rank that exits while gloo still has the other connected can abort at shutdown.
    trainer.accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1], [int(arg) for arg in sys.argv[2:]])
    exit_without_teardown()
