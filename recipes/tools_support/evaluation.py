"""Greedy evaluation of real tool episodes on held-out problems: accuracy, tool-call rate, failed calls, turns.

The episodes are run by grpo_hf's own `EpisodeRunner` (the one training uses) with greedy decoding: the model's
turns are generated, its tool calls parsed and really run, and the replies appended, up to `max_completion_length`
tokens per episode. Without tools the same runner gives single-turn answers.

Every context of a batch starts with the same system prompt and tool schema (about 230 of the ~260 prompt tokens
with the tool), so `greedy_shared_prefix` prefills that common prefix once and the rest of each row on top of it: the
evaluation costs a fraction of `model.generate`'s, which prefills every row's whole context at every turn. It picks
the same tokens as greedy `model.generate` (up to float rounding in the order of the sums).

The metrics: `accuracy` (episodes whose last message is the model's and ends on the product), `tool_call_rate`
(episodes with at least one tool reply), `failed_call_rate` (failed calls per call, as `tools/failure_frequency` in
training: unknown tool, bad arguments, an exception; 0 when nothing was called) and `mean_turns` (the model's turns
per episode, as `tools/turns_mean`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import DynamicCache

from grpo_hf.rollout import eos_token_ids_of
from grpo_hf.rollout.episodes import EpisodeRunner
from grpo_hf.rollout.prompts import tokenize_prompts
from grpo_hf.rollout.sampling import cache_keyword

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
    """Greedy episodes on every row of `dataset` (columns `prompt`, `answer`): the metrics above and the records."""
    eos = eos_token_ids_of(model, tokenizer)
    runner = EpisodeRunner(
        tokenizer,
        max_completion_length=max_completion_length,
        eos_token_ids=eos,
        max_tool_calling_iterations=max_tool_calling_iterations,
        template_kwargs=template_kwargs,
    )

    def generate(ids, mask, max_new_tokens, images, draws):  # contexts padded on the CPU; text only; greedy: no draws
        ids, mask = ids.to(model.device), mask.to(model.device)
        completion_ids, completion_mask = greedy_shared_prefix(model, ids, mask, max_new_tokens, eos, pad)
        return completion_ids, completion_mask, None

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    was_training = model.training
    model.eval()

    records, calls, failures = [], 0, 0
    for start in range(0, len(dataset), batch_size):
        rows = dataset.select(range(start, min(start + batch_size, len(dataset))))
        row_tools = [list(tools)] * len(rows)
        ids, mask, _ = tokenize_prompts(tokenizer, rows["prompt"], None, template_kwargs, tools=row_tools)
        episodes = runner.run(generate, ids.to(model.device), mask.to(model.device), row_tools)
        calls, failures = calls + episodes.tool_calls, failures + episodes.tool_failures
        scores = correct_answer(episodes.messages, rows["answer"])
        for row, messages, score, turns in zip(rows, episodes.messages, scores, episodes.turns, strict=True):
            records.append({"question": row["question"], "answer": row["answer"], "correct": score,
                            "called_tool": called_tool(messages), "turns": turns, "messages": messages})  # fmt: skip
    model.train(was_training)
    n = len(records)
    return {
        "accuracy": sum(r["correct"] for r in records) / n,
        "tool_call_rate": sum(r["called_tool"] for r in records) / n,
        "failed_call_rate": failures / calls if calls else 0.0,
        "mean_turns": sum(r["turns"] for r in records) / n,
        "n": n,
        "records": records,
    }


@torch.no_grad()
def greedy_shared_prefix(
    model, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int, eos: list[int], pad: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy continuations of the left-padded contexts `ids` [B, L] (`mask` 1 on tokens): (ids [B, T], mask [B, T],
    1 up to and including each row's first EOS). The tokens all rows start with are run once and their KV cache
    repeated for every row; each row's rest follows them, left-padded (padding between the shared prefix and a row's
    own tokens is masked out, positions count tokens only)."""
    rows = [row[keep.bool()] for row, keep in zip(ids, mask, strict=True)]
    shortest = min(len(row) for row in rows)
    same = torch.stack([row[:shortest] for row in rows]).eq(rows[0][:shortest]).all(dim=0)  # [shortest]
    shared = min(int(same.long().cumprod(0).sum()), shortest - 1)  # every row keeps a token of its own
    B, device = len(rows), ids.device
    cache, keyword = DynamicCache(config=model.config), cache_keyword(model)  # `cache=` or `past_key_values=`
    if shared:
        model(input_ids=rows[0][None, :shared], use_cache=True, logits_to_keep=1, **{keyword: cache})
        cache.batch_repeat_interleave(B)
    width = max(len(row) for row in rows) - shared
    rest = torch.full((B, width), pad, dtype=ids.dtype, device=device)  # [B, S] left-padded
    rest_mask = torch.zeros((B, width), dtype=mask.dtype, device=device)  # [B, S]
    for i, row in enumerate(rows):
        rest[i, width - len(row) + shared :], rest_mask[i, width - len(row) + shared :] = row[shared:], 1
    attention = torch.cat([torch.ones((B, shared), dtype=mask.dtype, device=device), rest_mask], dim=1)
    positions = (shared + rest_mask.cumsum(1) - 1).clamp(min=0)  # [B, S]
    logits = model(
        input_ids=rest, attention_mask=attention, position_ids=positions, use_cache=True, logits_to_keep=1,
        **{keyword: cache},
    ).logits[:, -1]  # [B, V]  # fmt: skip
    eos_ids = torch.tensor(eos, device=device)
    finished = torch.zeros(B, dtype=torch.bool, device=device)
    tokens, keep = [], []
    position = positions[:, -1:]  # [B, 1]
    for _ in range(max_new_tokens):
        token = torch.where(finished, pad, logits.argmax(-1))  # [B]
        tokens.append(token)
        keep.append(~finished)
        finished = finished | torch.isin(token, eos_ids)
        if bool(finished.all()):
            break
        attention = torch.cat([attention, torch.ones_like(attention[:, :1])], dim=1)
        position = position + 1
        logits = model(
            input_ids=token[:, None], attention_mask=attention, position_ids=position, use_cache=True,
            **{keyword: cache},
        ).logits[:, -1]  # fmt: skip
    return torch.stack(tokens, dim=1), torch.stack(keep, dim=1).long()
