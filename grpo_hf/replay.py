"""MoE routing replay on the training side (`router_replay`, docs/moe.md): the experts each training-side forward
routes a rollout's tokens to, and how far training and rollout disagree.

In RL on a Mixture-of-Experts model the rollout engine and the training forward choose experts independently; small
numerical differences flip some top-k choices, the flips compound over layers, and a token is trained under experts
it was not sampled with (arXiv 2510.11370). Routing replay makes the training forwards use recorded experts instead:

- `"r3"` (rollout routing replay): the experts the rollout engine chose, `MicroBatch.routes` [B, P + T, L, k];
- `"r2"`: the experts the old-policy forward chose, recorded here into `MicroBatch.old_routes` by that forward, which
  then always runs (where the loss needs no old log-probs, for its routes only);
- `"off"`: every forward routes as it computes.

What a caller may rely on:

- Which forwards: the old-policy log-probs (r3 replays; r2 records), the reference model's (under PEFT the policy with
  its adapters off or frozen: the same routers) and the policy's loss forward, on every path they take (padded, the
  shared prompt run once per group, a group at a time, in chunks): each forward names its rows and its columns of
  cat(prompt_ids, completion_ids) (`logprobs.Routing`), and `BatchRouting` cuts the routes to them. The shared prompt
  of a group runs under its first row's routes. Tokens with a route of -1 (padding, a completion's last token, which
  the rollout never fed back) route live.
- The router keeps its gradient and the load-balancing loss is the family's own: `routers.replaying` swaps in the
  recorded indices with weights recomputed from the live router logits, and returns the live logits.
- `"off"` changes nothing: the hooks `routers` installs return the module's own output unless a context is open, and
  recording (for the metrics below) opens one that only reads.
- Metrics, for an MoE policy grpo_hf knows the router of, whatever the setting, per training micro-step, summed over
  micro-steps and processes before dividing (`Metrics.add_ratio`):
  - `router/route_mismatch`, `router/token_mismatch`: the share of (token, layer) routes, and of tokens with any
    layer, whose top-k set in the loss forward differs from the rollout's (`routers.route_mismatch_counts`), where
    the rollout recorded routes. The loss forward's live choice is recorded before any replay: under r3 it is the
    choice replay overrode;
  - `router/logp_gap` (mean |delta|) and `router/k3_kl` (Schulman's k3 estimate of KL(sampler || trainer), from
    samples of the sampler): the loss forward's log-probs against the sampler's own (`sampling_logps`) on completion
    tokens, where the sampler recorded them (vLLM, a stale batch of the async producer, `rollout_func`), both under
    the distribution the sampler drew from (`trainer_logps`: its top-k, top-p, penalties replayed on the trainer's
    logits, not log(kept mass) in every token's gap). After an optimizer step on the same rollout
    (num_iterations > 1), they include the policy's own change.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, replace
from typing import get_args

import torch
from torch import Tensor, nn

from grpo_hf.config import RouterReplayMode
from grpo_hf.core import check_choice
from grpo_hf.metrics import Metrics
from grpo_hf.rollout.batching import MicroBatch
from grpo_hf.routers import recording, replaying, route_mismatch_counts, router_sites

logger = logging.getLogger(__name__)

MODES = get_args(RouterReplayMode)  # "off", "r2", "r3": `GRPOConfig.router_replay`


@dataclass
class BatchRouting:
    """The `logprobs.Routing` of one micro-batch's forwards: the routes they replay (`replay` [B, P + T, L, k], -1:
    live; None: none) and, with `live` [B, P + T, L, k], the experts they choose, recorded there (before any replay;
    -1 off the tokens the forwards read, `mask` [B, P + T]). `offset`: the micro-batch's row where the rows of the
    batch a forward is given start (`from_row`). `logps`: the loss's log-probs [B, T], once seen
    (`logprobs.watch_logps`)."""

    replay: Tensor | None
    mask: Tensor
    live: Tensor | None = None
    offset: int = 0
    logps: Tensor | None = None

    def from_row(self, start: int) -> BatchRouting:
        """The same routes and recording, for a batch of this one's rows from `start` on."""
        return replace(self, offset=self.offset + start)

    @contextlib.contextmanager
    def __call__(self, model: nn.Module, rows: Tensor, columns: slice, *, shared: bool = False):
        rows = rows.to(self.mask.device) + self.offset  # [n] rows of the micro-batch
        with contextlib.ExitStack() as stack:
            if self.replay is not None:
                stack.enter_context(replaying(model, self.replay[rows[:1] if shared else rows, columns]))
            recorder = stack.enter_context(recording(model)) if self.live is not None else None
            yield
            if recorder is not None:
                routes = recorder.pop(1 if shared else rows.numel())  # [n or 1, w, L, k]
                read = self.mask[rows, columns].bool()[:, :, None, None]  # [n, w, 1, 1]
                self.live[rows, columns] = (
                    routes.to(self.live.dtype).expand(len(rows), -1, -1, -1).masked_fill(~read, -1)
                )


class RouterReplay:
    """One run's routing replay (`mode`, one of `MODES`) on a policy with `layers` MoE layers of top-`top_k` routers,
    and the metrics it records into (`metrics`, the run's)."""

    def __init__(self, mode: str, layers: int, top_k: int, metrics: Metrics | None = None):
        self.mode, self.layers, self.top_k, self.metrics = mode, layers, top_k, metrics

    @classmethod
    def of(cls, mode: str, model: nn.Module, metrics: Metrics | None = None) -> RouterReplay | None:
        """The replay of `model` (the bare policy) under `router_replay=mode`; None for a dense model with it off, and
        for an MoE model whose router grpo_hf does not know with it off (no metrics then; logged). With it on, a
        dense model, or an unknown router (`routers.router_sites`' error), is a ValueError."""
        check_choice("router_replay", mode, MODES)
        try:
            sites = router_sites(model)
        except ValueError as error:
            if mode != "off":
                raise
            logger.info("MoE router metrics off: %s", error)
            return None
        if not sites:
            if mode != "off":
                raise ValueError(
                    f"router_replay={mode!r}, but {type(model).__name__} is not a Mixture-of-Experts model: it has no "
                    "router whose experts could be replayed. Leave router_replay='off' for a dense model."
                )
            return None
        return cls(mode, len(sites), sites[0].top_k, metrics)

    @property
    def records_old(self) -> bool:
        """Whether the old-policy forward records its routes (r2): it then runs for every micro-batch."""
        return self.mode == "r2"

    def old(self, batch: MicroBatch) -> BatchRouting | None:
        """The routing of `batch`'s old-policy forward: r3 replays the rollout's routes, r2 records `old_routes`."""
        if self.mode == "r2":
            batch.old_routes = self._empty(batch)
            return BatchRouting(None, _read_mask(batch), live=batch.old_routes)
        return self._replaying(batch, None)

    def reference(self, batch: MicroBatch) -> BatchRouting | None:
        """The routing of `batch`'s reference forward: the routes the policy's forwards replay."""
        return self._replaying(batch, None)

    def training(self, batch: MicroBatch) -> BatchRouting:
        """The routing of `batch`'s loss forward: the routes replayed, and the live ones recorded where the rollout
        recorded its own (for the metrics, `record`)."""
        live = self._empty(batch) if batch.routes is not None else None
        return self._replaying(batch, live, always=True)

    def _replaying(self, batch: MicroBatch, live: Tensor | None, always: bool = False) -> BatchRouting | None:
        routes = {"r3": batch.routes, "r2": batch.old_routes}.get(self.mode)
        if self.mode != "off" and routes is None:
            where = "the rollout engine recorded none" if self.mode == "r3" else "the old-policy forward recorded none"
            raise RuntimeError(
                f"router_replay={self.mode!r}, but this micro-batch has no routes to replay: {where}. Please report "
                "this with the rollout engine and settings."
            )
        if routes is None and live is None and not always:
            return None
        mask = _read_mask(batch)
        if routes is not None:
            _check_width(routes, mask, "routes" if self.mode == "r3" else "old_routes")
            routes = routes.to(mask.device)
        return BatchRouting(routes, mask, live=live)

    def _empty(self, batch: MicroBatch) -> Tensor:
        """[B, P + T, L, k] of -1, for routes recorded by a forward of `batch`."""
        B, width = len(batch), batch.prompt_ids.size(1) + batch.completion_ids.size(1)
        dtype = batch.routes.dtype if batch.routes is not None else torch.int16
        return torch.full((B, width, self.layers, self.top_k), -1, dtype=dtype, device=batch.prompt_ids.device)

    def record(self, routing: BatchRouting | None, batch: MicroBatch, logps: Tensor | None = None) -> None:
        """The loss forward's mismatch with the rollout into the run's train metrics (see the module docstring):
        `logps` [B, T] its log-probs (None: those `logprobs.watch_logps` kept)."""
        if routing is None or self.metrics is None:
            return
        logps = routing.logps if logps is None else logps
        counts = [torch.zeros(4, device=batch.prompt_ids.device)] * 2
        if routing.live is not None:
            live_read = (routing.live >= 0).all(dim=-1).all(dim=-1)  # [B, P + T] tokens the loss forward ran
            counts[0] = route_mismatch_counts(batch.routes.to(routing.live.device), routing.live, live_read)
        if batch.sampling_logps is not None and logps is not None:
            counts[1] = logp_gap_sums(trainer_logps(logps, batch), batch.sampling_logps, batch.completion_mask)
        differ, compared, tokens_differ, tokens, gap, k3, gap_tokens, _ = torch.cat(counts).tolist()  # one sync
        for name, numerator, denominator in (
            ("route_mismatch", differ, compared),
            ("token_mismatch", tokens_differ, tokens),
            ("logp_gap", gap, gap_tokens),
            ("k3_kl", k3, gap_tokens),
        ):
            self.metrics.add_ratio("train", f"router/{name}", numerator, denominator)


def trainer_logps(logps: Tensor, batch: MicroBatch) -> Tensor:
    """The loss forward's log-probs `logps` [B, T] under the distribution the sampler drew from, detached: as they are
    where that is the trainer's softmax; where the sampler truncates or penalises (`batch.old_sampling_logps`, its
    processors replayed on the trainer's logits: the loss forward's own without old log-probs, else the old forward's,
    moved by log(pi / pi_old), as `Objective.off_policy_logps` moves the sampler's)."""
    logps = logps.detach()
    if batch.old_sampling_logps is None:
        return logps
    if batch.old_logps is None:
        return batch.old_sampling_logps.to(logps.device)
    return batch.old_sampling_logps.to(logps.device) + (logps - batch.old_logps.to(logps.device))  # [B, T]


def logp_gap_sums(logps: Tensor, sampling_logps: Tensor, mask: Tensor) -> Tensor:
    """[sum |delta|, sum k3, tokens, 0] (float32) over the completion tokens of `mask` [B, T] where the sampler's
    log-probs `sampling_logps` [B, T] are finite: delta = log pi_trainer - log pi_sampler, k3 = exp(delta) - 1 - delta
    (Schulman's estimate of KL(sampler || trainer) from the sampler's samples, >= 0)."""
    delta = logps.float() - sampling_logps.float().to(logps.device)  # [B, T]
    use = mask.to(logps.device).bool() & torch.isfinite(delta)
    delta = torch.where(use, delta, torch.zeros_like(delta))
    k3 = torch.expm1(delta) - delta  # [B, T], 0 where not used
    return torch.stack([delta.abs().sum(), k3.sum(), use.sum().float(), delta.new_zeros(())])


def _read_mask(batch: MicroBatch) -> Tensor:
    """[B, P + T] the tokens a forward of `batch` reads: the prompt's and the completion's (tool replies included)."""
    return torch.cat([batch.prompt_mask, batch.attention_mask], dim=1)


def _check_width(routes: Tensor, mask: Tensor, name: str) -> None:
    if routes.dim() != 4 or routes.shape[:2] != mask.shape:
        raise ValueError(
            f"MicroBatch.{name} has shape {tuple(routes.shape)}, but its rows and columns must match cat(prompt_ids, "
            f"completion_ids) {tuple(mask.shape)}: [B, P + T, L, k]. Please report this with the rollout settings."
        )
