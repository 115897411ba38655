"""Reward functions for GRPO: answer verifiers, format checks, code execution, a registry, and the calling machinery.

Every reward function has TRL's signature (docs/design.md ("The public contract"))::

    fn(prompts, completions, completion_ids=None, trainer_state=None, **columns) -> list[float | None]

`prompts`/`completions` are strings, or lists of chat messages when the dataset is conversational; every other
dataset column arrives as a keyword argument holding one value per completion. `None` means "not applicable".

The package, one job per module:

- `answers`: reading final answers and gold answers as exact numbers (`extract_answer`, `extract_gold`,
  `answers_match`): the GSM8K-style numeric verifier.
- `functions`: the built-in rewards (`accuracy`, `format`, `format_gsm8k`, `tag_count`, `soft_overlong_punishment`)
  and the registry (`REWARD_FUNCS`, `REWARD_FACTORIES`, `get_reward_funcs`, `reward_func_name`).
- `calling`: `compute_rewards`, which calls a list of reward functions and enforces the error policy.
- `latex`: `math_accuracy`, LaTeX answers compared by mathematical equivalence (math-verify, in a worker process).
- `sandbox` and `code`: `code` / `code_pass_rate`, the completion's Python run against the row's tests in a
  confined subprocess.
- `reward_models`: a sequence-classification model as a reward function (`RewardModel`); it imports torch and
  transformers, so this package does not import it.

Four modules are programs that run in processes of their own, on the standard library only (the worker adds
math-verify): `sandbox_bootstrap` (sets up one execution's sandbox; run by path), `sandbox_runner` (runs the code and
the tests inside it; its source is sent to the sandbox's interpreter), `sandbox_probe` (the interpreter's directories,
and the checks `Sandbox.check` runs inside a sandbox) and `latex_worker` (math-verify's comparisons, for `latex`; run
by path). Tests import them like any module.

Importing `grpo_hf.rewards` loads only the standard library: no torch, no transformers, no sympy.
"""

from grpo_hf.rewards.answers import answers_match, completion_text, extract_answer, extract_gold, parse_number
from grpo_hf.rewards.calling import compute_rewards, needs_main_thread
from grpo_hf.rewards.code import CodeReward, extract_code, make_code_pass_rate_reward, make_code_reward
from grpo_hf.rewards.functions import (
    REWARD_FACTORIES,
    REWARD_FUNCS,
    AccuracyReward,
    SoftOverlongPunishment,
    accuracy_reward,
    format_reward,
    get_reward_funcs,
    gsm8k_format_reward,
    is_reward_func_name,
    make_accuracy_reward,
    names_a_reward_model,
    reward_func_name,
    soft_overlong_punishment,
    tag_count_reward,
)
from grpo_hf.rewards.latex import (
    MathAccuracyReward,
    extract_latex_answer,
    extract_latex_gold,
    make_math_accuracy_reward,
)
from grpo_hf.rewards.sandbox import ExecutionResult, Sandbox, SandboxError, SandboxLimits, SandboxUnavailableError

__all__ = [
    "REWARD_FACTORIES",
    "REWARD_FUNCS",
    "AccuracyReward",
    "CodeReward",
    "ExecutionResult",
    "MathAccuracyReward",
    "Sandbox",
    "SandboxError",
    "SandboxLimits",
    "SandboxUnavailableError",
    "SoftOverlongPunishment",
    "accuracy_reward",
    "answers_match",
    "completion_text",
    "compute_rewards",
    "extract_answer",
    "extract_code",
    "extract_gold",
    "extract_latex_answer",
    "extract_latex_gold",
    "format_reward",
    "get_reward_funcs",
    "gsm8k_format_reward",
    "is_reward_func_name",
    "make_accuracy_reward",
    "names_a_reward_model",
    "needs_main_thread",
    "make_code_pass_rate_reward",
    "make_code_reward",
    "make_math_accuracy_reward",
    "parse_number",
    "reward_func_name",
    "soft_overlong_punishment",
    "tag_count_reward",
]
