"""Rollouts: prompts -> groups of sampled completions, with masks and truncation flags.

- `batching`: `RepeatSampler` (a prompt's G copies together), the typed batches of a step (`Rollout`,
  `MicroBatch`), splitting into micro-batches and padding.
- `prompts`: prompt tokenisation, completion masks, prompt runs (the groups inside a batch).
- `engine`: the `RolloutEngine` interface, the registry of engines by name and the `"auto"` choice.
- `sampling`: the logits processors `model.generate` applies and an exact categorical draw, shared by
  grpo_hf's own decoders.
- engines, each in its own module, imported when chosen: `loop` (the CPU decoding loop),
  `hf_generate` (`model.generate`, optionally with a static compiled cache), `cuda_graph` (a static
  KV cache and a decode step captured as one CUDA graph), `vllm_engine` (vLLM in this process, or a `vllm serve`
  through `vllm_server`).
- `lora_decode`: a LoRA policy's adapted layers decode with merged copies of their weights (`LoraDecode`).
"""

from __future__ import annotations

from grpo_hf.rollout.batching import (
    MicroBatch,
    RepeatedStream,
    RepeatSampler,
    Rollout,
    Sequences,
    split_into_micro_batches,
)
from grpo_hf.rollout.engine import ENGINES, Completions, RolloutEngine, engine_class, make_engine, register_engine
from grpo_hf.rollout.prompts import (
    completion_mask,
    eos_token_ids_of,
    is_conversational,
    prompt_runs,
    prompt_text,
    tokenize_prompts,
)
from grpo_hf.rollout.sampling import (
    logits_processors,
    resolve_sampling_settings,
    sample_categorical,
    supports_sample_groups,
    unsupported_reason,
)

__all__ = [
    "ENGINES",
    "Completions",
    "MicroBatch",
    "RepeatedStream",
    "RepeatSampler",
    "Rollout",
    "RolloutEngine",
    "Sequences",
    "completion_mask",
    "engine_class",
    "eos_token_ids_of",
    "is_conversational",
    "logits_processors",
    "make_engine",
    "prompt_runs",
    "prompt_text",
    "register_engine",
    "resolve_sampling_settings",
    "sample_categorical",
    "sample_groups",
    "split_into_micro_batches",
    "supports_sample_groups",
    "tokenize_prompts",
    "unsupported_reason",
]


def __getattr__(name: str):
    if name == "sample_groups":  # the loop's function, without importing the loop module up front
        from grpo_hf.rollout.loop import sample_groups

        return sample_groups
    raise AttributeError(f"module 'grpo_hf.rollout' has no attribute {name!r}")
