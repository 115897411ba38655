"""The one place that knows each Mixture-of-Experts family's router: where its top-k is taken, and how its routing
weights follow from its logits at given experts. Routing replay (R2/R3, docs/moe.md) records the experts a forward
chose and makes a later forward use them; nothing else in grpo_hf names a family.

transformers 5.x gives every MoE block a router module of its own, called once per forward on the block's tokens
flattened batch-major ([B, T, H] -> [B * T, H]; DeepSeek-V3's reshapes itself), returning three tensors:

- Qwen3-MoE, Qwen2-MoE, Qwen3-Next (`<Family>TopKRouter`): top-k of softmax(logits); the weights are those
  probabilities, normalised to sum 1 if `norm_topk_prob`;
- Qwen3.5 MoE (`Qwen3_5MoeTopKRouter`), Qwen3-VL-MoE (`Qwen3VLMoeTextTopKRouter`), Mixtral (`MixtralTopKRouter`,
  float32 weights): the same, always normalised;
- GPT-OSS (`GptOssTopKRouter`, logits with a bias), GraniteMoeHybrid (`GraniteMoeHybridTopKRouter`): top-k of the
  logits; the weights are the softmax over the k chosen logits;
- DeepSeek-V3 (`DeepseekV3TopkRouter`): group-limited top-k of sigmoid(logits) + `e_score_correction_bias`; the
  weights are sigmoid(logits) at the chosen experts WITHOUT the bias, normalised if `norm_topk_prob`, times
  `routed_scaling_factor`.

The router returns (logits [N, E], weights [N, k], indices [N, k]) in transformers 5.25; GraniteMoeHybrid's returned
(indices, weights, logits) in 5.19 (vLLM's environment). Which position holds what is not assumed: `_check_family`
runs each family's router class once, on a tiny instance (the first time a model of the family is seen), finds the
three by their shapes and dtypes, and checks that `Family.weights` at the router's own indices gives the router's
own weights. A family whose router fails (a new release changed its formula or its outputs) is refused, named, with
what failed: replay would otherwise weigh experts by a formula the model no longer uses.

How it hooks in: `router_sites` finds the router modules (by class, through PEFT, DDP and FSDP wrappers, which keep
the modules and, for FSDP2, subclass them) and gives each, once, a forward hook and a `_SiteState` attribute. The
hook does nothing (returns None: the module's own output, bit for bit) unless a context set that state:

- `recording(model)`: the hook appends the router's live indices, before any replay, to the `Recorder`;
- `replaying(model, routes)`: the hook swaps in the recorded indices for the tokens that have them and the weights
  `Family.weights` computes from the LIVE logits at those indices, so the gradient reaches the router; the logits it
  returns are the live ones (the load-balancing loss, which transformers collects from them, is the family's own).

The state lives on the router module, not in this module: a deep copy of the model (the async producer's snapshot)
has states of its own, and two models decode and train in two threads without seeing each other's contexts.
Gradient checkpointing recomputes a layer during backward, after the context has closed: inside `replaying`, each
checkpointed layer's `_gradient_checkpointing_func` is wrapped so that the recompute runs under the replay the
forward ran under (and records nothing).

Costs: inactive, one attribute read per router call. Recording keeps a reference to each call's indices (no copy, no
host sync). Replaying does a `torch.where` and the family's weight formula per router call; the routes' range is
checked once per context, on the routes' device (no host sync for routes on an accelerator).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache

import torch
import transformers
from torch import Tensor, nn

logger = logging.getLogger(__name__)

MOE_CONFIG_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
"""A config with any of these (above 0) describes a Mixture-of-Experts model."""


def _softmax_at(logits: Tensor, indices: Tensor, normalise: bool) -> Tensor:
    """The softmax over all experts (float32) at the chosen ones [N, k], normalised to sum 1 when `normalise`."""
    chosen = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, indices)  # [N, k]
    return chosen / chosen.sum(dim=-1, keepdim=True) if normalise else chosen


def _softmax_normalised_if_asked(module: nn.Module, logits: Tensor, indices: Tensor) -> Tensor:
    """Qwen3-MoE, Qwen2-MoE, Qwen3-Next: normalised when the router's `norm_topk_prob`."""
    return _softmax_at(logits, indices, module.norm_topk_prob)


def _softmax_normalised(module: nn.Module, logits: Tensor, indices: Tensor) -> Tensor:
    """Qwen3.5 MoE, Qwen3-VL-MoE, Mixtral: always normalised."""
    return _softmax_at(logits, indices, True)


def _softmax_of_chosen(module: nn.Module, logits: Tensor, indices: Tensor) -> Tensor:
    """GPT-OSS, GraniteMoeHybrid: a softmax over the chosen experts' logits alone."""
    return torch.softmax(logits.gather(1, indices), dim=-1)  # [N, k]


def _deepseek(module: nn.Module, logits: Tensor, indices: Tensor) -> Tensor:
    """DeepSeek-V3: sigmoid scores at the chosen experts (the correction bias only chooses), normalised if
    `norm_topk_prob`, times `routed_scaling_factor`."""
    chosen = logits.float().sigmoid().gather(1, indices)  # [N, k]
    if module.norm_topk_prob:
        chosen = chosen / (chosen.sum(dim=-1, keepdim=True) + 1e-20)
    return chosen * module.routed_scaling_factor


@dataclass(frozen=True)
class Family:
    """One MoE family: its router class (looked up in `transformers.models.<module>.modeling_<module>`) and the
    formula of its weights at given experts, `weights(router, logits [N, E], indices [N, k]) -> [N, k]` (any float
    dtype: the hook casts to the router's own). Module-level functions, so that a hooked model still pickles."""

    name: str
    module: str
    router_class: str
    weights: Callable[[nn.Module, Tensor, Tensor], Tensor]


FAMILIES = (
    Family("Qwen3-MoE", "qwen3_moe", "Qwen3MoeTopKRouter", _softmax_normalised_if_asked),
    Family("Qwen2-MoE", "qwen2_moe", "Qwen2MoeTopKRouter", _softmax_normalised_if_asked),
    Family("Qwen3-Next", "qwen3_next", "Qwen3NextTopKRouter", _softmax_normalised_if_asked),
    Family("Qwen3.5-MoE", "qwen3_5_moe", "Qwen3_5MoeTopKRouter", _softmax_normalised),
    Family("Qwen3-VL-MoE", "qwen3_vl_moe", "Qwen3VLMoeTextTopKRouter", _softmax_normalised),
    Family("Mixtral", "mixtral", "MixtralTopKRouter", _softmax_normalised),
    Family("GPT-OSS", "gpt_oss", "GptOssTopKRouter", _softmax_of_chosen),
    Family("GraniteMoeHybrid", "granitemoehybrid", "GraniteMoeHybridTopKRouter", _softmax_of_chosen),
    Family("DeepSeek-V3", "deepseek_v3", "DeepseekV3TopkRouter", _deepseek),
)
_BY_CLASS_NAME = {family.router_class: family for family in FAMILIES}


@dataclass(frozen=True)
class Layout:
    """Where a family's router returns each tensor: positions of the logits, the weights and the indices."""

    logits: int
    weights: int
    indices: int


def _probe_config(hidden: int, experts: int, top_k: int, normalise: bool) -> types.SimpleNamespace:
    """Every attribute a supported router's `__init__` reads, for a tiny instance."""
    return types.SimpleNamespace(
        hidden_size=hidden,
        num_experts=experts,
        num_local_experts=experts,
        n_routed_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=normalise,
        routed_scaling_factor=2.5,
        n_group=2,
        topk_group=1,
    )


def _find_layout(outputs, tokens: int, experts: int, top_k: int) -> Layout:
    """The positions of logits [N, E] (float), weights [N, k] (float) and indices [N, k] (integer) in `outputs`."""
    if not isinstance(outputs, tuple) or len(outputs) != 3 or not all(isinstance(t, Tensor) for t in outputs):
        raise TypeError(f"returns {type(outputs).__name__}, not a tuple of three tensors")
    shapes = [(tuple(t.shape), t.is_floating_point()) for t in outputs]
    try:
        return Layout(
            logits=shapes.index(((tokens, experts), True)),
            weights=shapes.index(((tokens, top_k), True)),
            indices=shapes.index(((tokens, top_k), False)),
        )
    except ValueError:
        raise TypeError(f"returns tensors of shapes and kinds {shapes}, not logits, weights and indices") from None


@cache
def _check_family(family: Family) -> tuple[type | None, Layout | None, str | None]:
    """The family's router class, where it returns what, and None; or (class or None, None, why it is refused).

    Runs tiny instances of the class (`_probe`, with `norm_topk_prob` on and off): the outputs must be logits,
    weights and indices, and `family.weights` at the router's indices its weights."""
    try:
        cls = getattr(
            importlib.import_module(f"transformers.models.{family.module}.modeling_{family.module}"),
            family.router_class,
        )
    except (ImportError, AttributeError):
        return None, None, f"this transformers has no {family.router_class}"
    try:
        layouts = {_probe(family, cls, normalise) for normalise in (True, False)}  # `norm_topk_prob` both ways
        if len(layouts) != 1:
            raise TypeError(f"returns its tensors in an order that changes with norm_topk_prob: {layouts}")
    except Exception as error:  # whatever the class does differently: refuse the family, say what
        reason = (
            f"{cls.__name__} of transformers {transformers.__version__} no longer routes as grpo_hf expects "
            f"({type(error).__name__}: {error})"
        )
        logger.warning("MoE routing replay: %s; models of the %s family are refused", reason, family.name)
        return cls, None, reason
    return cls, layouts.pop(), None


def _probe(family: Family, cls: type, normalise: bool) -> Layout:
    """Where a tiny instance of `cls` returns what; AssertionError if `family.weights` at its indices are not its
    weights (on 6 tokens, 4 experts, top 2, random weights and correction bias)."""
    tokens, hidden, experts, top_k = 6, 8, 4, 2
    generator = torch.Generator().manual_seed(0)
    router = cls(_probe_config(hidden, experts, top_k, normalise)).float()
    with torch.no_grad():
        for tensor in [*router.parameters(), *router.buffers()]:
            tensor.copy_(torch.randn(tensor.shape, generator=generator))
        outputs = router(torch.randn(tokens, hidden, generator=generator))
    if (router.top_k, router.num_experts) != (top_k, experts):  # what `router_sites` reads of every router
        raise TypeError(f"top_k, num_experts read {router.top_k}, {router.num_experts}, not {top_k}, {experts}")
    layout = _find_layout(outputs, tokens, experts, top_k)
    live, indices = outputs[layout.weights], outputs[layout.indices]
    weights = family.weights(router, outputs[layout.logits], indices).to(live.dtype)
    torch.testing.assert_close(weights, live, rtol=1e-6, atol=1e-7)
    return layout


@dataclass
class Recorder:
    """The live top-k indices of every router call since the last `pop`, per MoE layer."""

    calls: list[list[Tensor]]  # [layer][call] -> [N_call, k]

    def pop(self, batch_size: int) -> Tensor:
        """The routes of the forwards since the last pop, [B, t, L, k] (int64): each forward's B * t_i tokens
        (batch-major), concatenated along t; L MoE layers in layer order. Empties the recorder."""
        counts = {len(calls) for calls in self.calls}
        if len(counts) != 1 or 0 in counts:
            raise RuntimeError(
                f"the MoE layers were called {sorted(len(c) for c in self.calls)} times since the last pop; every "
                "layer must see every forward once (record whole forwards of the model)"
            )
        layers = []
        for calls in self.calls:
            for routes in calls:
                if routes.shape[0] % batch_size:
                    raise ValueError(
                        f"a forward routed {routes.shape[0]} tokens, not a multiple of batch_size={batch_size}: pass "
                        "the batch size of the recorded forwards"
                    )
            layers.append(torch.cat([routes.view(batch_size, -1, routes.shape[-1]) for routes in calls], dim=1))
        for calls in self.calls:
            calls.clear()
        return torch.stack(layers, dim=2)  # [B, t, L, k]


@dataclass
class _SiteState:
    """What the hook of one router does now: record into `recorder`'s list for `layer`, replay `routes`."""

    family: Family
    layout: Layout
    layer: int = 0
    recorder: Recorder | None = None
    routes: Tensor | None = None  # [B, T, L, k]


@dataclass(frozen=True)
class RouterSite:
    """One MoE router: its module's name in the model, the module, its family, its MoE layer index (0 ... L - 1),
    its top-k and its number of experts."""

    name: str
    module: nn.Module
    family: Family
    layer: int
    top_k: int
    num_experts: int


_STATE = "_grpo_hf_route"  # the attribute of a hooked router module holding its `_SiteState`


def _hook(module: nn.Module, args, outputs):
    state: _SiteState = getattr(module, _STATE)
    if state.recorder is None and state.routes is None:
        return None
    layout = state.layout
    indices = outputs[layout.indices]
    if state.recorder is not None:
        state.recorder.calls[state.layer].append(indices.detach())
    if state.routes is None:
        return None
    return _replayed(module, state, outputs, indices)


def _replayed(module: nn.Module, state: _SiteState, outputs, indices: Tensor):
    """`outputs` with the recorded indices and their weights from the live logits, for tokens with a route."""
    layout, routes = state.layout, state.routes
    tokens = indices.shape[0]
    if routes.shape[0] * routes.shape[1] != tokens:
        raise ValueError(
            f"replaying routes for {routes.shape[0]} x {routes.shape[1]} tokens, but the router got {tokens}: enter "
            "replaying() with the routes of exactly the forward it wraps ([B, T, L, k] for input_ids [B, T])"
        )
    recorded = routes[:, :, state.layer].reshape(tokens, -1).to(indices.device)  # [N, k]
    use = (recorded >= 0).all(dim=-1, keepdim=True)  # [N, 1]
    chosen = torch.where(use, recorded, indices)
    live = outputs[layout.weights]
    weights = state.family.weights(module, outputs[layout.logits], chosen).to(live.dtype)
    replaced = list(outputs)
    replaced[layout.indices] = chosen
    replaced[layout.weights] = torch.where(use, weights, live)
    return tuple(replaced)


def _config(model: nn.Module):
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "to_dict"):
            get_text = getattr(config, "get_text_config", None)
            return get_text(decoder=True) if get_text is not None else config
    return None


def _configured_as_moe(model: nn.Module) -> bool:
    config = _config(model)
    return config is not None and is_moe_config(config)


def is_moe_config(config) -> bool:
    """Whether a transformers config (a vision-language one: its text decoder's) says Mixture-of-Experts: one of
    `MOE_CONFIG_KEYS` above 0."""
    get_text = getattr(config, "get_text_config", None)
    config = get_text(decoder=True) if get_text is not None else config
    return any((getattr(config, key, None) or 0) > 0 for key in MOE_CONFIG_KEYS)


def _family_of(module: nn.Module) -> Family | None:
    for cls in type(module).__mro__:
        family = _BY_CLASS_NAME.get(cls.__name__)
        if family is not None:
            return family
    return None


def _unknown_routers(model: nn.Module) -> list[str]:
    """Class names of modules that look like an MoE router or block (for the error naming what is not supported)."""
    names = []
    for module in model.modules():
        name = type(module).__name__
        looks = name.endswith(("Router", "Gate")) or ("moe" in name.lower() and hasattr(module, "experts"))
        if looks and name not in names:
            names.append(name)
    return names


def router_sites(model: nn.Module) -> list[RouterSite]:
    """Every MoE router module of `model`, in layer order (through PEFT, DDP and FSDP wrappers), hooked; [] for a
    dense model. A model whose config says MoE but whose routers no family knows, or whose family's router failed
    `_check_family`: ValueError naming the class and the supported families."""
    sites = []
    for name, module in model.named_modules():
        family = _family_of(module)
        if family is None:
            continue
        cls, layout, reason = _check_family(family)
        if reason is not None or not isinstance(module, cls):
            raise ValueError(
                f"MoE routing: the router {type(module).__name__} ({name}) cannot be recorded or replayed: "
                f"{reason or 'it is not the class grpo_hf checked'}. Upgrade or pin transformers to a version whose "
                f"{family.name} router grpo_hf supports, or leave router replay off."
            )
        state = getattr(module, _STATE, None)
        if state is None:
            state = _SiteState(family, layout)
            setattr(module, _STATE, state)  # before the hook: a hook never sees a module without its state
            module.register_forward_hook(_hook)
        state.layer = len(sites)
        sites.append(RouterSite(name, module, family, len(sites), int(module.top_k), int(module.num_experts)))
    if not sites and _configured_as_moe(model):
        found = ", ".join(_unknown_routers(model)) or "no module named like a router"
        supported = ", ".join(f"{f.name} ({f.router_class})" for f in FAMILIES)
        raise ValueError(
            f"{type(model).__name__} is a Mixture-of-Experts model (its config has "
            f"{[k for k in MOE_CONFIG_KEYS if getattr(_config(model), k, None)]}) whose router grpo_hf does not know "
            f"(found: {found}). Routing replay supports: {supported}. Leave router replay off for this model."
        )
    return sites


def is_moe(model: nn.Module) -> bool:
    """Whether `model` has MoE routers grpo_hf can record and replay (ValueError for one whose routers it cannot)."""
    return bool(router_sites(model))


def _states(model: nn.Module, sites: list[RouterSite] | None = None) -> list[_SiteState]:
    sites = router_sites(model) if sites is None else sites
    if not sites:
        raise ValueError(
            f"{type(model).__name__} has no Mixture-of-Experts router: there are no routes to record or replay. "
            "Routing replay is for MoE models only; leave it off for dense ones."
        )
    return [getattr(site.module, _STATE) for site in sites]


@contextlib.contextmanager
def _set(states: list[_SiteState], recorder: Recorder | None | bool = False, routes: Tensor | None | bool = False):
    """Every state's recorder and routes set (False: left as they are) for the block, then put back."""
    saved = [(state.recorder, state.routes) for state in states]
    for state in states:
        state.recorder = state.recorder if recorder is False else recorder
        state.routes = state.routes if routes is False else routes
    try:
        yield
    finally:
        for state, (old_recorder, old_routes) in zip(states, saved, strict=True):
            state.recorder, state.routes = old_recorder, old_routes


def _recompute_as_forward(checkpoint: Callable, states: list[_SiteState]) -> Callable:
    """`checkpoint` (a layer's `_gradient_checkpointing_func`) whose recompute, during backward, replays the routes
    the forward was replaying and records nothing (the forward recorded)."""

    def checkpointed(function, *args, **kwargs):
        routes, calls = states[0].routes, 0

        def run(*inner_args, **inner_kwargs):
            nonlocal calls
            calls += 1
            if calls == 1:  # the forward itself, under the context's states
                return function(*inner_args, **inner_kwargs)
            with _set(states, recorder=None, routes=routes):
                return function(*inner_args, **inner_kwargs)

        return checkpoint(run, *args, **kwargs)

    return checkpointed


@contextlib.contextmanager
def _checkpoints_follow(model: nn.Module, states: list[_SiteState]) -> Iterator[None]:
    """Inside the block, every gradient-checkpointed layer recomputes with the routes its forward used."""
    layers = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False)]
    layers = [m for m in layers if getattr(m, "_gradient_checkpointing_func", None) is not None]
    own = [("_gradient_checkpointing_func" in vars(m), m._gradient_checkpointing_func) for m in layers]
    for layer, (_, checkpoint) in zip(layers, own, strict=True):
        layer._gradient_checkpointing_func = _recompute_as_forward(checkpoint, states)
    try:
        yield
    finally:
        for layer, (was_own, checkpoint) in zip(layers, own, strict=True):
            if was_own:
                layer._gradient_checkpointing_func = checkpoint
            else:
                del layer._gradient_checkpointing_func


@contextlib.contextmanager
def recording(model: nn.Module) -> Iterator[Recorder]:
    """Every router call of `model` inside the block records the live top-k indices it chose (before any replay);
    `Recorder.pop(batch_size)` gives them as [B, t, L, k]. A `recording` inside another takes the calls inside it."""
    states = _states(model)
    recorder = Recorder([[] for _ in states])
    with _set(states, recorder=recorder), _checkpoints_follow(model, states):
        yield recorder


def _check_routes(sites: list[RouterSite], routes: Tensor) -> None:
    top_k = {site.top_k for site in sites}
    if routes.dim() != 4 or routes.is_floating_point() or routes.shape[2:] != (len(sites), max(top_k)):
        raise ValueError(
            f"routes must be an integer tensor [B, T, L={len(sites)}, k={max(top_k)}] (one top-k per token and MoE "
            f"layer of this model, -1 where there is none), got {routes.dtype} of shape {tuple(routes.shape)}"
        )
    if len(top_k) != 1:
        raise ValueError(f"MoE layers with different top-k {sorted(top_k)} cannot share one routes tensor")
    experts = min(site.num_experts for site in sites)
    message = f"routes must be expert indices in [0, {experts}) or -1 (no route), got values outside"
    if not routes.numel():
        return
    inside = (routes.max() < experts) & (routes.min() >= -1)
    check_on_device = getattr(torch, "_assert_async", None)
    if routes.device.type != "cpu" and check_on_device is not None:
        check_on_device(inside, message)  # without waiting for the device (a failure stops the process, with message)
    elif not inside:
        raise ValueError(message)


@contextlib.contextmanager
def replaying(model: nn.Module, routes: Tensor) -> Iterator[None]:
    """Every router call of `model` inside the block uses `routes` [B, T, L, k] (integer, -1: route live) for the
    tokens that have one, with weights from the live logits at those experts; each forward inside must be over the
    B x T tokens `routes` describes (enter a new context for a forward of other tokens). A token whose k routes in a
    layer include a -1 routes live in that layer. A `recording` inside still sees the live choice."""
    sites = router_sites(model)
    states = _states(model, sites)
    _check_routes(sites, routes)
    weight = next(iter(sites[0].module.parameters()), None)  # moved once, not per router call (a no-op if there)
    routes = routes if weight is None else routes.to(weight.device)
    with _set(states, routes=routes), _checkpoints_follow(model, states):
        yield


def route_mismatch_counts(recorded: Tensor, live: Tensor, mask: Tensor) -> Tensor:
    """[differing (token, layer) routes, routes compared, tokens with any differing layer, tokens compared] (float,
    on `recorded`'s device) between `recorded` and `live` [B, T, L, k] over tokens where `mask` [B, T] is set and
    `recorded` has a route in every layer. Two routes differ when their top-k SETS differ. Sum them across
    micro-batches and processes, then `mismatch_shares`."""
    if recorded.shape != live.shape or recorded.shape[:2] != mask.shape:
        raise ValueError(
            f"recorded {tuple(recorded.shape)} and live {tuple(live.shape)} routes must both be [B, T, L, k], and "
            f"mask {tuple(mask.shape)} [B, T]"
        )
    live = live.to(recorded.device)
    differ = (recorded.sort(dim=-1).values != live.sort(dim=-1).values).any(dim=-1)  # [B, T, L]
    valid = mask.to(recorded.device).bool() & (recorded >= 0).all(dim=-1).all(dim=-1)  # [B, T]
    differ = differ & valid[..., None]
    routes, tokens = valid.sum() * recorded.shape[2], valid.sum()
    return torch.stack([differ.sum(), routes, differ.any(dim=-1).sum(), tokens]).float()


def mismatch_shares(counts: Tensor) -> tuple[Tensor, Tensor]:
    """(share of routes that differ, share of tokens with any differing layer) from `route_mismatch_counts` (summed);
    0 where nothing was compared."""
    return counts[0] / counts[1].clamp(min=1), counts[2] / counts[3].clamp(min=1)


def route_mismatch(recorded: Tensor, live: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Shares over tokens where `mask` (and `recorded` >= 0): (token, layer) routes whose top-k sets differ, and
    tokens with any differing layer. To sum across micro-batches or processes, sum `route_mismatch_counts`."""
    return mismatch_shares(route_mismatch_counts(recorded, live, mask))
