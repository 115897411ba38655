"""Prompts: tokenisation with the chat template, completion masks, EOS ids.

- `tokenize_prompts` applies the chat template, fits a prompt over `max_prompt_length` (`fit_prompt`), left-pads,
  and encodes each distinct prompt once (a group's G copies share one encoding).
- `fit_prompt`: a chat prompt loses whole turns of its history, oldest first, never its system messages, the tools'
  schemas nor its last user turn (an error when those alone are over the limit); a plain-text prompt its beginning.
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
    """Encode prompts once per run of identical consecutive prompts (a group), left-pad, and fit those over
    `max_prompt_length` (`fit_prompt`; None: no limit, TRL's).
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
            kwargs = {**(chat_template_kwargs or {}), **({"tools": tools[starts[k]]} if tools[starts[k]] else {})}
            encoded[k] = fit_prompt(prompts[starts[k]], ids, max_prompt_length, _encoder(tokenizer, kwargs))
    if any(len(ids) == 0 for ids in encoded):
        raise ValueError("A prompt encodes to zero tokens; remove empty prompts from the dataset.")

    unique_ids, unique_mask = pad_token_lists(encoded, tokenizer.pad_token_id, left=True)  # [U, P] each
    repeats = torch.tensor(counts)
    prompt_ids = unique_ids.repeat_interleave(repeats, dim=0)  # [N, P]
    prompt_mask = unique_mask.repeat_interleave(repeats, dim=0)  # [N, P]
    is_prompt_truncated = torch.tensor(truncated).repeat_interleave(repeats)  # [N]
    return prompt_ids, prompt_mask, is_prompt_truncated


def _encoder(tokenizer, chat_template_kwargs: dict):
    """messages -> the ids of the prompt they make (`prompt_text`)."""
    return lambda prompt: tokenizer(prompt_text(tokenizer, prompt, chat_template_kwargs), add_special_tokens=False)[
        "input_ids"
    ]


def _turns(prompt: list[dict]) -> tuple[int, list[int]]:
    """The number of leading system messages, and the index of each later user message that starts a turn after the
    first non-system message (where history may be cut)."""
    head = next((i for i, m in enumerate(prompt) if m.get("role") != "system"), len(prompt))
    return head, [i for i, m in enumerate(prompt) if m.get("role") == "user" and i > head]


def kept_part(prompt: list[dict]) -> list[dict]:
    """What `fit_prompt` never cuts from a chat prompt: its leading system messages and its last user turn on."""
    head, users = _turns(prompt)
    return prompt[:head] + prompt[users[-1] :] if users else prompt


def fit_prompt(prompt: str | list[dict], ids: list[int], max_prompt_length: int, encode) -> list[int]:
    """The ids of `prompt` (`ids`, over `max_prompt_length`) cut to fit: a plain-text prompt keeps its end (the
    question and what follows it); a chat prompt drops whole turns of its history, oldest first (a turn: a user
    message and what follows it up to the next one), keeping its leading system messages, the tools' schemas (the
    template renders them whatever the messages) and its last user turn; `encode(messages)` gives the ids of a
    shorter prompt. A chat prompt that cannot fit so is an error: cutting into the system message or the tools'
    schemas would leave the model without its instructions or its tools."""
    if not is_conversational(prompt):
        return ids[-max_prompt_length:]
    head, users = _turns(prompt)
    for start in users:  # drop prompt[head:start]: the history before that user turn
        shorter = encode(prompt[:head] + prompt[start:])
        if len(shorter) <= max_prompt_length:
            return shorter
    kept = len(encode(kept_part(prompt))) if users else len(ids)
    raise ValueError(
        f"A chat prompt is {len(ids)} tokens long, over max_prompt_length={max_prompt_length}, and still {kept} "
        "tokens with its history dropped: its system messages, the tools' schemas and its last user turn alone are "
        "over the limit, and cutting into them would hide the model's instructions or tools. Raise max_prompt_length "
        "(or set it to None, TRL's default: no limit), shorten the system message or the tools' docstrings, or drop "
        "the long rows from the dataset."
    )


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
