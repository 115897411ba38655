"""One GRPO step with top_entropy_quantile < 1 and adaptive entropy control, under torchrun with 1 or 2 CPU processes.

    python tests/distributed/entropy_step.py OUT.pt {fast|padded}

The fixed rollouts of `grpo_step.py`, a micro-batch of the whole group of 8 (8 rows on 1 process, 4 + 4 on 2): the
entropy threshold is taken over the same tokens either way, and so is the adaptive controller's entropy. Writes the
loss, the parameters and the controller's state to argv[1].
"""

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for conftest's builders
sys.path.insert(0, str(Path(__file__).resolve().parent))

from conftest import exit_without_teardown  # noqa: E402
from grpo_step import GLOBAL_BATCH, build_trainer  # noqa: E402


def main(out_path: str, fast: bool) -> None:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    trainer = build_trainer(
        out_path,
        per_device_train_batch_size=GLOBAL_BATCH // world_size,
        share_prompt_prefix=fast,
        learning_rate=1.0,
        max_grad_norm=0.0,
        top_entropy_quantile=0.3,
        use_adaptive_entropy=True,
        entropy_coef_delta=0.05,
        entropy_target=100.0,
    )
    trainer.train()
    if trainer.accelerator.is_main_process:
        log = next(h for h in trainer.state.log_history if "loss" in h)
        params = {n: p.detach().clone() for n, p in trainer.accelerator.unwrap_model(trainer.model).named_parameters()}
        torch.save({"log": log, "params": params, "control": trainer.objective.entropy.state()}, out_path)
    trainer.accelerator.wait_for_everyone()
    trainer.accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] == "fast")
    exit_without_teardown()
