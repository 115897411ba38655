"""Greedy evaluation of real tool episodes on held-out problems: accuracy and tool-call rate.

The episodes are run by grpo_hf's own `EpisodeRunner` (the one training uses) on top of the `generate` engine with
greedy decoding: the model's turns are generated, its tool calls parsed and really run, and the replies appended, up
to `max_completion_length` tokens per episode. Without tools the same runner gives single-turn answers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import GenerationConfig

from grpo_hf.rollout import eos_token_ids_of
from grpo_hf.rollout.episodes import EpisodeRunner
from grpo_hf.rollout.hf_generate import GenerateEngine
from grpo_hf.rollout.prompts import tokenize_prompts

from tools_support.problems import called_tool, correct_answer


@torch.no_grad()
def evaluate(
    model,
    tokenizer,
    dataset,
    tools: list[Callable],
    *,
    max_completion_length: int,
    template_kwargs: dict,
    batch_size: int = 32,
    max_tool_calling_iterations: int | None = 2,
) -> dict:
    """Greedy episodes on every row of `dataset` (columns `prompt`, `answer`): accuracy, tool-call rate, records."""
    eos = eos_token_ids_of(model, tokenizer)
    greedy = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_completion_length,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=eos,
    )
    engine = GenerateEngine(greedy, eos)
    runner = EpisodeRunner(
        tokenizer,
        max_completion_length=max_completion_length,
        eos_token_ids=eos,
        max_tool_calling_iterations=max_tool_calling_iterations,
        template_kwargs=template_kwargs,
    )

    def generate(ids, mask, max_new_tokens, images, draws):  # contexts padded on the CPU; text only; greedy: no draws
        completion = engine.generate(model, ids.to(model.device), mask.to(model.device), max_new_tokens=max_new_tokens)
        return completion.completion_ids, completion.completion_mask, None

    records = []
    for start in range(0, len(dataset), batch_size):
        rows = dataset.select(range(start, min(start + batch_size, len(dataset))))
        row_tools = [list(tools)] * len(rows)
        ids, mask, _ = tokenize_prompts(tokenizer, rows["prompt"], None, template_kwargs, tools=row_tools)
        episodes = runner.run(generate, ids.to(model.device), mask.to(model.device), row_tools)
        scores = correct_answer(episodes.messages, rows["answer"])
        for row, messages, score in zip(rows, episodes.messages, scores, strict=True):
            records.append({"question": row["question"], "answer": row["answer"], "correct": score,
                            "called_tool": called_tool(messages), "messages": messages})  # fmt: skip
    n = len(records)
    return {
        "accuracy": sum(r["correct"] for r in records) / n,
        "tool_call_rate": sum(r["called_tool"] for r in records) / n,
        "n": n,
        "records": records,
    }
