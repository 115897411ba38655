"""The supervised warm start: a few steps of TRL's `SFTTrainer` on generated, correct traces.

A 135M model never writes a tool call on its own, so GRPO alone would have nothing to reward. A short warm start
shows it the format; GRPO then trains on what it samples. Both arms get the same warm start on the same problems:

- with the tool: the prompt holds the tool's schema, and a `tool_fraction` of the traces (spread evenly over the
  rows) call it: `[prompt][call multiply(a, b)][tool reply][The answer is N.]`; the others answer at once,
  `[prompt][The answer is N.]`. With a fraction below 1 the warm start shows both ways to answer, and leaves it to the
  reward to tell which one works;
- without: `[prompt][The answer is N.]` (a direct answer, which the model has to compute in its head).

Traces are token ids built as a tool episode builds its training rows (`grpo_hf.rollout.episodes`): each model turn
tokenised on its own and closed by the EOS, the tool reply as the chat template's ids (`tool_reply_ids`). The loss
covers the model's turns only (`completion_mask`), not the prompt nor the tool reply.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any

import datasets
from transformers import TrainingArguments
from trl import SFTConfig, SFTTrainer

from grpo_hf.rollout.prompts import tokenize_prompts
from grpo_hf.rollout.tools import tool_reply_ids

from tools_support.problems import multiply

logger = logging.getLogger(__name__)

ANSWER = "The answer is {}."


def trace_ids(
    tokenizer, row: dict[str, Any], with_tool: bool, template_kwargs: dict, calls: bool = True
) -> tuple[list[int], list[int]]:
    """(input_ids, completion_mask) of one correct trace for `row` (with its `prompt`, `a`, `b`, `answer`).
    `with_tool`: the prompt lists the tool; `calls` (with the tool): the trace calls it, else it answers at once."""
    tools = [[multiply]] if with_tool else None
    ids, mask, _ = tokenize_prompts(tokenizer, [row["prompt"]], None, template_kwargs, tools=tools)
    prompt = ids[0][mask[0].bool()].tolist()

    def turn(text: str) -> list[int]:
        return tokenizer(text + tokenizer.eos_token, add_special_tokens=False)["input_ids"]

    answer = turn(ANSWER.format(row["answer"]))
    if not (with_tool and calls):
        return prompt + answer, [0] * len(prompt) + [1] * len(answer)
    call = {"name": multiply.__name__, "arguments": {"a": row["a"], "b": row["b"]}}
    first = turn(f"<tool_call>\n{json.dumps(call)}\n</tool_call>")
    reply = tool_reply_ids(
        tokenizer, [{"role": "tool", "name": "multiply", "content": row["answer"]}], template_kwargs
    )
    ids = prompt + first + reply + answer
    return ids, [0] * len(prompt) + [1] * len(first) + [0] * len(reply) + [1] * len(answer)


def calls_tool(index: int, fraction: float) -> bool:
    """Whether trace `index` calls the tool when a `fraction` of the traces do, spread evenly: 0.5 calls on every
    second trace, 0.25 on every fourth."""
    return math.floor((index + 1) * fraction + 1e-9) > math.floor(index * fraction + 1e-9)


def warm_start(
    model,
    tokenizer,
    dataset: datasets.Dataset,
    *,
    with_tool: bool,
    template_kwargs: dict,
    output_dir: str,
    max_completion_length: int | None = None,
    tool_fraction: float = 1.0,
    **settings,
):
    """Train `model` in place on one trace per row of `dataset`; with the tool, a `tool_fraction` of them call it
    (`calls_tool`). `settings` are SFTConfig fields (learning rate, epochs, batch size). Warns when a trace is longer
    than `max_completion_length` (the episodes' bound). Returns the trainer's log history."""
    if not 0.0 <= tool_fraction <= 1.0:
        raise ValueError(f"tool_fraction={tool_fraction} must be between 0 and 1 (the share of traces that call).")
    rows = [
        trace_ids(tokenizer, row, with_tool, template_kwargs, calls=calls_tool(i, tool_fraction))
        for i, row in enumerate(dataset)
    ]
    longest = max(len(ids) - mask.index(1) for ids, mask in rows)  # the episode after the prompt
    if max_completion_length is not None and longest > max_completion_length:
        logger.warning(
            "A correct %s episode takes up to %d tokens, more than max_completion_length=%d: episodes will be cut "
            "before their answer. Raise max_completion_length.",
            "tool" if with_tool else "direct",
            longest,
            max_completion_length,
        )
    traces = datasets.Dataset.from_dict({"input_ids": [r[0] for r in rows], "completion_mask": [r[1] for r in rows]})
    checkpointing = (
        "activation_checkpointing"
        if "activation_checkpointing" in TrainingArguments.__dataclass_fields__
        else "gradient_checkpointing"
    )
    config = SFTConfig(
        output_dir=output_dir,
        completion_only_loss=True,
        max_length=None,
        lr_scheduler_type="constant",
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        **{checkpointing: False},
        **settings,
    )
    use_cache = model.config.use_cache
    trainer = SFTTrainer(model=model, args=config, train_dataset=traces, processing_class=tokenizer)
    trainer.train()
    model.config.use_cache = use_cache  # SFTTrainer turns the KV cache off for training; generation needs it
    return trainer.state.log_history
