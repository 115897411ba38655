"""Greedy evaluation of real tool episodes on held-out problems: accuracy, tool-call rate, failed calls, turns.

The episodes are run by grpo_hf's own `EpisodeRunner` (the one training uses) on the `loop` engine's joining decoder
(`run_joining` driving `LoopEngine.decode_turns`) with a greedy generation config (`greedy_engine`): the model's
turns are decoded, its tool calls parsed and really run, and the replies appended, up to `max_completion_length`
tokens per episode; a turn whose tools have returned joins the decoding batch at the next token step. Without tools
the same runner gives single-turn answers.

Every context of a batch starts with the same system prompt and tool schema (about 230 of the ~260 prompt tokens
with the tool), and every later turn with the episode's earlier ones: the engine's episode cache prefills that shared
prefix once for the batch and keeps each row's KV cache across its turns, so a row that comes back from its tools
prefills only the reply. The evaluation costs a fraction of `model.generate`'s, which prefills every row's whole
context at every turn, and picks the same tokens as greedy `model.generate` on the same contexts (up to float
rounding in the order of the sums).

The metrics: `accuracy` (episodes whose last message is the model's and ends on the product), `tool_call_rate`
(episodes with at least one tool reply), `failed_call_rate` (failed calls per call, as `tools/failure_frequency` in
training: unknown tool, bad arguments, an exception; 0 when nothing was called) and `mean_turns` (the model's turns
per episode, as `tools/turns_mean`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import GenerationConfig

from grpo_hf.rollout import eos_token_ids_of
from grpo_hf.rollout.episodes import EpisodeRunner
from grpo_hf.rollout.loop import LoopEngine
from grpo_hf.rollout.prompts import tokenize_prompts

from tools_support.problems import called_tool, correct_answer


def greedy_engine(model, tokenizer, max_new_tokens: int, episode_cache_gb: float = 4.0) -> LoopEngine:
    """The `loop` engine decoding greedily (the argmax at each step) with an episode cache of `episode_cache_gb` GiB
    (`GRPOConfig.episode_cache_gb`): a row that does not fit re-prefills its context when it comes back."""
    eos = eos_token_ids_of(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=pad, eos_token_id=eos)
    return LoopEngine(config, eos, episode_cache_bytes=int(episode_cache_gb * 2**30))


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
    episode_cache_gb: float = 4.0,
) -> dict:
    """Greedy episodes on every row of `dataset` (columns `prompt`, `answer`): the metrics above and the records.
    `episode_cache_gb`: the engine's episode cache budget (`greedy_engine`)."""
    runner = EpisodeRunner(
        tokenizer,
        max_completion_length=max_completion_length,
        eos_token_ids=eos_token_ids_of(model, tokenizer),
        max_tool_calling_iterations=max_tool_calling_iterations,
        template_kwargs=template_kwargs,
    )
    engine = greedy_engine(model, tokenizer, max_completion_length, episode_cache_gb)
    records, calls, failures = [], 0, 0
    for start in range(0, len(dataset), batch_size):
        rows = dataset.select(range(start, min(start + batch_size, len(dataset))))
        row_tools = [list(tools)] * len(rows)
        ids, mask, _ = tokenize_prompts(tokenizer, rows["prompt"], None, template_kwargs, tools=row_tools)
        ids, mask = ids.to(model.device), mask.to(model.device)
        episodes = runner.run_joining(lambda source: engine.decode_turns(model, source), ids, mask, row_tools)
        calls, failures = calls + episodes.tool_calls, failures + episodes.tool_failures
        scores = correct_answer(episodes.messages, rows["answer"])
        for row, messages, score, turns in zip(rows, episodes.messages, scores, episodes.turns, strict=True):
            records.append({"question": row["question"], "answer": row["answer"], "correct": score,
                            "called_tool": called_tool(messages), "turns": turns, "messages": messages})  # fmt: skip
    n = len(records)
    return {
        "accuracy": sum(r["correct"] for r in records) / n,
        "tool_call_rate": sum(r["called_tool"] for r in records) / n,
        "failed_call_rate": failures / calls if calls else 0.0,
        "mean_turns": sum(r["turns"] for r in records) / n,
        "n": n,
        "records": records,
    }
