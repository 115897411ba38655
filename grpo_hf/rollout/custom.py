"""Rollout rows from outside the engines: a user's `rollout_func` (TRL 1.16's contract).

`rollout_func(prompts, trainer) -> dict` replaces tokenisation and sampling for one rollout round. It gets this
process's prompt rows as the sampler serves them (each prompt already repeated `num_generations` times, kept
together; the raw prompts, chat messages untemplated) and the trainer, and returns one completion per row:

- `prompt_ids`, `completion_ids`: lists of token-id lists, one per row (no padding). The log-probs of the loss are
  those of `prompt_ids + completion_ids`, so they must be the tokens the policy would see.
- `logprobs`: the sampler's per-token log-probs. Required, as in TRL; not used (TRL uses them only for its vLLM
  importance-sampling correction, which has no counterpart here).
- `logprob_token_ids`: optional, not used either.
- any other key: passed to the reward functions as a keyword argument, a list (one value per row) or one value
  for every row.

A completion is scored and trained on whole: its mask covers every returned token, and it counts as truncated
when its last token is neither an EOS nor the pad token (TRL's rule). `env_mask` (tokens excluded from the loss)
is refused: grpo_hf has one mask per completion token for attention and loss alike.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from grpo_hf.rollout.batching import Sequences, pad_token_lists

REQUIRED_KEYS = ("prompt_ids", "completion_ids", "logprobs")
_UNUSED_KEYS = ("logprob_token_ids",)


def rollout_from_func(
    rollout_func: Callable[[list], dict[str, Any]],
    prompts: list,
    *,
    pad_token_id: int,
    eos_token_ids: Sequence[int],
    device: torch.device,
) -> tuple[Sequences, torch.Tensor, dict[str, list]]:
    """Call `rollout_func` on this process's prompt rows (the trainer binds itself as TRL's second argument); return
    the token tensors (prompts left-padded, completions right-padded), `is_truncated` [B], and the extra fields as
    reward-function columns (one value per row)."""
    output = rollout_func(list(prompts))
    if not isinstance(output, dict):
        raise TypeError(f"rollout_func must return a dict, got {type(output).__name__}.")
    missing = sorted(set(REQUIRED_KEYS) - output.keys())
    if missing:
        raise ValueError(f"rollout_func must return keys {missing} in its output dict.")
    if "env_mask" in output:
        raise ValueError(
            "rollout_func returned 'env_mask' (tokens to leave out of the loss), which grpo_hf does not support: its "
            "completion mask covers attention and loss alike. Drop those tokens from completion_ids instead."
        )
    n = len(prompts)
    for key in ("prompt_ids", "completion_ids"):
        if len(output[key]) != n:
            raise ValueError(
                f"rollout_func returned {len(output[key])} {key} for {n} prompt rows: return one per row (the rows "
                "already hold num_generations copies of each prompt)."
            )
    prompt_ids, prompt_mask = pad_token_lists(output["prompt_ids"], pad_token_id, left=True)
    completion_ids, completion_mask = pad_token_lists(output["completion_ids"], pad_token_id, left=False)
    ends = set(eos_token_ids) | {pad_token_id}
    is_truncated = torch.tensor([len(ids) == 0 or int(ids[-1]) not in ends for ids in output["completion_ids"]])
    tokens = Sequences(
        prompt_ids.to(device), prompt_mask.to(device), completion_ids.to(device), completion_mask.to(device)
    )
    return tokens, is_truncated.to(device), _extra_columns(output, n)


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
