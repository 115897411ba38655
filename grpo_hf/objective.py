"""The training objective of one micro-batch: `core.grpo_loss_with` the run's `LossSettings`, and what surrounds it.

`Objective(logps, batch, ...)` is the loss `compute_loss` returns (docs/design.md, "The maths"):

- `core.grpo_loss_with` of the policy log-probs on the micro-batch's tokens (or the high-entropy ones,
  `top_entropy_quantile`), with vLLM's importance-sampling weight when the rollout has sampler log-probs;
- for the `dapo` aggregation (dapo, cispo, vespo), rescaled so that the gradient Trainer accumulates over the
  micro-steps and data parallelism averages over processes is exactly the optimizer step's sum / token count;
- minus the entropy bonus (`core.entropy_bonus`, its coefficient adaptive or not: `core.EntropyControl`);
- plus `router_aux_loss_coef` x the MoE load-balancing loss (TRL).

It holds the entropy control and the settings; the trainer gives it the micro-batch and the accumulation count.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from grpo_hf.core import (
    LOSS_VARIANTS,
    EntropyControl,
    EntropySettings,
    LossSettings,
    SamplingCorrection,
    entropy_bonus,
    grpo_loss_with,
    high_entropy_mask,
)
from grpo_hf.rollout.batching import MicroBatch


class Objective:
    """The loss of a micro-batch under one run's frozen settings: the loss's, the entropy terms' and vLLM's
    importance-sampling correction's (None: off), as `GRPOConfig` builds them."""

    def __init__(
        self,
        accelerator,
        loss: LossSettings,
        entropy: EntropySettings,
        correction: SamplingCorrection | None,
        *,
        router_aux_loss_coef: float,
    ):
        self.accelerator, self.router_aux_loss_coef = accelerator, router_aux_loss_coef
        self.settings, self.entropy_settings, self.correction = loss, entropy, correction
        self.entropy = EntropyControl(entropy)  # the entropy bonus's coefficient, adapted during the run

    def __call__(
        self,
        logps: Tensor,
        batch: MicroBatch,
        entropy: Tensor | None = None,
        policy_mask: Tensor | None = None,
        *,
        accumulation_steps: int | None = None,
        router_aux: list[Tensor] | None = None,
    ) -> tuple[Tensor, dict[str, float]]:
        """The loss of the policy log-probs `logps` [B, T] on `batch`, the policy term on the tokens of `policy_mask`
        [B, T] (None: all), with its metrics. `accumulation_steps`: Trainer's for this optimizer step (training);
        None for evaluation (on-policy, normalised by this batch's own tokens, nothing accumulated). `router_aux`:
        the MoE load-balancing losses of the forwards."""
        settings, mask, train = self.settings, batch.completion_mask, accumulation_steps is not None
        sampling_weight, sampling_metrics = self.sampling_weight(logps, batch) if train else (None, {})
        loss, metrics = grpo_loss_with(
            logps,
            batch.old_logps,
            batch.ref_logps,
            batch.advantages,
            mask,
            settings,
            num_items=batch.num_items_in_batch if train else mask.sum(),
            policy_mask=policy_mask,
            sampling_weight=sampling_weight,
            off_policy_logps=self.off_policy_logps(logps, batch),  # the mask's reference where the sampler gave it
        )
        metrics.update(sampling_metrics)
        if train and LOSS_VARIANTS[settings.loss_type].aggregation == "dapo":  # dapo, cispo, vespo: global tokens
            # dapo's loss is a sum over the whole optimizer step divided by its token count. Trainer divides each
            # micro-batch loss by the accumulation steps and data parallelism averages gradients over processes;
            # undo both so the gradient is exactly that sum / count.
            loss = loss * accumulation_steps * self.accelerator.num_processes
        if self.entropy.enabled:  # TRL: loss = policy loss - coef x mean entropy, the same for every loss type
            metrics["policy_loss"] = loss.item()
            tokens = mask if policy_mask is None else mask * policy_mask  # the policy term's tokens
            loss = loss - entropy_bonus(entropy, tokens, self.entropy.applied)
        if router_aux:  # after the dapo rescaling: Trainer's division by the accumulation steps applies to it (TRL)
            aux_loss = torch.stack(router_aux).mean()
            metrics["aux_loss"] = aux_loss.item()
            loss = loss + self.router_aux_loss_coef * aux_loss
        return loss, metrics

    def loss_of(self, batch: MicroBatch, accumulation_steps: int):
        """The training loss of `batch` as `logprobs.backward_per_group`'s `loss_fn(logps, entropy, router_aux=None)`:
        the log-probs and entropy [B, T] and the MoE load-balancing losses so far."""
        return lambda logps, entropy, router_aux=None: self(
            logps, batch, entropy, accumulation_steps=accumulation_steps, router_aux=router_aux
        )

    def sampling_weight(self, logps: Tensor, batch: MicroBatch) -> tuple[Tensor | None, dict[str, float]]:
        """vLLM's importance-sampling correction and decoupled PPO's (`core.sampling_importance_weights`): the weight
        pi_old / pi_sampler [B, T] or [B, 1] and its metrics, or (None, {}) without the sampler's log-probs or with the
        correction off (`correction` None). Without old log-probs (no optimizer step since the rollout) pi_old is the
        current policy's, detached. Both under the distribution the sampler drew from: pi_old's replayed there
        (`batch.old_sampling_logps`) where the sampling settings penalise or truncate (`sampling.SamplingReplay`),
        without old log-probs from the logits of the forward that gave `logps` (`logprobs.ProxReplay`)."""
        if self.correction is None or batch.sampling_logps is None:
            return None, {}
        old_logps = logps.detach() if batch.old_logps is None else batch.old_logps
        if batch.old_sampling_logps is not None:
            old_logps = batch.old_sampling_logps
        weight, values = self.correction.weights(old_logps, batch.sampling_logps, batch.completion_mask)
        floats = torch.stack(list(values.values())).tolist()  # one sync per micro-batch
        return weight, {f"sampling/{name}": value for name, value in zip(values, floats, strict=True)}

    @staticmethod
    def off_policy_logps(logps: Tensor, batch: MicroBatch) -> Tensor | None:
        """The sampler's log-probs as the off-policy mask (`off_policy_mask_threshold`) compares them with the policy's
        temperature-only `logps` [B, T]: as they are, or, where pi_old is replayed under the sampling distribution,
        moved into the policy's by pi_old's own difference, so that the drift is log(pi / pi_old) + log(pi_old /
        pi_sampler), each term like with like."""
        if batch.sampling_logps is None or batch.old_sampling_logps is None:
            return batch.sampling_logps
        old_logps = logps.detach() if batch.old_logps is None else batch.old_logps
        return batch.sampling_logps + (old_logps - batch.old_sampling_logps)  # [B, T]

    @property
    def needs_entropy(self) -> bool:
        """Whether the loss reads the entropy: the entropy bonus, or the high-entropy token mask."""
        return self.entropy.enabled or self.entropy_settings.masks_tokens

    def router_aux(self, kwargs: dict) -> list[Tensor] | None:
        """With the MoE load-balancing loss on (`router_aux_loss_coef` != 0): an empty list, put in the log-prob
        `kwargs` as `router_aux` for the forward to fill (`logprobs.padded_logps`, `shared_prefix_logps`); else
        None."""
        if self.router_aux_loss_coef == 0.0:
            return None
        kwargs["router_aux"] = []
        return kwargs["router_aux"]

    def policy_mask(self, entropy: Tensor | None, mask: Tensor) -> Tensor | None:
        """The policy term's tokens [B, T] for `top_entropy_quantile`; None at 1.0: all."""
        if not self.entropy_settings.masks_tokens:
            return None
        return self.high_entropy_mask(entropy, mask, self.entropy_settings.top_entropy_quantile)

    def high_entropy_mask(self, entropies: Tensor, mask: Tensor, quantile: float) -> Tensor:
        """bool [B, T]: the completion tokens whose entropy is in the top `quantile` of the completion tokens of this
        micro-batch on every process (`gathered_high_entropy_mask`)."""
        return gathered_high_entropy_mask(self.accelerator, entropies, mask, quantile)

    def record_entropy(
        self, entropy: Tensor, mask: Tensor, policy_mask: Tensor | None, metrics: dict[str, list[float]]
    ) -> None:
        """Log the mean entropy over the completion tokens `mask` [B, T]. Adaptive entropy control
        (`core.EntropyControl`): this micro-batch's entropy over the policy term's tokens joins the window; at an
        optimizer step, the window's entropy over every process updates the coefficient. `entropy_coef` is logged once
        per optimizer step while the bonus is on (TRL)."""
        mask_f = mask.float()
        metrics["entropy"].append(((entropy.detach() * mask_f).sum() / mask_f.sum().clamp(min=1)).item())
        control, accelerator = self.entropy, self.accelerator
        if control.adaptive:
            control.accumulate(entropy, mask if policy_mask is None else mask * policy_mask)
            if accelerator.sync_gradients:
                window = control.window
                control.step(accelerator.reduce(window, "sum") if accelerator.num_processes > 1 else window)
        if control.enabled and accelerator.sync_gradients:
            metrics["entropy_coef"].append(control.entropy_coef)


CLIP_EXTREMES = {"clip_ratio/low_min": min, "clip_ratio/high_max": max}
"""The loss's metrics that are an extreme over sequences (TRL's), and how a process's own values combine."""


def gathered_clip_extremes(accelerator, metrics: dict[str, float]) -> dict[str, float]:
    """`metrics` of one micro-step, with TRL's `clip_ratio/low_min` / `high_max` taken over the sequences of every
    process (TRL gathers the per-sequence fractions, then takes the nanmin / nanmax): the smallest / largest of the
    processes' own, a NaN (a process without a completion token) left out. Every process calls it at each
    micro-step; on one process `metrics` is returned as it is."""
    names = [name for name in CLIP_EXTREMES if name in metrics]
    if accelerator.num_processes == 1 or not names:
        return metrics
    local = torch.tensor([[metrics[name] for name in names]], dtype=torch.float64, device=accelerator.device)
    gathered = accelerator.gather(local).tolist()  # [P, len(names)]
    for k, name in enumerate(names):
        values = [row[k] for row in gathered if not math.isnan(row[k])]
        metrics[name] = CLIP_EXTREMES[name](values) if values else math.nan
    return metrics


def gathered_high_entropy_mask(accelerator, entropies: Tensor, mask: Tensor, quantile: float) -> Tensor:
    """`core.high_entropy_mask` over the completion tokens of every process: bool [B, T], the completion tokens of
    `mask` [B, T] whose entropy is in the top `quantile` of the pool of all processes' completion tokens. Uses only
    the accelerator's `pad_across_processes` and `gather` (both pass a tensor through on one process), as TRL's
    `get_high_entropy_mask` does."""
    entropy = entropies.detach()
    pool = entropy[mask.bool()]  # [n] this process's completion tokens
    pool = accelerator.gather(accelerator.pad_across_processes(pool, dim=0, pad_index=-1.0))
    pool = pool[pool >= 0]  # entropies are >= 0: drop the padding
    return high_entropy_mask(entropy, mask, quantile, pool)
