"""Training runs whose weights reach a running `vllm serve` through the network transport, under torchrun:

    python tests/distributed/vllm_network_push.py OUT_PREFIX BASE_URL MODEL_DIR MODE

`async-fsdp2` (2 processes): AsyncGRPOTrainer at max_staleness=1, the policy sharded by FSDP2, 4 optimizer steps.
The weights of every version pushed are recorded as they are pushed (`ServerWeights.attach` / `stage`, on every
process: the gather is collective), and so is every generation batch the trainer takes (its version, tokens and vLLM's
log-probs). After training each process recomputes, for each of its batches, the log-probs of the sampled tokens
under the weights of the batch's version and of the next one, and writes the largest gaps to vLLM's.
`async-stop` then `async-resume` (1 process each, DDP): the same run stopped after its step-2 checkpoint, then resumed
from it by a new process (a new weight-transfer group with the server), whose batches are checked the same way.
`lora-adapter` (1 process): GRPOTrainer with a LoRA policy and vllm_server_lora_push='adapter', 2 steps, then greedy
completions from the server through the run's engine against the trained model's `generate`. `zero3` (2 processes):
the same under DeepSpeed ZeRO-3 without LoRA (the sharded harness's CPU patch), each process with prompts of its own.

Writes OUT_PREFIX-<rank>.json: the transport used, the network pushes and the files written by this process.
"""

import contextlib
import json
import os
import socket
import sys
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, TrainerCallback

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for conftest's helpers

from conftest import exit_without_teardown, make_trainer, tiny_run_args  # noqa: E402

from grpo_hf import AsyncGRPOTrainer, GRPOTrainer  # noqa: E402
from grpo_hf.producer import Producer, ServerWeights  # noqa: E402
from grpo_hf.rollout import tokenize_prompts  # noqa: E402
from grpo_hf.rollout import vllm_server as server_module  # noqa: E402
from grpo_hf.rollout.weights import named_weights  # noqa: E402

FILES_WRITTEN = []  # directories the files transport wrote (none expected)


def free_port() -> int:
    """A port free on this machine now, for the weight-transfer group (other runs may hold the default)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def record_files() -> None:
    write_shards = server_module.write_shards
    server_module.write_shards = lambda weights, directory: (FILES_WRITTEN.append(directory), write_shards(weights,
                                                             directory))[1]  # fmt: skip


def record_versions(versions: dict) -> None:
    """The full weights of every version pushed by the producer's server client, as it is pushed."""
    attach, stage = ServerWeights.attach, ServerWeights.stage

    def snapshot(weights, version):
        versions[version] = {name: tensor.clone() for name, tensor in named_weights(weights.model)}

    def attached(self, engine):
        snapshot(self, self.version)
        attach(self, engine)

    def staged(self, version):
        snapshot(self, version)
        stage(self, version)

    ServerWeights.attach, ServerWeights.stage = attached, staged


def record_batches(batches: list, trainer_box: list) -> None:
    take = Producer.take

    def taken(self, k):
        handed = take(self, k)
        sampled = handed.produced.sampled
        tokens = sampled.tokens
        batches.append({
            "version": handed.version, "trains_at": trainer_box[0].state.global_step,
            "prompt_ids": tokens.prompt_ids.clone(), "prompt_mask": tokens.prompt_mask.clone(),
            "completion_ids": tokens.completion_ids.clone(), "completion_mask": tokens.completion_mask.clone(),
            "sampling_logps": sampled.sampling_logps.clone(),
        })  # fmt: skip
        return handed

    Producer.take = taken


def logps_under(model, batch) -> list[torch.Tensor]:
    """Per row, the log-probs of its completion tokens under `model` (temperature 1), from an unpadded forward."""
    rows = []
    for i in range(batch["prompt_ids"].size(0)):
        prompt = batch["prompt_ids"][i][batch["prompt_mask"][i].bool()]
        completion = batch["completion_ids"][i][batch["completion_mask"][i].bool()]
        ids = torch.cat([prompt, completion])[None]
        with torch.no_grad():
            logits = model(ids).logits[0, prompt.numel() - 1 : -1].float()
        rows.append(torch.log_softmax(logits, -1).gather(-1, completion[:, None])[:, 0])
    return rows


def gaps(model_dir, versions, batches) -> list[dict]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for batch in batches:
        vllm = [row[mask.bool()] for row, mask in zip(batch["sampling_logps"], batch["completion_mask"], strict=True)]
        found = {}
        for which, version in (("at_version", batch["version"]), ("at_next", batch["version"] + 1)):
            model.load_state_dict(versions[version])
            ours = logps_under(model, batch)
            found[which] = max(float((a - b).abs().max()) for a, b in zip(ours, vllm, strict=True) if a.numel())
        staleness = batch["trains_at"] - batch["version"]
        out.append({"version": batch["version"], "staleness": staleness, **{f"gap_{k}": v for k, v in found.items()}})
    return out


def transport_of() -> tuple[str, int]:
    link = next(iter(server_module.NETWORK_LINKS.values()), None)
    return (link.transport if link is not None else "files"), (link.pushes if link is not None else 0)


def main(prefix: str, base_url: str, model_dir: str, mode: str) -> None:
    record_files()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    dataset = Dataset.from_dict({"prompt": ["Hi", "2+2=", "abc", "The fox"] * 4})
    common = dict(
        per_device_train_batch_size=4, num_generations=4, max_completion_length=6, beta=0.0, use_vllm=True,
        vllm_mode="server", vllm_server_base_url=base_url, vllm_server_timeout=60, use_cpu=True, save_strategy="no",
        seed=0, temperature=1.0, top_p=1.0, top_k=0, vllm_group_port=free_port(),  # used by process 0 only
    )  # fmt: skip
    if mode == "lora-adapter":
        return train_lora(prefix, model, tokenizer, dataset, common)
    if mode == "zero3":
        return train_zero3(prefix, model, tokenizer, dataset, common)
    sharding = {}
    if mode == "async-fsdp2":
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from sharded import allow_fsdp_on_cpu

        allow_fsdp_on_cpu()
        sharding = {"fsdp": "full_shard", "fsdp_config": {"version": 2}}
    else:  # async-stop / async-resume: one run stopped after its step-2 checkpoint, resumed by another process
        common.update(output_dir=str(Path(prefix).parent / "resumed-out"), save_strategy="steps", save_steps=2)
    versions, batches, box = {}, [], []
    record_versions(versions)
    record_batches(batches, box)
    args = tiny_run_args(
        common.pop("output_dir", f"{prefix}-out"), {}, max_steps=4, learning_rate=3e-3, max_staleness=1, **sharding,
        **common,
    )  # fmt: skip
    reward = lambda completion_ids, **kw: [float(sum(ids) % 7) for ids in completion_ids]  # noqa: E731
    callbacks = [StopAt(2)] if mode == "async-stop" else None
    trainer = make_trainer(args, reward, dataset, tokenizer=tokenizer, model=model, trainer_cls=AsyncGRPOTrainer,
                           callbacks=callbacks)  # fmt: skip
    box.append(trainer)
    trainer.train(resume_from_checkpoint=f"{args.output_dir}/checkpoint-2" if mode == "async-resume" else None)
    versions[trainer.state.global_step] = {
        name: t.clone() for name, t in named_weights(trainer.accelerator.unwrap_model(trainer.model))
    }
    rank = trainer.accelerator.process_index
    transport, pushes = transport_of()
    result = {
        "rank": rank, "transport": transport, "network_pushes": pushes, "files_written": len(FILES_WRITTEN),
        "sharded": any(hasattr(p, "full_tensor") for p in trainer.model.parameters()),
        "steps": trainer.state.global_step, "batches": gaps(model_dir, versions, batches),
    }  # fmt: skip
    Path(f"{prefix}-{rank}.json").write_text(json.dumps(result))
    exit_without_teardown()


class StopAt(TrainerCallback):
    """Stops training after optimizer step `step` (once its checkpoint is saved), as a preempted job would."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


def train_zero3(prefix, model, tokenizer, dataset, common) -> None:
    """GRPOTrainer under DeepSpeed ZeRO-3 (the sharded harness's CPU patch), 2 steps; then each process's greedy
    completions from the server against its model's own, the parameters gathered for `generate`."""
    import deepspeed

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from sharded import allow_deepspeed_on_cpu, zero

    allow_deepspeed_on_cpu()
    args = tiny_run_args(f"{prefix}-out", {}, max_steps=2, learning_rate=3e-3, **{**common, **zero(3)})
    reward = lambda completion_ids, **kw: [float(sum(ids) % 7) for ids in completion_ids]  # noqa: E731
    trainer = make_trainer(args, reward, dataset, tokenizer=tokenizer, model=model, trainer_cls=GRPOTrainer)
    trainer.train()
    rank = trainer.accelerator.process_index
    prompts = [["Once upon", "Hello there"], ["Numbers: 1 2", "xyz"]][rank]  # each process its own
    policy = trainer.accelerator.unwrap_model(trainer.model).eval()
    sharded = all(hasattr(p, "ds_id") for p in policy.parameters())
    gathered = lambda: deepspeed.zero.GatheredParameters(list(policy.parameters()))  # noqa: E731
    ours, reference, mask = greedy_pair(trainer, policy, tokenizer, prompts, gathered)
    transport, pushes = transport_of()
    result = {
        "equal": bool(torch.equal(ours[mask], reference[:, : mask.size(1)][mask])), "tokens": int(mask.sum()),
        "sharded": sharded, "transport": transport, "network_pushes": pushes, "files_written": len(FILES_WRITTEN),
    }  # fmt: skip
    Path(f"{prefix}-{rank}.json").write_text(json.dumps(result))
    exit_without_teardown()


def greedy_pair(trainer, policy, tokenizer, prompts, gathered):
    """Greedy completions of `prompts` from the run's engine (the server: the weights pushed first if they changed)
    and from `policy.generate` inside `gathered()`: (the engine's ids, generate's ids, the engine's mask)."""
    prompt_ids, prompt_mask, _ = tokenize_prompts(tokenizer, prompts)
    config = GenerationConfig(max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    engine = trainer.rollout or trainer.experience.sampler.engine_for(policy)
    engine.generation_config = config
    ours = engine.generate(policy, prompt_ids, prompt_mask)
    with gathered():
        reference = policy.generate(input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=config,
                                    eos_token_id=engine.eos_token_ids)[:, prompt_ids.size(1) :]  # fmt: skip
    return ours.completion_ids, reference, ours.completion_mask.bool()


def train_lora(prefix, model, tokenizer, dataset, common) -> None:
    from peft import LoraConfig

    args = tiny_run_args(
        f"{prefix}-out", {}, max_steps=2, learning_rate=2e-2, vllm_server_lora_push="adapter", **common
    )
    reward = lambda completion_ids, **kw: [float(sum(ids) % 7) for ids in completion_ids]  # noqa: E731
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    trainer = make_trainer(args, reward, dataset, tokenizer=tokenizer, model=model, trainer_cls=GRPOTrainer,
                           peft_config=lora)  # fmt: skip
    trainer.train()
    policy = trainer.accelerator.unwrap_model(trainer.model).eval()
    prompts = ["Once upon", "Hello there", "xyz"]
    ours, reference, mask = greedy_pair(trainer, policy, tokenizer, prompts, contextlib.nullcontext)
    engine = trainer.rollout or trainer.experience.sampler.engine_for(policy)
    transport, pushes = transport_of()
    result = {
        "equal": bool(torch.equal(ours[mask], reference[:, : mask.size(1)][mask])),
        "tokens": int(mask.sum()), "pushes": len(engine.push_seconds), "adapter_bytes": engine.backend.adapter.bytes,
        "transport": transport, "network_pushes": pushes, "files_written": len(FILES_WRITTEN),
    }  # fmt: skip
    Path(f"{prefix}-0.json").write_text(json.dumps(result))
    exit_without_teardown()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main(*sys.argv[1:5])
