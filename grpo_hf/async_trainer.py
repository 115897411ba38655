"""`AsyncGRPOTrainer`: `GRPOTrainer` under the constructor of TRL 1.16's `trl.experimental.async_grpo`.

It is the same trainer, built from the same arguments, with its producer thread always on (docs/async.md): generation
runs ahead of training by at most `args.max_staleness` optimizer steps (`AsyncGRPOConfig`: TRL's default, 4), and at
`max_staleness=0` the producer and the trainer take turns, which is the synchronous run bit for bit. So the producer's
limits apply at every staleness (docs/async.md names them: no vLLM colocate, no FSDP / ZeRO-3 without a vLLM server,
no `rollout_func`; `GRPOTrainer` at `max_staleness=0` runs them all). The promises:

- TRL's arguments, in TRL's order and with TRL's names: `model, reward_funcs, args, train_dataset,
  processing_class, callbacks, optimizers, peft_config, tools, environment_factory, rollout_worker,
  weight_transfer`; grpo_hf's other `GRPOTrainer` arguments (`eval_dataset`, `reward_processing_classes`,
  `quantization_config`, `rollout_func`) follow, keyword-only;
- `args=None` is `AsyncGRPOConfig(output_dir="<model name>-AsyncGRPO")`, as TRL's; a `GRPOConfig` is taken as it is
  (its own `max_staleness`); TRL's config object is refused with the import to change;
- `rollout_worker` and `weight_transfer` (TRL's rollout process and its NCCL weight sync) are refused when given, with
  what to use instead: grpo_hf samples with its own engines and moves the weights itself;
- settings the producer cannot run (`producer.async_unsupported_reason`) are refused before any model loads, naming
  `GRPOTrainer` at `max_staleness=0` as the trainer that runs them.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from transformers import PreTrainedModel, TrainerCallback

from grpo_hf.async_config import AsyncGRPOConfig
from grpo_hf.config import GRPOConfig
from grpo_hf.producer import async_unsupported_reason
from grpo_hf.trainer import GRPOTrainer, RewardFunc


class AsyncGRPOTrainer(GRPOTrainer):
    """GRPO with generation in a producer thread, ahead of training by at most `args.max_staleness` optimizer steps,
    under TRL's `AsyncGRPOTrainer` constructor (TRL 1.16, `trl.experimental.async_grpo`). Arguments: `GRPOTrainer`'s,
    and `rollout_worker` / `weight_transfer`, which must stay None (see the module docstring)."""

    _tag_names = ["grpo", "grpo_hf", "async-grpo"]
    _produce_always = True  # the producer thread even at max_staleness=0, taking turns with the trainer

    def __init__(
        self,
        model: str | PreTrainedModel,
        reward_funcs: RewardFunc | list[RewardFunc] | None = None,
        args: GRPOConfig | None = None,
        train_dataset=None,
        processing_class=None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers=(None, None),
        peft_config=None,
        tools: list[Callable] | None = None,
        environment_factory=None,
        rollout_worker=None,
        weight_transfer=None,
        *,
        eval_dataset=None,
        reward_processing_classes=None,
        quantization_config=None,
        rollout_func=None,
    ):
        refuse_trl_only_arguments(rollout_worker, weight_transfer)
        args = async_config_or_default(args, model)
        refuse_what_the_producer_cannot_run(args, rollout_func)
        super().__init__(
            model,
            reward_funcs,
            args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            reward_processing_classes=reward_processing_classes,
            callbacks=callbacks,
            optimizers=optimizers,
            quantization_config=quantization_config,
            peft_config=peft_config,
            tools=tools,
            rollout_func=rollout_func,
            environment_factory=environment_factory,
        )


def refuse_trl_only_arguments(rollout_worker, weight_transfer) -> None:
    """TRL's `rollout_worker` and `weight_transfer` have no counterpart here: refused with what to use instead."""
    if rollout_worker is not None:
        raise ValueError(
            f"rollout_worker={type(rollout_worker).__name__}(...): grpo_hf has no separate rollout worker; its "
            "trainer samples with its own rollout engines (rollout_engine=..., or use_vllm=True with "
            "vllm_mode='server' for a vLLM server) and scores with reward_funcs. To replace sampling, pass "
            "rollout_func=f(prompts, trainer) to GRPOTrainer, synchronous (docs/tools.md, 'rollout_func'); to score "
            "elsewhere, pass a reward function that calls your scorer. Remove rollout_worker."
        )
    if weight_transfer is not None:
        raise ValueError(
            f"weight_transfer={type(weight_transfer).__name__}(...): grpo_hf keeps the sampler's weights up to date "
            "itself (its own engines sample from the trained model; a colocated vLLM gets them in memory and a vLLM "
            "server as files from process 0, whenever the policy changed) and takes no weight-sync backend. Remove "
            "weight_transfer."
        )


def refuse_what_the_producer_cannot_run(args: GRPOConfig, rollout_func) -> None:
    """The producer's limits (`producer.async_unsupported_reason`, the one rule) that the config shows, refused before
    any model loads, pointing to `GRPOTrainer`: this trainer runs the producer even at max_staleness=0. Sharding
    (FSDP, ZeRO-3) is known once `Trainer` is built, and `GRPOTrainer` checks it then."""
    why = async_unsupported_reason(args, sharded=False, rollout_func=rollout_func is not None)
    if why is not None:
        raise ValueError(
            f"AsyncGRPOTrainer samples in a producer thread at every max_staleness (here {args.max_staleness}), and "
            f"the producer cannot run these settings: {why}. For them, use GRPOTrainer, which runs no producer at "
            "max_staleness=0 (docs/async.md)."
        )


def async_config_or_default(args, model) -> GRPOConfig:
    """`args` when it is grpo_hf's config; TRL's default when None: `AsyncGRPOConfig` writing to
    `<model name>-AsyncGRPO`. Another config (TRL's own, say) is refused with the import to change."""
    if args is None:
        name = model if isinstance(model, str) else model.config._name_or_path
        return AsyncGRPOConfig(output_dir=f"{os.path.basename(str(name).rstrip('/')) or 'model'}-AsyncGRPO")
    if not isinstance(args, GRPOConfig):
        kind = f"{type(args).__module__}.{type(args).__qualname__}"
        raise TypeError(
            f"args is {kind}, not grpo_hf's config: build it with `from grpo_hf import AsyncGRPOConfig` (same "
            "fields as TRL's AsyncGRPOConfig) and pass that."
        )
    return args
