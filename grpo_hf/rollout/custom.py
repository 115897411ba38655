"""Rollout rows from outside the engines: a user's `rollout_func` (TRL 1.16's contract).

`rollout_func(prompts, trainer) -> dict` replaces tokenisation and sampling for one rollout round. It gets this
process's prompt rows as the sampler serves them (each prompt already repeated `num_generations` times, kept
together; the raw prompts, chat messages untemplated) and the trainer, and returns one completion per row:

- `prompt_ids`, `completion_ids`: lists of token-id lists, one per row (no padding). The log-probs of the loss are
  those of `prompt_ids + completion_ids`, so they must be the tokens the policy would see.
- `logprobs`: the sampler's per-token log-probs, one list per row (required, as in TRL). They are the log-probs of
  the policy that sampled: with `use_vllm=True` and `vllm_importance_sampling_correction` they weight the loss by
  pi_old / pi_sampler, as vLLM's own log-probs do (`core.sampling_importance_weights`).
- `env_mask`: optional, one 0/1 list per row over `completion_ids`: 1 on the tokens the model sampled, 0 on tokens
  an environment or a tool wrote (read by the model, out of the loss), like a tool reply of grpo_hf's own episodes.
- `logprob_token_ids`: optional, not used.
- any other key: passed to the reward functions as a keyword argument, a list (one value per row) or one value
  for every row.

A completion is scored and trained on whole (but for its `env_mask` zeros): it counts as truncated when its last
token is neither an EOS nor the pad token (TRL's rule). Token ids outside the model's vocabulary are an error that
names the row.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from grpo_hf.rollout.batching import Sequences, pad_token_lists

REQUIRED_KEYS = ("prompt_ids", "completion_ids", "logprobs")
_UNUSED_KEYS = ("logprob_token_ids", "env_mask")


@dataclass
class FuncRollout:
    """What a `rollout_func` returned, as tensors."""

    tokens: Sequences  # prompts left-padded, completions right-padded; `context_mask` from `env_mask`
    is_truncated: torch.Tensor  # [B] bool
    logps: torch.Tensor  # [B, T] the sampler's log-probs, 0 off the loss mask
    columns: dict[str, list]  # the extra keys, one value per row, for the reward functions


def rollout_from_func(
    rollout_func: Callable[[list], dict[str, Any]],
    prompts: list,
    *,
    pad_token_id: int,
    eos_token_ids: Sequence[int],
    vocab_size: int,
    device: torch.device,
) -> FuncRollout:
    """Call `rollout_func` on this process's prompt rows (the trainer binds itself as TRL's second argument) and
    check what it returned."""
    output = rollout_func(list(prompts))
    if not isinstance(output, dict):
        raise TypeError(f"rollout_func must return a dict, got {type(output).__name__}.")
    missing = sorted(set(REQUIRED_KEYS) - output.keys())
    if missing:
        raise ValueError(f"rollout_func must return keys {missing} in its output dict.")
    n = len(prompts)
    for key in ("prompt_ids", "completion_ids", "logprobs", *(("env_mask",) if "env_mask" in output else ())):
        if len(output[key]) != n:
            raise ValueError(
                f"rollout_func returned {len(output[key])} {key} for {n} prompt rows: return one per row (the rows "
                "already hold num_generations copies of each prompt)."
            )
    for key in ("prompt_ids", "completion_ids"):
        _check_token_ids(output[key], key, vocab_size)
    prompt_ids, prompt_mask = pad_token_lists(output["prompt_ids"], pad_token_id, left=True)
    completion_ids, attended = pad_token_lists(output["completion_ids"], pad_token_id, left=False)
    completion_mask, context_mask = attended, None
    if "env_mask" in output:
        completion_mask = _per_token(output["env_mask"], output["completion_ids"], "env_mask", torch.long)
        context_mask = attended - completion_mask
    logps = _per_token(output["logprobs"], output["completion_ids"], "logprobs", torch.float32) * completion_mask
    ends = set(eos_token_ids) | {pad_token_id}
    is_truncated = torch.tensor([len(ids) == 0 or int(ids[-1]) not in ends for ids in output["completion_ids"]])
    tokens = Sequences(
        prompt_ids.to(device),
        prompt_mask.to(device),
        completion_ids.to(device),
        completion_mask.to(device),
        context_mask=None if context_mask is None else context_mask.to(device),
    )
    return FuncRollout(tokens, is_truncated.to(device), logps.to(device), _extra_columns(output, n))


def _check_token_ids(rows: Sequence[Sequence[int]], key: str, vocab_size: int) -> None:
    """Every id of every row in [0, vocab_size): else an error naming the row (not a crash inside the embedding)."""
    for i, ids in enumerate(rows):
        bad = [int(t) for t in ids if not 0 <= int(t) < vocab_size]
        if bad:
            raise ValueError(
                f"rollout_func returned {key}[{i}] with token ids {bad[:5]} outside the model's vocabulary [0, "
                f"{vocab_size}): return ids of the policy's tokenizer."
            )


def _per_token(rows: Sequence[Sequence[float]], completion_ids: Sequence, key: str, dtype) -> torch.Tensor:
    """One value per completion token, per row -> [B, T] right-padded with 0 (T: the longest completion)."""
    width = max([1, *(len(ids) for ids in completion_ids)])
    out = torch.zeros((len(rows), width), dtype=dtype)
    for i, (values, ids) in enumerate(zip(rows, completion_ids, strict=True)):
        if len(values) != len(ids):
            raise ValueError(
                f"rollout_func returned {key}[{i}] with {len(values)} values for {len(ids)} completion tokens: give "
                "one per token of completion_ids."
            )
        if len(values):
            out[i, : len(values)] = torch.tensor([float("nan") if v is None else v for v in values], dtype=dtype)
    return out


def _extra_columns(output: dict[str, Any], n: int) -> dict[str, list]:
    """The keys of `output` beyond the contract's, one value per row: a list of n values, or one value for all."""
    columns = {}
    for key, values in output.items():
        if key in REQUIRED_KEYS or key in _UNUSED_KEYS:
            continue
        if isinstance(values, list):
            if len(values) != n:
                raise ValueError(
                    f"rollout_func returned {key!r} with {len(values)} values for {n} rows: give one per row, or a "
                    "single value (not a list) for every row."
                )
            columns[key] = values
        else:
            columns[key] = [values] * n
    return columns
