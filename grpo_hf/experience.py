"""Prompt rows -> a scored `Rollout` with advantages -> the `MicroBatch`es a training step trains on.

`ExperienceMaker` is the rollout half of a GRPO step (docs/design.md, "One training step"); OpenRLHF calls it an
experience maker, TRL's trainer `_generate_and_score_completions`. For this process's prompt rows it:

1. samples completions (`rollout.sampler.Sampler`: the rollout engine, tool episodes, or the user's
   `rollout_func`);
2. scores them with the reward functions (`rewards.compute_rewards`), gathers the rewards of the whole
   generation batch over the processes and combines them (`core.combine_rewards`);
3. computes group advantages over whole groups (`core.group_advantages`, or GDPO's `decoupled_advantages`) and
   keeps this process's rows; with `dynamic_sampling`, first replaces the groups without signal
   (`rollout.dynamic`);
4. for training, cuts the rollout into micro-batches (`rollout.batching`) and adds their old and reference
   log-probs and the token count each loss is normalised by.

It is given everything it uses when it is built (the trainer builds it once): the settings, the accelerator, the
tokenizer, the sampler, the reward functions, the models and how to compute their log-probs, the non-finite guard and
the metrics it records into. It never reaches back into the trainer.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch
from accelerate.utils import gather_object
from torch import Tensor, nn

from grpo_hf.completion_log import completion_rows
from grpo_hf.core import combine_rewards, decoupled_advantages, group_advantages, nan_group_std
from grpo_hf.guards import NonfiniteGuard
from grpo_hf.logprobs import LogprobPath
from grpo_hf.metrics import Metrics, check_finite_rewards, length_metrics, no_signal_warning, reward_metrics
from grpo_hf.parallel import stop_together, sum_over_processes
from grpo_hf.peft_utils import reference_adapter
from grpo_hf.replay import RouterReplay
from grpo_hf.rewards import compute_rewards
from grpo_hf.rewards.calling import RewardLogs
from grpo_hf.rollout import MicroBatch, Rollout, RolloutEngine, Sequences, is_conversational, split_into_micro_batches
from grpo_hf.rollout.dynamic import FreshPrompts, GroupPool, gather_rows, take_rows
from grpo_hf.rollout.sampler import Generation, Sampled, Sampler
from grpo_hf.rollout.sampling import SamplingReplay
from grpo_hf.rollout.sampling_spec import SamplingSpec, engine_kind
from grpo_hf.rollout.vision import IMAGE_COLUMNS, row_images
from grpo_hf.vision import encode_rows, image_token_ids, is_processor, tokenizer_of

__all__ = ["ExperienceMaker", "Generation", "Models", "Produced", "RewardSet"]

logger = logging.getLogger(__name__)

# The fields of a `Rollout` that hold the whole generation batch, not this process's rows.
_GLOBAL = ("all_rewards", "combined_rewards")

NO_SIGNAL_BATCHES = 2
"""Training generation batches in a row in which every group's rewards are all equal (no learning signal) before the
warning (`metrics.no_signal_warning`), once per run: one such batch can be chance (one or two hard prompts)."""


# `EpisodeCache.stats` entries summed over processes by `_record_tools`, in this order
_CACHE_COUNTS = ("prefill_tokens", "prefill_positions", "reused_tokens", "evictions", "kept", "hits")


@dataclass
class Produced:
    """This process's rows of one round, sampled and scored (`ExperienceMaker.produce`), before anything collective:
    the rewards [B, R] (NaN = None), the completions' texts, the skipped rewards' error counts and what the reward
    functions logged; `failure`: what the reward functions raised instead."""

    prompts: list
    columns: dict[str, list]
    sampled: Sampled
    rewards: Tensor | None = None
    texts: list[str] | None = None
    errors: dict[str, int] | None = None
    logs: RewardLogs | None = None
    failure: Exception | None = None
    trainer_state: Any = None  # what the reward functions see as `trainer_state` (None: Trainer's, as it stands)


@dataclass(frozen=True)
class RewardSet:
    """The reward functions of a run, their names (for metrics and messages) and their weights [R]."""

    funcs: list
    names: list[str]
    weights: Tensor


@dataclass(frozen=True)
class Models:
    """The models a rollout uses, as functions: Trainer re-wraps the policy when training starts (DDP, FSDP)."""

    policy: Callable[[], nn.Module]  # the policy as Trainer holds it (`trainer.model`)
    reference: nn.Module | None  # the reference model; None under PEFT (`peft_utils.reference_adapter`) or beta = 0


class ExperienceMaker:
    """The rollouts of one run: `train_batches` for a training step, `eval_batch` for an evaluation batch."""

    def __init__(
        self,
        args,
        accelerator,
        tokenizer,
        *,
        rewards: RewardSet,
        models: Models,
        logps: LogprobPath,
        guard: NonfiniteGuard,
        metrics: Metrics,
        state: Callable[[], Any],  # -> Trainer's `TrainerState` (the step, for reward functions and logs)
        sampler: Sampler,
        train_rows: Callable[[], Any] | None = None,  # -> the train dataset as the dataloader serves it
    ):
        self.args, self.accelerator, self.tokenizer = (
            args,
            accelerator,
            tokenizer_of(tokenizer),
        )  # a VLM: its processor's
        self.is_vlm = is_processor(tokenizer)  # rows may carry images (`rollout.vision`)
        self.num_image_encodings = 0  # prompts whose images were encoded for the log-prob forwards (tests count)
        self.rewards, self.models, self.logps, self.guard, self.metrics = rewards, models, logps, guard, metrics
        self.state, self.sampler, self.train_rows = state, sampler, train_rows
        self.replay = self.sampling_replay()
        # An MoE policy's routing replay and router metrics (`grpo_hf.replay`); None: a dense model, replay off
        self.router = RouterReplay.of(args.router_replay, accelerator.unwrap_model(models.policy()), metrics)
        # Its log-prob gap: the engine's own log-probs, where no loss reads them (no correction, no off-policy mask)
        quiet = args.sampling_correction() is None and args.off_policy_mask_threshold is None
        if self.router is not None and quiet:
            sampler.metric_logps, self.replay = self.metric_sampling()
        # Old log-probs differ from the current policy's only if an optimizer step happens between generation and
        # the last use of the batch: unless all steps_per_generation x num_iterations micro-steps of one rollout fall
        # inside one accumulation window.
        self.needs_old_logps = (
            args.gradient_accumulation_steps % (args.steps_per_generation * args.num_iterations) != 0
        )
        if self.router is not None and self.router.records_old and not self.needs_old_logps:
            logger.warning(
                "router_replay='r2' replays the old-policy forward's experts, but no optimizer step falls between "
                "that forward and a batch's loss forwards here (gradient_accumulation_steps=%d is a multiple of "
                "steps_per_generation x num_iterations=%d): the loss forward chooses those experts anyway, and r2 "
                "costs one extra no-grad forward per micro-batch for nothing. Use router_replay='r3' for the "
                "rollout's experts, or 'off'.",
                args.gradient_accumulation_steps,
                args.steps_per_generation * args.num_iterations,
            )
        self.num_generate_calls = 0  # rollout rounds generated (tests count rollout reuse with it)
        self.num_tokens = 0  # prompt + completion tokens so far (of the kept groups), over all processes
        # `log_completions`: the last training rollout's rows, and the rows of the evaluation under way
        self.completion_rows: dict[str, list[dict[str, Any]]] = {"train": [], "eval": []}
        self._refill_dataset = None  # the train dataset as the dataloader serves it, for dynamic sampling
        # round -> a context around dynamic sampling's refill round (a producer's: `AsyncRollouts._refilling`)
        self.refill_context: Callable[[int], contextlib.AbstractContextManager] | None = None
        self.all_masked_rollouts = 0  # rollouts whose completions mask_truncated_completions masked all
        self.no_signal_batches = 0  # training generation batches in a row whose groups all have equal rewards
        self.warned_no_signal = False

    # ---- a training step's micro-batches -------------------------------------------------------------------------
    def train_batches(self, inputs: list[dict[str, Any]]) -> list[MicroBatch]:
        """One generation batch of this process's prompt rows -> its micro-batches, each with its old/ref log-probs
        and the completion token count `num_items_in_batch` of the optimizer step it belongs to (all processes)."""
        return self.batches_of(self.rollout_round(inputs, self.args.num_generations, self.metrics["train"]))

    def produced_batches(self, produced: Produced, staleness: int) -> list[MicroBatch]:
        """`train_batches` of a generation batch the producer sampled and scored (`producer.Producer`), by weights
        `staleness` optimizer steps older than the policy now. Stale rows keep the sampler's own log-probs: the
        loss weighs them by pi_prox / pi_behaviour (decoupled PPO, `objective.sampling_weight`), pi_prox being the
        policy now (the old log-probs' path); fresh ones (staleness 0) are exactly the synchronous run's rows (which
        keep vLLM's log-probs, for its own correction)."""
        rollout = self.finish_round(produced, self.args.num_generations, self.metrics["train"])
        if staleness == 0 and not self.args.use_vllm:
            rollout.sampling_logps = None
        elif rollout.sampling_logps is None:
            raise RuntimeError(
                f"A generation batch sampled {staleness} optimizer steps ago has no sampler log-probs (its rollout "
                "engine did not record them), so its stale rows cannot be corrected. Please report this."
            )
        return self.batches_of(rollout)

    def batches_of(self, rollout: Rollout) -> list[MicroBatch]:
        """A scored training rollout -> its micro-batches (advantages, masks, old/ref log-probs, token counts)."""
        args, G = self.args, self.args.num_generations
        kept = None
        if args.dynamic_sampling:
            rollout, kept = self.keep_groups_with_signal(rollout, G)
        else:  # dynamic sampling replaces the groups without signal, and says when it cannot
            self._warn_if_no_signal(rollout, G)
        self.set_advantages(rollout, G, kept, check=True)
        start = self.accelerator.process_index * len(rollout)
        if kept is not None:  # rows of dropped groups that fill an incomplete batch carry no loss
            rollout.completion_mask = rollout.completion_mask * kept[start : start + len(rollout)].unsqueeze(1).long()
        self._record_training_rows(rollout)  # counts truncated completions' tokens too (TRL)
        if args.mask_truncated_completions:
            rollout.completion_mask = rollout.completion_mask * (~rollout.is_truncated).unsqueeze(1).long()
            self._warn_if_all_masked(rollout.is_truncated)
        batches = self.split(rollout, args.per_device_train_batch_size)
        self.encode_images(rollout)
        with torch.no_grad():
            for batch in batches:
                self.set_old_logps(batch)
                batch.ref_logps = self.reference_logps(batch, self.router and self.router.reference(batch))
        self._set_token_counts(batches)
        return batches

    def sampling_replay(self) -> SamplingReplay | None:
        """The distribution the engines draw from (`sampling.SamplingReplay` of the run's `SamplingSpec`: the engine
        kind, the settings resolved as the engines resolve them, a VLM's blocked image tokens), for the weight of a
        correction (vLLM's, or a stale batch's: `sampling_correction`); None without one, or when it is the trainer's
        temperature-only softmax. A setting the engine cannot sample as described, or, with a correction, that the
        replay cannot describe, is refused here, when the trainer is built (`SamplingSpec.check`). vLLM pads no prompt:
        its repetition penalty never reads padding, whatever the installed `generate` does with it."""
        corrected = self.args.sampling_correction() is not None
        spec = self.sampling_spec()
        spec.check(corrected=corrected, multi_turn=bool(self.sampler.tools))
        return SamplingReplay.of(spec, self.args.temperature) if corrected else None

    def sampling_spec(self) -> SamplingSpec:
        """What the engines sample from (`SamplingSpec.of`): the engine kind, the settings as the engines resolve them,
        a VLM's blocked image tokens."""
        policy = self.accelerator.unwrap_model(self.models.policy())
        return SamplingSpec.of(
            policy,
            self.sampler.generation.generation_config,
            kind=engine_kind(self.args.rollout_engine, self.args.use_vllm),
            skip_padding=True if self.args.use_vllm else None,
            blocked_token_ids=image_token_ids(policy),
        )

    def metric_sampling(self) -> tuple[bool, SamplingReplay | None]:
        """For the router metrics' log-prob gap where no loss reads the sampler's log-probs: whether the engine records
        them, and the replay of its distribution on the trainer's logits (None: the trainer's temperature-only
        softmax). A sampler that truncates or penalises (top_k, top_p, ...) draws from another distribution than the
        trainer's log-probs: the replayed ones (`batch.old_sampling_logps`, which no loss reads without a correction)
        are compared instead, like with like (`replay.RouterReplay.record`). Settings the replay cannot describe:
        no gap (logged)."""
        spec = self.sampling_spec()
        why = spec.refusal(corrected=True, multi_turn=bool(self.sampler.tools))
        if why is not None:
            logger.info("MoE router metrics: no router/logp_gap, the sampling distribution is not replayable: %s", why)
            return False, None
        return True, SamplingReplay.of(spec, self.args.temperature)

    def set_old_logps(self, batch: MicroBatch) -> None:
        """`batch.old_logps` where an optimizer step separates the rollout from its last use (else None: the current
        policy's, detached). A batch the loss corrects (it has the sampler's log-probs) under sampling settings that
        penalise or truncate (`replay`) then also gets `old_sampling_logps`, pi_old under the sampling distribution,
        for the weight pi_old / pi_sampler only, from the same no-grad forward. Without old log-probs, pi_old is the
        policy the training forward runs, and that forward replays its own logits (`logprobs.ProxReplay`): no forward
        here, unless router_replay='r2' records that forward's routes (`replay.RouterReplay.old`)."""
        policy, routing = self.models.policy(), None if self.router is None else self.router.old(batch)
        if not self.needs_old_logps:
            batch.old_logps = None
            if self.router is not None and self.router.records_old:
                self.logps.no_grad(policy, batch, routing=routing)
            return
        if self.replay is None or batch.sampling_logps is None:
            batch.old_logps = self.logps.no_grad(policy, batch, routing=routing)
        else:
            batch.old_logps, batch.old_sampling_logps = self.logps.no_grad(
                policy, batch, replay=self.replay, routing=routing
            )

    def loss_kwargs(self, plan, batch: MicroBatch) -> dict:
        """`logprobs.completion_logps`' keyword arguments for `batch`'s loss forward under `plan` (a `ForwardPlan`):
        pi_prox replayed where the batch is corrected (`LogprobPath.kwargs`) and an MoE policy's `routing`, the experts
        replayed and the live ones recorded (`replay.RouterReplay.training`)."""
        kwargs = self.logps.kwargs(plan, batch, self.replay)
        if self.router is not None:
            kwargs["routing"] = self.router.training(batch)
        return kwargs

    def record_routing(self, routing, batch: MicroBatch, logps: Tensor | None) -> None:
        """An MoE policy's loss forward (its `routing`) against the rollout, into the train metrics
        (`replay.RouterReplay.record`; `logps` [B, T] the loss forward's log-probs, None: those its `routing` kept)."""
        if self.router is not None:
            self.router.record(routing, batch, logps)

    def eval_batch(self, inputs: list[dict[str, Any]]) -> MicroBatch | None:
        """An evaluation batch, sampled with `num_generations_eval` completions per prompt, scored, with advantages
        and reference log-probs; None when the batch cuts a group (no advantages, no loss)."""
        G = self.args.num_generations_eval or self.args.num_generations
        rollout = self.rollout_round(inputs, G, self.metrics["eval"])
        if rollout.combined_rewards.numel() % G:
            return None
        self.set_advantages(rollout, G)
        if self.args.log_completions:
            self.completion_rows["eval"] += self._completion_rows(rollout)
        (batch,) = self.split(rollout, len(rollout))
        self.encode_images(rollout)
        batch.ref_logps = self.reference_logps(batch)
        return batch

    def split(self, rollout: Rollout, size: int) -> list[MicroBatch]:
        """`rollout` in micro-batches of `size` rows, each trimmed and padded once (`pad_to_multiple_of`)."""
        return split_into_micro_batches(rollout.as_batch(), size, self.pad_multiple(), self.tokenizer.pad_token_id)

    def encode_images(self, rollout: Rollout) -> None:
        """A VLM with a frozen vision side: each prompt's images encoded once for all the forwards of this generation
        batch (old, reference, policy; every micro-step it serves), its features kept with the rows
        (`vision.encode_rows`)."""
        if rollout.image_inputs is not None:
            with self.accelerator.autocast():
                self.num_image_encodings += encode_rows(self.models.policy(), rollout.image_inputs)

    def reference_logps(self, batch: Sequences, routing=None) -> Tensor | None:
        """The reference model's log-probs [B, T] (None when beta = 0); under PEFT, the policy with its frozen copy of
        a given adapter, or with adapters off (`peft_utils.reference_adapter`). `routing`: the experts its forwards
        use (`replay.RouterReplay.reference`; None: live)."""
        if self.args.beta == 0.0:
            return None
        if self.models.reference is not None:
            return self.logps.no_grad(self.models.reference, batch, routing=routing)
        policy = self.models.policy()
        with reference_adapter(self.accelerator.unwrap_model(policy)):  # the given adapter, or the adapters off
            return self.logps.no_grad(policy, batch, routing=routing)

    def _set_token_counts(self, batches: list[MicroBatch]) -> None:
        """dapo normalises by the completion tokens of the whole optimizer step (all processes and accumulation
        slices): count them per micro-batch over all processes, and give each its optimizer step's count."""
        tokens = torch.stack([batch.num_completion_tokens for batch in batches]).float()  # [S]
        if self.accelerator.num_processes > 1:
            tokens = self.accelerator.reduce(tokens, "sum")
        ga, S = self.args.gradient_accumulation_steps, len(batches)
        for k, batch in enumerate(batches):
            if S % ga == 0:  # exact: the optimizer step covers micro-batches [w * ga, (w + 1) * ga)
                window = (k // ga) * ga
                batch.num_items_in_batch = tokens[window : window + ga].sum()
            else:  # an optimizer step spans several rollouts: use this rollout's average
                batch.num_items_in_batch = tokens.sum() * ga / S

    # ---- advantages ------------------------------------------------------------------------------------------------
    def set_advantages(self, rollout: Rollout, G: int, kept: Tensor | None = None, check: bool = False) -> None:
        """This process's rows of the generation batch's advantages [N] (`advantages`); with `kept` [N] (dynamic
        sampling), the group statistics of the kept groups only, 0 elsewhere. `check`: the non-finite guard."""
        combined, all_rewards = rollout.combined_rewards, rollout.all_rewards  # [N], [N, R]
        if kept is None:
            advantages = self.advantages(combined, all_rewards, G)  # [N]
        else:
            advantages = torch.zeros_like(combined)
            if bool(kept.any()):
                advantages[kept] = self.advantages(combined[kept], all_rewards[kept], G)
        if check and self.guard.advantages(advantages, all_rewards, G, self.state().global_step + 1):
            rollout.nonfinite = True  # every optimizer step this rollout feeds is skipped
        start = self.accelerator.process_index * len(rollout)
        rollout.advantages = advantages[start : start + len(rollout)]  # [B]

    def advantages(self, combined: Tensor, all_rewards: Tensor, G: int) -> Tensor:
        """Advantages [N] of a generation batch from its combined rewards [N] ("sum_then_normalize":
        `core.group_advantages` with `scale_rewards`) or from each function's rewards `all_rewards` [N, R]
        ("normalize_then_sum", GDPO: `core.decoupled_advantages`), per `multi_objective_aggregation`."""
        if self.args.multi_objective_aggregation == "normalize_then_sum":
            return decoupled_advantages(all_rewards, G, self.rewards.weights.to(all_rewards.device))
        return group_advantages(combined, G, self.args.scale_rewards)

    def _warn_if_all_masked(self, is_truncated: Tensor) -> None:
        """mask_truncated_completions with every completion of a rollout truncated trains on nothing: say so (the
        1st, 2nd, 4th, 8th, ... time, with the count)."""
        if not bool(is_truncated.all()):
            return
        self.all_masked_rollouts += 1
        count = self.all_masked_rollouts
        if count & (count - 1) == 0:
            logger.warning(
                f"Every completion of this rollout ({is_truncated.numel()} on this process) reached "
                f"max_completion_length={self.args.max_completion_length} without an EOS, and "
                "mask_truncated_completions=True masks them all: the step trains on nothing (the policy term is 0). "
                f"Raise max_completion_length or set mask_truncated_completions=False. ({count} such rollouts so far)"
            )

    def _warn_if_no_signal(self, rollout: Rollout, G: int) -> None:
        """Once per run, on the main process: a warning (`metrics.no_signal_warning`) when every group of
        `NO_SIGNAL_BATCHES` training generation batches in a row has rewards all equal (`frac_reward_zero_std` 1):
        zero advantages, nothing learned, most often a reward function that gives every completion one value."""
        combined = rollout.combined_rewards  # [N], the whole generation batch
        if self.warned_no_signal or combined.numel() % G:
            return
        signal = bool((nan_group_std(combined.view(-1, G)) > 0).any())  # NaN (all None) is no signal either
        self.no_signal_batches = 0 if signal else self.no_signal_batches + 1
        if self.no_signal_batches < NO_SIGNAL_BATCHES:
            return
        self.warned_no_signal = True
        if self.accelerator.is_main_process:
            logger.warning(no_signal_warning(rollout.all_rewards, self.rewards.names, NO_SIGNAL_BATCHES))

    def _record_training_rows(self, rollout: Rollout) -> None:
        """The token count (`num_tokens`) and, with `log_completions`, the rows to print at the next log."""
        tokens = int(rollout.prompt_mask.sum() + rollout.completion_mask.sum())
        self.num_tokens += sum_over_processes(self.accelerator, tokens)
        self.metrics["train"]["num_tokens"].append(float(self.num_tokens))
        if self.args.log_completions:
            self.completion_rows["train"] = self._completion_rows(rollout)

    def _completion_rows(self, rollout: Rollout) -> list[dict[str, Any]]:
        """The `log_completions` rows of `rollout`, of every process."""
        rows = completion_rows(
            rollout.prompts, rollout.texts, self.rewards.names, rollout.rewards, rollout.advantages, rollout.extra
        )
        return gather_object(rows) if self.accelerator.num_processes > 1 else rows

    # ---- one round: sample, score, gather ------------------------------------------------------------------------
    def rollout_round(self, inputs: list[dict[str, Any]], G: int, metrics: dict[str, list[float]]) -> Rollout:
        """Sample and score this process's rows; record the round's metrics into `metrics`."""
        return self.finish_round(self.produce(inputs), G, metrics)

    def produce(self, inputs: list[dict[str, Any]], sampler: Sampler | None = None) -> Produced:
        """Sample and score this process's rows with `sampler` (None: the run's own), calling nothing collective: the
        producer thread runs this (`grpo_hf.producer`), the main thread `finish_round`."""
        return self.score_round(self.sample_round(inputs, sampler))

    def sample_round(
        self, inputs: list[dict[str, Any]], sampler: Sampler | None = None, trainer_state=None
    ) -> Produced:
        """`produce`'s first half: the rows sampled, not yet scored (`trainer_state`: what their reward functions will
        see, None: Trainer's state as it stands when they run)."""
        prompts = [row.get("prompt") for row in inputs]  # None: an environment's reset gives it
        columns = {key: [row[key] for row in inputs] for key in inputs[0] if key != "prompt"}
        self.num_generate_calls += 1
        sampled = (sampler or self.sampler).sample(prompts, columns)  # may add columns (rollout_func's, environments)
        return Produced(sampled.prompts or prompts, columns, sampled, trainer_state=trainer_state)

    def score_round(self, produced: Produced) -> Produced:
        """`produce`'s second half: `produced`'s rows scored by the reward functions (what they raise is kept in
        `failure`, reported by every process in `finish_round`)."""
        try:
            scores = self.score(produced.prompts, produced.columns, produced.sampled, produced.trainer_state)
            produced.rewards, produced.texts, produced.errors, produced.logs = scores
        except Exception as error:  # reported by every process (`stop_together`), not only by this one
            produced.failure = error
        return produced

    def finish_round(self, produced: Produced, G: int, metrics: dict[str, list[float]]) -> Rollout:
        """`produce`'s rows -> a `Rollout`: the rewards gathered over the processes and combined, the round's
        metrics recorded into `metrics` (every process calls this for every round)."""
        accelerator, prompts, columns, sampled = self.accelerator, produced.prompts, produced.columns, produced.sampled
        stop_together(produced.failure, accelerator, "computing rewards")
        rewards, texts, errors, logs = produced.rewards, produced.texts, produced.errors, produced.logs
        # Whole groups may straddle processes: gather, normalise over the full batch.
        all_rewards = accelerator.gather(rewards)  # [N, R]
        combined = combine_rewards(all_rewards, self.rewards.weights.to(accelerator.device))  # [N]
        for key, value in reward_metrics(all_rewards, combined, self.rewards.names, G).items():
            metrics[key].append(value)
        if self.args.reward_error_policy == "skip":
            for name in self.rewards.names:
                metrics[f"rewards/{name}/errors"].append(float(sum_over_processes(accelerator, errors.get(name, 0))))
        self.metrics.add_logged(metrics, logs.metrics, accelerator)
        self._record_lengths(metrics, sampled)
        self._record_tools(metrics, sampled)
        extra = [{column: values[i] for column, values in logs.extra.items()} for i in range(len(prompts))]
        if self.is_vlm and self.args.log_completions and self.args.log_multimodal:
            for i, row in enumerate(extra):  # log_multimodal: each row's images go to the completions log
                row["images"] = row_images({k: columns[k][i] for k in IMAGE_COLUMNS if k in columns})
        return Rollout(
            **sampled.tokens.tokens(),
            is_truncated=sampled.is_truncated,
            prompts=prompts,
            texts=texts,
            rewards=rewards,
            all_rewards=all_rewards,
            combined_rewards=combined,
            extra=extra,
            sampling_logps=sampled.sampling_logps,
            routes=sampled.routes,
        )

    def _record_lengths(self, metrics, sampled: Sampled) -> None:
        """Completion lengths (the model's tokens: tool replies not counted, as TRL), those of the completions that
        ended with EOS, truncation (`metrics.length_metrics`), and with tools
        `tools/call_frequency` (calls per completion) and `tools/failure_frequency` (failed calls per call)."""
        accelerator = self.accelerator
        float_lengths = accelerator.gather(sampled.tokens.completion_mask.sum(dim=1)).float()  # [N]
        is_truncated = accelerator.gather(sampled.is_truncated)  # [N]
        for key, value in length_metrics(float_lengths, is_truncated).items():
            metrics[key].append(value)
        truncated_prompts = sum_over_processes(accelerator, int(sampled.is_prompt_truncated.sum()))
        metrics["prompts/num_truncated"].append(float(truncated_prompts))
        if sampled.tool_calls is not None:
            calls = sum_over_processes(accelerator, sampled.tool_calls)
            failures = sum_over_processes(accelerator, sampled.tool_failures)
            metrics["tools/call_frequency"].append(calls / float_lengths.numel())
            metrics["tools/failure_frequency"].append(failures / calls if calls else 0.0)

    def _record_tools(self, metrics, sampled: Sampled) -> None:
        """With tools, per tool of the run: `tools/<name>/calls`, `/failures`, `/timeouts` (summed over the processes'
        episodes) and `/latency_mean` (seconds per call that ran to its end; logged once one has), and
        `tools/turns_mean` (the model's turns per episode). With the `loop` engine's episode cache: the tokens
        prefilled, the positions the prefills computed (padding included) and the tokens taken from kept caches, per
        episode (`tools/prefill_tokens_mean`, `tools/prefill_positions_mean`, `tools/reused_tokens_mean`), and the
        episodes whose cache did not fit the budget (`tools/cache_evictions`, and per episode that waited for tools,
        `tools/cache_eviction_rate`)."""
        if sampled.tool_stats is None:
            return
        names = list(sampled.tool_stats)  # every tool of the run, in the same order on every process
        rows = [[s.calls, s.failures, s.timeouts, s.returned, s.seconds, 0] for s in sampled.tool_stats.values()]
        rows.append([sum(sampled.turns), len(sampled.turns), 0, 0, 0, 0])
        cache = sampled.episode_cache
        rows.append([cache[k] for k in _CACHE_COUNTS] if cache is not None else [0] * len(_CACHE_COUNTS))
        stats = torch.tensor(rows, dtype=torch.float64, device=self.accelerator.device)  # [tools + 2, 6]
        if self.accelerator.num_processes > 1:
            stats = self.accelerator.reduce(stats, "sum")
        *per_tool, (turns, episodes, *_), (prefill, positions, reused, evictions, kept, _) = stats.tolist()
        if cache is not None:  # the same engine on every process
            metrics["tools/prefill_tokens_mean"].append(prefill / episodes)
            metrics["tools/prefill_positions_mean"].append(positions / episodes)
            metrics["tools/reused_tokens_mean"].append(reused / episodes)
            metrics["tools/cache_evictions"].append(evictions)
            metrics["tools/cache_eviction_rate"].append(evictions / (kept + evictions) if kept + evictions else 0.0)
        for name, (calls, failures, timeouts, returned, seconds, _) in zip(names, per_tool, strict=True):
            metrics[f"tools/{name}/calls"].append(calls)
            metrics[f"tools/{name}/failures"].append(failures)
            metrics[f"tools/{name}/timeouts"].append(timeouts)
            if returned:
                metrics[f"tools/{name}/latency_mean"].append(seconds / returned)
        metrics["tools/turns_mean"].append(turns / episodes)

    def pad_multiple(self) -> int | None:
        """`pad_to_multiple_of`, with "auto" resolved as TRL resolves it: 128 on Neuron, no padding elsewhere."""
        value = self.args.pad_to_multiple_of
        if value == "auto":
            return 128 if self.accelerator.device.type == "neuron" else None
        return value

    def score(self, prompts, columns, sampled: Sampled, trainer_state=None):
        """Rewards [B, R] (NaN = None) of each completion, its text, the error counts of skipped rewards, and what the
        reward functions logged through `log_extra` / `log_metric` (`rewards.calling.RewardLogs`).

        Reward functions see the ids (and text) of each completion up to and including its last EOS, tool replies
        included; with conversational prompts the completion is its chat messages: one assistant message, or a tool
        episode's assistant turns and tool replies.
        """
        lengths = sampled.tokens.attention_mask.sum(dim=1).tolist()  # [B]
        ids = sampled.tokens.completion_ids
        completion_id_lists = [row[:n].tolist() for row, n in zip(ids, lengths, strict=True)]
        texts = self.tokenizer.batch_decode(completion_id_lists, skip_special_tokens=True)
        completions = texts
        if sampled.messages is not None:
            completions = sampled.messages
        elif is_conversational(prompts[0]):
            completions = [[{"role": "assistant", "content": t}] for t in texts]
        reward_rows, errors = compute_rewards(
            self.rewards.funcs,
            prompts,
            completions,
            completion_id_lists,
            columns=columns,
            trainer_state=self.state() if trainer_state is None else trainer_state,
            timeout=self.args.reward_timeout,
            error_policy=self.args.reward_error_policy,
            logs=(logs := RewardLogs(len(completions))),
        )
        rewards = torch.tensor(reward_rows, dtype=torch.float32, device=self.accelerator.device)
        rewards = rewards.view(len(prompts), -1)  # [B, R]
        check_finite_rewards(rewards, self.rewards.names)
        no_reward = torch.isnan(rewards).all(dim=1)  # [B]
        if bool(no_reward.any()):  # TRL's warning, about the first such completion
            row = int(no_reward.nonzero()[0])
            kw = {"prompt": prompts[row], "completion": completions[row], **{k: c[row] for k, c in columns.items()}}
            logger.warning(
                f"All reward functions returned None for the following kwargs: {kw}. Please ensure that at least "
                "one reward function returns a valid reward (a completion without any reward gets advantage 0)."
            )
        return rewards, texts, errors, logs

    # ---- the rollout engine (`rollout.sampler.Sampler` owns it) ----------------------------------------------------
    @property
    def engine(self) -> RolloutEngine | None:
        """The rollout engine, once the first rollout has chosen it."""
        return self.sampler.engine

    def weights_updated(self, model: nn.Module) -> None:
        """Tell the rollout engine, if one was built, that the policy's weights changed (`model`: unwrapped)."""
        self.sampler.weights_updated(model)

    def release_engine(self) -> None:
        """Release what the rollout engine holds beyond the trainer (vLLM: its engine, its KV cache, its copy of the
        weights); the next rollout (an evaluation after training) starts it again."""
        if self.engine is not None:
            self.engine.close()

    # ---- dynamic sampling ----------------------------------------------------------------------------------------
    def keep_groups_with_signal(self, first: Rollout, G: int) -> tuple[Rollout, Tensor]:
        """DAPO's dynamic sampling (`rollout.dynamic`): drop the groups of `first` whose rewards are all equal and
        generate for fresh prompts, at most `dynamic_sampling_max_rounds` more rounds, until the batch is full.

        Returns this process's share of the new batch, and `kept` [N] (bool), False on the rows of dropped groups
        that fill the batch when the rounds ran out.
        """
        B, pad, accelerator = len(first), self.tokenizer.pad_token_id, self.accelerator
        pool = GroupPool(num_groups=first.combined_rewards.numel() // G, num_generations=G)
        rollout, rounds, fresh = first, 0, None
        while True:
            pool.add({**gather_rows(_local_rows(rollout), accelerator, pad), "total": rollout.combined_rewards})
            if pool.full or rounds == self.args.dynamic_sampling_max_rounds:
                break
            if fresh is None:
                if self._refill_dataset is None:  # the rows as the dataloader serves them
                    self._refill_dataset = self.train_rows()
                fresh = FreshPrompts(self._refill_dataset, self.args.seed, self.state().global_step)
            rounds += 1
            inputs = self._fresh_inputs(fresh, pool.seen, B, G)
            with self.refill_context(rounds) if self.refill_context is not None else contextlib.nullcontext():
                rollout = self.rollout_round(inputs, G, self.metrics["train"])
            if first.sampling_logps is None:  # a fresh batch's rows (a producer's refills record theirs)
                rollout.sampling_logps = None
        rows, kept = pool.batch(pad)
        self._record_dynamic_sampling(pool, rounds)
        start = accelerator.process_index * B
        local = take_rows(rows, torch.arange(start, start + B))
        del local["total"]
        combined = rows["total"]
        batch = Rollout(**local, all_rewards=rows["rewards"], combined_rewards=combined)
        return batch, kept.to(combined.device)

    def _record_dynamic_sampling(self, pool: GroupPool, rounds: int) -> None:
        metrics = self.metrics["train"]
        metrics["dynamic_sampling/dropped_groups"].append(float(pool.num_dropped))
        metrics["dynamic_sampling/extra_rounds"].append(float(rounds))
        unfilled = pool.num_groups - min(pool.num_kept, pool.num_groups)
        metrics["dynamic_sampling/unfilled_groups"].append(float(unfilled))
        if not pool.full:
            logger.warning(
                f"Dynamic sampling: {pool.num_kept} of {pool.num_groups} groups have rewards that differ after "
                f"{rounds} extra rounds (dynamic_sampling_max_rounds); this step trains on those only. Raise "
                "dynamic_sampling_max_rounds, or check that the rewards can tell completions apart."
            )

    def _fresh_inputs(self, fresh: FreshPrompts, seen: set[str], B: int, G: int) -> list[dict[str, Any]]:
        """This process's rows of a generation batch of fresh prompts, G copies of each."""
        accelerator = self.accelerator
        rows = [row for row in fresh.take(B * accelerator.num_processes // G, seen) for _ in range(G)]
        start = accelerator.process_index * B
        return rows[start : start + B]


def _local_rows(rollout: Rollout) -> dict[str, Any]:
    """The per-row fields of `rollout` (tensors [B, ...] and lists of B), as `rollout.dynamic` handles rows."""
    skipped = {*_GLOBAL, "advantages", "nonfinite"}
    values = {f.name: getattr(rollout, f.name) for f in fields(rollout) if f.name not in skipped}
    return {name: value for name, value in values.items() if value is not None}
