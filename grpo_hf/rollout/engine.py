"""Rollout engines: one interface, a registry by name, and the `"auto"` choice.

An engine turns prompt rows into sampled completions::

    engine = make_engine("auto", model, generation_config, eos_token_ids)   # -> (engine, why)
    completion_ids, completion_mask, is_truncated = engine.generate(model, prompt_ids, prompt_mask)
    engine.on_weights_updated(model)      # after each optimizer step (engines that keep state)

With `engine.record_logps = True` (engines whose `can_record_logps`; `make_engine(record_logps=True)` picks one),
each `generate` call also leaves `engine.sampling_logps` [N, T] float32, on the completion ids' device: the log of the
probability each completion token was drawn with, after temperature, repetition penalty and truncation (top-k, top-p,
min-p), 0 off the completion mask; the behaviour policy of an off-policy correction. Off (the default), it is None
and the engines do no extra work: the tokens sampled are the same either way.

With `engine.record_routes = True` (engines whose `can_record_routes`: `loop`, `generate`, vLLM where it can;
`make_engine(record_routes=True)` picks one, for routing replay), each call of an MoE model also leaves
`engine.sampling_routes` [N, P + T, L, k] (`routes.ROUTE_DTYPE`), aligned with cat(prompt_ids, completion_ids): the
top-k experts of every token the policy read, -1 on padding, a completion's last token and what follows it
(`rollout.routes`). `continuous_batching` packs requests into one flat row, `cuda_graph`'s captured step runs no
Python hook and `generate_static`'s compiled one replays CUDA graphs: they record none (`ROUTES_REFUSAL`).

Engines live in their own modules and are imported only when chosen (`ENGINES` maps a name to
"module:Class"; `register_engine` adds one). Each engine says why it does not apply to a model and
settings (`unsupported_reason`); `"auto"` walks a chain of engines and takes the first that applies:

- on CUDA: `cuda_graph` -> `generate_static` (`model.generate` with a static, compiled cache) -> `loop`
  -> `generate`;
- elsewhere: `loop` -> `generate`.

A named engine that does not apply falls back along the same chain from its own position, and the line
`make_engine` returns says so. `generate` (plain `model.generate`) applies to every model.
"""

from __future__ import annotations

import copy
import importlib
from collections.abc import Sequence
from typing import NamedTuple

import torch

from grpo_hf.rollout.prompts import completion_mask
from grpo_hf.rollout.routes import masked, read_mask, realign

# What an engine that cannot record MoE routes says when asked to (routing replay), after its name.
ROUTES_REFUSAL = (
    "cannot record the MoE routes routing replay needs (router_replay='r3'): continuous_batching packs every "
    "request into one flat row, cuda_graph's captured decode step runs no Python hook, and generate_static's "
    "compiled step replays CUDA graphs, whose outputs the next step overwrites. Use rollout_engine='loop' or "
    "'generate' (or 'auto', which picks one that records them), or router_replay='r2' (which replays the old "
    "policy's routes and records none in the rollout)."
)


class Completions(NamedTuple):
    completion_ids: torch.Tensor  # [N, T] pad after the first EOS
    completion_mask: torch.Tensor  # [N, T] 1 on real tokens up to and including the first EOS
    is_truncated: torch.Tensor  # [N] bool: no EOS within max_new_tokens


class RolloutEngine:
    """Samples one completion per prompt row. Subclasses implement `sample` (and may `unsupported_reason`).

    `generate` puts the model in eval mode for the call, builds the completion mask and pads after EOS,
    so every engine returns the same thing for the same tokens.
    """

    name = "base"
    takes_images = False  # `sample` takes `images`: each row's image inputs (`grpo_hf.vision`), for VLMs
    # True: `sample` takes `draws` (`sampling.RowDraws`): it draws each row's tokens from the row's own random stream,
    # not from the global generator (tool episodes: what a row samples does not depend on the rows beside it).
    takes_draws = False
    # True: every call samples up to the configured max_new_tokens whatever `generate` is asked (`cuda_graph`: one
    # captured graph per length; a tool episode cuts each turn to its budget instead).
    fixed_length = False
    # True: `sample` runs the policy's own forward in this process, so a LoRA policy decodes through merged copies of
    # its adapted layers (`lora_decode`, applied by the `Sampler`); vLLM, which holds its own weights, sets False.
    decodes_with_model = True
    # True: with `record_logps` on, `sample` sets `self.sampling_logps` [N, T] to the log-probs its tokens were drawn
    # with (vLLM sets them on every call).
    can_record_logps = False
    # True: with `record_routes` on, `sample` sets `self.sampling_routes` [N, P + T, L, k] to the MoE routes of the
    # forwards it ran (`routes.StepRoutes`); `generate` masks what was not read.
    can_record_routes = False

    def __init__(self, generation_config, eos_token_ids: Sequence[int]):
        self.generation_config = generation_config
        self.eos_token_ids = list(eos_token_ids)
        self.blocked_token_ids: list[int] = []  # never sampled (a VLM's image tokens); engines that take images
        # Set by the caller: record the sampler's log-probs of each call's tokens (`sampling_logps`).
        self.record_logps = False
        self.sampling_logps: torch.Tensor | None = None  # [N, T] float32 of the last call; None: not recorded
        # Set by the caller (an MoE policy): record the routes of each call's tokens (`sampling_routes`).
        self.record_routes = False
        self.sampling_routes: torch.Tensor | None = None  # [N, P + T, L, k] of the last call; None: not recorded

    @classmethod
    def unsupported_reason(cls, model, generation_config) -> str | None:
        """Why this engine cannot sample what `model.generate` would for this model and settings; None if it can."""
        return None

    def sample(self, model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> torch.Tensor:
        """Token ids [N, T] sampled after each left-padded prompt row [N, P] (T <= max_new_tokens)."""
        raise NotImplementedError

    def on_weights_updated(self, model) -> None:
        """Called after every optimizer step; engines holding a copy of the weights refresh it here."""

    def close(self) -> None:
        """Release what the engine holds beyond the process (vLLM: its engine and process groups). Idempotent."""

    @torch.no_grad()
    def generate(
        self,
        model,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        max_new_tokens: int | None = None,
        images=None,
        draws=None,
    ) -> Completions:
        """`max_new_tokens`: this call's bound (a tool episode's next turn: what is left of max_completion_length);
        None: the generation config's. `images`: each row's image inputs (`grpo_hf.vision.ImageRow`, None for a
        text-only row), given only to engines that take them (`takes_images`). `draws`: each row's random stream
        (`sampling.RowDraws`), for the engines that take them (`takes_draws`); the others draw from the global
        generator. With `record_logps`, the call's log-probs are left in `sampling_logps` (0 off the completion
        mask); with `record_routes`, its routes in `sampling_routes` (-1 where no token was read)."""
        self._check_recording()
        self.sampling_logps = self.sampling_routes = None
        was_training, config = model.training, self.generation_config
        if max_new_tokens is not None and max_new_tokens != config.max_new_tokens and not self.fixed_length:
            self.generation_config = copy.copy(config)
            self.generation_config.max_new_tokens = max_new_tokens
        model.eval()
        try:
            extra = {"images": images} if images is not None else {}
            if draws is not None and self.takes_draws:
                extra["draws"] = draws
            completion_ids = self.sample(model, prompt_ids, prompt_mask, **extra)  # [N, T]
        finally:
            model.train(was_training)
            self.generation_config = config
        pad = self.generation_config.pad_token_id
        if completion_ids.size(1) == 0:  # the model produced nothing at all
            N, device = prompt_ids.size(0), prompt_ids.device
            completion_ids = torch.full((N, 1), pad, dtype=torch.long, device=device)
            mask = torch.zeros_like(completion_ids)
            if self.record_logps:
                self.sampling_logps = torch.zeros((N, 1), dtype=torch.float32, device=device)
            if self.sampling_routes is not None:  # the prompt's, if the engine ran a forward: no token was read after
                P = prompt_ids.size(1)
                self.sampling_routes = realign(self.sampling_routes, P, P, 1)
                self.sampling_routes = masked(self.sampling_routes, read_mask(prompt_mask, mask))
            return Completions(completion_ids, mask, torch.ones(N, dtype=torch.bool, device=device))
        mask, is_truncated = completion_mask(completion_ids, self.eos_token_ids)
        if self.record_logps:
            self._mask_logps(completion_ids, mask)
        if self.record_routes:
            self._mask_routes(prompt_mask, mask)
        return Completions(completion_ids.masked_fill(mask == 0, pad), mask, is_truncated)

    def _check_recording(self) -> None:
        """Refuse a recording this engine cannot do, by name, with the engines that can."""
        if self.record_logps and not self.can_record_logps:
            raise ValueError(
                f"The {self.name!r} rollout engine does not record the sampler's log-probs, and record_logps=True "
                "asks for them. Use an engine that does (loop, generate, generate_static, cuda_graph, "
                "continuous_batching, vllm), or make_engine(..., record_logps=True), which skips those that do not."
            )
        if self.record_routes and not self.can_record_routes:
            raise ValueError(f"The {self.name!r} rollout engine {ROUTES_REFUSAL}")

    def _mask_routes(self, prompt_mask: torch.Tensor, mask: torch.Tensor) -> None:
        """`sampling_routes` [N, P + T, L, k], -1 where no token was read (`routes.read_mask`); checked against the
        tokens. A model with no MoE layer records nothing (None)."""
        routes = self.sampling_routes
        if routes is None:
            return
        N, P, T = mask.size(0), prompt_mask.size(1), mask.size(1)
        if routes.dim() != 4 or routes.shape[:2] != (N, P + T):
            raise RuntimeError(
                f"The {self.name!r} rollout engine was asked to record its MoE routes (record_routes) and left "
                f"{tuple(routes.shape)} for prompts {tuple(prompt_mask.shape)} and completions {tuple(mask.shape)}: "
                "its `sample` must set `self.sampling_routes` [N, P + T, L, k] when recording."
            )
        self.sampling_routes = masked(routes.to(mask.device), read_mask(prompt_mask, mask))

    def _mask_logps(self, completion_ids: torch.Tensor, mask: torch.Tensor) -> None:
        """`sampling_logps` as float32 on the ids' device, 0 off the completion mask; checked against the ids."""
        logps = self.sampling_logps
        if logps is None or logps.shape != completion_ids.shape:
            raise RuntimeError(
                f"The {self.name!r} rollout engine was asked to record its log-probs (record_logps) and left "
                f"{None if logps is None else tuple(logps.shape)} for completions of shape "
                f"{tuple(completion_ids.shape)}: its `sample` must set `self.sampling_logps` [N, T] when recording."
            )
        logps = logps.to(device=completion_ids.device, dtype=torch.float32)
        self.sampling_logps = logps.masked_fill(mask == 0, 0.0)


ENGINES: dict[str, str | type[RolloutEngine]] = {
    "loop": "grpo_hf.rollout.loop:LoopEngine",
    "generate": "grpo_hf.rollout.hf_generate:GenerateEngine",
    "generate_static": "grpo_hf.rollout.hf_generate:StaticGenerateEngine",
    "cuda_graph": "grpo_hf.rollout.cuda_graph:CUDAGraphEngine",
    "vllm": "grpo_hf.rollout.vllm_engine:VLLMEngine",
    "continuous_batching": "grpo_hf.rollout.continuous_batching:ContinuousBatchingEngine",
}
_CHAINS = {"cuda": ["cuda_graph", "generate_static", "loop", "generate"], "other": ["loop", "generate"]}


def register_engine(name: str, engine: str | type[RolloutEngine]) -> None:
    """Make `rollout_engine=name` use `engine` (a `RolloutEngine` subclass or its "module:Class" path)."""
    ENGINES[name] = engine


def engine_class(name: str) -> type[RolloutEngine]:
    """The engine class registered as `name`, imported on first use."""
    if name not in ENGINES:
        raise ValueError(f"Unknown rollout engine {name!r}; known: {['auto', *ENGINES]}.")
    engine = ENGINES[name]
    if isinstance(engine, str):
        module, _, attr = engine.partition(":")
        engine = ENGINES[name] = getattr(importlib.import_module(module), attr)
    return engine


def make_engine(
    name: str,
    model,
    generation_config,
    eos_token_ids: Sequence[int],
    *,
    sharded: bool = False,
    device: torch.device | None = None,
    blocked_token_ids: Sequence[int] = (),
    record_logps: bool = False,
    record_routes: bool = False,
    **options,
) -> tuple[RolloutEngine, str]:
    """The engine to use, and one line saying which and why (for the log).

    `sharded=True` (FSDP, DeepSpeed ZeRO-3: parameters are gathered anew for each rollout) rules out engines that keep
    references to the weights between calls (`cuda_graph`). `options` go to the chosen engine's constructor
    when it accepts them (e.g. `compile` for `cuda_graph`). `device` (default: the model's) picks the chain.
    `blocked_token_ids` (a vision-language model's image tokens) rule out engines that do not take images, and the
    engine chosen never samples them. `record_logps` rules out engines that cannot record the sampler's log-probs
    (`can_record_logps`) and turns recording on in the one chosen; `record_routes` (routing replay: the MoE routes
    are needed) the same for the routes (`can_record_routes`), a named engine that cannot record them being refused.
    The choice is `choose_engine`'s.
    """
    candidate, why = choose_engine(
        name, model, generation_config, sharded=sharded, device=device,
        blocked_token_ids=blocked_token_ids, record_logps=record_logps, record_routes=record_routes,
    )  # fmt: skip
    cls = engine_class(candidate)
    accepted = {k: v for k, v in options.items() if k in getattr(cls, "options", ())}
    engine = cls(generation_config, eos_token_ids, **accepted)
    engine.blocked_token_ids = list(blocked_token_ids)
    engine.record_logps = record_logps
    engine.record_routes = record_routes
    return engine, why


def check_records_routes(name: str) -> None:
    """Refuse `rollout_engine=name` for routing replay when it names an engine that cannot record MoE routes (by
    name, with the alternatives); "auto" picks one that can."""
    if name != "auto" and not engine_class(name).can_record_routes:
        raise ValueError(f"rollout_engine={name!r} {ROUTES_REFUSAL}")


def choose_engine(
    name: str,
    model,
    generation_config,
    *,
    sharded: bool = False,
    device: torch.device | None = None,
    blocked_token_ids: Sequence[int] = (),
    record_logps: bool = False,
    record_routes: bool = False,
) -> tuple[str, str]:
    """The name of the engine `make_engine` builds for these arguments, and its log line (the engine, and why each
    one before it in the chain was skipped), without building it. With `record_routes`, an engine named (not "auto")
    that cannot record MoE routes is refused by name, and "auto" skips those."""
    if record_routes:
        check_records_routes(name)
    device = torch.device(device) if device is not None else next(model.parameters()).device
    chain = _CHAINS["cuda" if device.type == "cuda" else "other"]
    if name == "auto":
        candidates = chain
    elif name in chain:
        candidates = chain[chain.index(name) :]
    else:
        candidates = [name]
    skipped = []
    for candidate in candidates:
        cls = engine_class(candidate)
        reason = cls.unsupported_reason(model, generation_config)
        if reason is None and sharded and candidate == "cuda_graph":
            reason = "the weights are sharded (FSDP / ZeRO-3) and gathered anew for each rollout"
        if reason is None and blocked_token_ids and not cls.takes_images:
            reason = "it does not take images (a vision-language model)"
        if reason is None and record_logps and not cls.can_record_logps:
            reason = "it does not record the sampler's log-probs (record_logps=True)"
        if reason is None and record_routes and not cls.can_record_routes:
            reason = "it does not record MoE routes (routing replay)"
        if reason is None:
            why = f"rollout engine: {candidate}" + (f" (requested {name})" if name != candidate else "")
            if skipped:
                why += "; skipped " + "; ".join(skipped)
            return candidate, why
        skipped.append(f"{candidate}: {reason}")
    raise ValueError(
        f"rollout_engine={name!r} applies to neither this model nor these settings: {'; '.join(skipped)}."
    )
