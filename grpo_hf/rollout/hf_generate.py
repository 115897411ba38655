"""The `generate` and `generate_static` engines: `model.generate`, for every model and setting.

`generate` calls `model.generate` with the trainer's generation config as it is (a user's
`cache_implementation` included). `generate_static` asks for a static KV cache, which transformers
compiles the decode step for on CUDA (about 4x faster than the dynamic cache for small models, after a
one-time compile). Both build the static cache themselves (`static_cache`): transformers' own allocates
the values in the keys' dtype, which fails under autocast with fp32 weights, where rotary embeddings
leave the keys fp32 and the values bf16. Its length is rounded up to `cache_bucket` positions, so that
batches whose prompts differ a little in length reuse one compiled decode step (every new length would
compile again, and past Dynamo's recompile limit generate's step runs uncompiled).

`generate` draws through the sampling spec (`sampling_spec.SamplingSpec`): its stage (repetition penalty, n-grams,
bad words, biases, suppressed and blocked tokens) is the first logits processor, and the config `generate` gets has
those settings off (`neutral_generation_config`), also where the model's own `generation_config` sets them (which
`generate` merges into the config it is given, and which the spec reads: `StageOffConfig`), so `generate` applies only
its warpers and each stage setting runs once; what it samples is what the correction replays, on every transformers
version.

Given `draws` (tool episodes, `episodes.EpisodeRunner`), each row draws its tokens from its own random stream instead
of the global generator (`sampling.DrawFromStreams`, a logits processor that draws and leaves `generate` one token).

With `record_logps`, a logits processor placed before the draw (`sampling.RecordLogps`) applies the sampling warpers
to a copy of the scores and keeps the log-prob of each drawn token (no `output_scores`: it holds one [N, V] row set).
With `record_routes` (an MoE policy), the routers' top-k of every forward `generate` runs are recorded
(`routers.recording`): its rows are never reordered, so they are the prompts' routes then each fed token's, in order.
"""

from __future__ import annotations

import copy

import torch
from transformers import LogitsProcessorList, StaticCache
from transformers.cache_utils import StaticLayer

from grpo_hf.rollout.engine import RolloutEngine
from grpo_hf.rollout.routes import recording_steps
from grpo_hf.rollout.sampling import (
    DrawFromStreams,
    RecordLogps,
    resolve_sampling_settings,
    streams_unsupported_reason,
)
from grpo_hf.rollout.sampling_spec import SamplingSpec, neutral_generation_config
from grpo_hf.vision import forward_kwargs


class _OwnValueDtypeLayer(StaticLayer):
    """A `StaticLayer` whose values buffer takes the values' dtype, not the keys'."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        if self.values.dtype != value_states.dtype:
            self.values = torch.zeros_like(self.values, dtype=value_states.dtype)
            if not torch.compiler.is_compiling():
                torch._dynamo.mark_static_address(self.values)


def static_cache(config, max_cache_len: int) -> StaticCache:
    """transformers' `StaticCache` for `config`, whose full-attention layers keep keys and values in their own
    dtypes (sliding-window layers are left as transformers makes them)."""
    cache = StaticCache(config=config, max_cache_len=max_cache_len)
    cache.layers = [
        _OwnValueDtypeLayer(max_cache_len=max_cache_len) if type(layer) is StaticLayer else layer
        for layer in cache.layers
    ]
    return cache


class GenerateEngine(RolloutEngine):
    """`model.generate` with the trainer's generation config."""

    name = "generate"
    takes_images = True
    takes_draws = True
    can_record_logps = True
    can_record_routes = True
    cache_implementation: str | None = None  # None: the generation config's own
    cache_bucket = 64  # a static cache's length is rounded up to a multiple of this

    def sample(
        self, model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, images=None, draws=None
    ) -> torch.Tensor:
        """`draws` (`sampling.RowDraws`): each row draws from its own stream (`DrawFromStreams`), where the settings
        allow (`streams_unsupported_reason`; otherwise, and without `draws`, from the global generator)."""
        config = self.generation_config
        kwargs = forward_kwargs(model, prompt_ids, images)  # a VLM's image inputs, row by row
        spec = SamplingSpec.of(model, config, blocked_token_ids=self.blocked_token_ids)  # blocked: never drawn
        processors, record = LogitsProcessorList([spec.processors(prompt_mask, sampling=False)[0]]), None
        if self.record_logps:
            reason = streams_unsupported_reason(model, config)
            if reason is not None:
                raise ValueError(
                    f"The {self.name!r} engine cannot record the sampler's log-probs (record_logps) because {reason}; "
                    "sample with temperature, top_k, top_p, min_p and repetition_penalty only."
                )
            record = RecordLogps(resolve_sampling_settings(model, config))
            processors.append(record)  # before the draw: it reads the scores the draw takes
        if draws is not None and streams_unsupported_reason(model, config) is None:
            processors.append(DrawFromStreams(resolve_sampling_settings(model, config), draws.to(prompt_ids.device)))
        kwargs["logits_processor"] = processors
        config = neutral_generation_config(config, spec)  # the spec's stage runs instead of generate's
        if (self.cache_implementation or config.cache_implementation) == "static":
            config = copy.copy(config)
            config.cache_implementation = None
            max_len = -(-(prompt_ids.size(1) + config.max_new_tokens) // self.cache_bucket) * self.cache_bucket
            kwargs["past_key_values"] = static_cache(model.config, max_len)
        completion_ids = self._generate(model, prompt_ids, prompt_mask, config, kwargs)  # [N, T]
        if record is not None and completion_ids.size(1):
            self.sampling_logps = record.logps(completion_ids)
        return completion_ids

    def _generate(self, model, prompt_ids, prompt_mask, config, kwargs) -> torch.Tensor:
        """`model.generate`'s completion ids [N, T]; with `record_routes`, the MoE routes of its forwards (the
        prompts', then one token a row per step but the last) in `sampling_routes`, its step never compiled (a static
        cache on CUDA would be: CUDA graphs overwrite the routers' outputs a hook keeps)."""
        (N, P), T = prompt_ids.shape, config.max_new_tokens
        if self.record_routes:
            config = copy.copy(config)
            config.disable_compile = True
        with recording_steps(model, self.record_routes, N, P + T) as routes:
            output = model.generate(
                input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=config, **kwargs
            )  # [N, P + T]
            if routes is not None:
                routes.prefill(N)
        if routes is not None:
            self.sampling_routes = routes.result(output.size(1))
        return output[:, P:]


class StaticGenerateEngine(GenerateEngine):
    """`model.generate` with a static KV cache: transformers compiles its decode step on CUDA."""

    name = "generate_static"
    cache_implementation = "static"
    # On CUDA its decode step is compiled with CUDA graphs, whose outputs (the routers' indices a hook would keep) the
    # next step overwrites: it records no MoE routes (`engine.ROUTES_REFUSAL`).
    can_record_routes = False

    @classmethod
    def unsupported_reason(cls, model, generation_config) -> str | None:
        if not getattr(model, "_can_compile_fullgraph", False):
            return f"{type(model).__name__} does not support a static, compiled cache"
        if getattr(generation_config, "max_new_tokens", None) is None:
            return "max_new_tokens is not set"
        return None
