"""One generation batch of prompt rows -> scored completions with advantages -> the micro-batches of a rollout.

`ExperienceMaker` is the rollout half of a GRPO step (docs/design.md, "One training step"); OpenRLHF calls it an
experience maker, TRL's trainer `_generate_and_score_completions`. For this process's prompt rows it:

1. tokenizes the prompts and samples completions with the rollout engine (`grpo_hf.rollout`), or takes them
   from the user's `rollout_func` (`rollout.custom`);
2. scores them with the reward functions (`rewards.compute_rewards`), gathers the rewards of the whole
   generation batch over the processes and combines them (`core.combine_rewards`);
3. computes group advantages over whole groups (`core.group_advantages`, or GDPO's `decoupled_advantages`) and
   keeps this process's rows; with `dynamic_sampling`, first replaces the groups without signal
   (`rollout.dynamic`);
4. for training, adds the old and reference log-probs and cuts the batch into micro-batch slices, each with
   the token count its loss is normalised by.

It records the rollout's metrics (rewards, lengths, truncation, tokens) and, with `log_completions`, the rows
to print. It reads the trainer it serves (config, accelerator, tokenizer, reward functions, the trainer state)
and calls back into it for log-probs (`_logps_in_chunks`, `_reference_logps`) and the non-finite guard.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any

import torch
from accelerate.utils import gather_object
from torch import nn

from grpo_hf.completion_log import completion_rows
from grpo_hf.core import combine_rewards, decoupled_advantages, group_advantages
from grpo_hf.metrics import check_finite_rewards, reward_metrics
from grpo_hf.parallel import fsdp2_gathered, is_fsdp2, is_zero3, stop_together, sum_over_processes
from grpo_hf.rewards import compute_rewards
from grpo_hf.rewards.calling import RewardLogs
from grpo_hf.rollout import RolloutEngine, is_conversational, make_engine, split_into_slices, tokenize_prompts
from grpo_hf.rollout.custom import pad_to_multiple, rollout_from_func
from grpo_hf.rollout.dynamic import FreshPrompts, GroupPool, gather_rows, take_rows

if TYPE_CHECKING:
    from grpo_hf.trainer import GRPOTrainer

logger = logging.getLogger(__name__)


class ExperienceMaker:
    """The rollouts of one `GRPOTrainer`: `slices` for a training step, `make` for one batch (training or eval)."""

    def __init__(self, trainer: GRPOTrainer):
        self.trainer = trainer
        self.engine: RolloutEngine | None = None  # chosen at the first rollout (`engine_for`)
        self.num_generate_calls = 0  # rollout rounds generated (tests count rollout reuse with it)
        self.num_tokens = 0  # prompt + completion tokens so far (of the kept groups), over all processes
        self.completion_rows: list[dict[str, Any]] = []  # the last rollout's rows for `log_completions`
        self._refill_dataset = None  # the train dataset as the dataloader serves it, for dynamic sampling
        self.all_masked_rollouts = 0  # rollouts whose completions mask_truncated_completions masked all

    # ---- a training step's rollout -----------------------------------------------------------------------------
    def slices(self, inputs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """One generation batch -> scored, with old/ref log-probs -> micro-batch slices, each with the completion
        token count `num_items_in_batch` of the optimizer step it belongs to (over all processes)."""
        trainer = self.trainer
        batch = self.make(inputs, "train")
        with torch.no_grad():
            batch["old_logps"] = trainer._logps_in_chunks(trainer.model, batch) if trainer._needs_old_logps else None
            batch["ref_logps"] = trainer._reference_logps(batch)
        slices = split_into_slices(batch, trainer.args.per_device_train_batch_size)  # trimmed: padded again below
        pad = trainer.processing_class.pad_token_id
        slices = [pad_to_multiple(part, self.pad_multiple(), pad) for part in slices]  # pad_to_multiple_of
        # dapo normalises by the completion tokens of the whole optimizer step (all processes and
        # accumulation slices). Count them per slice over all processes.
        tokens = torch.stack([s["completion_mask"].sum() for s in slices]).float()  # [S]
        accelerator = trainer.accelerator
        tokens = accelerator.reduce(tokens, "sum") if accelerator.num_processes > 1 else tokens
        ga, S = trainer.args.gradient_accumulation_steps, len(slices)
        for k, part in enumerate(slices):
            if S % ga == 0:  # exact: the optimizer step covers slices [w*ga, (w+1)*ga)
                window = (k // ga) * ga
                part["num_items_in_batch"] = tokens[window : window + ga].sum()
            else:  # an optimizer step spans several rollouts: use this rollout's average
                part["num_items_in_batch"] = tokens.sum() * ga / S
        return slices

    def make(self, inputs: list[dict[str, Any]], mode: str) -> dict[str, Any]:
        """Generate completions for this process's rows, score them, and compute advantages.

        Returns tensors for this process's rows: prompt_ids/prompt_mask [B, P], completion_ids/completion_mask
        [B, T], advantages [B] (whenever the batch holds whole groups). With `dynamic_sampling`, the rows are those
        of the groups with signal (`keep_groups_with_signal`).
        """
        trainer, args = self.trainer, self.trainer.args
        G = args.num_generations if mode == "train" else (args.num_generations_eval or args.num_generations)
        rollout, kept = self.rollout_round(inputs, mode, G), None
        if mode == "train" and args.dynamic_sampling:
            rollout, kept = self.keep_groups_with_signal(rollout, G)
        keys = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "sampling_logps")
        batch = {key: rollout[key] for key in keys if key in rollout}
        B, total = len(rollout["prompts"]), rollout["total"]  # total: [N], the whole generation batch
        start = trainer.accelerator.process_index * B
        if total.numel() % G == 0:  # whole groups (always in training; evaluation batches may cut a group)
            if kept is None:
                advantages = self.advantages(total, rollout["all_rewards"], G)  # [N]
            else:  # the group statistics (and a "batch" std) of the kept groups only
                advantages = torch.zeros_like(total)
                if bool(kept.any()):
                    advantages[kept] = self.advantages(total[kept], rollout["all_rewards"][kept], G)
            batch["advantages"] = advantages[start : start + B]  # [B]
            if mode == "train" and trainer._nonfinite("advantages", advantages, rollout, G):
                batch["nonfinite"] = True  # every optimizer step this rollout feeds is skipped
        if mode != "train":
            return batch
        if kept is not None:  # rows of dropped groups that fill an incomplete batch carry no loss
            batch["completion_mask"] = batch["completion_mask"] * kept[start : start + B].unsqueeze(1).long()
        self._record_training_rows(rollout, batch)  # counts truncated completions' tokens too (TRL)
        if args.mask_truncated_completions:
            batch["completion_mask"] = batch["completion_mask"] * (~rollout["is_truncated"]).unsqueeze(1).long()
            self._warn_if_all_masked(rollout["is_truncated"])
        return batch

    def _warn_if_all_masked(self, is_truncated: torch.Tensor) -> None:
        """mask_truncated_completions with every completion of a rollout truncated trains on nothing: say so (the
        1st, 2nd, 4th, 8th, ... time, with the count)."""
        if not bool(is_truncated.all()):
            return
        self.all_masked_rollouts += 1
        count = self.all_masked_rollouts
        if count & (count - 1) == 0:
            logger.warning(
                f"Every completion of this rollout ({is_truncated.numel()} on this process) reached "
                f"max_completion_length={self.trainer.args.max_completion_length} without an EOS, and "
                "mask_truncated_completions=True masks them all: the step trains on nothing (the policy term is 0). "
                f"Raise max_completion_length or set mask_truncated_completions=False. ({count} such rollouts so far)"
            )

    def _record_training_rows(self, rollout: dict[str, Any], batch: dict[str, Any]) -> None:
        """The token count (`num_tokens`) and, with `log_completions`, the rows to print at the next log."""
        trainer = self.trainer
        tokens = int(batch["prompt_mask"].sum() + batch["completion_mask"].sum())
        self.num_tokens += sum_over_processes(trainer.accelerator, tokens)
        trainer._metrics["train"]["num_tokens"].append(float(self.num_tokens))
        if trainer.args.log_completions:
            rows = completion_rows(
                trainer.state.global_step,
                rollout["prompts"],
                rollout["texts"],
                trainer.reward_func_names,
                rollout["rewards"],
                batch["advantages"],
                rollout["extra"],
            )
            self.completion_rows = gather_object(rows) if trainer.accelerator.num_processes > 1 else rows

    def advantages(self, total: torch.Tensor, all_rewards: torch.Tensor, G: int) -> torch.Tensor:
        """Advantages [N] of a generation batch from its combined rewards `total` [N] ("sum_then_normalize":
        `core.group_advantages` with `scale_rewards`) or from each function's rewards `all_rewards` [N, R]
        ("normalize_then_sum", GDPO: `core.decoupled_advantages`), per `multi_objective_aggregation`."""
        args, weights = self.trainer.args, self.trainer.reward_weights
        if args.multi_objective_aggregation == "normalize_then_sum":
            return decoupled_advantages(all_rewards, G, weights.to(all_rewards.device))
        return group_advantages(total, G, args.scale_rewards)

    # ---- one round: sample, score, gather ------------------------------------------------------------------------
    def rollout_round(self, inputs: list[dict[str, Any]], mode: str, G: int) -> dict[str, Any]:
        """Tokenize, generate and score this process's rows; record the round's metrics.

        Returns this process's prompt/completion tensors [B, ...], `is_truncated` [B], `rewards` [B, R], the
        `prompts`, completion `texts` and `extra` (per row, the columns reward functions logged with `log_extra`),
        and of the whole generation batch the rewards `all_rewards` [N, R] and their combination `total` [N].
        """
        trainer = self.trainer
        accelerator = trainer.accelerator
        prompts = [row["prompt"] for row in inputs]
        columns = {key: [row[key] for row in inputs] for key in inputs[0] if key != "prompt"}
        sample, is_prompt_truncated = self.sample(prompts, columns)  # [B, ...]; may add columns (rollout_func)
        completion_ids, is_truncated = sample["completion_ids"], sample["is_truncated"]  # [B, T], [B]

        lengths = sample["completion_mask"].sum(dim=1)  # [B]
        failure = None
        try:
            rewards, texts, errors, logs = self.score(prompts, columns, completion_ids, lengths)  # [B, R]
        except Exception as error:  # reported by every process (`stop_together`), not only by this one
            failure = error
        stop_together(failure, accelerator, "computing rewards")
        # Whole groups may straddle processes: gather, normalise over the full batch.
        all_rewards = accelerator.gather(rewards)  # [N, R]
        total = combine_rewards(all_rewards, trainer.reward_weights.to(accelerator.device))  # [N]

        metrics = trainer._metrics[mode]
        for key, value in reward_metrics(all_rewards, total, trainer.reward_func_names, G).items():
            metrics[key].append(value)
        if trainer.args.reward_error_policy == "skip":
            for name in trainer.reward_func_names:
                metrics[f"rewards/{name}/errors"].append(float(sum_over_processes(accelerator, errors.get(name, 0))))
        trainer._metrics.add_logged(mode, logs.metrics, accelerator)
        float_lengths = accelerator.gather(lengths).float()  # [N]
        metrics["completions/mean_length"].append(float_lengths.mean().item())
        metrics["completions/min_length"].append(float_lengths.min().item())
        metrics["completions/max_length"].append(float_lengths.max().item())
        metrics["completions/clipped_ratio"].append(accelerator.gather(is_truncated).float().mean().item())
        truncated_prompts = sum_over_processes(accelerator, int(is_prompt_truncated.sum()))
        metrics["prompts/num_truncated"].append(float(truncated_prompts))
        extra = [{column: values[i] for column, values in logs.extra.items()} for i in range(len(prompts))]
        return {
            **sample,
            "rewards": rewards,
            "prompts": prompts,
            "texts": texts,
            "extra": extra,
            "all_rewards": all_rewards,
            "total": total,
        }

    def sample(self, prompts: list, columns: dict[str, list]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """This process's rollout tensors, `prompt_ids`/`prompt_mask` [B, P], `completion_ids`/`completion_mask`
        [B, T] and `is_truncated` [B], padded to `pad_to_multiple_of`; and which prompts were truncated [B]. From the
        rollout engine, or from `rollout_func` (TRL's contract, `rollout.custom`): its extra fields join `columns`."""
        trainer = self.trainer
        args, device, pad = trainer.args, trainer.accelerator.device, trainer.processing_class.pad_token_id
        if trainer.rollout_func is not None:
            sample, extra = rollout_from_func(
                trainer.rollout_func,
                prompts,
                trainer,
                pad_token_id=pad,
                eos_token_ids=trainer.eos_token_ids,
                device=device,
            )
            columns.update(extra)
            is_prompt_truncated = torch.zeros(len(prompts), dtype=torch.bool)
        else:
            prompt_ids, prompt_mask, is_prompt_truncated = tokenize_prompts(
                trainer.processing_class, prompts, args.max_prompt_length, trainer.chat_template_kwargs
            )
            prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)  # [B, P]
            with self.model_for_generation() as unwrapped:
                engine = self.engine_for(unwrapped)
                completion_ids, completion_mask, is_truncated = engine.generate(
                    unwrapped, prompt_ids, prompt_mask
                )  # [B, T], [B, T], [B]
            sample = {
                "prompt_ids": prompt_ids,
                "prompt_mask": prompt_mask,
                "completion_ids": completion_ids,
                "completion_mask": completion_mask,
                "is_truncated": is_truncated,
            }
            sampling_logps = getattr(engine, "sampling_logps", None)  # [B, T] the sampler's own (vllm)
            if sampling_logps is not None and sampling_logps.shape == completion_mask.shape:
                sample["sampling_logps"] = sampling_logps.masked_fill(completion_mask == 0, 0.0)
        self.num_generate_calls += 1
        return pad_to_multiple(sample, self.pad_multiple(), pad), is_prompt_truncated

    def pad_multiple(self) -> int | None:
        """`pad_to_multiple_of`, with "auto" resolved as TRL resolves it: 128 on Neuron, no padding elsewhere."""
        value = self.trainer.args.pad_to_multiple_of
        if value == "auto":
            return 128 if self.trainer.accelerator.device.type == "neuron" else None
        return value

    def score(self, prompts, columns, completion_ids, lengths):
        """Rewards [B, R] (NaN = None) of each completion, its text, the error counts of skipped rewards, and what the
        reward functions logged through `log_extra` / `log_metric` (`rewards.calling.RewardLogs`).

        Reward functions see the text (and ids) of each completion up to and including its EOS; with
        conversational prompts the completion is one assistant message.
        """
        trainer = self.trainer
        completion_id_lists = [ids[:n].tolist() for ids, n in zip(completion_ids, lengths.tolist(), strict=True)]
        texts = trainer.processing_class.batch_decode(completion_id_lists, skip_special_tokens=True)
        completions = texts
        if is_conversational(prompts[0]):
            completions = [[{"role": "assistant", "content": t}] for t in texts]
        reward_rows, errors = compute_rewards(
            trainer.reward_funcs,
            prompts,
            completions,
            completion_id_lists,
            columns=columns,
            trainer_state=trainer.state,
            timeout=trainer.args.reward_timeout,
            error_policy=trainer.args.reward_error_policy,
            logs=(logs := RewardLogs(len(completions))),
        )
        device = trainer.accelerator.device
        rewards = torch.tensor(reward_rows, dtype=torch.float32, device=device).view(len(prompts), -1)  # [B, R]
        check_finite_rewards(rewards, trainer.reward_func_names)
        no_reward = torch.isnan(rewards).all(dim=1)  # [B]
        if bool(no_reward.any()):  # TRL's warning, about the first such completion
            row = int(no_reward.nonzero()[0])
            kw = {"prompt": prompts[row], "completion": completions[row], **{k: c[row] for k, c in columns.items()}}
            logger.warning(
                f"All reward functions returned None for the following kwargs: {kw}. Please ensure that at least "
                "one reward function returns a valid reward (a completion without any reward gets advantage 0)."
            )
        return rewards, texts, errors, logs

    # ---- the rollout engine ------------------------------------------------------------------------------------
    def engine_for(self, model: nn.Module) -> RolloutEngine:
        """The rollout engine (`args.rollout_engine`), chosen at the first rollout, with the model on its device."""
        if self.engine is None:
            trainer = self.trainer
            sharded = trainer.is_fsdp_enabled or is_zero3(trainer.accelerator)
            self.engine, why = make_engine(
                trainer.args.rollout_engine,
                model,
                trainer.generation_config,
                trainer.eos_token_ids,
                sharded=sharded,
                autocast=trainer.accelerator.autocast,  # for engines that call a model autocast does not wrap
                args=trainer.args,  # for the engines that take settings from it (vllm)
                accelerator=trainer.accelerator,
            )
            logger.info(why)
        return self.engine

    @contextlib.contextmanager
    def model_for_generation(self):
        """The bare model for `generate`. Under DeepSpeed ZeRO-3 its shards are gathered first (TRL's helper); under
        FSDP2 once for the whole rollout (`parallel.fsdp2_gathered`), not in every forward (every token).

        Gradient checkpointing needs no switching off: `generate` runs in eval mode, where it is inactive.
        """
        trainer = self.trainer
        if is_zero3(trainer.accelerator):
            from trl.models.utils import unwrap_model_for_generation

            with unwrap_model_for_generation(trainer.model_wrapped, trainer.accelerator) as unwrapped:
                yield unwrapped
        elif is_fsdp2(trainer.accelerator):
            with fsdp2_gathered(trainer.model_wrapped):
                yield trainer.accelerator.unwrap_model(trainer.model_wrapped)
        else:
            yield trainer.accelerator.unwrap_model(trainer.model_wrapped)

    # ---- dynamic sampling ----------------------------------------------------------------------------------------
    def keep_groups_with_signal(self, first: dict[str, Any], G: int) -> tuple[dict[str, Any], torch.Tensor]:
        """DAPO's dynamic sampling (`rollout.dynamic`): drop the groups of `first` whose rewards are all equal and
        generate for fresh prompts, at most `dynamic_sampling_max_rounds` more rounds, until the batch is full.

        Returns this process's share of the new batch (as `rollout_round`), and `kept` [N] (bool), False on the
        rows of dropped groups that fill the batch when the rounds ran out.
        """
        trainer = self.trainer
        B, pad = len(first["prompts"]), trainer.processing_class.pad_token_id
        pool = GroupPool(num_groups=first["total"].numel() // G, num_generations=G)
        rollout, rounds, fresh = first, 0, None
        while True:
            local = {key: value for key, value in rollout.items() if key not in ("total", "all_rewards")}  # global
            pool.add({**gather_rows(local, trainer.accelerator, pad), "total": rollout["total"]})
            if pool.full or rounds == trainer.args.dynamic_sampling_max_rounds:
                break
            if fresh is None:
                if self._refill_dataset is None:  # the rows as the dataloader serves them
                    self._refill_dataset = trainer._remove_unused_columns(
                        trainer.train_dataset, description="training"
                    )
                fresh = FreshPrompts(self._refill_dataset, trainer.args.seed, trainer.state.global_step)
            rounds += 1
            rollout = self.rollout_round(self._fresh_inputs(fresh, pool.seen, B, G), "train", G)
        rows, kept = pool.batch(pad)
        self._record_dynamic_sampling(pool, rounds)
        start = trainer.accelerator.process_index * B
        local = take_rows(rows, torch.arange(start, start + B))
        return {**local, "total": rows["total"], "all_rewards": rows["rewards"]}, kept.to(rows["total"].device)

    def _record_dynamic_sampling(self, pool: GroupPool, rounds: int) -> None:
        metrics = self.trainer._metrics["train"]
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
        accelerator = self.trainer.accelerator
        rows = [row for row in fresh.take(B * accelerator.num_processes // G, seen) for _ in range(G)]
        start = accelerator.process_index * B
        return rows[start : start + B]
