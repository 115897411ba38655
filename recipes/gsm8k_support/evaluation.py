"""Greedy pass@1 evaluation on GSM8K-style data.

For each problem the model decodes one completion greedily (`do_sample=False`, so the score is
deterministic), and the completion is scored with the same functions the trainer rewards:
`grpo_hf.rewards.accuracy_reward` for correctness (the final `#### N` / `<answer>` / "the answer is"
number, compared numerically with the gold) and the format reward that matches the prompt's answer
format (`gsm8k_format_reward` for "####", `format_reward` for "tags").

Generation is batched with left padding and runs on the model's device. With several processes
(`accelerate launch`) the recipe gives each process its own slice of the problems and gathers the
records; pass `synced_gpus=True` when the parameters are sharded (FSDP, ZeRO-3) so that every process
keeps stepping until the slowest has finished.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import GenerationConfig

from grpo_hf.rewards import accuracy_reward, extract_answer, extract_gold, format_reward, gsm8k_format_reward

logger = logging.getLogger(__name__)

FORMAT_CHECKS = {"####": gsm8k_format_reward, "tags": format_reward}


def _prompt_texts(tokenizer, prompts: list) -> list[str]:
    if prompts and not isinstance(prompts[0], str):  # conversational: list of messages
        return [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
    return list(prompts)


def _eos_ids(model, tokenizer) -> list[int]:
    ids = set()
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (tokenizer.eos_token_id, gen_eos):
        if isinstance(value, int):
            ids.add(value)
        elif value is not None:
            ids.update(value)
    return sorted(ids)


@torch.inference_mode()
def generate_completions(
    model,
    tokenizer,
    prompts: list,
    *,
    max_new_tokens: int,
    batch_size: int = 16,
    synced_gpus: bool = False,
    desc: str = "Evaluating",
    disable_progress: bool = False,
) -> tuple[list[str], list[int], list[bool]]:
    """Greedy completions for `prompts` (strings or chat messages): texts, token lengths, truncated flags.

    A completion's length counts its tokens up to and including the first EOS; a completion with no EOS
    within `max_new_tokens` is truncated.
    """
    device = next(model.parameters()).device
    eos_ids = _eos_ids(model, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    generation_config = GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos_ids, pad_token_id=pad_id
    )
    padding_side, tokenizer.padding_side = tokenizer.padding_side, "left"
    was_training = model.training
    model.eval()
    texts, lengths, truncated = [], [], []
    try:
        prompt_texts = _prompt_texts(tokenizer, prompts)
        num_batches = math.ceil(len(prompt_texts) / batch_size)
        for start in tqdm(
            range(0, len(prompt_texts), batch_size), total=num_batches, desc=desc, disable=disable_progress
        ):
            batch = tokenizer(
                prompt_texts[start : start + batch_size], return_tensors="pt", padding=True, add_special_tokens=False
            ).to(device)
            output = model.generate(**batch, generation_config=generation_config, synced_gpus=synced_gpus)
            completion_ids = output[:, batch["input_ids"].shape[1] :]  # [B, T]
            is_eos = torch.isin(completion_ids, torch.tensor(eos_ids, device=completion_ids.device))  # [B, T]
            has_eos = is_eos.any(dim=1)  # [B]
            first_eos = torch.where(has_eos, is_eos.int().argmax(dim=1), completion_ids.shape[1])  # [B]
            for row, eos_at, ended in zip(completion_ids, first_eos.tolist(), has_eos.tolist(), strict=True):
                texts.append(tokenizer.decode(row[:eos_at], skip_special_tokens=True))
                lengths.append(eos_at + 1 if ended else eos_at)
                truncated.append(not ended)
    finally:
        tokenizer.padding_side = padding_side
        model.train(was_training)
    return texts, lengths, truncated


def score_completions(
    completions: list[str], golds: list, answer_format: str = "####"
) -> tuple[list[float], list[float]]:
    """(correct, formatted) per completion, from the library's reward functions (1.0 / 0.0)."""
    if answer_format not in FORMAT_CHECKS:
        raise ValueError(f"answer_format={answer_format!r} is not one of {list(FORMAT_CHECKS)}.")
    correct = [r or 0.0 for r in accuracy_reward(completions=completions, answer=golds)]
    formatted = FORMAT_CHECKS[answer_format](completions=completions)
    return correct, formatted


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Accuracy, format rate, mean completion length and truncation rate of per-sample records."""
    n = len(records)

    def mean(key: str) -> float:
        return sum(float(r[key]) for r in records) / n if n else 0.0

    return {
        "accuracy": mean("correct"),
        "format_rate": mean("formatted"),
        "mean_length": mean("length"),
        "truncated_rate": mean("truncated"),
        "n": n,
        "records": records,
    }


def _record(prompt, gold, completion: str, length: int, truncated: bool, correct: float, formatted: float) -> dict:
    """One evaluated sample: the question (the prompt's last message), the completion and how it scored."""
    return {
        "question": prompt if isinstance(prompt, str) else prompt[-1]["content"],
        "completion": completion,
        "predicted": extract_answer(completion),
        "gold": extract_gold(gold),
        "correct": bool(correct),
        "formatted": bool(formatted),
        "length": length,
        "truncated": truncated,
    }


def evaluate_accuracy(
    model,
    tokenizer,
    dataset,
    *,
    max_new_tokens: int = 256,
    batch_size: int = 16,
    answer_column: str = "answer",
    prompt_column: str = "prompt",
    answer_format: str = "####",
    synced_gpus: bool = False,
    desc: str = "Evaluating",
    disable_progress: bool = False,
) -> dict[str, Any]:
    """Greedy pass@1 on `dataset` (a `datasets.Dataset` or a list of dicts with prompt + answer columns).

    Returns `{"accuracy", "format_rate", "mean_length", "truncated_rate", "n", "records"}`; each record
    holds the prompt's last message (the question), the completion, the predicted and gold answers,
    `correct`, `formatted`, `length` (tokens) and `truncated`.
    """
    rows = list(dataset)
    for column in (prompt_column, answer_column):
        if rows and column not in rows[0]:
            raise ValueError(f"evaluate_accuracy needs a {column!r} column; columns found: {sorted(rows[0])}.")
    prompts = [r[prompt_column] for r in rows]
    golds = [r[answer_column] for r in rows]
    completions, lengths, truncated = generate_completions(
        model,
        tokenizer,
        prompts,
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
        synced_gpus=synced_gpus,
        desc=desc,
        disable_progress=disable_progress,
    )
    correct, formatted = score_completions(completions, golds, answer_format)
    records = [
        _record(prompt, gold, completion, length, cut, right, formatted_ok)
        for prompt, gold, completion, length, cut, right, formatted_ok in zip(
            prompts, golds, completions, lengths, truncated, correct, formatted, strict=True
        )
    ]
    result = summarize(records)
    logger.info(
        "%s: accuracy %.3f, format %.3f, mean length %.1f tokens on %d problems",
        desc,
        result["accuracy"],
        result["format_rate"],
        result["mean_length"],
        result["n"],
    )
    return result
