"""What tool episodes' turns keep of their KV caches between turns (`loop.decode_turns`), under a byte budget.

A tool episode alternates the model's turns and tool replies, and each turn's context is the previous turn's context,
the turn, and the reply. Without this cache a turn that rejoins the decoding batch prefills its whole context again
(prompt, system block, tool schemas, every earlier turn): an episode of n turns prefills its prompt n times. With it:

- when a turn ends and its episode waits for tools, the row's state is copied out of the batch's cache into an entry of
  its own (`keep`): per layer, what a batch-1 cache would hold after the context's tokens but the last sampled one
  (which was never fed): keys and values (full attention: all of them; a sliding window: the last window - 1), a
  conv state and a recurrent state (linear attention, convolution, Mamba), or both (hybrid layers), through
  `cache_layers.cut_row`;
- when the episode rejoins, its entry is the base of its row (`base`, `cache_layers.stack_rows`): only the tokens
  after it (the turn's last token and the tool reply) are fed on top of it, so a recurrent state has taken every
  context token exactly once;
- the longest token prefix the batch's first contexts share (chat template header, system prompt, tool schemas) is
  prefilled once (`set_prefix`) and is the base of every row that has no entry of its own.

The entries live on the model's device. Their bytes are counted against `budget_bytes`; an entry that does not fit in
what is left is not kept (its episode re-prefills its whole context, as without the cache) and counts as an eviction:
nothing already kept is dropped for it, so a row about to rejoin never loses its entry to a later one. An episode
that will not come back (its reply rolled back, or filling its budget, or bringing images that `generate` goes on
with) has its entry dropped when it ends (`drop`, on the source's word: `_Turns.ended`), so it holds no budget that a
live row needs. `stats` counts what happened: `prefill_tokens` (real tokens run through prefill forwards),
`prefill_positions` (the positions those forwards computed, padding included), `reused_tokens` (context tokens a
joining row took from an entry or the shared prefix instead), `evictions`, `kept` and `hits` (rows that rejoined on
their own entry).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from grpo_hf.cache_layers import RowState, cut_row

# The default byte budget of `GRPOConfig.episode_cache_gb`: 4 GiB holds about 90,000 tokens of a 7B-class model
# (28 layers x 4 key-value heads x 128 x 2 x bf16 = 57 KiB a token), e.g. 64 rows of 1,400-token contexts.
DEFAULT_BUDGET_GB = 4.0
# A prefix shorter than this is not worth a forward of its own.
MIN_SHARED_PREFIX = 16


@dataclass
class Entry:
    """A context's first tokens as a batch-1 cache would hold them: every layer's `cache_layers.RowState`."""

    tokens: list[int]  # the context tokens the states are of (fed, all of them, and nothing else)
    layers: list[RowState]  # per layer: keys and values, and/or conv and recurrent states

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)


class EpisodeCache:
    """Kept entries by episode key, the shared prefix, the budget and the counts (module docstring)."""

    def __init__(self, budget_bytes: int):
        if budget_bytes < 0:
            raise ValueError(f"The episode cache's budget must be >= 0 bytes, got {budget_bytes}.")
        self.budget_bytes = int(budget_bytes)
        self.entries: OrderedDict[Hashable, Entry] = OrderedDict()
        self.prefix: Entry | None = None
        self.prefix_chosen = False  # the shared prefix is chosen once, from the first join of two or more rows
        self.used_bytes = 0
        self.peak_bytes = 0
        self.stats = {
            "prefill_tokens": 0,
            "prefill_positions": 0,
            "reused_tokens": 0,
            "evictions": 0,
            "kept": 0,
            "hits": 0,
        }

    def count_prefill(self, tokens: int, positions: int) -> None:
        """Count a prefill forward: its real `tokens`, and its `positions` (rows x width: what it computed, padding
        included)."""
        self.stats["prefill_tokens"] += tokens
        self.stats["prefill_positions"] += positions

    def shared_prefix_length(self, contexts: Sequence[Sequence[int]]) -> int:
        """How many leading tokens of `contexts` to prefill once for all: their longest common prefix, each context
        keeping at least one token of its own; 0 when it is shorter than `MIN_SHARED_PREFIX` or when a prefix was
        chosen before. The prefix is chosen once, from the first call with two or more contexts (a run's first join
        holds every episode's first turn)."""
        if self.prefix_chosen or len(contexts) < 2:
            return 0
        self.prefix_chosen = True
        first, length = contexts[0], min(len(c) for c in contexts) - 1
        for context in contexts[1:]:
            same = 0
            while same < length and context[same] == first[same]:
                same += 1
            length = same
        return length if length >= MIN_SHARED_PREFIX else 0

    def set_prefix(self, entry: Entry) -> None:
        """The shared prefix: kept if it fits in the budget (else rows prefill it as their own)."""
        if self._fits(entry):
            self.prefix = entry
            self._add(entry)

    def keep(self, key: Hashable, entry: Entry) -> None:
        """Keep `entry` for episode `key` until it rejoins, if it fits in what is left of the budget."""
        self.drop(key)
        if not self._fits(entry):
            self.stats["evictions"] += 1
            return
        self.entries[key] = entry
        self._add(entry)
        self.stats["kept"] += 1

    def base(self, key: Hashable, context: Sequence[int]) -> Entry | None:
        """The entry a joining row of episode `key` with `context` prefills on top of, taken out of the cache: the
        episode's own when its tokens begin `context` (and leave some of it to prefill), else the shared prefix when
        `context` begins with it, else None (the whole context is prefilled)."""
        own = self.entries.pop(key, None)
        if own is not None:
            self.used_bytes -= own.nbytes
            if _begins(context, own.tokens):
                self.stats["hits"] += 1
                return own
        if self.prefix is not None and _begins(context, self.prefix.tokens):
            return self.prefix
        return None

    def drop(self, key: Hashable) -> None:
        entry = self.entries.pop(key, None)
        if entry is not None:
            self.used_bytes -= entry.nbytes

    def clear(self) -> None:
        """Drop every entry and the shared prefix (their memory goes back); `stats` and `peak_bytes` stay."""
        self.entries.clear()
        self.prefix, self.prefix_chosen, self.used_bytes = None, False, 0

    def _fits(self, entry: Entry) -> bool:
        return self.used_bytes + entry.nbytes <= self.budget_bytes

    def _add(self, entry: Entry) -> None:
        self.used_bytes += entry.nbytes
        self.peak_bytes = max(self.peak_bytes, self.used_bytes)


def _begins(context: Sequence[int], tokens: Sequence[int]) -> bool:
    """Whether `context` begins with `tokens` and goes on past them."""
    return len(tokens) < len(context) and list(context[: len(tokens)]) == list(tokens)


def row_entry(cache, tokens: torch.Tensor, mask: torch.Tensor, row: int, width: int) -> Entry:
    """Row `row` of a decoding batch's `cache` (which has fed the first `width` of the `tokens` [A, W'] columns; `mask`
    [A, W'] 1 on real tokens) as an entry of its own: each layer's state of the row (`cache_layers.cut_row`), copied,
    and the real tokens it is of."""
    columns = torch.nonzero(mask[row, :width]).flatten()  # [c]
    return Entry(tokens[row, columns].tolist(), [cut_row(layer, row, columns, width) for layer in cache.layers])


def cache_entry(cache, ids: torch.Tensor) -> Entry:
    """A batch-1 `cache` that has fed `ids` [1, L] as an entry."""
    return row_entry(cache, ids, torch.ones_like(ids), 0, ids.size(1))
