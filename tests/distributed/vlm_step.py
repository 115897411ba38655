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

from datasets import Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for the builders
sys.path.insert(1, str(Path(__file__).resolve().parent))  # grpo_step's fixed rollouts and settings

from conftest import exit_without_teardown, make_trainer, tiny_run_args  # noqa: E402
from grpo_step import fixed_completions, run_dir, save_step, step_settings  # noqa: E402
from tiny_vlm import image, tiny_qwen2_vl  # noqa: E402

from grpo_hf.rollout import RolloutEngine, register_engine  # noqa: E402

GLOBAL_BATCH, G, T = 8, 4, 5


class FixedImageEngine(RolloutEngine):
    """Deterministic completions of varying lengths, whatever the model and images: runs compare exactly."""

    takes_images = True

    def sample(self, model, prompt_ids, prompt_mask, images=None):
        assert images is not None and all(row is not None for row in images)
        return fixed_completions(prompt_ids, T, self.eos_token_ids[0])


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

    args = tiny_run_args(
        run_dir(out_path),
        step_settings(G, T),
        per_device_train_batch_size=GLOBAL_BATCH // world_size,
        learning_rate=100.0,
        max_grad_norm=1e-3,  # always clips: the gradient must be averaged over processes before it is clipped
        rollout_engine="fixed_images",
    )
    trainer = make_trainer(args, reward, dataset, tokenizer=processor, model=model)
    trainer.train()
    save_step(trainer, out_path)


if __name__ == "__main__":
    main(sys.argv[1])
    exit_without_teardown()
