"""`GRPOConfig`: every knob of a GRPO run, validated once in `__post_init__`.

Field names and meanings follow TRL's `GRPOConfig` for the knobs the two share, so a TRL
config ports by changing the import. Defaults follow DeepSeekMath (Shao et al., 2024, §4.2),
the paper that defines GRPO; where they differ from TRL's defaults the class docstring says so.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import logging
import math
import numbers
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from transformers import GenerationConfig, TrainingArguments

from grpo_hf.checkpoint import normalize_resume
from grpo_hf.core import EntropySettings, LossSettings, check_choice
from grpo_hf.values import as_dict, with_article
from grpo_hf.vllm_config import VLLMArguments

logger = logging.getLogger(__name__)

DICT_FIELDS = (
    "model_init_kwargs",
    "generation_kwargs",
    "chat_template_kwargs",
    "transformers_continuous_batching_config",
    "vllm_kwargs",
)
"""The dict-valued fields: a dict, JSON text (the command line) or None, each made a dict in `__post_init__`."""

LOW_TEMPERATURE = 0.1  # below it, sampling is greedy in effect and the step's log-probs degenerate: a warning

LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]
ScaleRewards = Literal["group", "batch", "none"]
ImportanceSamplingLevel = Literal["token", "sequence", "sequence_sum"]
RewardErrorPolicy = Literal["raise", "skip"]
LostUpdateAction = Literal["warn", "raise"]
NonFiniteAction = Literal["raise", "skip_step"]
MultiObjectiveAggregation = Literal["sum_then_normalize", "normalize_then_sum"]
RouterReplayMode = Literal["off", "r2", "r3"]


@dataclass
class GRPOConfig(VLLMArguments, TrainingArguments):
    r"""Configuration of [`GRPOTrainer`]: `TrainingArguments` plus the GRPO knobs.

    `per_device_train_batch_size` counts **completions**, not prompts, as in TRL: with
    `per_device_train_batch_size=8`, `num_generations=4` and one process, each micro-batch holds
    2 prompts x 4 completions. The *generation batch* is `per_device_train_batch_size x
    num_processes x steps_per_generation` completions; it must hold whole groups, i.e. be divisible
    by `num_generations`. A group's completions may sit on different processes; advantages are
    still computed over the whole group.

    Defaults that differ from TRL's `GRPOConfig`, and why:

    - `loss_type="grpo"` (TRL: `"dapo"`): the per-sequence length normalisation of the GRPO paper
      (DeepSeekMath eq. 3). Pick `"dapo"` or `"dr_grpo"` to remove its length bias.
    - `beta=0.04` (TRL: `0.0`): the KL coefficient used in DeepSeekMath §4.2. With `beta=0` no
      reference model is built and no reference forward is run.
    - `disable_dropout=True` (TRL: `False`): dropout makes the "on-policy" ratio differ from 1 and
      adds noise to the old/reference log-probs; RL fine-tuning runs switch it off.
    - `max_completion_length=256` (TRL: 512): GSM8K-style answers are short.
    - `use_bias_correction_kl=False` (TRL: `True`): DeepSeekMath's k3 KL term as the paper writes it.
    - `logging_steps=1` (TRL: 10): RL runs are short and noisy; every step's reward is worth seeing.
    - `gradient_checkpointing=False` (TRL: `True`): it turns off the shared-prompt-prefix forward and
      costs 1.2x the time for 0.97x the memory on the measured config (README).
    - `bf16` keeps the `TrainingArguments` default (off) instead of TRL's "on unless fp16":
      turn it on for GPUs; this library never assumes the hardware.

    `GRPOConfig.from_trl_defaults(...)` starts from TRL's values instead (`TRL_DEFAULTS`), and the trainer warns
    once, when built, about the defaults a config leaves that differ from TRL's (`defaults_differing_from_trl`: a
    field passed to the constructor is a choice, even at grpo_hf's value).
    - Shared with TRL: `epsilon=0.2`, `scale_rewards="group"`, `num_generations=8`,
      `learning_rate=1e-6`, `temperature=1.0`, `num_iterations=1`.
    """

    # ---- TrainingArguments defaults we change ----------------------------------------------------
    learning_rate: float = field(default=1e-6, metadata={"help": "Initial AdamW learning rate (DeepSeekMath: 1e-6)."})
    logging_steps: float = field(default=1, metadata={"help": "Log every N optimizer steps."})
    logging_nan_inf_filter: bool = field(
        default=False,
        metadata={"help": "False: a NaN or inf loss is logged as it is (TrainingArguments' True logs it as 0)."},
    )
    remove_unused_columns: bool | None = field(
        default=False,
        metadata={"help": "Keep every dataset column: the extra columns are passed to the reward functions."},
    )

    # ---- model ------------------------------------------------------------------------------------
    model_init_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata={"help": "Keyword arguments for `AutoModelForCausalLM.from_pretrained` when `model` is a string."},
    )
    disable_dropout: bool = field(
        default=True,
        metadata={"help": "Set every dropout probability to 0 in the policy (and reference) model."},
    )
    trust_remote_code: bool = field(
        default=False,
        metadata={
            "help": "Allow models and tokenizers that ship their own Python code: passed to `from_pretrained` of the "
            "policy, the reference model, their tokenizer, and reward models and their tokenizers loaded from a path "
            "(`model_init_kwargs['trust_remote_code']`, when set, wins for the policy and reference)."
        },
    )
    router_aux_loss_coef: float | None = field(
        default=None,
        metadata={
            "help": "Mixture-of-Experts models (a config with `output_router_logits`): the training loss adds this "
            "coefficient x the model's load-balancing loss (its `aux_loss`, over the prompt + completion tokens of "
            "the micro-batch), logged as `aux_loss`. None: the model config's `router_aux_loss_coef` (0 if none); "
            "0.0: off. A non-zero value with a model that is not MoE, or whose forward computes no load-balancing "
            "loss (DeepSeek-V3: its config's own value then counts as 0), is an error. While on, the shared-prefix "
            "forward counts each prompt token's routing once per row, as the padded forward does; one group's "
            "backward at a time (backward_per_group) first runs a no-grad routing pass over the micro-batch for the "
            "expert counts, which span every group (a model whose load-balancing loss is not Switch Transformer's: "
            "one backward)."
        },
    )
    router_replay: RouterReplayMode = field(
        default="off",
        metadata={
            "help": "Mixture-of-Experts models: the experts the training forwards route each token to (docs/moe.md). "
            "'r3' (rollout routing replay): every training-side forward of a rollout's tokens (the policy's loss "
            "forward, the old-policy and reference log-probs, the shared-prompt path) uses the top-k experts the "
            "rollout engine chose, per token and layer; 'r2': those the old-policy forward chose (that forward then "
            "always runs). The routing weights are recomputed from the live router logits at those experts, so the "
            "router still gets gradients; the load-balancing loss is the model's own. 'off': each forward routes "
            "as it computes. A model that is not MoE, or whose router grpo_hf does not know, is an error when it is "
            "on. Whatever the setting, an MoE run logs how often the training forward's experts differ from the "
            "rollout's (router/route_mismatch, router/token_mismatch) and the log-prob gap (router/logp_gap, "
            "router/k3_kl) where the rollout recorded them."
        },
    )
    cast_lm_head_to_fp32: bool = field(
        default=False,
        metadata={
            "help": "Keep the LM head's weights in float32 and compute the logits in float32, outside autocast, for "
            "the policy and the reference model (ScaleRL): log-probs and sampling see fp32 logits in bf16/fp16 runs. "
            "With tied embeddings the shared matrix becomes fp32 and the embedding output is cast back to the "
            "model's dtype. Not with a PEFT adapter on the LM head."
        },
    )

    # ---- data and generation ----------------------------------------------------------------------
    max_prompt_length: int | None = field(
        default=None,
        metadata={
            "help": "None (TRL's): prompts are never cut. Else a prompt over this many tokens is cut to fit, with a "
            "warning at the first cut and the `prompts/num_truncated` metric: a chat prompt loses whole turns of its "
            "history (its system messages, the tools' schemas and its last user turn are kept; a prompt whose kept "
            "part is over the limit is an error), a plain-text prompt its beginning."
        },
    )
    num_generations: int = field(
        default=8, metadata={"help": "Completions sampled per prompt (the group size G). At least 2."}
    )
    num_generations_eval: int | None = field(
        default=None, metadata={"help": "Group size during evaluation. `None` uses `num_generations`."}
    )
    max_completion_length: int = field(default=256, metadata={"help": "Maximum number of generated tokens."})
    pad_to_multiple_of: int | str | None = field(
        default="auto",
        metadata={
            "help": "Pad prompt rows (on the left) and completion rows (on the right) of each rollout to a multiple "
            "of this many tokens, so shapes repeat (compilers that specialise on shapes). Padding is masked: the loss "
            "is unchanged. 'auto': 128 on Neuron (AWS Trainium), none elsewhere. None: no padding."
        },
    )
    shuffle_dataset: bool = field(
        default=True, metadata={"help": "Shuffle prompts (never the copies inside a group) each epoch, under `seed`."}
    )
    generation_batch_size: int | None = field(
        default=None,
        metadata={
            "help": "Completions generated at once, over all processes. `None`: per_device_train_batch_size x "
            "num_processes x steps_per_generation. Set this or `steps_per_generation`, not both."
        },
    )
    steps_per_generation: int | None = field(
        default=None,
        metadata={"help": "Micro-batches served by one generation batch. `None`: gradient_accumulation_steps."},
    )
    dynamic_sampling: bool = field(
        default=False,
        metadata={
            "help": "DAPO's dynamic sampling: drop the groups whose rewards are all equal (zero advantage) and "
            "generate for fresh prompts until the generation batch is full of groups with signal."
        },
    )
    dynamic_sampling_max_rounds: int = field(
        default=4,
        metadata={
            "help": "Extra generation rounds dynamic sampling may make per generation batch; when they run out, the "
            "step trains on the groups it has (logged as dynamic_sampling/unfilled_groups)."
        },
    )
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature; must be > 0."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling probability mass, in (0, 1]."})
    top_k: int = field(
        default=0,
        metadata={"help": "Top-k sampling; 0 or -1 (vLLM's 'off') disables it, as does a value >= the vocabulary."},
    )
    min_p: float | None = field(default=None, metadata={"help": "Min-p sampling threshold; `None` disables it."})
    repetition_penalty: float = field(default=1.0, metadata={"help": "Repetition penalty; 1.0 disables it."})
    generation_kwargs: dict[str, Any] | str | None = field(
        default=None, metadata={"help": "Extra keyword arguments for `GenerationConfig`; they override the above."}
    )
    chat_template_kwargs: dict[str, Any] | str | None = field(
        default=None, metadata={"help": "Extra keyword arguments for `tokenizer.apply_chat_template`."}
    )
    max_tool_calling_iterations: int | None = field(
        default=None,
        metadata={
            "help": "With tools or environments: the most rounds of tool calls in one episode; a turn asking for "
            "more ends the episode. `None`: no limit but max_completion_length, which bounds the whole episode."
        },
    )
    tool_timeout: float | None = field(
        default=None,
        metadata={
            "help": "Seconds a tool call may take; one that takes longer becomes an error reply to the model and "
            "counts as a failed call. `None`: no limit."
        },
    )

    # ---- asynchronous GRPO (docs/async.md) --------------------------------------------------------------------
    max_staleness: int = field(
        default=0,
        metadata={
            "help": "0: the policy samples, then trains, in turn (synchronous GRPO). s > 0: a producer thread samples "
            "and scores the next generation batches while the trainer trains, with weights at most s optimizer "
            "steps older than those the batch trains (generation of batch k starts once k - s steps are taken), "
            "corrected as decoupled PPO (docs/async.md)."
        },
    )

    # ---- the GRPO objective -----------------------------------------------------------------------
    beta: float = field(
        default=0.04,
        metadata={"help": "KL coefficient (k3 estimator). 0 builds no reference model and skips its forward."},
    )
    num_iterations: int = field(
        default=1, metadata={"help": "Optimisation passes over each generation batch (mu in the paper)."}
    )
    epsilon: float = field(default=0.2, metadata={"help": "Lower clipping range: ratio >= 1 - epsilon."})
    epsilon_high: float | None = field(
        default=None,
        metadata={"help": "Upper clipping range: ratio <= 1 + epsilon_high (DAPO clip-higher). `None`: epsilon."},
    )
    importance_sampling_level: ImportanceSamplingLevel = field(
        default="token",
        metadata={
            "help": "'token': per-token ratios (GRPO). 'sequence': length-normalised sequence ratio (GSPO). "
            "'sequence_sum': joint-probability ratio and sequence-level KL (DeepSeek-V2/V3; needs loss_type='grpo')."
        },
    )
    loss_type: LossType = field(
        default="grpo",
        metadata={
            "help": "'grpo': mean over sequences of the per-sequence token mean (DeepSeekMath). 'bnpo': token mean "
            "over the local batch. 'dr_grpo': token sum / (N x max_completion_length) (Dr. GRPO). 'dapo': token sum "
            "/ completion tokens in the whole global batch (DAPO). 'cispo': clipped, detached IS weight x A x "
            "log-prob (MiniMax-M1; epsilon_high is the cap). 'sapo': a sigmoid-gated soft clip (SAPO). 'luspo': GSPO "
            "weighted by length. 'vespo': a smooth sequence-level weight (VESPO). Formulas: grpo_hf/core/losses.py."
        },
    )
    scale_rewards: ScaleRewards = field(
        default="group",
        metadata={
            "help": "'group': divide advantages by the group std. 'batch': by the batch std. 'none': no scaling "
            "(Dr. GRPO). `True`/`False` are accepted as 'group'/'none'."
        },
    )
    delta: float | None = field(
        default=None,
        metadata={"help": "Two-sided clipping (INTELLECT-2): the ratio is also capped at delta (> 1 + epsilon_high)."},
    )
    use_bias_correction_kl: bool = field(
        default=False,
        metadata={
            "help": "Multiply the KL term by the importance ratio (DeepSeek-V3.2), which corrects it off-policy. "
            "TRL defaults it to True; False keeps DeepSeekMath's k3 term."
        },
    )
    off_policy_mask_threshold: float | None = field(
        default=None,
        metadata={
            "help": "Drop the policy term of negative-advantage sequences whose mean log(pi_old / pi_theta) exceeds "
            "this (DeepSeek-V3.2 off-policy sequence masking). None: off."
        },
    )
    sapo_temperature_pos: float = field(default=1.0, metadata={"help": "SAPO gate temperature for A > 0."})
    sapo_temperature_neg: float = field(default=1.05, metadata={"help": "SAPO gate temperature for A <= 0."})
    vespo_k_pos: float = field(default=2.0, metadata={"help": "VESPO shape k for A >= 0."})
    vespo_lambda_pos: float = field(default=3.0, metadata={"help": "VESPO rate lambda for A >= 0."})
    vespo_k_neg: float = field(default=3.0, metadata={"help": "VESPO shape k for A < 0."})
    vespo_lambda_neg: float = field(default=2.0, metadata={"help": "VESPO rate lambda for A < 0."})
    top_entropy_quantile: float = field(
        default=1.0,
        metadata={
            "help": "rho of 'Beyond the 80/20 rule': train the policy term only on the top-rho fraction of completion "
            "tokens by entropy (threshold: the (1 - rho) quantile over the micro-batch's completion tokens on all "
            "processes; the KL term keeps every token). In [0, 1]: 1.0 all tokens, 0.0 the highest-entropy one; the "
            "paper uses 0.2. Not with importance_sampling_level='sequence_sum'. Below 1.0, backward_per_group does "
            "not apply (the mask needs every group's entropy first): one backward per micro-batch."
        },
    )
    entropy_coef: float = field(
        default=0.0,
        metadata={
            "help": "Entropy bonus: loss -= entropy_coef x the mean per-token entropy over the policy term's tokens, "
            "the same for every loss_type. With use_adaptive_entropy, the starting coefficient. 0.0: off."
        },
    )
    use_adaptive_entropy: bool = field(
        default=False,
        metadata={
            "help": "Skywork-OR1's adaptive entropy control: after each optimizer step, entropy_coef grows by "
            "entropy_coef_delta if that step's mean entropy (all micro-batches and processes) is <= entropy_target, "
            "else shrinks by it; the bonus applies only while the entropy is <= entropy_target."
        },
    )
    entropy_coef_min: float = field(default=0.0, metadata={"help": "Lower bound of the adaptive entropy_coef."})
    entropy_coef_max: float = field(default=1.0, metadata={"help": "Upper bound of the adaptive entropy_coef."})
    entropy_coef_delta: float = field(
        default=0.005, metadata={"help": "Step of the adaptive entropy_coef per optimizer step (>= 0)."}
    )
    entropy_target: float = field(
        default=0.2,
        metadata={
            "help": "Adaptive control's target mean entropy (nats per token, over the policy term's tokens). Language "
            "models often sit at 2-10 nats, where 0.2 never triggers: set it near the `entropy` logged early on."
        },
    )
    reward_weights: list[float] | None = field(
        default=None, metadata={"help": "One weight per reward function. `None`: all 1.0."}
    )
    multi_objective_aggregation: MultiObjectiveAggregation = field(
        default="sum_then_normalize",
        metadata={
            "help": "How several reward functions make one advantage. 'sum_then_normalize': the weighted sum of the "
            "rewards, then the group normalisation of `scale_rewards`. 'normalize_then_sum' (GDPO): each function's "
            "rewards normalised within the group (mean, std + 1e-4), then the weighted sum, then that sum normalised "
            "over the whole generation batch (mean, std + 1e-4); `scale_rewards` does not apply (as in TRL). "
            "Formula: core.decoupled_advantages."
        },
    )
    sync_ref_model: bool = field(
        default=False,
        metadata={
            "help": "TR-DPO: every `ref_model_sync_steps` optimizer steps, the reference model becomes "
            "ref_model_mixup_alpha x policy + (1 - ref_model_mixup_alpha) x reference, parameter by parameter. Needs "
            "beta != 0 and a separate reference model (not LoRA, whose reference is the base model)."
        },
    )
    ref_model_mixup_alpha: float = field(
        default=0.6,
        metadata={"help": "TR-DPO's alpha in [0, 1]: the policy's share in the reference update (sync_ref_model)."},
    )
    ref_model_sync_steps: int = field(
        default=512,
        metadata={"help": "TR-DPO's tau: optimizer steps between reference updates (sync_ref_model); >= 1."},
    )
    mask_truncated_completions: bool = field(
        default=False,
        metadata={"help": "Exclude completions that hit max_completion_length without EOS from the loss (DAPO)."},
    )
    reward_timeout: float | None = field(
        default=None, metadata={"help": "Seconds one call of one reward function may take. `None`: no limit."}
    )
    reward_error_policy: RewardErrorPolicy = field(
        default="raise",
        metadata={
            "help": "'raise': an exception in a reward function stops training. 'skip': the sample is scored None "
            "and counted in the `rewards/<func>/errors` metric."
        },
    )

    # ---- speed and memory -------------------------------------------------------------------------
    share_prompt_prefix: bool | None = field(
        default=None,
        metadata={
            "help": "In the log-prob forwards (policy, old and reference), run each distinct prompt once and let the "
            "completions of its group attend to its cache (keys/values, conv and recurrent states), in at most two "
            "length buckets, each cut to its longest completion: no compute on repeated prompts and little on "
            "padding. Exact (same maths, float rounding aside). Used for decoder-only models on one process or under "
            "DDP (whose forward it bypasses; the trainer then averages gradients itself) that are not "
            "gradient-checkpointed; FSDP, DeepSpeed and checkpointed models run one forward over the padded prompt + "
            "completion rows, as with False. None: chosen per micro-batch by device: on CUDA, where the padded "
            "micro-batch's forward and backward fit in 0.7 of the memory available, the padded forward (fewer kernel "
            "launches); else the shared prefix. The log says which and why."
        },
    )
    backward_per_group: bool | None = field(
        default=None,
        metadata={
            "help": "Where share_prompt_prefix applies: run forward and backward one group (prompt) at a time, "
            "so only one group's activations are in memory. The same gradient (the loss is a sum over rows), "
            "float rounding aside. False: one backward over the whole micro-batch. None: True where the shared "
            "prefix is chosen by device (on a CPU, or on CUDA when memory is tight), False where the padded forward "
            "is; with share_prompt_prefix=True on CUDA, one backward where the micro-batch fits."
        },
    )
    rollout_engine: str = field(
        default="auto",
        metadata={
            "help": "How completions are sampled. 'auto': 'cuda_graph' on CUDA, 'loop' elsewhere, each falling back "
            "when the model or settings do not allow it (the log says which engine runs and why). 'loop': grpo_hf's "
            "decoding loop (each prompt prefilled once for its group, preallocated KV cache, finished rows leave the "
            "batch). 'cuda_graph': a static KV cache and the decode step (forward, logits processors, draw) captured "
            "as one CUDA graph, no host sync per token. 'generate': `model.generate` as configured. "
            "'generate_static': `model.generate` with a static, compiled cache. All draw from the distribution "
            "`model.generate` would (same processors, the model's generation_config defaults); 'loop' also applies "
            "sequence_bias, no_repeat_ngram_size, bad_words_ids, min_new_tokens and (begin_)suppress_tokens "
            "(docs/rollout.md); other settings use `model.generate`. More engines: "
            "`grpo_hf.rollout.register_engine`."
        },
    )
    episode_cache_gb: float = field(
        default=4.0,
        metadata={
            "help": "Tool episodes on the 'loop' engine: GiB of device memory for the KV caches episodes keep while "
            "their tools run, so that a turn that comes back prefills only the tool reply (the batch's shared prefix, "
            "e.g. the tool schemas, is prefilled once and counted here too). An episode whose cache does not fit "
            "re-prefills its whole context (counted by the tools/cache_evictions metric). 0: keep nothing. "
            "Every cache layer kind: full, sliding-window and linear attention, convolution, Mamba (docs/rollout.md)."
        },
    )
    use_model_generate: bool = field(
        default=False,
        metadata={"help": "TRL's switch for rollout_engine='generate'."},
    )
    cache_implementation: str | None = field(
        default=None,
        metadata={
            "help": "The KV cache of the `generate` engines (`GenerationConfig.cache_implementation`, e.g. 'static', "
            "'offloaded'). Set, it makes rollout_engine='auto' choose 'generate' (grpo_hf's engines keep their own "
            "cache). None: the engines' own."
        },
    )
    use_transformers_continuous_batching: bool = field(
        default=False,
        metadata={
            "help": "Sample with transformers' continuous batching (`model.generate_batch`, paged attention): the "
            "same as rollout_engine='continuous_batching'."
        },
    )
    transformers_continuous_batching_config: dict[str, Any] | str | None = field(
        default=None,
        metadata={
            "help": "Keyword arguments of transformers' `ContinuousBatchingConfig` for the continuous_batching engine "
            "(max_memory_percent defaults to 0.5, as in TRL, to leave memory for training)."
        },
    )
    use_transformers_paged: bool = field(
        default=False,
        metadata={"help": "Deprecated alias of use_transformers_continuous_batching (TRL deprecates it too)."},
    )
    merge_lora_for_generation: bool = field(
        default=True,
        metadata={
            "help": "With LoRA, grpo_hf's own engines (all but vLLM) sample with each adapted Linear layer computing "
            "one matmul with a copy of its weight plus the adapters' deltas (in the weight's dtype; memory: one copy "
            "of the adapted weights), refreshed before the first rollout after each optimizer step; the base weights "
            "and the training forwards are unchanged. DoRA, non-Linear and quantized layers, and sharded models "
            "(FSDP, ZeRO-3) keep PEFT's layers; the log says which. False: PEFT's layers throughout."
        },
    )
    ds3_gather_for_generation: bool = field(
        default=True,
        metadata={
            "help": "DeepSpeed ZeRO-3: gather the whole model once per rollout before sampling (fast, needs the "
            "whole model's memory on each process). False: sample with the partitioned model through the "
            "'generate' engine (whose processes decode in step), each layer gathered as it runs: slow, for models "
            "that do not fit one device. vLLM's weight push gathers the weights either way."
        },
    )
    logprob_chunk_size: int | None = field(
        default=None,
        metadata={
            "help": "Token positions per chunk when turning logits into log-probs and entropy. `None`: as many as "
            "fit 2^23 logits (32 MiB in fp32) off CUDA; on CUDA, as many as fit 1/256 of the memory available, "
            "between 2^23 and 2^28 logits (fewer, larger kernels)."
        },
    )

    # ---- precision --------------------------------------------------------------------------------
    fp32_master_weights: bool = field(
        default=True,
        metadata={
            "help": "When trainable weights are bf16/fp16 (a model loaded with dtype=bfloat16) and DeepSpeed does not "
            "manage precision: the optimizer updates fp32 master copies and writes them back, rounded, after each "
            "step. Without them most updates at RL learning rates round away (one AdamW step at lr 1e-5 changes 2 in "
            "100 of a bf16 model's weights). Costs 4 bytes per trainable parameter. False: update the bf16 weights "
            "directly."
        },
    )
    lost_update_check_steps: int = field(
        default=50,
        metadata={
            "help": "At the first optimizer step and every N steps after, measure on sampled elements the fraction of "
            "updates lost to rounding (value unchanged, gradient non-zero), logged as `precision/lost_updates`. 0: "
            "never (the prediction before training is still made)."
        },
    )
    lost_update_threshold: float = field(
        default=0.1,
        metadata={"help": "Lost-update fraction (measured, or predicted before training) above which to warn/raise."},
    )
    on_lost_updates: LostUpdateAction = field(
        default="warn",
        metadata={"help": "'warn' (log a warning that says how to fix it) or 'raise' when the threshold is exceeded."},
    )
    on_nonfinite: NonFiniteAction = field(
        default="raise",
        metadata={
            "help": "A NaN/inf advantage, loss or gradient norm: 'raise' stops training before the weights change, "
            "naming the cause; 'skip_step' drops that optimizer step's update (logged as nonfinite/skipped_steps)."
        },
    )
    fault_timeout: float | None = field(
        default=120.0,
        metadata={
            "help": "In a multi-process run, how many seconds each training process waits for a peer whose "
            "heartbeat stopped (killed, its node lost, hung), or for the launcher's store on the main node, before "
            "it exits with code 69, naming that peer (node, host, pid). Independent of ddp_timeout, which bounds one "
            "collective and should stay long (checkpoint saves, weight pushes). `None`: no watchdog "
            "(docs/distributed.md)."
        },
    )

    # ---- logging ----------------------------------------------------------------------------------
    log_completions: bool = field(
        default=False,
        metadata={
            "help": "At every log, in training (the latest rollout) and evaluation: print a table of prompt / "
            "completion / rewards / advantage, append the rows to `output_dir/completions.jsonl` and write TRL's "
            "`output_dir/completions/completions_<step>.parquet` (`eval_completions_<step>.parquet`), and send the "
            "table to wandb / trackio when they report."
        },
    )
    num_completions_to_print: int | None = field(
        default=None, metadata={"help": "Rows printed per logging step when log_completions. `None`: all (TRL)."}
    )
    log_unique_prompts: bool = field(
        default=False,
        metadata={
            "help": "With log_completions: the completions table sent to wandb / trackio keeps one row per distinct "
            "prompt (the files keep every row)."
        },
    )
    log_completions_hub_repo: str | None = field(
        default=None,
        metadata={
            "help": "With log_completions: a Hugging Face Hub dataset repository (`user/name`, created if missing, "
            "private per hub_private_repo) that the `completions/*.parquet` files are pushed to at every log."
        },
    )
    log_multimodal: bool = field(
        default=True,
        metadata={
            "help": "With log_completions, keep each row's images with its completion (saved as PNG files under "
            "`output_dir/completion_images/`, their paths in the rows). False: text only."
        },
    )

    def __post_init__(self):
        """Normalise every field once (aliases resolved, JSON text read), then check each group of fields; the
        frozen settings the step reads (`loss_settings()`, `entropy_settings()`, `sampling_correction()`) check
        themselves when built, so a config that builds is one the trainer can run. Each check raises with the fix."""
        self.scale_rewards = {True: "group", False: "none"}.get(self.scale_rewards, self.scale_rewards)
        self.resume_from_checkpoint = normalize_resume(self.resume_from_checkpoint)  # 'true'/'last' -> True
        super().__post_init__()
        for name in DICT_FIELDS:  # JSON text (the command line) read here, once; None -> {}
            setattr(self, name, as_dict(getattr(self, name), name))
        self._check_choices()
        self._check_trl_options()
        self._check_precision_options()
        if self.reward_weights is not None:
            check_reward_weights(self.reward_weights)  # a list of finite numbers
        self._check_sampling()
        self._check_generation_kwargs()
        self._check_loss()
        self._check_rollout_options()
        self._check_liger()
        self._derive_generation_batch()

    def _check_choices(self) -> None:
        """The fields whose value is one of a few names (their `Literal` types); the loss's own are `LossSettings`'."""
        check_choice("scale_rewards", self.scale_rewards, get_args(ScaleRewards))
        check_choice("reward_error_policy", self.reward_error_policy, get_args(RewardErrorPolicy))
        check_choice("on_lost_updates", self.on_lost_updates, get_args(LostUpdateAction))
        check_choice("on_nonfinite", self.on_nonfinite, get_args(NonFiniteAction))
        check_choice("router_replay", self.router_replay, get_args(RouterReplayMode))

    def _check_precision_options(self) -> None:
        """The lost-update check's period and threshold."""
        if self.lost_update_check_steps < 0:
            raise ValueError(f"lost_update_check_steps={self.lost_update_check_steps} must be >= 0 (0: never).")
        if not 0 <= self.lost_update_threshold <= 1:
            raise ValueError(f"lost_update_threshold={self.lost_update_threshold} must be a fraction in [0, 1].")

    def _check_sampling(self) -> None:
        """Group sizes, dynamic sampling's rounds, the sampling settings and the prompt and completion lengths."""
        if self.num_generations < 2:
            raise ValueError(
                f"num_generations={self.num_generations}: GRPO needs at least 2 completions per prompt to compare "
                "them. Set num_generations >= 2."
            )
        if self.num_generations_eval is not None and self.num_generations_eval < 1:
            raise ValueError(f"num_generations_eval={self.num_generations_eval} must be >= 1 (or None).")
        if isinstance(self.dynamic_sampling_max_rounds, bool) or self.dynamic_sampling_max_rounds < 0:
            raise ValueError(
                f"dynamic_sampling_max_rounds={self.dynamic_sampling_max_rounds!r} must be an int >= 0: the extra "
                "generation rounds dynamic sampling may make per generation batch (0: drop, never refill)."
            )
        self._check_temperature()
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1].")
        if self.top_k < -1:
            raise ValueError(f"top_k={self.top_k} must be >= 1 to keep that many tokens, or 0 or -1 for no top-k.")
        if self.num_iterations < 1:
            raise ValueError(f"num_iterations={self.num_iterations} must be >= 1.")
        if self.max_completion_length < 1:
            raise ValueError(f"max_completion_length={self.max_completion_length} must be >= 1.")
        if self.max_prompt_length is not None and self.max_prompt_length < 1:
            raise ValueError(f"max_prompt_length={self.max_prompt_length} must be >= 1 (or None for no limit).")
        if self.max_tool_calling_iterations is not None and self.max_tool_calling_iterations < 0:
            raise ValueError(
                f"max_tool_calling_iterations={self.max_tool_calling_iterations} must be >= 0 (or None for no limit)."
            )
        if self.tool_timeout is not None and not self.tool_timeout > 0:
            raise ValueError(f"tool_timeout={self.tool_timeout} must be > 0 seconds (or None for no limit).")
        meaning = "how many optimizer steps older than the trained policy the weights that sampled a batch may be"
        _check_int("max_staleness", self.max_staleness, 0, f"{meaning} (0: synchronous GRPO)")

    def _check_temperature(self) -> None:
        """temperature > 0, and a warning when it is so low that the groups and the log-probs degenerate."""
        if self.temperature <= 0:
            raise ValueError(
                f"temperature={self.temperature} must be > 0: GRPO samples its groups. For greedy decoding in "
                "evaluation use the recipe's evaluation; for training use e.g. temperature=1.0."
            )
        if self.temperature < LOW_TEMPERATURE:
            logger.warning(
                f"temperature={self.temperature} is close to 0: sampling is all but greedy, so the completions of a "
                "group come out (nearly) the same, their rewards equal and their advantages 0, and the log-probs of "
                f"logits / {self.temperature} are degenerate (about 0 or -inf), which makes the importance ratios "
                "meaningless. GRPO learns from sampled groups: use a temperature around 0.6-1.0 (1.0 is the default)."
            )

    def _check_generation_kwargs(self) -> None:
        """`generation_kwargs`: real `GenerationConfig` fields only, and none that undoes what GRPO relies on
        (sampling, one completion per row, this config's temperature and max_completion_length, which the log-probs
        and the loss use)."""
        fields = {name for name in vars(GenerationConfig()) if not name.startswith("_")}
        kwargs = self.generation_kwargs
        for key in kwargs:
            if key not in fields:
                close = difflib.get_close_matches(key, sorted(fields), n=1)
                hint = f"Did you mean {close[0]!r}? " if close else ""
                raise ValueError(
                    f"generation_kwargs has {key!r}, which is not a GenerationConfig field, so it would be ignored. "
                    f"{hint}Valid names: transformers.GenerationConfig's attributes."
                )
        for key, name in (("temperature", "temperature"), ("max_new_tokens", "max_completion_length")):
            if key in kwargs and kwargs[key] != getattr(self, name):
                raise ValueError(
                    f"generation_kwargs[{key!r}]={kwargs[key]!r} differs from {name}={getattr(self, name)!r}: the "
                    f"log-probs and the loss use {name}, so set it in the config ({name}={kwargs[key]!r}) and drop "
                    "the key."
                )
        if kwargs.get("do_sample", True) is False:
            raise ValueError(
                "generation_kwargs['do_sample']=False decodes greedily, so the G completions of a prompt are "
                "identical and GRPO learns nothing from them. Remove it (sampling is on), and set temperature / top_p "
                "instead."
            )
        if kwargs.get("num_return_sequences", 1) != 1:
            raise ValueError(
                f"generation_kwargs['num_return_sequences']={kwargs['num_return_sequences']!r}: the trainer samples "
                "one completion per row and repeats each prompt num_generations times. Set num_generations instead."
            )

    def _check_loss(self) -> None:
        """Build the loss and entropy settings once (they raise for impossible ones) and log their warnings."""
        for message in [*self.loss_settings().warnings(), *self.entropy_settings().warnings()]:
            logger.warning(message)

    def _check_rollout_options(self) -> None:
        """The reward timeout, the log-prob chunk size, the rollout engine (and its aliases) and vLLM's fields."""
        if self.reward_timeout is not None and self.reward_timeout <= 0:
            raise ValueError(f"reward_timeout={self.reward_timeout} must be > 0 seconds (or None for no limit).")
        if self.fault_timeout is not None and not self.fault_timeout >= 10:
            raise ValueError(
                f"fault_timeout={self.fault_timeout} must be >= 10 seconds (how long a silent peer process is waited "
                "for; processes beat every 2 s), or None for no watchdog."
            )
        if self.logprob_chunk_size is not None and self.logprob_chunk_size < 1:
            raise ValueError(f"logprob_chunk_size={self.logprob_chunk_size} must be >= 1.")
        if not self.episode_cache_gb >= 0:
            raise ValueError(
                f"episode_cache_gb={self.episode_cache_gb} must be >= 0 GiB (0: keep no episode's cache)."
            )
        self._resolve_engine_aliases()
        self.check_vllm()  # use_vllm=True: rollout_engine="vllm"
        from grpo_hf.rollout.engine import ENGINES  # the engine registry (rollout imports nothing of the config)

        if self.rollout_engine != "auto" and self.rollout_engine not in ENGINES:
            raise ValueError(
                f"rollout_engine={self.rollout_engine!r} is not one of {['auto', *ENGINES]} (register more with "
                "grpo_hf.rollout.register_engine)."
            )
        if self.auto_find_batch_size:
            raise ValueError(
                "auto_find_batch_size=True would shrink the batch below whole groups of num_generations. Set it to "
                "False and lower per_device_train_batch_size instead."
            )

    def _check_liger(self) -> None:
        """`use_liger_kernel` as in TRL: Liger's layer kernels (RMSNorm, SwiGLU, RoPE, ...) only. Its fused linear
        cross-entropy, part of transformers' default patching, replaces the model's forward, which would compute a
        loss GRPO does not use and skip the LM head grpo_hf runs only at completion positions: refused."""
        if not self.use_liger_kernel:
            return
        settings = as_dict(self.liger_kernel_config, "liger_kernel_config")
        if settings.get("fused_linear_cross_entropy"):
            raise ValueError(
                'liger_kernel_config={"fused_linear_cross_entropy": True} replaces the model\'s forward with a '
                "cross-entropy loss, which GRPO does not use (it needs the completion tokens' log-probs). Leave it "
                "out: use_liger_kernel=True then applies Liger's layer kernels only, as TRL does."
            )
        self.liger_kernel_config = {**settings, "fused_linear_cross_entropy": False}
        if importlib.util.find_spec("liger_kernel") is None or self.use_cpu:
            raise ImportError(
                "use_liger_kernel=True needs the liger-kernel package and a GPU (its kernels are Triton kernels): "
                "`pip install liger-kernel` on a GPU machine, or set use_liger_kernel=False (the loss is the same "
                "without it)."
            )

    def _resolve_engine_aliases(self) -> None:
        """TRL's switches for an engine (`use_model_generate`, `use_transformers_continuous_batching` and its
        deprecated alias `use_transformers_paged`) become `rollout_engine`; `cache_implementation` makes 'auto' pick
        'generate'. The continuous-batching settings are read once, here."""
        if self.use_transformers_paged:
            warnings.warn(
                "use_transformers_paged is deprecated (as in TRL 1.16): use use_transformers_continuous_batching.",
                FutureWarning,
                stacklevel=3,
            )
            self.use_transformers_continuous_batching = True
        aliases = [("use_model_generate", "generate"), ("use_transformers_continuous_batching", "continuous_batching")]
        wanted = [(flag, engine) for flag, engine in aliases if getattr(self, flag)]
        if len(wanted) > 1:
            raise ValueError(
                f"{' and '.join(f'{flag}=True' for flag, _ in wanted)} ask for different rollout engines: keep one."
            )
        for flag, engine in wanted:
            if self.rollout_engine not in ("auto", engine):
                raise ValueError(
                    f"{flag}=True asks for rollout_engine={engine!r} but rollout_engine={self.rollout_engine!r} is "
                    "set too. Keep only rollout_engine."
                )
            self.rollout_engine = engine
        if self.cache_implementation is not None and self.rollout_engine == "auto":
            self.rollout_engine = "generate"  # the engine that has a `cache_implementation`

    def _derive_generation_batch(self) -> None:
        """The generation batch: one rollout serves `steps_per_generation` micro-batches, and holds whole groups."""
        global_batch = self.per_device_train_batch_size * self.world_size
        if self.generation_batch_size is not None and self.steps_per_generation is not None:
            raise ValueError(
                "generation_batch_size and steps_per_generation are both set; set only one of them (the other is "
                "derived from per_device_train_batch_size x num_processes)."
            )
        if self.generation_batch_size is not None:
            if self.generation_batch_size % global_batch != 0:
                raise ValueError(
                    f"generation_batch_size={self.generation_batch_size} must be a multiple of "
                    f"per_device_train_batch_size x num_processes = {global_batch}."
                )
            self.steps_per_generation = self.generation_batch_size // global_batch
        else:
            if self.steps_per_generation is None:
                self.steps_per_generation = self.gradient_accumulation_steps
            if self.steps_per_generation < 1:
                raise ValueError(f"steps_per_generation={self.steps_per_generation} must be >= 1.")
            self.generation_batch_size = global_batch * self.steps_per_generation
        if self.generation_batch_size % self.num_generations != 0:
            raise ValueError(
                f"The generation batch ({self.generation_batch_size} completions = per_device_train_batch_size "
                f"{self.per_device_train_batch_size} x {self.world_size} processes x steps_per_generation "
                f"{self.steps_per_generation}) is not divisible by num_generations={self.num_generations}, so it "
                "cannot hold whole groups. Change per_device_train_batch_size, gradient_accumulation_steps / "
                "steps_per_generation, or num_generations."
            )

    def _check_trl_options(self) -> None:
        """Checks of multi_objective_aggregation, sync_ref_model and pad_to_multiple_of (the CLI gives it as text)."""
        check_choice(
            "multi_objective_aggregation", self.multi_objective_aggregation, get_args(MultiObjectiveAggregation)
        )
        if self.multi_objective_aggregation == "normalize_then_sum" and self.scale_rewards != "group":
            logger.warning(
                f"scale_rewards={self.scale_rewards!r} does not apply with multi_objective_aggregation="
                "'normalize_then_sum': each reward is normalised by its group std and the sum by the batch std (TRL)."
            )
        if not 0.0 <= self.ref_model_mixup_alpha <= 1.0:
            raise ValueError(f"ref_model_mixup_alpha={self.ref_model_mixup_alpha} must be in [0, 1].")
        if isinstance(self.ref_model_sync_steps, bool) or self.ref_model_sync_steps < 1:
            raise ValueError(f"ref_model_sync_steps={self.ref_model_sync_steps!r} must be an int >= 1.")
        if self.sync_ref_model and self.beta == 0.0:
            raise ValueError(
                "sync_ref_model=True with beta=0.0: no reference model is built or used, so there is nothing to "
                "synchronize. Set beta > 0, or sync_ref_model=False."
            )
        if isinstance(self.pad_to_multiple_of, str) and self.pad_to_multiple_of != "auto":
            text = self.pad_to_multiple_of.strip().lower()
            self.pad_to_multiple_of = None if text in ("none", "null") else int(text)
        if self.pad_to_multiple_of not in ("auto", None) and (
            isinstance(self.pad_to_multiple_of, bool) or self.pad_to_multiple_of < 1
        ):
            raise ValueError(f"pad_to_multiple_of={self.pad_to_multiple_of!r} must be an int >= 1, 'auto' or None.")

    def model_load_kwargs(self) -> dict[str, Any]:
        """`from_pretrained` keyword arguments for the policy and reference model: `model_init_kwargs`, with
        `trust_remote_code` from this config unless they set it (TRL)."""
        return {"trust_remote_code": self.trust_remote_code, **self.model_init_kwargs}

    def generation_config_for(self, pad_token_id: int, eos_token_ids: list[int]) -> GenerationConfig:
        """The rollouts' `GenerationConfig`: this config's sampling settings, then `generation_kwargs` over them."""
        settings = {
            "max_new_tokens": self.max_completion_length,
            "do_sample": True,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "pad_token_id": pad_token_id,
            "eos_token_id": eos_token_ids,
            "use_cache": True,
            "cache_implementation": self.cache_implementation,
        }
        return GenerationConfig(**{**settings, **self.generation_kwargs})

    def loss_settings(self) -> LossSettings:
        """The loss's settings (`core.LossSettings`, this config's fields of the same names), frozen and checked when
        built. `__post_init__` builds them once to check them; the trainer builds them once more when it is
        constructed (so a field set between the two counts) and hands them to the objective."""
        return LossSettings(**{name: getattr(self, name) for name in LossSettings.field_names()})

    def entropy_settings(self) -> EntropySettings:
        """The entropy terms' settings (`core.EntropySettings`, same names), frozen and checked when built."""
        return EntropySettings(**{f.name: getattr(self, f.name) for f in dataclasses.fields(EntropySettings)})

    @classmethod
    def from_trl_defaults(cls, **kwargs) -> GRPOConfig:
        """A config that starts from TRL's `GRPOConfig` defaults (`TRL_DEFAULTS`) where grpo_hf's differ; `kwargs`
        override them as usual. Use it to port a TRL script that relies on TRL's defaults. bf16 follows TRL's rule
        where this machine can run it (`with_trl_precision`)."""
        return cls(**with_trl_precision(TRL_DEFAULTS, kwargs))

    def __new__(cls, *args, **kwargs):
        """Records the fields the caller passed (`_fields_given`), so that a field set to grpo_hf's value on purpose
        is not reported as a default left (`defaults_differing_from_trl`). HfArgumentParser and `dataclasses.replace`
        pass every field: then which ones were chosen is unknown (None), and only the values tell."""
        config = super().__new__(cls)
        names = [f.name for f in dataclasses.fields(cls) if f.init]
        given = set(names[: len(args)]) | set(kwargs)
        config._fields_given = None if given >= set(names) else frozenset(given)
        return config

    def defaults_differing_from_trl(self) -> list[str]:
        """`name=value (TRL: value)` for every field left at grpo_hf's default where TRL's default differs
        (`TRL_DEFAULTS`; `defaults_left_differing`)."""
        return defaults_left_differing(self, TRL_DEFAULTS)

    def log_defaults_differing_from_trl(self) -> None:
        """Called once by the trainer when it is built: one warning naming `defaults_differing_from_trl()`, so that a
        ported TRL script's different behaviour is seen (`warn_defaults_differing`)."""
        warn_defaults_differing(self.defaults_differing_from_trl(), "GRPOConfig")


def with_trl_precision(trl_defaults: Mapping[str, Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """`trl_defaults` then `kwargs`, with TRL's bf16 unless `kwargs` set it: on unless fp16 is set, and off, with a
    warning saying why, where this machine cannot run it: no bf16-capable accelerator and not `use_cpu`, which
    `TrainingArguments` refuses ("Your setup doesn't support bf16/gpu"; TRL's own default fails there)."""
    settings = {**trl_defaults, **kwargs}
    if "bf16" in kwargs:
        return settings
    settings["bf16"] = not settings.get("fp16", False)
    if settings["bf16"] and not settings.get("use_cpu", False) and not bf16_accelerator_available():
        settings["bf16"] = False
        logger.warning(
            "from_trl_defaults: bf16=False, not TRL's bf16=True: this machine has no accelerator that runs bfloat16 "
            "(TrainingArguments refuses bf16 there unless use_cpu=True), so the run is float32. Pass use_cpu=True "
            "to keep bf16 on the CPU, or bf16=False to choose float32 without this warning."
        )
    return settings


def bf16_accelerator_available() -> bool:
    """Whether `TrainingArguments` takes bf16=True without use_cpu: a GPU (or other accelerator) that runs bfloat16."""
    from transformers.utils import is_torch_bf16_gpu_available, is_torch_xla_available

    return is_torch_bf16_gpu_available() or is_torch_xla_available()


def defaults_left_differing(config: GRPOConfig, trl_defaults: Mapping[str, Any]) -> list[str]:
    """`name=value (TRL: value)` for each field of `trl_defaults` that `config` leaves at a grpo_hf default that
    differs from TRL's: its value is grpo_hf's default and it was not passed to the constructor (a field passed is a
    choice, even at grpo_hf's value; when every field was passed, as HfArgumentParser does, only the values tell)."""
    ours = {f.name: _USED_AS.get(f.name, f.default) for f in dataclasses.fields(config)}
    given = getattr(config, "_fields_given", None) or frozenset()
    return [
        f"{name}={getattr(config, name)!r} (TRL: {trl!r})"
        for name, trl in trl_defaults.items()
        if name not in given and getattr(config, name) == ours[name] and getattr(config, name) != trl
    ]


def warn_defaults_differing(differing: list[str], config_name: str) -> None:
    """The warning (once per trainer built) naming the fields `differing` left at grpo_hf defaults that differ from
    those of TRL's `config_name`, and how to keep or change them; nothing when there are none."""
    if differing:
        logger.warning(
            "Defaults that differ from TRL's %s, left at grpo_hf's value: %s. A TRL script ported by changing its "
            "import behaves differently there (docs/porting.md says why each differs). Pass a field to keep "
            "grpo_hf's value without this warning, or build the config with %s.from_trl_defaults(...) to start "
            "from TRL's.",
            config_name,
            ", ".join(differing),
            config_name,
        )


# TRL 1.16's GRPOConfig defaults where grpo_hf's differ (the class docstring says why ours differ).
TRL_DEFAULTS: dict[str, Any] = {
    "loss_type": "dapo",
    "beta": 0.0,
    "disable_dropout": False,
    "max_completion_length": 512,
    "use_bias_correction_kl": True,
    "logging_steps": 10,
    "gradient_checkpointing": True,
    "bf16": True,  # TRL: True unless fp16 is set (`from_trl_defaults`: and where the machine runs bf16)
    "logging_nan_inf_filter": True,  # TrainingArguments' default
}

# Fields declared None whose None `TrainingArguments` resolves when the config is built: the default as used.
_USED_AS: dict[str, Any] = {"gradient_checkpointing": False}

# TRL 1.16's GRPOConfig fields and GRPOTrainer arguments that grpo_hf does not take (yet), with the reason: the
# one table of differences besides the defaults above (docs/porting.md shows both; tests/test_trl_dropin.py reads
# the installed TRL and fails on any other difference).
TRL_DIFFERENCES: dict[str, str] = {}


def check_reward_weights(weights: Any) -> None:
    """`reward_weights`: a list of finite real numbers (the count is checked against the functions by the trainer)."""
    if isinstance(weights, (str, bytes, Mapping)) or not isinstance(weights, Sequence):
        raise TypeError(
            f"reward_weights={weights!r} must be a list with one number per reward function, e.g. [1.0, 0.5]."
        )
    for k, weight in enumerate(weights):
        if isinstance(weight, bool) or not isinstance(weight, numbers.Real):
            raise TypeError(
                f"reward_weights[{k}]={weight!r} is {with_article(type(weight).__name__)}; every weight must be a "
                "number, e.g. reward_weights=[1.0, 0.5]."
            )
    if not all(math.isfinite(float(weight)) for weight in weights):
        raise ValueError(
            f"reward_weights={list(weights)} has a non-finite entry: every weight must be a finite number "
            "(0 turns a reward function off)."
        )


def config_reference_markdown(cls: type | None = None) -> str:
    """The README's config reference: one row per field of `cls` itself (default GRPOConfig; its base classes'
    fields are not repeated: TrainingArguments', and VLLMArguments', whose table is in docs/vllm.md)."""
    cls = cls or GRPOConfig
    rows = ["| field | default | meaning |", "|---|---|---|"]
    for f in dataclasses.fields(cls):
        if f.name not in cls.__annotations__:
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        rows.append(f"| `{f.name}` | `{default!r}` | {f.metadata['help']} |")
    return "\n".join(rows)


if __name__ == "__main__":  # python -m grpo_hf.config  -> the README's config table
    print(config_reference_markdown())


def config_or_default(args: GRPOConfig | None, model) -> GRPOConfig:
    """`args`, checked to be a GRPOConfig, or TRL's default when None: output_dir `<model name>-GRPO`."""
    if args is None:
        name = model if isinstance(model, str) else model.config._name_or_path
        args = GRPOConfig(output_dir=f"{os.path.basename(str(name)) or 'model'}-GRPO")
    if not isinstance(args, GRPOConfig):
        raise TypeError(f"args must be a GRPOConfig, got {type(args).__name__}.")
    return args


def _check_int(name: str, value: Any, minimum: int | None, meaning: str) -> None:
    """`value` is an int (not a bool) >= `minimum` (None: any int); the message says what the field counts."""
    if isinstance(value, bool) or not isinstance(value, int) or (minimum is not None and value < minimum):
        bound = f" >= {minimum}" if minimum is not None else ""
        raise ValueError(f"{name}={value!r} must be an int{bound}: {meaning}.")
