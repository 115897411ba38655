"""One GRPO step on fixed rollouts, run under torchrun with 1 or 2 CPU processes (gloo).

    python tests/distributed/grpo_step.py OUT_DIR CASE [CASE ...]

Each CASE is `{grpo|dapo}-{1|2 accumulation steps}-{fast|padded}[-stream]`, trained by its own trainer one after the
other in this launch (as users run several trainers in one process), its step written to `OUT_DIR/CASE/step.pt`.
`stream`: the prompts come as a `datasets.IterableDataset` (`grpo_hf.streams`) instead of a `datasets.Dataset`.

Generation is replaced by a deterministic function of the *global* row index, so every process
layout sees the same completions; everything after it (rewards, gather, advantages, loss, DDP
backward, optimizer step) is the real trainer. Writes advantages, loss and parameters of each case.
"""

import os
import sys
from pathlib import Path

import torch
from accelerate import PartialState
from datasets import Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for conftest's builders

from conftest import exit_without_teardown, fresh_accelerator, make_trainer, tiny_run_args  # noqa: E402

from grpo_hf import GRPOTrainer  # noqa: E402
from grpo_hf.rollout import RolloutEngine, register_engine  # noqa: E402

GLOBAL_BATCH, G, T = 8, 8, 6


class FixedEngine(RolloutEngine):
    """Deterministic completions of varying lengths (some truncated), whatever the model: runs compare exactly."""

    def sample(self, model, prompt_ids, prompt_mask):
        return fixed_completions(prompt_ids, T, self.eos_token_ids[0])


def fixed_completions(prompt_ids, T: int, eos_token_id: int):
    """[B, T] completions that depend only on each row's global index: lengths vary, some are truncated."""
    B = prompt_ids.size(0)
    rows = torch.arange(B) + PartialState().process_index * B  # [B] global row index
    completion_ids = (rows.unsqueeze(1) * 7 + torch.arange(T) * 3) % 200 + 10  # [B, T] ordinary byte tokens
    eos_at = 1 + rows % T  # [B] varying lengths; rows with eos_at == T are truncated
    for i, k in enumerate(eos_at.tolist()):
        if k < T:
            completion_ids[i, k] = eos_token_id
    return completion_ids.to(prompt_ids.device)


def step_settings(G: int, T: int) -> dict:
    """The settings every layout of these one-step runs shares (SGD, one step, no shuffling, CPU): a preset of
    `tiny_run_args`, whose output directory is `run_dir(out_path)`."""
    return dict(
        num_generations=G,
        max_completion_length=T,
        max_steps=1,
        optim="sgd",
        beta=0.04,
        shuffle_dataset=False,
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )


def run_dir(out_path: str) -> Path:
    """The output directory of the run that writes its step to `out_path`."""
    return Path(out_path).parent / "run"


def save_step(trainer, out_path: str, last: bool = True, **extra) -> None:
    """Write the step's advantages (all processes'), loss and parameters to `out_path`; after the `last` trainer of
    the launch, leave together (a rank that exits while gloo still has the other connected can abort at shutdown)."""
    advantages = torch.cat([part.advantages for part in trainer._buffer])
    all_advantages = trainer.accelerator.gather(advantages)
    if trainer.accelerator.is_main_process:
        loss = next(h["loss"] for h in trainer.state.log_history if "loss" in h)
        params = {n: p.detach().clone() for n, p in trainer.accelerator.unwrap_model(trainer.model).named_parameters()}
        torch.save({"advantages": all_advantages, "loss": loss, "params": params, **extra}, out_path)
    trainer.accelerator.wait_for_everyone()
    if last:
        trainer.accelerator.end_training()


def build_trainer(out_path: str, stream: bool = False, **settings) -> GRPOTrainer:
    """The tiny model, 4 prompts and fixed rollouts (`FixedEngine`), with one step of this layout's `settings`."""
    register_engine("fixed", FixedEngine)
    fresh_accelerator()  # per trainer of the launch
    dataset = Dataset.from_dict({"prompt": [f"Prompt number {i}" for i in range(4)]})
    if stream:
        dataset = dataset.to_iterable_dataset()

    def reward(completion_ids, **kwargs):
        return [float(sum(ids) % 11) for ids in completion_ids]

    args = tiny_run_args(run_dir(out_path), step_settings(G, T), rollout_engine="fixed", **settings)
    return make_trainer(args, reward, dataset, model_seed=5)


def main(out_dir: str, cases: list[str]) -> None:
    # PartialState is a singleton: it must first be created by the Trainer (use_cpu -> gloo), so
    # the process count comes from torchrun's environment here.
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    for i, case in enumerate(cases):
        loss_type, accumulation, path, *stream = case.split("-")
        out_path = Path(out_dir, case, "step.pt")
        out_path.parent.mkdir(parents=True, exist_ok=True)
        trainer = build_trainer(
            str(out_path),
            stream == ["stream"],
            per_device_train_batch_size=GLOBAL_BATCH // world_size // int(accumulation),
            gradient_accumulation_steps=int(accumulation),
            share_prompt_prefix=path == "fast",  # the fast path (shared prompt, per-group backward): no DDP forward
            learning_rate=100.0,
            max_grad_norm=1e-3,  # always clips: the gradient must be averaged over processes before it is clipped
            loss_type=loss_type,
        )
        trainer.train()
        fast_path = trainer.logps.blocker(trainer.model_wrapped) is None
        save_step(trainer, str(out_path), last=i == len(cases) - 1, fast_path=fast_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
    exit_without_teardown()
