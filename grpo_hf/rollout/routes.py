"""MoE routes of a rollout: the top-k experts each token the policy read was sent to, kept with its row.

Rollout Routing Replay (R3, arXiv 2510.11370) trains each token under the experts the rollout chose. The rollout side
records them (`grpo_hf.routers.recording`, the one place that knows each family's router) and hands them on with the
tokens they belong to.

Layout. A row's routes are `[P + T, L, k]` (a batch: `[N, P + T, L, k]`, `ROUTE_DTYPE`), aligned with
`cat(prompt_ids [N, P], completion_ids [N, T])`: column j holds, for each of the L MoE layers, the k experts the
forward that READ token j routed it to. A token is read when it is fed to the model: every prompt token and every
sampled token fed back to sample the next one; not the left padding, not a completion's last token (nothing reads it:
an EOS, or the token that hit the length bound), nothing after it. Those hold `NO_ROUTE` (-1). The layout splits at
the prompt width P, so every path that re-pads or trims rows does it on each side (`realign`, `trim`), prompts on the
left and completions on the right, as the token tensors.

Recording (`StepRoutes`): an engine writes each forward's routes into one buffer as the forward runs (the prefill's
into the prompt columns, each decode step's into its column, through the row map of a batch whose finished rows left
it), with device-side indexing only: no host-device sync per token. `RolloutEngine.generate` then masks what was not
read (`read_mask`).
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from grpo_hf.routers import recording

NO_ROUTE = -1
ROUTE_DTYPE = torch.int16  # expert indices: up to 32,767 experts a layer (DeepSeek-V3 has 256)


def read_mask(prompt_mask: Tensor, completion_mask: Tensor, context_mask: Tensor | None = None) -> Tensor:
    """[N, P + T] bool: the tokens of `cat(prompt, completion)` a forward read while sampling: the prompt's, and each
    completion token followed by another (sampled, or a tool reply's: `context_mask`, read by the next turn)."""
    attended = completion_mask if context_mask is None else completion_mask + context_mask  # [N, T]
    followed = torch.nn.functional.pad(attended[:, 1:], (0, 1))  # [N, T] 1 where a next token exists
    return torch.cat([prompt_mask != 0, (attended != 0) & (followed != 0)], dim=1)


def masked(routes: Tensor, read: Tensor) -> Tensor:
    """`routes` [N, W, L, k] with `NO_ROUTE` wherever `read` [N, W] is False."""
    return routes.masked_fill(~read.to(routes.device)[:, :, None, None], NO_ROUTE)


def realign(routes: Tensor, prompt_width: int, new_prompt_width: int, new_completion_width: int) -> Tensor:
    """`routes` [N, P + T, L, k] (P = `prompt_width`) re-padded (or cut) to P' + T' columns: the prompt part on the
    left, the completion part on the right, as `batching.pad_columns` pads the tokens; new columns hold `NO_ROUTE`."""
    prompt, completion = routes[:, :prompt_width], routes[:, prompt_width:]
    prompt = _fit(prompt, new_prompt_width, left=True)
    completion = _fit(completion, new_completion_width, left=False)
    return torch.cat([prompt, completion], dim=1)


def trim(routes: Tensor, prompt_width: int, first: int, last: int) -> Tensor:
    """The columns of `routes` [N, P + T, L, k] that a batch trimmed to prompt columns [first, P) and completion
    columns [0, last) keeps (`batching.split_into_micro_batches`)."""
    return routes[:, first : prompt_width + last]


def _fit(part: Tensor, width: int, left: bool) -> Tensor:
    """`part` [N, w, L, k] padded with `NO_ROUTE` or cut to `width` columns, on the left or the right."""
    missing = width - part.size(1)
    if missing < 0:
        return part[:, -missing:] if left else part[:, :width]
    if missing == 0:
        return part
    padding = part.new_full((part.size(0), missing, *part.shape[2:]), NO_ROUTE)
    return torch.cat([padding, part] if left else [part, padding], dim=1)


def no_routes(rows: int, width: int, like: Tensor) -> Tensor:
    """[rows, width, L, k] of `NO_ROUTE`, with the layers, k, dtype and device of `like` [*, *, L, k]."""
    return like.new_full((rows, width, *like.shape[2:]), NO_ROUTE)


class StepRoutes:
    """One engine call's routes as its forwards run, written into a buffer [N, W, L, k] (`ROUTE_DTYPE`, -1 where no
    forward wrote), within `routers.recording(model)`: `prefill` after a forward of the U distinct prompts (their rows
    repeated to the N rows by `prompt_of_row`), `step` after each one-token forward of the batch's rows `rows` [A].
    Nothing here reads a tensor on the host."""

    def __init__(self, recorder, rows: int, width: int):
        self.recorder, self.rows, self.width = recorder, rows, width
        self.routes: Tensor | None = None  # [N, W, L, k], allocated at the first forward (L and k come with it)

    def _buffer(self, like: Tensor) -> Tensor:
        if self.routes is None:
            shape = (self.rows, self.width, *like.shape[2:])
            self.routes = torch.full(shape, NO_ROUTE, dtype=ROUTE_DTYPE, device=like.device)
        return self.routes

    def prefill(self, distinct: int, prompt_of_row: Tensor | None = None, start: int = 0) -> None:
        """The last forward was of `distinct` rows of s tokens: their routes go to columns [start, start + s) of the
        rows `prompt_of_row` [N] names (None: row i is row i)."""
        routes = self.recorder.pop(distinct)  # [U, s, L, k]
        if prompt_of_row is not None:
            routes = routes[prompt_of_row.to(routes.device)]
        self._buffer(routes)[:, start : start + routes.size(1)] = routes.to(ROUTE_DTYPE)

    def step(self, rows: Tensor, column: int) -> None:
        """The last forward fed one token to each of the batch's rows `rows` [A] (rows of the buffer), at `column`."""
        routes = self.recorder.pop(rows.numel())  # [A, 1, L, k]
        self._buffer(routes)[rows.to(routes.device), column] = routes[:, 0].to(ROUTE_DTYPE)

    def result(self, width: int) -> Tensor | None:
        """The buffer's first `width` columns (None: no forward ran)."""
        return None if self.routes is None else self.routes[:, :width]


@contextlib.contextmanager
def recording_steps(model, enabled: bool, rows: int, width: int):
    """`StepRoutes` of `rows` x `width` within `routers.recording(model)` when `enabled`; else None (nothing recorded,
    no hook installed)."""
    if not enabled:
        yield None
        return
    with recording(model) as recorder:
        yield StepRoutes(recorder, rows, width)
