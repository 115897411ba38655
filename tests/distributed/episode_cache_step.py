"""Tool episodes trained with the `loop` engine, its episode cache on and off, at max_staleness 0 and 1: the runs
must be the same (the cache changes what is prefilled, not what is sampled). Run in-process (1 process) by
tests/test_episode_cache.py, and under torchrun with 2 CPU processes (gloo):

    python -m torch.distributed.run --nproc_per_node=2 tests/distributed/episode_cache_step.py OUT.pt

Writes each run's parameters, logs and the completions of its first rollout to OUT.pt (main process).
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for conftest's and test_tools' builders

from conftest import exit_without_teardown  # noqa: E402
from test_tools import args_for, call_of, sums_dataset, tool_tokenizer, trainer_for, with_eos_tokens  # noqa: E402

RUNS = {"off0": (0.0, 0), "on0": (4.0, 0), "off1": (0.0, 1), "on1": (4.0, 1)}


def lookup(key: str) -> str:
    """Look a key up.

    Args:
        key: What to look up.
    """
    time.sleep(random.uniform(0.0, 0.01))  # a tool of random latency: turns rejoin in a different order each run
    return f"value of {key}"


def by_length(completion_ids, **kwargs):
    return [float(len(ids) % 5) for ids in completion_ids]


def parse(tokenizer, ids, context, tools):
    """Every turn calls the tool until the episode has two replies, then answers."""
    if tokenizer.decode(context).count("<tool_response>") >= 2:
        return {"role": "assistant", "content": "done"}
    return {"role": "assistant", "content": "", "tool_calls": [call_of("lookup", key=str(len(ids)))]}


def run(out_dir: Path, cache_gb: float, staleness: int) -> dict:
    tokenizer = tool_tokenizer()
    config = args_for(
        out_dir, rollout_engine="loop", per_device_train_batch_size=4, max_completion_length=80, temperature=1.0,
        max_steps=2, episode_cache_gb=cache_gb, max_staleness=staleness, seed=3,
    )  # fmt: skip
    trainer = trainer_for(out_dir, tokenizer, reward_funcs=by_length, tools=[lookup], args=config,
                          dataset=sums_dataset(4))  # fmt: skip
    sampler = with_eos_tokens(trainer, [i for i in range(len(tokenizer)) if i % 4 == 0])
    sampler.episodes.parse = parse
    seen = []
    score = trainer.experience.score

    def recording(prompts, columns, sampled, *args, **kwargs):
        seen.append((sampled.tokens.completion_ids.cpu(), sampled.sampling_logps, sampled.episode_cache))
        return score(prompts, columns, sampled, *args, **kwargs)

    trainer.experience.score = recording
    trainer.train()
    model = trainer.accelerator.unwrap_model(trainer.model)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    logs = [row for row in trainer.state.log_history if "loss" in row]
    trainer.accelerator.wait_for_everyone()
    return {"params": params, "logs": logs, "rollouts": seen, "main": trainer.accelerator.is_main_process}


def main(out_path: str) -> None:
    out = Path(out_path).parent
    results = {name: run(out / name, *settings) for name, settings in RUNS.items()}
    if results["off0"]["main"]:
        torch.save({name: {k: v for k, v in r.items() if k != "main"} for name, r in results.items()}, out_path)


if __name__ == "__main__":
    main(sys.argv[1])
    exit_without_teardown()
