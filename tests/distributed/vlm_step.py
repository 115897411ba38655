"""One GRPO step of a tiny Qwen2-VL on fixed rollouts, under torchrun with 1 or 2 CPU processes (gloo).

    python tests/distributed/vlm_step.py OUT.pt

Each prompt has its own image (row 1: two), so the two processes' micro-batches carry different images. Generation
is replaced by a deterministic function of the global row index (an engine that takes images); everything after it
(the processor's encoding, rewards, gather, advantages, the padded forward with each row's images, DDP backward, the
optimizer step) is the real trainer. Writes advantages, loss and parameters to argv[1].
"""

import os
import sys
from pathlib import Path

import torch
from accelerate import PartialState
from datasets import Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for the builders

from conftest import exit_without_teardown  # noqa: E402
from tiny_vlm import image, tiny_qwen2_vl  # noqa: E402

from grpo_hf import GRPOConfig, GRPOTrainer  # noqa: E402
from grpo_hf.rollout import RolloutEngine, register_engine  # noqa: E402

GLOBAL_BATCH, G, T = 8, 4, 5


class FixedImageEngine(RolloutEngine):
    """Deterministic completions of varying lengths, whatever the model and images: runs compare exactly."""

    takes_images = True

    def sample(self, model, prompt_ids, prompt_mask, images=None):
        assert images is not None and all(row is not None for row in images)
        B = prompt_ids.size(0)
        rows = torch.arange(B) + PartialState().process_index * B  # [B] global row index
        completion_ids = (rows.unsqueeze(1) * 7 + torch.arange(T) * 3) % 200 + 10  # [B, T] ordinary byte tokens
        for i, k in enumerate((1 + rows % T).tolist()):
            if k < T:
                completion_ids[i, k] = self.eos_token_ids[0]
        return completion_ids.to(prompt_ids.device)


def main(out_path: str) -> None:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    register_engine("fixed_images", FixedImageEngine)
    model, processor = tiny_qwen2_vl(seed=5)
    images = [[image(k, 56 + 28 * (k % 2))] + ([image(10 + k)] if k == 1 else []) for k in range(2)]
    dataset = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": f"Prompt {k}"}], "images": images[k]} for k in range(2)]
    )

    def reward(completion_ids, **kwargs):
        return [float(sum(ids) % 11) for ids in completion_ids]

    args = GRPOConfig(
        output_dir=str(Path(out_path).parent / "run"),
        num_generations=G,
        max_completion_length=T,
        max_steps=1,
        per_device_train_batch_size=GLOBAL_BATCH // world_size,
        optim="sgd",
        learning_rate=100.0,
        max_grad_norm=1e-3,  # always clips: the gradient must be averaged over processes before it is clipped
        beta=0.04,
        shuffle_dataset=False,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        rollout_engine="fixed_images",
    )
    trainer = GRPOTrainer(model, reward, args, train_dataset=dataset, processing_class=processor)
    trainer.train()
    advantages = torch.cat([part.advantages for part in trainer._buffer])
    all_advantages = trainer.accelerator.gather(advantages)
    if trainer.accelerator.is_main_process:
        loss = next(h["loss"] for h in trainer.state.log_history if "loss" in h)
        params = {n: p.detach().clone() for n, p in trainer.accelerator.unwrap_model(trainer.model).named_parameters()}
        torch.save({"advantages": all_advantages, "loss": loss, "params": params}, out_path)
    trainer.accelerator.wait_for_everyone()
    trainer.accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1])
    exit_without_teardown()
