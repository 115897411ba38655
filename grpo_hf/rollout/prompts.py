"""Prompts: tokenisation with the chat template, completion masks, EOS ids.

- `tokenize_prompts` applies the chat template, left-truncates to `max_prompt_length`, left-pads,
  and encodes each distinct prompt once (a group's G copies share one encoding).
- `completion_mask` marks completion tokens up to and including the first EOS (docs/design.md ("The maths"), `m`).
- `prompt_runs` finds the groups inside a batch: runs of identical consecutive prompt rows.

The sampler, the typed batches and the padding live in `rollout.batching`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from grpo_hf.core import prompt_runs  # noqa: F401  (re-exported: the groups inside a batch)
from grpo_hf.rollout.batching import pad_token_lists


def is_conversational(prompt: Any) -> bool:
    """A prompt is conversational when it is a list of `{"role", "content"}` messages."""
    return isinstance(prompt, list) and len(prompt) > 0 and isinstance(prompt[0], dict) and "role" in prompt[0]


def prompt_text(tokenizer, prompt: str | list[dict], chat_template_kwargs: dict | None = None) -> str:
    """The text the model sees: the chat template with a generation prompt, or the string itself."""
    if is_conversational(prompt):
        return tokenizer.apply_chat_template(
            prompt, tokenize=False, add_generation_prompt=True, **(chat_template_kwargs or {})
        )
    if isinstance(prompt, str):
        return prompt
    raise TypeError(
        f"A prompt must be a string or a list of chat messages with 'role' and 'content'; got {type(prompt).__name__}."
    )


def tokenize_prompts(
    tokenizer,
    prompts: Sequence[str | list[dict]],
    max_prompt_length: int | None = None,
    chat_template_kwargs: dict | None = None,
    tools: Sequence[list | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Encode prompts once per run of identical consecutive prompts (a group), left-pad and left-truncate.
    `tools`: per row, the tools the chat template describes in its prompt (tool episodes); None: no tools.

    Returns `prompt_ids [N, P]`, `prompt_mask [N, P]` and `is_prompt_truncated [N]` (bool).
    Special tokens are not added again: chat templates already contain them.
    """
    tools = tools if tools is not None else [None] * len(prompts)
    # Runs of identical consecutive prompts (with the same tools): a group's G copies are encoded once.
    same = lambda i: prompts[i] == prompts[i - 1] and tools[i] == tools[i - 1]  # noqa: E731
    starts = [i for i in range(len(prompts)) if i == 0 or not same(i)]
    counts = [b - a for a, b in zip(starts, starts[1:] + [len(prompts)], strict=True)]
    texts = [
        prompt_text(
            tokenizer, prompts[i], {**(chat_template_kwargs or {}), **({"tools": tools[i]} if tools[i] else {})}
        )
        for i in starts
    ]
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]

    truncated = []
    for k, ids in enumerate(encoded):
        too_long = max_prompt_length is not None and len(ids) > max_prompt_length
        truncated.append(too_long)
        if too_long:
            encoded[k] = ids[-max_prompt_length:]  # keep the end: it holds the question and generation prompt
    if any(len(ids) == 0 for ids in encoded):
        raise ValueError("A prompt encodes to zero tokens; remove empty prompts from the dataset.")

    unique_ids, unique_mask = pad_token_lists(encoded, tokenizer.pad_token_id, left=True)  # [U, P] each
    repeats = torch.tensor(counts)
    prompt_ids = unique_ids.repeat_interleave(repeats, dim=0)  # [N, P]
    prompt_mask = unique_mask.repeat_interleave(repeats, dim=0)  # [N, P]
    is_prompt_truncated = torch.tensor(truncated).repeat_interleave(repeats)  # [N]
    return prompt_ids, prompt_mask, is_prompt_truncated


def completion_mask(completion_ids: torch.Tensor, eos_token_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask of real completion tokens, up to and including the first EOS, and the truncation flags.

    Returns `completion_mask [N, T]` (long, 1 = real token) and `is_truncated [N]` (bool: no EOS
    within the completion, i.e. it hit max_completion_length).
    """
    eos = torch.isin(completion_ids, torch.tensor(list(eos_token_ids), device=completion_ids.device))  # [N, T]
    T = completion_ids.size(1)
    has_eos = eos.any(dim=1)  # [N]
    first_eos = torch.where(has_eos, eos.int().argmax(dim=1), torch.full_like(has_eos, T, dtype=torch.long))  # [N]
    positions = torch.arange(T, device=completion_ids.device).unsqueeze(0)  # [1, T]
    mask = (positions <= first_eos.unsqueeze(1)).long()  # [N, T]
    return mask, ~has_eos


def eos_token_ids_of(model, tokenizer) -> list[int]:
    """Every id that ends a completion: the generation config's EOS ids plus the tokenizer's."""
    ids: set[int] = set()
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(configured, int):
        ids.add(configured)
    elif configured is not None:
        ids.update(int(i) for i in configured)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    if not ids:
        raise ValueError(
            "Neither the model's generation_config nor the tokenizer defines an EOS token, so no completion could "
            "end. Set tokenizer.eos_token (e.g. '<|im_end|>') or model.generation_config.eos_token_id."
        )
    return sorted(ids)
