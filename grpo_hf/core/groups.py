"""Where the groups sit in a batch: the runs of rows that share a prompt.

Not maths, but the layout every lower layer agrees on (a group is G consecutive rows of one prompt): the shared-
prefix log-prob forward (`grpo_hf.logprobs`) and the rollout engines both read it, and `grpo_hf.core` is the one
module below both of them. It belongs with the rollout's batching code once `logprobs` may import that.
"""

import torch


def prompt_runs(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> list[tuple[int, int]]:
    """`(start, stop)` of every run of identical consecutive rows of `prompt_ids`/`prompt_mask` [N, P].

    A group's G copies of one prompt are such a run (`RepeatSampler` keeps them together); a group
    split across processes or micro-batches gives one run per piece.
    """
    if prompt_ids.size(0) == 0:
        return []
    same = (prompt_ids[1:] == prompt_ids[:-1]).all(dim=1) & (prompt_mask[1:] == prompt_mask[:-1]).all(dim=1)  # [N-1]
    starts = [0, *(torch.nonzero(~same).flatten() + 1).tolist()]
    return list(zip(starts, [*starts[1:], prompt_ids.size(0)], strict=True))
