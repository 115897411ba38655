"""GRPO steps with rollouts from a running `vllm serve` (vllm_mode="server"), under torchrun with 1 or 2 processes.

    python tests/distributed/vllm_server_step.py OUT_PREFIX BASE_URL MODEL_DIR [ddp|fsdp2] [sync|sync-3|STALENESS]

Trains the model saved in MODEL_DIR (the one the server started from) for 2 optimizer steps, then each process
samples greedily from the server for prompts of its own (different on each process) and compares with its own
`model.generate`: equal tokens mean that the trained weights reached the server and that each process got its own
rows back. With `fsdp2`, the policy is sharded with FSDP2 (accelerate's FSDP path, let run on CPU by the sharded
harness's patch): process 0 pushes weights gathered from the shards. `sync-3`: the same for 3 steps at a lower
learning rate; a STALENESS (0, 1, ...): an `AsyncGRPOTrainer` at that max_staleness instead (its producer thread
samples from the server), as `sync-3`. `fsdp2-reward`: `fsdp2` with a reward model too (sharded like the reference
model): the threads its forwards ran on are recorded. Writes OUT_PREFIX-<rank>.json (with the logs, the versions
the producer pushed, the transport process 0 pushed through and the files written) and the trained parameters in
OUT_PREFIX-<rank>.pt.
"""

import contextlib
import json
import os
import sys
import threading
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for conftest's helpers

from conftest import exit_without_teardown, make_trainer, tiny_run_args  # noqa: E402
from test_vllm_server import free_port  # noqa: E402

from grpo_hf import AsyncGRPOTrainer, GRPOTrainer  # noqa: E402
from grpo_hf.parallel import fsdp2_gathered  # noqa: E402
from grpo_hf.producer import ServerWeights  # noqa: E402
from grpo_hf.rollout import tokenize_prompts  # noqa: E402
from grpo_hf.rollout import vllm_server as server_module  # noqa: E402


def main(prefix: str, base_url: str, model_dir: str, layout: str = "ddp", staleness: str = "sync") -> None:
    sharding = {}
    if layout.startswith("fsdp2"):
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from sharded import allow_fsdp_on_cpu

        allow_fsdp_on_cpu()
        sharding = {"fsdp": "full_shard", "fsdp_config": {"version": 2}}
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    args = tiny_run_args(
        f"{prefix}-out",
        {},
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=6,
        max_steps=2 if staleness == "sync" else 3,
        learning_rate=3e-3 if staleness == "sync" else 1e-3,
        beta=0.0,
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_url=base_url,
        vllm_server_timeout=60,
        vllm_group_port=free_port(),  # used by process 0 only; the test's own process may hold the default (a link)
        use_cpu=True,
        save_strategy="no",
        seed=0,
        max_staleness=0 if staleness.startswith("sync") else int(staleness),
        **sharding,
    )
    dataset = Dataset.from_dict({"prompt": ["Hi", "2+2=", "abc", "The fox"] * 2})
    reward = lambda completion_ids, **kw: [float(sum(ids) % 7) for ids in completion_ids]  # noqa: E731
    written = []  # the directories the files transport wrote (none: the weights go over the gloo group)
    write_shards = server_module.write_shards
    server_module.write_shards = lambda weights, directory: (written.append(directory), write_shards(weights,
                                                             directory))[1]  # fmt: skip
    pushed = []  # the versions the producer pushed to the server (async)
    stage = ServerWeights.stage
    ServerWeights.stage = lambda self, version: (stage(self, version), pushed.append(version))[0]
    trainer_cls = GRPOTrainer if staleness.startswith("sync") else AsyncGRPOTrainer
    rewards, reward_threads = reward, set()
    if layout == "fsdp2-reward":  # a sequence classifier of the served model's shape, scoring every completion
        from transformers import AutoModelForSequenceClassification

        config = AutoConfig.from_pretrained(model_dir, num_labels=1, pad_token_id=tokenizer.pad_token_id)
        torch.manual_seed(5)
        scorer = AutoModelForSequenceClassification.from_config(config)
        scorer.register_forward_hook(lambda *_: reward_threads.add(threading.current_thread().name))
        rewards = [reward, scorer]
    trainer = make_trainer(args, rewards, dataset, tokenizer=tokenizer, model=model, trainer_cls=trainer_cls)
    trainer.train()
    rank = trainer.accelerator.process_index
    with fsdp2_gathered(trainer.model) if layout.startswith("fsdp2") else contextlib.nullcontext():
        trained = {
            name: p.detach().clone() for name, p in trainer.accelerator.unwrap_model(trainer.model).named_parameters()
        }
    torch.save(trained, f"{prefix}-{rank}.pt")

    prompts = [["Once upon", "Hello there"], ["Numbers: 1 2", "xyz"]][rank]  # each process its own
    prompt_ids, prompt_mask, _ = tokenize_prompts(tokenizer, prompts)
    config = GenerationConfig(max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    # the run's own engine (built here after an async run, whose producer had an engine of its own)
    engine = trainer.rollout or trainer.experience.sampler.engine_for(trainer.accelerator.unwrap_model(trainer.model))
    engine.generation_config = config
    ours = engine.generate(trainer.model.eval(), prompt_ids, prompt_mask)
    with fsdp2_gathered(trainer.model) if layout.startswith("fsdp2") else contextlib.nullcontext():  # per-process
        reference = trainer.model.generate(
            input_ids=prompt_ids,
            attention_mask=prompt_mask,
            generation_config=config,
            eos_token_id=engine.eos_token_ids,
        )[:, prompt_ids.size(1) :]
    mask = ours.completion_mask.bool()
    result = {
        "equal": bool(torch.equal(ours.completion_ids[mask], reference[:, : mask.size(1)][mask])),
        "pushes": len(engine.push_seconds),
        "tokens": int(mask.sum()),
        "sharded": any(hasattr(p, "full_tensor") for p in trainer.model.parameters()),  # DTensor shards
        "losses": [row["loss"] for row in trainer.state.log_history if "loss" in row],
        "logs": [row for row in trainer.state.log_history if "loss" in row],
        "producer_pushes": pushed,
        "reward_threads": sorted(reward_threads),
        "transport": next((link.transport for link in server_module.NETWORK_LINKS.values()), "files"),
        "files_written": len(written),
    }
    Path(f"{prefix}-{rank}.json").write_text(json.dumps(result))
    exit_without_teardown()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main(*sys.argv[1:6])
