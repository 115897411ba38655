"""grpo_hf: Group Relative Policy Optimization on top of `transformers.Trainer`.

The public names are imported lazily, so `import grpo_hf.core` pulls in torch only, and
`import grpo_hf.rewards` pulls in no model code.
"""

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_EXPORTS = {
    "AsyncGRPOConfig": "grpo_hf.async_config",
    "AsyncGRPOTrainer": "grpo_hf.async_trainer",
    "GRPOConfig": "grpo_hf.config",
    "GRPOTrainer": "grpo_hf.trainer",
    "REWARD_FUNCS": "grpo_hf.rewards",
    "get_reward_funcs": "grpo_hf.rewards",
    "extract_answer": "grpo_hf.rewards",
    "accuracy_reward": "grpo_hf.rewards",
    "format_reward": "grpo_hf.rewards",
    "tag_count_reward": "grpo_hf.rewards",
    "soft_overlong_punishment": "grpo_hf.rewards",
    "gsm8k_format_reward": "grpo_hf.rewards",
    "make_accuracy_reward": "grpo_hf.rewards",
    "compute_rewards": "grpo_hf.rewards",
    "offline_model_path": "grpo_hf.offline_model",
}

__all__ = [
    "AsyncGRPOConfig",
    "AsyncGRPOTrainer",
    "GRPOConfig",
    "GRPOTrainer",
    "REWARD_FUNCS",
    "accuracy_reward",
    "compute_rewards",
    "extract_answer",
    "format_reward",
    "get_reward_funcs",
    "gsm8k_format_reward",
    "make_accuracy_reward",
    "offline_model_path",
    "soft_overlong_punishment",
    "tag_count_reward",
]

if TYPE_CHECKING:  # pragma: no cover
    from grpo_hf.async_config import AsyncGRPOConfig
    from grpo_hf.async_trainer import AsyncGRPOTrainer
    from grpo_hf.config import GRPOConfig
    from grpo_hf.offline_model import offline_model_path
    from grpo_hf.rewards import (
        REWARD_FUNCS,
        accuracy_reward,
        compute_rewards,
        extract_answer,
        format_reward,
        get_reward_funcs,
        gsm8k_format_reward,
        make_accuracy_reward,
        soft_overlong_punishment,
        tag_count_reward,
    )
    from grpo_hf.trainer import GRPOTrainer


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'grpo_hf' has no attribute {name!r}")
