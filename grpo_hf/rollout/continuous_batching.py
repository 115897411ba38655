"""The `continuous_batching` engine: transformers' own continuous batching (`model.generate_batch`, paged attention).

TRL's `use_transformers_continuous_batching`. The prompts go to `generate_batch` as token lists (padding stripped),
one request per row; transformers schedules them over a paged KV cache, so a finished row frees its pages for the
next request instead of decoding padding. It samples with the trainer's `GenerationConfig` (temperature, top_k,
top_p, EOS ids, `max_new_tokens`). Its settings are transformers' `ContinuousBatchingConfig`, from
`transformers_continuous_batching_config`, with `max_memory_percent` 0.5 unless given (TRL's default: the rest of the
memory is the training step's). Its measured cost against `loop` on a CPU: docs/benchmarks.md. With `record_logps`,
transformers returns each token's log-prob (`return_logprobs`: the log of the processed distribution at the token).
It penalises repetitions in its own way (only each step's query tokens) and fails on `bad_words_ids` and
`no_repeat_ngram_size` (transformers 5.25): those are refused (`sampling_spec.SamplingSpec.refusal`), the first only
where a correction replays the sampling, the others always; a top_k of -1 or at least the vocabulary means none.
"""

from __future__ import annotations

import copy
import dataclasses

import torch

from grpo_hf.rollout.engine import RolloutEngine
from grpo_hf.rollout.sampling_spec import SamplingSpec, normal_top_k, vocab_size_of

DEFAULT_MAX_MEMORY_PERCENT = 0.5  # TRL's: transformers' own 0.9 leaves too little for the backward pass


class ContinuousBatchingEngine(RolloutEngine):
    """`model.generate_batch` behind the engine interface: one request per prompt row, padded back to [N, T]."""

    name = "continuous_batching"
    options = ("args",)
    can_record_logps = True

    def __init__(self, generation_config, eos_token_ids, args=None):
        super().__init__(generation_config, eos_token_ids)
        settings = dict(getattr(args, "transformers_continuous_batching_config", None) or {})
        settings.setdefault("max_memory_percent", DEFAULT_MAX_MEMORY_PERCENT)
        from transformers.generation import ContinuousBatchingConfig

        self.continuous_batching_config = ContinuousBatchingConfig(**settings)

    @classmethod
    def unsupported_reason(cls, model, generation_config) -> str | None:
        if not hasattr(model, "generate_batch"):
            return f"{type(model).__name__} has no `generate_batch` (transformers >= 5.8 continuous batching)"
        return SamplingSpec.of(model, generation_config, kind="continuous_batching").refusal(corrected=False)

    def sample(self, model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> torch.Tensor:
        prompts = [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids, prompt_mask, strict=True)]  # N lists
        settings = self.continuous_batching_config
        if self.record_logps:
            settings = dataclasses.replace(settings, return_logprobs=True)
        config = copy.copy(self.generation_config)
        config.top_k = normal_top_k(config.top_k, vocab_size_of(model))  # -1 or the vocabulary: none
        outputs = model.generate_batch(
            prompts,
            generation_config=config,
            continuous_batching_config=settings,
            progress_bar=False,
        )
        # Request ids are "req_<row>"; the dict is in the order requests finished.
        by_row = sorted(outputs.values(), key=lambda output: int(output.request_id.rsplit("_", 1)[-1]))
        if len(by_row) != len(prompts):
            raise RuntimeError(f"generate_batch returned {len(by_row)} completions for {len(prompts)} prompts.")
        failed = [output for output in by_row if output.error is not None]
        if failed:
            raise RuntimeError(f"generate_batch failed on request {failed[0].request_id}: {failed[0].error}")
        width = max(len(output.generated_tokens) for output in by_row)
        pad = self.generation_config.pad_token_id
        completion_ids = torch.full((len(by_row), width), pad, dtype=torch.long, device=prompt_ids.device)  # [N, T]
        logps = torch.zeros((len(by_row), width), dtype=torch.float32) if self.record_logps else None  # [N, T]
        for row, output in enumerate(by_row):
            tokens = output.generated_tokens
            completion_ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            if logps is not None:
                if len(output.logprobs) != len(tokens):
                    raise RuntimeError(
                        f"generate_batch returned {len(output.logprobs)} log-probs for the {len(tokens)} tokens of "
                        f"request {output.request_id} (return_logprobs=True)."
                    )
                logps[row, : len(tokens)] = torch.tensor(output.logprobs, dtype=torch.float32)
        if logps is not None:
            self.sampling_logps = logps.to(prompt_ids.device)
        return completion_ids
