"""MoE routes through dynamic sampling on 2 gloo processes (issue 61): run under torchrun.

    python tests/distributed/routes_step.py OUT_DIR

A tiny fp32 Qwen3-MoE samples with the `loop` engine; half the prompts are "flat" (every completion of theirs gets the
same reward), so dynamic sampling drops their groups and refills from fresh prompts: each round's rows, of their own
prompt and completion widths on each process, are gathered across the processes (`dynamic.gather_rows`), stacked
(`stack_rows`) and handed back, routes with them. With learning rate 0 the weights stay those that sampled, so every
process checks each micro-batch it trained on against one plain full forward of its tokens
(`test_rollout_routes.assert_routes_of_tokens`) and writes what it found to OUT_DIR/rank_<r>.json. The run replays the
routes (router_replay='r3', a reference forward with beta > 0): its router metrics go there too.
"""

import json
import os
import sys
from pathlib import Path

from datasets import Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for conftest's builders

from conftest import build_tiny_tokenizer, exit_without_teardown, make_trainer, tiny_run_args  # noqa: E402
from test_rollout_routes import assert_routes_of_tokens, moe_model  # noqa: E402

from grpo_hf.experience import ExperienceMaker  # noqa: E402

GLOBAL_BATCH, G = 8, 4


def reward(prompts, completion_ids, kind, **kwargs):
    """Flat prompts: 1.0 for every completion. Others: a number that differs between a group's completions."""
    return [
        1.0 if k == "flat" else float(len(ids) + sum(ids) % 3) for k, ids in zip(kind, completion_ids, strict=True)
    ]


def main(out_dir: str) -> None:
    world_size, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    batches, split = [], ExperienceMaker.split

    def capturing(self, rollout, size):
        parts = split(self, rollout, size)
        batches.extend(parts)
        return parts

    ExperienceMaker.split = capturing
    tokenizer = build_tiny_tokenizer()
    kinds = ["flat" if i % 2 == 0 else "varied" for i in range(12)]
    dataset = Dataset.from_dict({"prompt": [f"Prompt {i} {k} " * (1 + i % 3) for i, k in enumerate(kinds)],
                                 "kind": kinds})  # fmt: skip
    settings = dict(
        per_device_train_batch_size=GLOBAL_BATCH // world_size, num_generations=G, max_completion_length=6,
        max_steps=1, learning_rate=0.0, shuffle_dataset=False, dynamic_sampling=True, dynamic_sampling_max_rounds=2,
        use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0, rollout_engine="loop", report_to="none",
        router_replay="r3", beta=0.1,
    )  # fmt: skip
    trainer = make_trainer(tiny_run_args(out_dir, {}, **settings), reward, dataset, tokenizer=tokenizer,
                           model=moe_model(tokenizer))  # fmt: skip
    trainer.train()
    model = trainer.accelerator.unwrap_model(trainer.model)
    for batch in batches:
        assert_routes_of_tokens(model, batch.routes, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                                batch.completion_mask)  # fmt: skip
    logs = next(h for h in trainer.state.log_history if "loss" in h)
    result = {"batches": len(batches), "extra_rounds": logs["dynamic_sampling/extra_rounds"], "checked": True,
              "router": {k: v for k, v in logs.items() if k.startswith("router/")}}  # fmt: skip
    (Path(out_dir) / f"rank_{rank}.json").write_text(json.dumps(result))
    trainer.accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1])
    exit_without_teardown()
