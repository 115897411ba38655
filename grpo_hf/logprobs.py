"""Model -> log-probabilities of completion tokens: the forwards behind the GRPO loss.

Functions of `(model, batch, ...)`, testable without a trainer. A batch is a `rollout.batching.Sequences` (or a
`MicroBatch`, which is one): `prompt_ids`, `prompt_mask` [B, P] (left-padded) and `completion_ids`, `completion_mask`
[B, T]; a multi-turn episode's tool output inside the completion (`context_mask`) is attended to like the rest
(`Sequences.attention_mask`), and gets log-probs the loss then leaves out.

The tricks, each exact (same maths as one padded forward, float rounding aside):

- **Shared prompt prefix** (`shared_prefix_logits`): each group's prompt goes through the decoder
  once; its G completions attend to its cached keys/values. No compute on repeated prompts. (Not for a batch with
  images inside its completions, a tool's reply in an episode: `images_in_completions`.)
- **Length buckets** (`length_buckets`): a group's completions are split by length into at most two
  buckets, each cut to its longest completion. Little compute on padding.
- **LM head only where needed** and **chunked log-softmax** (`core.selective_log_softmax`): logits
  only at the positions that predict completion tokens, upcast per chunk, never a full fp32 copy.
- **Per-group backward** (`backward_per_group`): the loss is a sum of per-row terms once advantages
  and normalisers are fixed, so its gradient can be accumulated one group at a time; only one group's
  activations are alive at once. The MoE load-balancing loss is one too once its expert counts are fixed, by a
  no-grad routing pass first (`expert_load`, `RouterTally.share`).
- **pi_prox from the training forward** (`ProxReplay`): where no optimizer step separates a corrected micro-batch's
  start from its training forward, the proximal policy is the one that forward runs. Its log-probs under the
  sampler's distribution (`rollout.sampling.SamplingReplay`) are replayed on that forward's own logits, detached,
  instead of a no-grad forward of their own.
- **Routing replay** (`routing`, `grpo_hf.replay.BatchRouting`): every forward below names the rows and the columns of
  cat(prompt, completion) it runs, so an MoE model's experts can be replayed from, or recorded into, per-token
  routes of the batch, whichever path (padded, shared prefix, a group at a time, in chunks) computes them.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn
from transformers import DynamicCache

from grpo_hf.cache_layers import cache_keyword, repeat_cache, unrepeatable_layers
from grpo_hf.core import entropy_from_logits, entropy_with_grad, prompt_runs, selective_log_softmax
from grpo_hf.forward_plan import ForwardPlan, Planner
from grpo_hf.peft_utils import base_model, is_peft_model
from grpo_hf.vision import (
    forward_kwargs,
    has_images,
    image_token_ids,
    is_vision_model,
    multimodal_model,
    position_offsets,
    split_runs,
    uses_mrope,
)

if TYPE_CHECKING:
    from grpo_hf.rollout.batching import MicroBatch
    from grpo_hf.rollout.batching import Sequences as Batch


# Config attributes of models whose forward transforms the LM head's output (softcapping, scaling):
# `shared_prefix_logits` applies the LM head itself, so it leaves these models to their own forward.
_LOGIT_TRANSFORMS = (
    "final_logit_softcapping",
    "logit_scale",
    "logits_scaling",
    "output_multiplier",
    "lm_head_multiplier",
)


class Routing(Protocol):
    """Where an MoE model's experts come from in the forwards of one batch (`grpo_hf.replay.BatchRouting`)."""

    def __call__(
        self, model: nn.Module, rows: torch.Tensor, columns: slice, *, shared: bool = False
    ) -> contextlib.AbstractContextManager:
        """The context one forward of `model` runs in: its rows are the batch's `rows` [n] (`shared`: one row
        standing for all of them, a group's prompt), its tokens the `columns` of cat(prompt_ids, completion_ids)."""

    def from_row(self, start: int) -> Routing:
        """The same, for a batch that is this one's rows from `start` on (`Sequences.rows`)."""

    logps: torch.Tensor | None  # the loss forward's log-probs [B, T], kept by `watch_logps`


def watch_logps(routing: Routing | None, loss_fn: Callable) -> Callable:
    """`loss_fn(logps, ...)` that also keeps the log-probs it is given in `routing.logps` (the last call's, whose rows
    are all real in `backward_per_group`), for the router metrics; `loss_fn` itself without a routing."""
    if routing is None:
        return loss_fn

    def watched(logps, *args, **kwargs):
        routing.logps = logps
        return loss_fn(logps, *args, **kwargs)

    return watched


def routed(routing: Routing | None, model: nn.Module, rows: torch.Tensor, columns: slice, shared: bool = False):
    """`routing`'s context for one forward (`Routing`), or none."""
    return contextlib.nullcontext() if routing is None else routing(model, rows, columns, shared=shared)


def _from_row(rows_of, start: int):
    """`rows_of.from_row(start)` (a `Routing` or a `ProxReplay`), or None."""
    return None if rows_of is None else rows_of.from_row(start)


def shared_prefix_unsupported(model: nn.Module) -> str | None:
    """Why `shared_prefix_logits` does not apply to `model`'s architecture, or None: it needs a decoder-only LM with
    an LM head, whose cache layers `cache_layers.repeat_cache` can repeat to a group's rows (full attention, sliding
    windows, linear attention, convolution and Mamba states); or an image-text-to-text model whose language model is
    one and whose logits are `lm_head(decoder(...))` (its prompts go through the multimodal model, its completions
    through the language model and the LM head)."""
    if is_peft_model(model):
        if model.active_peft_config.is_prompt_learning:  # virtual tokens are added by PeftModel.forward
            return "a PEFT prompt-learning adapter adds virtual tokens in PeftModel.forward"
        model = model.get_base_model()
    name = type(model).__name__
    config = getattr(model, "config", None)
    if config is None or config.is_encoder_decoder:
        return f"{name} is not a decoder-only model"
    text_config = config.get_text_config()
    vision = is_vision_model(model)
    if text_config is not config and not vision:
        return f"{name} has a sub-model config that is not a vision-language model's"
    if not hasattr(model, "get_decoder") or model.get_output_embeddings() is None:
        return f"{name} has no decoder and LM head to call"
    if vision and any(getattr(c, a, None) is not None for c in (config, text_config) for a in _LOGIT_TRANSFORMS):
        return f"{name}'s forward transforms the LM head's output, which the vision-language forward does not apply"
    layers = unrepeatable_layers(config)
    if layers is not None:
        return f"{name}'s cache has layers the shared prefix cannot repeat to a group's rows: {layers}"
    return None


def supports_shared_prefix(model: nn.Module) -> bool:
    """Whether the shared-prefix forward applies to `model`'s architecture (`shared_prefix_unsupported`)."""
    return shared_prefix_unsupported(model) is None


def router_aux_unsupported(model: nn.Module) -> str | None:
    """Why the shared-prefix forward cannot give `model`'s MoE load-balancing loss, or None (`RouterTally`): it needs
    the model's own loss function (`load_balancing_loss_func` in its modeling module) and its expert counts, and a
    text-only model (the vision-language forward does not collect router logits)."""
    base = base_model(model)
    if is_vision_model(base):
        return "the vision-language shared-prefix forward does not collect the router logits"
    if _router_loss_function(base) is None or not hasattr(base, "num_experts_per_tok"):
        return f"{type(base).__name__} has no `load_balancing_loss_func` and `num_experts_per_tok` to reuse"
    return None


def shared_prefix_blocker(
    model: nn.Module, module: nn.Module, *, share_prompt_prefix: bool, router_aux_loss_coef: float, sharded: bool
) -> str | None:
    """Why `shared_prefix_logps` does not apply to `model` (as the trainer holds it; `module`: unwrapped), or None
    when it does: the option is on, the weights are not managed by FSDP or DeepSpeed (`sharded`), the model is the
    bare module or wrapped by DDP only (whose forward the fast path bypasses: the trainer then averages the gradients
    itself), it is not gradient-checkpointed (checkpointed layers drop the cache), its architecture qualifies
    (`shared_prefix_unsupported`) and, with the MoE load-balancing loss on, the loss can be counted as the padded
    forward counts it (`router_aux_unsupported`)."""
    if not share_prompt_prefix:
        return "share_prompt_prefix=False"
    if sharded:
        return (
            "FSDP and DeepSpeed ZeRO-3 shard the weights, which only the wrapper's own forward gathers; under "
            "ZeRO-1/2 the engine reduces and partitions the gradients, untested with the bare module's forward"
        )
    if module is not model and not isinstance(model, nn.parallel.DistributedDataParallel):
        return f"the model is wrapped by {type(model).__name__}"
    if module.training and any(getattr(layer, "gradient_checkpointing", False) for layer in module.modules()):
        return "gradient checkpointing drops the prompt's cache"
    reason = shared_prefix_unsupported(module)
    if reason is None and router_aux_loss_coef != 0.0:
        reason = router_aux_unsupported(module)
        reason = None if reason is None else f"router_aux_loss_coef={router_aux_loss_coef}: {reason}"
    return reason


def images_in_completions(model: nn.Module, batch: Batch) -> bool:
    """Whether image tokens sit in some row's completion (the images of a tool reply in an episode): the shared-prefix
    forward runs the completions through the language model alone, so such a batch takes the padded forward."""
    if not has_images(batch.image_inputs):
        return False
    return bool(
        torch.isin(
            batch.completion_ids, torch.tensor(image_token_ids(model), device=batch.completion_ids.device)
        ).any()
    )


def length_buckets(lengths: torch.Tensor, min_saving: float = 0.1) -> list[torch.Tensor]:
    """Split rows with these completion lengths [n] into at most two buckets, to cut padding.

    Each bucket is computed at its own longest length. Sorted by length, the split point that leaves
    the fewest padded positions is taken if it saves at least `min_saving` of the positions of one
    bucket (a second bucket costs one more decoder call). Returns the row indices of each bucket.
    """
    order = torch.argsort(lengths, stable=True)  # [n] shortest first
    sorted_lengths = lengths[order].tolist()
    n, longest = len(sorted_lengths), sorted_lengths[-1]
    best_cost, best_split = n * longest, n
    for k in range(1, n):  # rows order[:k] in the short bucket, at length sorted_lengths[k - 1]
        cost = k * sorted_lengths[k - 1] + (n - k) * longest
        if cost < best_cost:
            best_cost, best_split = cost, k
    if best_cost > (1 - min_saving) * n * longest:
        return [order]
    return [order[:best_split], order[best_split:]]


def shared_prefix_logits(
    model: nn.Module,
    batch: Batch,
    router: RouterTally | ExpertLoad | None = None,
    *,
    head: bool = True,
    routing: Routing | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
    """Logits predicting the completion tokens, each prompt run once: yields `(rows [n], logits [n, t, V])`.

    For each run of identical prompt rows (a group, `prompt_runs`), the prompt's real tokens (no padding) but the
    last go through the decoder as one row, into the model's own cache. Its rows are split by completion length
    (`length_buckets`); each bucket's n rows run the prompt's last token and their completions, cut to the bucket's
    longest (t tokens), through the model's forward (its LM head and whatever it does to the logits) on the prompt's
    cache repeated to n rows (`cache_layers.repeat_cache`: keys and values, sliding windows, conv and recurrent
    states), at positions p - 1, p, ... The logits at the prompt's last token and completion tokens 0 .. t - 2 predict
    completion tokens 0 .. t - 1. These are the numbers of the padded full forward (same positions, causal attention
    over the prompt and earlier completion tokens, the same windows; the padding after EOS is never attended to by a
    real token), float rounding aside. Gradients reach the prompt's forward through the cache. The prompt runs once
    per group, so with dropout on, the group shares its dropout mask. A bucket's forward has at least 2 tokens (one
    token would take the decode kernels that update linear-attention states in place), and with `router` (the MoE
    load-balancing loss) every real token, the last completion token included: each forward's router logits go to
    `router` with the number of rows each token stands for. `head=False`: the decoder alone, no LM head
    (`expert_load`'s routing pass); yields `(rows, None)`. `routing`: each forward's context (`routed`: the prompt's
    for its group's rows, `shared`). A vision-language model takes `_vision_prefix_logits`.
    """
    base = base_model(model)  # PEFT layers live inside the base model
    if is_vision_model(base):
        yield from _vision_prefix_logits(base, batch, routing)
        return
    decoder, keyword = base.get_decoder(), cache_keyword(base)
    prompt_ids, prompt_mask, completion_ids = batch.prompt_ids, batch.prompt_mask, batch.completion_ids
    P, lengths = prompt_ids.size(1), batch.attention_mask.sum(dim=1).clamp(min=1)  # lengths [B]: tool output included
    routed_kw = {"output_router_logits": True} if router is not None else {}
    for start, stop in prompt_runs(prompt_ids, prompt_mask):
        p = int(prompt_mask[start].sum())
        cache = DynamicCache(config=base.config)
        if p > 1:
            with routed(routing, base, torch.arange(start, stop), slice(P - p, P - 1), shared=True):
                prefix = decoder(input_ids=prompt_ids[start : start + 1, P - p : P - 1], use_cache=True, **routed_kw)
            cache = _cache_of(prefix)
            if router is not None:  # the prompt's tokens count once per row of the group
                router.add(prefix.router_logits, prompt_mask.new_full((1, p - 1), stop - start))
        for bucket in length_buckets(lengths[start:stop]):
            rows = bucket + start  # [n] rows of the batch
            n, t = rows.numel(), int(lengths[rows].max())
            width = t + 1 if router is not None else max(t, 2)
            last = prompt_ids[start : start + 1, P - 1 :].expand(n, 1)  # [n, 1]
            input_ids = torch.cat([last, completion_ids[rows, : width - 1]], dim=1)  # [n, width]
            positions = torch.arange(p - 1, p - 1 + width, device=prompt_ids.device).expand(n, -1)  # [n, width]
            keep = 0 if width == t else torch.arange(t, device=prompt_ids.device)
            with routed(routing, base, rows, slice(P - 1, P - 1 + width)):
                output = (base if head else decoder)(
                    input_ids=input_ids, position_ids=positions, use_cache=True, **{keyword: repeat_cache(cache, n)},
                    **({"logits_to_keep": keep} if head else {}), **routed_kw,
                )  # fmt: skip
            if router is not None:  # the prompt's last token, then the completion's real tokens
                weights = torch.cat([lengths.new_ones(n, 1), batch.attention_mask[rows, : width - 1]], dim=1)
                router.add(output.router_logits, weights)  # [n, width]
            yield rows, (output.logits if head else None)  # [n, t, V]


def _vision_prefix_logits(
    base: nn.Module, batch: Batch, routing: Routing | None = None
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """`shared_prefix_logits` for a vision-language model: each prompt (with its images, `_prompt_forward`) runs whole
    through the multimodal model; its completions, cut to t - 1 tokens, through the language model on its cache
    repeated to the bucket's n rows; the LM head maps the prompt's last hidden state and theirs to logits."""
    decoder, lm_head, keyword = base.get_decoder(), base.get_output_embeddings(), cache_keyword(base)
    prompt_ids, prompt_mask = batch.prompt_ids, batch.prompt_mask
    completion_ids = batch.completion_ids
    P = prompt_ids.size(1)
    lengths = batch.attention_mask.sum(dim=1).clamp(min=1)  # [B]
    for start, stop in split_runs(prompt_runs(prompt_ids, prompt_mask), batch.image_inputs):
        p = int(prompt_mask[start].sum())
        image_row = batch.image_inputs[start] if batch.image_inputs is not None else None
        with routed(routing, base, torch.arange(start, stop, device=prompt_ids.device), slice(P - p, P), shared=True):
            prompt, offset = _prompt_forward(base, decoder, prompt_ids[start : start + 1, P - p :], image_row)
        last_hidden = prompt.last_hidden_state[:, -1:]  # [1, 1, H]
        for bucket in length_buckets(lengths[start:stop]):
            rows = bucket + start  # [n] rows of the batch
            n, t = rows.numel(), int(lengths[rows].max())
            hidden = last_hidden.expand(n, 1, -1)  # [n, 1, H]
            if t > 1:
                cache = repeat_cache(prompt.cache, n)
                positions = torch.arange(p, p + t - 1, device=prompt_ids.device).expand(n, -1) + offset  # [n, t - 1]
                with routed(routing, base, rows, slice(P, P + t - 1)):
                    completion = decoder(
                        input_ids=completion_ids[rows, : t - 1], position_ids=positions, **{keyword: cache}
                    ).last_hidden_state  # [n, t - 1, H]
                hidden = torch.cat([hidden, completion], dim=1)  # [n, t, H]
            yield rows, lm_head(hidden)  # [n, t, V]


def _prompt_forward(base: nn.Module, decoder: nn.Module, prompt_ids: torch.Tensor, image_row):
    """One prompt [1, p] through the decoder, with its cache; a prompt with images through the multimodal model
    (its images, or their cached features, in place of its image tokens). Returns the output (`last_hidden_state`,
    and its cache as `cache`) and how far the positions after the prompt are from p: Qwen2-VL's M-RoPE gives an image
    fewer positions than tokens (0 for other models and text prompts)."""
    if image_row is None:
        output, offset = decoder(input_ids=prompt_ids, use_cache=True), 0
    else:
        output = multimodal_model(base)(
            input_ids=prompt_ids, use_cache=True, **forward_kwargs(base, prompt_ids, [image_row])
        )
        offsets = position_offsets(base)  # [1, 1] or None
        offset = 0 if offsets is None else offsets.to(prompt_ids.device)
    output.cache = _cache_of(output)
    return output, offset


def _cache_of(output):
    """The cache a forward returned: `cache` from transformers 5.24 on, `past_key_values` before."""
    cache = getattr(output, "cache", None)
    return output.past_key_values if cache is None else cache


class RouterTally:
    """The MoE router logits of a micro-batch's shared-prefix forwards, and how many rows each token stands for, to
    compute the load-balancing loss the padded forward computes (`loss`), or one group's share of it (`share`).

    The model's own `load_balancing_loss_func` (Switch Transformer's, as Mixtral, Qwen3-MoE, GPT-OSS and the rest
    copy it) averages, over every layer and real token, the top-k assignments per expert and the router's
    probabilities per expert, weighting each token by the attention mask; it returns num_experts x the sum of their
    products. Handed the concatenated logits of the shared forwards and, as the mask, each token's count (a prompt
    token: its group's rows, a completion token: 1, padding: 0), it computes the same means over the same tokens as
    over the padded micro-batch. The counts of assignments carry no gradient; the probabilities' do, through every
    group: `loss` is differentiated by one backward over the micro-batch; `share`, given the assignments of every
    group first (`expert_load`), one group at a time."""

    def __init__(self):
        self.layers: list[list[torch.Tensor]] = []  # per layer: the forwards' router logits [tokens, E]
        self.counts: list[torch.Tensor] = []  # per forward: [tokens], the rows each token stands for

    def add(self, router_logits: tuple[torch.Tensor, ...], counts: torch.Tensor) -> None:
        """A forward's router logits (per layer [b * s, E]) and its tokens' counts [b, s]."""
        if not self.layers:
            self.layers = [[] for _ in router_logits]
        for parts, logits in zip(self.layers, router_logits, strict=True):
            parts.append(logits)
        self.counts.append(counts.reshape(-1))

    def loss(self, model: nn.Module) -> torch.Tensor:
        base = base_model(model)
        gate_logits = tuple(torch.cat(parts) for parts in self.layers)  # per layer [tokens, E]
        counts = torch.cat(self.counts)[None]  # [1, tokens]
        return _router_loss_function(base)(gate_logits, base.num_experts, base.num_experts_per_tok, counts)

    def share(self, load: ExpertLoad) -> torch.Tensor:
        """These tokens' share of the micro-batch's load-balancing loss E x sum_i f_i P_i, with f (`load.fractions`)
        fixed: E x sum_i f_i x (sum over these tokens and layers of count x probability of expert i) / (the
        micro-batch's counts summed over layers). Linear in the probabilities, so the groups' shares sum to the loss
        and each share's gradient is the loss's gradient through this group's router."""
        counts = torch.cat(self.counts).float()  # [tokens]
        probs = torch.zeros_like(load.assigned)  # [E]
        for parts in self.layers:
            weights = torch.softmax(torch.cat(parts), dim=-1).float()  # [tokens, E]
            probs = probs + (weights * counts[:, None]).sum(dim=0)
        return torch.sum(load.fractions * probs / load.total) * load.assigned.numel()


class ExpertLoad:
    """No grad: the top-k assignments per expert of a micro-batch's tokens (`RouterTally`'s counts as weights),
    summed over layers (`assigned` [E]), and those weights summed over layers (`total`). `fractions` = f, the share of
    assignments each expert got, as `load_balancing_loss_func` counts it."""

    def __init__(self, num_experts: int, top_k: int, device: torch.device):
        self.top_k = top_k
        self.assigned = torch.zeros(num_experts, dtype=torch.float32, device=device)  # [E]
        self.total = torch.zeros((), dtype=torch.float32, device=device)

    def add(self, router_logits: tuple[torch.Tensor, ...], counts: torch.Tensor) -> None:
        """A forward's router logits (per layer [b * s, E]) and its tokens' counts [b, s]: the top-k experts of the
        router's probabilities, as the loss function picks them."""
        weights = counts.reshape(-1).float()  # [b * s]
        for logits in router_logits:
            _, experts = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)  # [b * s, k]
            self.assigned.scatter_add_(0, experts.reshape(-1), weights.repeat_interleave(self.top_k))
            self.total += weights.sum()

    @property
    def fractions(self) -> torch.Tensor:
        return self.assigned / self.total  # [E]


@torch.no_grad()
def expert_load(model: nn.Module, batch: Batch, routing: Routing | None = None) -> ExpertLoad:
    """The routing pass: every token's top-k experts (`ExpertLoad`) from one no-grad run of the shared-prefix decoder
    over `batch`, no LM head. The random state is restored after it, so that the training forwards that follow draw
    the same dropout masks and route as it did (`routing`: as they do)."""
    base = base_model(model)
    device = batch.prompt_ids.device
    load = ExpertLoad(base.num_experts, base.num_experts_per_tok, device)
    with torch.random.fork_rng(devices=[] if device.type == "cpu" else [device], device_type=device.type):
        for _ in shared_prefix_logits(model, batch, load, head=False, routing=routing):
            pass
    return load


def router_loss_splits(model: nn.Module) -> str | None:
    """Why `model`'s load-balancing loss cannot be split into the groups' shares (`RouterTally.share`), or None when
    it can: its `load_balancing_loss_func` (`router_aux_unsupported`) gives Switch Transformer's E x sum_i f_i P_i on
    a probe of random router logits and token counts (each model's modeling module has its own copy)."""
    reason = router_aux_unsupported(model)
    if reason is not None:
        return reason
    base = base_model(model)
    experts, top_k = base.num_experts, base.num_experts_per_tok
    generator = torch.Generator().manual_seed(0)
    logits = [torch.randn(6, experts, generator=generator, dtype=torch.float64) for _ in range(2)]  # 2 layers
    counts = torch.tensor([[3, 1, 0, 2, 1, 1]])  # [1, 6]
    want = _router_loss_function(base)(tuple(logits), experts, top_k, counts)
    tally, load = RouterTally(), ExpertLoad(experts, top_k, torch.device("cpu"))
    tally.add(logits, counts)
    load.add(logits, counts)
    got = tally.share(load)
    if not torch.is_tensor(want) or not torch.allclose(got.double(), want.double(), rtol=1e-5, atol=0.0):
        return f"{type(base).__name__}'s `load_balancing_loss_func` is not Switch Transformer's E x sum_i f_i P_i"
    return None


def _router_loss_function(base: nn.Module) -> Callable | None:
    """The load-balancing loss function of `base`'s modeling module (transformers' MoE models each define one)."""
    return getattr(sys.modules.get(type(base).__module__), "load_balancing_loss_func", None)


def padded_logps(
    model: nn.Module,
    batch: Batch,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    router_aux: list[torch.Tensor] | None = None,
    prox_replay: ProxReplay | None = None,
    routing: Routing | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [B, T] of the completion tokens from one forward over the padded prompt + completion rows.

    Works for every model, wrapped ones (DDP, FSDP, DeepSpeed) included, and for vision-language models: the
    batch's `image_inputs` (each row's images, or their cached features) go with it (`grpo_hf.vision`). The LM head
    runs only on the T + 1 last positions (`logits_to_keep`). Also returns the entropy [B, T] when `with_entropy`,
    with a gradient when `entropy_grad` (for the entropy bonus; else detached, a metric and a mask).
    `router_aux`: a list, for Mixture-of-Experts models; the forward then returns its router logits and its
    load-balancing loss (`aux_loss`, over every real prompt and completion token) is appended to the list.
    `prox_replay` (`ProxReplay`): the same logits, detached, replayed under the sampler's distribution into it.
    `routing` (`Routing`): the context of the forward, which runs every row and column.
    """
    completion_ids = batch.completion_ids
    logits = _padded_logits(model, batch, router_aux, routing)  # [B, T + 1, V]
    if prox_replay is not None:
        prox_replay(batch, torch.arange(len(batch), device=completion_ids.device), logits[:, :-1])
    # The log-softmax runs over all T + 1 kept positions, the last one against a dummy token, and its result is cut to
    # T: `logits[:, :-1]` would be a view whose rows cannot be flattened, walked row by row (B times the chunks).
    index = nn.functional.pad(completion_ids, (0, 1))  # [B, T + 1], token 0 at the dummy position
    logps, entropy = _logps_and_entropy(logits, index, temperature, chunk_size, with_entropy, entropy_grad)
    return logps[:, :-1], (entropy[:, :-1] if with_entropy else None)  # [B, T] each


def _padded_logits(
    model: nn.Module, batch: Batch, router_aux: list[torch.Tensor] | None = None, routing: Routing | None = None
) -> torch.Tensor:
    """The logits [B, T + 1, V] of `padded_logps`' one forward: the T + 1 last positions of the padded prompt +
    completion rows, the first T predicting the completion tokens."""
    prompt_ids, prompt_mask = batch.prompt_ids, batch.prompt_mask
    completion_ids = batch.completion_ids
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # [B, P + T]
    attention_mask = torch.cat([prompt_mask, batch.attention_mask], dim=1)  # [B, P + T], tool output included
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)  # [B, P + T], as generate() numbers them
    vision = forward_kwargs(model, input_ids, batch.image_inputs)  # a VLM's rows' images (or their features)
    if vision and uses_mrope(model):
        position_ids = None  # 3-D positions (Qwen2-VL): the model numbers a batch with images itself
    T = completion_ids.size(1)
    with routed(routing, model, torch.arange(len(batch), device=input_ids.device), slice(0, input_ids.size(1))):
        outputs = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            logits_to_keep=T + 1,
            use_cache=False,
            **vision,
            **({"output_router_logits": True} if router_aux is not None else {}),
        )
    if router_aux is not None:
        router_aux.append(outputs.aux_loss)
    return outputs.logits


def shared_prefix_logps(
    model: nn.Module,
    batch: Batch,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    router_aux: list[torch.Tensor] | None = None,
    router_load: ExpertLoad | None = None,
    prox_replay: ProxReplay | None = None,
    routing: Routing | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`padded_logps` with each group's prompt run once (`shared_prefix_logits`); positions past a row's
    bucket get 0. Needs the bare model (`supports_shared_prefix`). `router_aux`: as `padded_logps`'s, the
    load-balancing loss of the padded forward's tokens (`RouterTally`) appended to it; with `router_load` (the
    routing of a micro-batch `batch` is part of, `expert_load`), these tokens' share of that micro-batch's loss.
    `prox_replay`: as `padded_logps`'s, each bucket's logits replayed into it. `routing`: each forward's context."""
    completion_ids = batch.completion_ids
    T = completion_ids.size(1)
    rows, logps, entropy = [], [], []
    router = RouterTally() if router_aux is not None else None
    for bucket, logits in shared_prefix_logits(model, batch, router, routing=routing):  # logits [n, t, V], t <= T
        t = logits.size(1)
        rows.append(bucket)
        if prox_replay is not None:
            prox_replay(batch, bucket, logits)
        part_logps, part_entropy = _logps_and_entropy(
            logits, completion_ids[bucket, :t], temperature, chunk_size, with_entropy, entropy_grad
        )  # [n, t] each
        logps.append(nn.functional.pad(part_logps, (0, T - t)))  # [n, T]
        if with_entropy:
            entropy.append(nn.functional.pad(part_entropy, (0, T - t)))
    if router is not None:
        router_aux.append(router.loss(model) if router_load is None else router.share(router_load))
    order = torch.argsort(torch.cat(rows))  # [B] back to batch order
    return torch.cat(logps)[order], (torch.cat(entropy)[order] if with_entropy else None)  # [B, T] each


def _logps_and_entropy(
    logits: torch.Tensor,
    completion_ids: torch.Tensor,
    temperature: float,
    chunk_size: int | None,
    with_entropy: bool,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropy, with a gradient if `entropy_grad`) of the sampled distribution: logits [n, t, V] at
    `temperature`, in row chunks."""
    if temperature != 1.0:
        logits = logits / temperature
    logps = selective_log_softmax(logits, completion_ids, chunk_size=chunk_size)  # [n, t]
    if not with_entropy:
        return logps, None
    if entropy_grad:
        return logps, entropy_with_grad(logits, chunk_size=chunk_size)  # [n, t]
    return logps, entropy_from_logits(logits.detach(), chunk_size=chunk_size)  # [n, t]


def completion_logps(
    model: nn.Module, batch: Batch, *, share_prefix: bool, **kwargs
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [B, T] (and entropy) by `shared_prefix_logps` when `share_prefix`, else `padded_logps`."""
    return (shared_prefix_logps if share_prefix else padded_logps)(model, batch, **kwargs)


@torch.no_grad()
def logps_and_replayed(
    model: nn.Module,
    batch: Batch,
    replay: Callable[[Batch, torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    share_prefix: bool,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    routing: Routing | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """No grad: `completion_logps` [B, T] and, from the same logits, `replay(batch, rows, logits [n, t, V]) -> [n, t]`
    [B, T] (`rollout.sampling.SamplingReplay`: the log-probs under the distribution the sampler drew from). One
    forward for both; the first equals `completion_logps`' bit for bit. Positions past a row's bucket get 0."""
    completion_ids = batch.completion_ids
    T = completion_ids.size(1)
    logps = torch.zeros(completion_ids.shape, dtype=torch.float32, device=completion_ids.device)  # [B, T]
    replayed = torch.zeros_like(logps)  # [B, T]
    if share_prefix:
        parts = shared_prefix_logits(model, batch, routing=routing)  # (rows [n], logits [n, t, V]) per bucket, t <= T
    else:
        rows = torch.arange(len(batch), device=completion_ids.device)
        parts = [(rows, _padded_logits(model, batch, routing=routing))]  # t = T + 1
    for rows, logits in parts:
        t = min(logits.size(1), T)
        index = nn.functional.pad(completion_ids[rows, :t], (0, logits.size(1) - t))  # [n, t(+1)], 0 at a dummy
        part, _ = _logps_and_entropy(logits, index, temperature, chunk_size, False)  # [n, t(+1)]
        logps = logps.to(part.dtype)
        logps[rows, :t] = part[:, :t]
        replayed[rows, :t] = replay(batch, rows, logits[:, :t])
    return logps, replayed


class ProxReplay:
    """pi_prox's log-probs under the distribution the sampler drew from, replayed on the training forward's own logits
    (`padded_logps`, `shared_prefix_logps` and `backward_per_group` call it), for a corrected micro-batch without old
    log-probs.

    A micro-batch has no old log-probs when no optimizer step separates its start from its training forwards
    (`ExperienceMaker.needs_old_logps`): the proximal policy is then the policy those forwards run. Its
    temperature-only log-probs are the forward's own, detached (`Objective.sampling_weight`); its replayed ones
    (`replay(batch, rows, logits [n, t, V]) -> [n, t]`, `rollout.sampling.SamplingReplay`) come from the same logits,
    detached and without grad, instead of from a no-grad forward of their own (`logps_and_replayed`), which they equal
    float rounding aside (and dropout: the training forward's masks, as its temperature-only log-probs have them).
    `values` [B, T] float32 is the micro-batch's `old_sampling_logps`, written in place one bucket of rows at a time;
    a row whose logits have not come yet holds the sampler's own log-probs (weight 1, finite), as `backward_per_group`
    computes the loss before the later groups' forwards. `offset`: the micro-batch's row where the rows a forward is
    given start (one group's, in `backward_per_group`)."""

    def __init__(self, replay: Callable[[Batch, torch.Tensor, torch.Tensor], torch.Tensor], values: torch.Tensor):
        self.replay, self.values, self.offset = replay, values, 0

    @classmethod
    def into(cls, replay, batch: MicroBatch) -> ProxReplay:
        """A replay into `batch.old_sampling_logps`, set to the sampler's own log-probs [B, T] until it is filled."""
        batch.old_sampling_logps = batch.sampling_logps.float().clone()
        return cls(replay, batch.old_sampling_logps)

    def from_row(self, start: int) -> ProxReplay:
        """The same replay and values, for a forward over the micro-batch's rows from `start` on."""
        shifted = ProxReplay(self.replay, self.values)
        shifted.offset = self.offset + start
        return shifted

    @torch.no_grad()
    def __call__(self, batch: Batch, rows: torch.Tensor, logits: torch.Tensor) -> None:
        """The replayed log-probs of `batch`'s rows `rows` [n] from their logits [n, t, V] (t <= T, at the first t
        completion positions) into their rows of `values`; 0 past t, as `logps_and_replayed` leaves them."""
        T = self.values.size(1)
        t = min(logits.size(1), T)
        part = self.replay(batch, rows, logits.detach()[:, :t])  # [n, t]
        self.values[rows + self.offset] = nn.functional.pad(part.to(self.values.dtype), (0, T - t))


@torch.no_grad()
def logps_in_chunks(
    model: nn.Module, batch: Batch, micro_batch_size: int, *, share_prefix: bool, replay=None, **kwargs
):
    """No-grad log-probs [B, T] for a whole generation batch, `micro_batch_size` rows at a time, dropout off.
    With `with_entropy=True` in `kwargs`: `(logps, entropy)`, both [B, T]; with a `replay` (`logps_and_replayed`):
    `(logps, replayed)`. A `routing` (`Routing`) in `kwargs` routes every chunk's forwards."""
    was_training = model.training
    model.eval()
    routing = kwargs.pop("routing", None)
    try:
        parts = []
        for start in range(0, len(batch), micro_batch_size):
            part, chunk = batch.rows(start, start + micro_batch_size), {**kwargs, "routing": _from_row(routing, start)}
            if replay is not None:
                parts.append(logps_and_replayed(model, part, replay, share_prefix=share_prefix, **chunk))
            else:
                parts.append(completion_logps(model, part, share_prefix=share_prefix, **chunk))
        logps = torch.cat([part[0] for part in parts])  # [B, T]
        paired = kwargs.get("with_entropy") or replay is not None
        return (logps, torch.cat([part[1] for part in parts])) if paired else logps
    finally:
        model.train(was_training)


def backward_per_group(
    model: nn.Module,
    batch: MicroBatch,
    loss_fn: Callable[..., tuple[torch.Tensor, dict[str, float]]],
    backward_fn: Callable[[torch.Tensor], None],
    *,
    entropy_in_loss: bool = False,
    router_aux: list[torch.Tensor] | None = None,
    **kwargs,
) -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
    """The micro-batch loss, its gradient accumulated one group (prompt run) at a time.

    `loss_fn(logps [B, T]) -> (loss, metrics)` is the loss of the whole micro-batch. Every GRPO loss is a sum of
    per-row terms once advantages and normalisers are fixed (docs/design.md ("The maths")), so its gradient with
    respect to one group's log-probs depends on that group's rows only. For each group: its log-probs (with gradient)
    go into the full [B, T] tensor, whose other rows hold detached values (log-probs of earlier groups, placeholders
    for later ones), and `backward_fn(loss)` backpropagates the full loss, reaching only this group's graph, which is
    then freed. The last group's loss, whose rows are all real, is returned for the caller to backpropagate; its value
    and metrics are those of the whole micro-batch. `kwargs` go to `shared_prefix_logps` (`prox_replay`, `routing`:
    each group's from its first row, `from_row`). Returns `(loss, metrics, entropy [B, T])`, entropy detached.

    With `entropy_in_loss`, `loss_fn(logps, entropy)` also gets the entropy [B, T], built the same way: this
    group's rows from its forward (with a gradient when `entropy_grad=True` is in `kwargs`), earlier groups'
    detached, zeros for later ones. The gradient stays exact for terms that are sums over rows with fixed
    weights (`core.entropy_bonus` over a fixed token set), not for a token set chosen from every row's entropy
    (`core.high_entropy_mask`): that needs every group's entropy before the first backward, i.e. one backward.

    `router_aux`: a list, for Mixture-of-Experts models: a no-grad routing pass over the micro-batch first
    (`expert_load`) fixes the expert fractions of its load-balancing loss; `loss_fn(..., router_aux=[aux])` then gets
    the earlier groups' shares (detached) plus this group's (`RouterTally.share`), at the last group the whole
    micro-batch's loss, which is appended to the list.
    """
    runs = prompt_runs(batch.prompt_ids, batch.prompt_mask)
    # `ProxReplay`: later groups' rows weigh 1 (no gradient) until they run; `Routing`: the routing pass's too
    prox, routing = kwargs.pop("prox_replay", None), kwargs.pop("routing", None)
    # Rows not computed yet: the old log-probs (ratio 1) or the reference's, so every term stays finite.
    zeros = torch.zeros_like(batch.completion_ids, dtype=torch.float32)
    placeholder = next((x for x in (batch.old_logps, batch.ref_logps) if x is not None), zeros)
    values, entropy = placeholder.clone(), torch.zeros_like(placeholder)  # [B, T] each
    routed = router_aux is not None
    load, aux_done = (expert_load(model, batch, routing) if routed else None), 0.0  # aux_done: earlier groups' shares
    for k, (start, stop) in enumerate(runs):
        part, shares = batch.rows(start, stop), ([] if routed else None)
        group = {"prox_replay": _from_row(prox, start), "routing": _from_row(routing, start)}
        logps, part_entropy = shared_prefix_logps(
            model, part, with_entropy=True, router_aux=shares, router_load=load, **group, **kwargs
        )  # [n, T] each
        logps = logps.to(values.dtype)
        inputs = [torch.cat([values[:start], logps, values[stop:]])]  # [B, T]
        if entropy_in_loss:
            inputs.append(torch.cat([entropy[:start], part_entropy.to(entropy.dtype), entropy[stop:]]))  # [B, T]
        aux = [aux_done + shares[0]] if routed else None  # [the micro-batch's loss so far]
        loss, metrics = loss_fn(*inputs, **({"router_aux": aux} if routed else {}))
        values[start:stop], entropy[start:stop] = logps.detach(), part_entropy.detach()
        aux_done = aux[0].detach() if routed else aux_done
        if k < len(runs) - 1:
            backward_fn(loss)
    if routed:
        router_aux.extend(aux)
    return loss, metrics, entropy


class LogprobPath:
    """How a run computes log-probs: the shared-prefix fast path where it applies (`shared_prefix_blocker`), else one
    padded forward; on CUDA, by default, the padded forward and one backward where they fit (`forward_plan`). The
    settings every forward shares (temperature, logit chunk size); no-grad passes over whole batches,
    `micro_batch_size` rows at a time, under the accelerator's autocast."""

    def __init__(
        self,
        accelerator,
        forward_settings: dict,
        micro_batch_size: int,
        share_prompt_prefix: bool | None,
        router_aux_loss_coef: float,
        sharded: bool,
        backward_per_group: bool | None = None,
        module: nn.Module | None = None,
    ):
        """`forward_settings`: `completion_logps`' `temperature` and `chunk_size` (None: chosen by device), the same
        for every forward. `share_prompt_prefix`, `backward_per_group`: None to choose by device and memory.
        `module`: the bare model, whose MoE load-balancing loss may split into the groups' shares
        (`router_loss_splits`; None: it is taken not to)."""
        self.accelerator, self.sharded, self.router_aux_loss_coef = accelerator, sharded, router_aux_loss_coef
        self.share_prompt_prefix, self.micro_batch_size = share_prompt_prefix, micro_batch_size
        self.temperature = forward_settings.get("temperature", 1.0)
        one_backward = None
        if router_aux_loss_coef != 0.0:  # the expert counts span every group: a routing pass first, or one backward
            why = "no model given" if module is None else router_loss_splits(module)
            if why is not None:
                one_backward = f"router_aux_loss_coef={router_aux_loss_coef}, whose expert counts span every group"
                one_backward += f": {why}"
        self.router_pass = router_aux_loss_coef != 0.0 and one_backward is None  # before a group at a time
        self.planner = Planner(
            accelerator, share_prompt_prefix, backward_per_group, forward_settings.get("chunk_size"), self.temperature,
            one_backward,
        )  # fmt: skip

    def blocker(self, model: nn.Module) -> str | None:
        """Why the shared-prefix forward does not apply to `model` (as Trainer holds it), or None."""
        return shared_prefix_blocker(
            model,
            self.accelerator.unwrap_model(model),
            share_prompt_prefix=self.share_prompt_prefix is not False,
            router_aux_loss_coef=self.router_aux_loss_coef,
            sharded=self.sharded,
        )

    def describe(self, model: nn.Module) -> str:
        """One log line at start-up: the path the training forwards take, or how it is chosen."""
        blocker = self.blocker(model)
        line = self.planner.describe(blocker)
        if self.router_pass and blocker is None and self.share_prompt_prefix is not False:
            line += "; a group at a time runs a no-grad routing pass first (the MoE load-balancing loss's counts)"
        return line

    def plan(self, model: nn.Module, batch: Batch, grad: bool = True) -> ForwardPlan:
        """The `ForwardPlan` of `batch` on `model` (as Trainer holds it); `grad=False` for a no-grad pass."""
        return self.planner.plan(self.accelerator.unwrap_model(model), batch, self._blocker(model, batch), grad)

    def _blocker(self, model: nn.Module, batch: Batch) -> str | None:
        """`blocker`, and for `batch`: images inside its completions (`images_in_completions`)."""
        blocker = self.blocker(model)
        if blocker is None and images_in_completions(self.accelerator.unwrap_model(model), batch):
            blocker = "images inside the completions (tool replies), which the shared-prefix forward does not read"
        return blocker

    def kwargs(self, plan: ForwardPlan, batch: MicroBatch | None = None, replay=None) -> dict:
        """The keyword arguments of `completion_logps` under `plan`. For the training forward of `batch`, with
        `replay` (the sampler's distribution, `rollout.sampling.SamplingReplay`; None: the correction's weight needs
        none): when `batch` is corrected (it has the sampler's log-probs) and has no old log-probs, pi_prox is the
        policy this forward runs, and `prox_replay` (`ProxReplay`) fills `batch.old_sampling_logps` from its logits."""
        kwargs = {"share_prefix": plan.share_prefix, "temperature": self.temperature, "chunk_size": plan.chunk_size}
        if replay is not None and batch is not None and batch.sampling_logps is not None and batch.old_logps is None:
            kwargs["prox_replay"] = ProxReplay.into(replay, batch)
        return kwargs

    def no_grad(self, model: nn.Module, batch: Batch, **kwargs):
        """`logps_in_chunks` of `model` on `batch` [B, T] (with `with_entropy=True`: and the entropy; with `replay`:
        and the replayed log-probs), autocast on: the fast path calls the decoder and LM head directly, not the
        autocast-wrapped forward."""
        first = batch.rows(0, self.micro_batch_size)  # the memory plan's sample; the images' check reads every row
        plan = self.planner.plan(self.accelerator.unwrap_model(model), first, self._blocker(model, batch), grad=False)
        with self.accelerator.autocast():
            return logps_in_chunks(model, batch, self.micro_batch_size, **{**self.kwargs(plan), **kwargs})
