"""The episode cache of `loop.decode_turns`: a row's keys and values kept across its turns, a batch's shared prefix
prefilled once, identical contexts once; the episodes' tokens and log-probs those of the full re-prefill."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import build_tiny_model, torchrun
from transformers import GenerationConfig

from grpo_hf.cache_layers import RowState
from grpo_hf.rollout.episode_cache import MIN_SHARED_PREFIX, Entry, EpisodeCache
from grpo_hf.rollout.loop import decode_turns
from grpo_hf.rollout.sampling import RowDraws

SEED = 1234


class _Episodes:
    """Episodes of several turns for `decode_turns`: each turn's reply comes back after a random number of polls (a
    tool of random latency, the same for the same `latency_seed`), some episodes end early, each row draws from its
    own stream (so its tokens do not depend on the batch it shares), and `turn_done` says whether the episode comes
    back. A blocking poll hands back only the reply due first, as real tools do."""

    def __init__(self, prompts, replies, turns, budget: int, latency_seed: int):
        self.contexts, self.replies, self.turns = [list(p) for p in prompts], replies, turns
        self.budget, self.rng = budget, random.Random(latency_seed)
        self.count, self.drawn = [0] * len(prompts), [0] * len(prompts)
        self.ready, self.waiting, self.done, self.polls = list(range(len(prompts))), [], [], 0
        self.joined_mid_decode = False

    def poll(self, block: bool):
        self.polls += 1
        back = [k for k, at in self.waiting if at <= self.polls]
        if block and not back and self.waiting:
            back = [min(self.waiting, key=lambda w: w[1])[0]]
        self.waiting = [(k, at) for k, at in self.waiting if k not in back]
        ready, self.ready = self.ready + back, []
        self.joined_mid_decode |= bool(ready) and not block
        return [(k, list(self.contexts[k]), self.budget) for k in ready]

    def draws(self, keys) -> RowDraws:
        return RowDraws(SEED, torch.tensor(list(keys)), torch.tensor([self.drawn[k] for k in keys]))

    def turn_done(self, k, turn, logps) -> bool:
        self.done.append((k, list(self.contexts[k]), list(turn), list(logps)))
        self.count[k] += 1
        self.drawn[k] += len(turn)
        self.contexts[k] += turn
        if self.count[k] >= self.turns[k]:
            return False
        self.contexts[k] += self.replies[k % len(self.replies)]
        self.waiting.append((k, self.polls + self.rng.randint(0, 4)))
        return True

    def episodes(self) -> list[list[tuple]]:
        """Each episode's turns, in order: (context, turn, log-probs)."""
        return [[d[1:] for d in self.done if d[0] == k] for k in range(len(self.contexts))]


def _prompts(tokenizer, groups: int = 3, group_size: int = 2) -> list[list[int]]:
    """Prompts that share a system block longer than `MIN_SHARED_PREFIX`, then differ; each repeated `group_size`
    times in a row (a GRPO group's rows)."""
    system = tokenizer("system: you may call tools. " * 4, add_special_tokens=False)["input_ids"]
    assert len(system) > MIN_SHARED_PREFIX
    asks = ["what is 2+2?", "a longer question about the weather today", "hi"][:groups]
    return [system + tokenizer(a, add_special_tokens=False)["input_ids"] for a in asks for _ in range(group_size)]


def _run(model, tokenizer, cache_bytes: int | None, *, latency_seed=0, do_sample=True, **settings):
    replies = [tokenizer(r, add_special_tokens=False)["input_ids"] for r in (" <r> 4 </r>", " <r> sunny, 21 C </r>")]
    prompts = _prompts(tokenizer)
    source = _Episodes(prompts, replies, turns=[3, 1, 4, 2, 3, 4], budget=8, latency_seed=latency_seed)
    config = GenerationConfig(
        do_sample=do_sample, top_k=0, max_new_tokens=8, pad_token_id=tokenizer.pad_token_id, **settings
    )
    store = EpisodeCache(cache_bytes) if cache_bytes is not None else None
    ends = [i for i in range(len(tokenizer)) if i % 7 == 0]  # a seventh of the tokens end a turn: varied lengths
    decode_turns(model, source, config, ends, episode_cache=store)
    return source, store


def _assert_same_episodes(cached: _Episodes, plain: _Episodes) -> None:
    for with_cache, without in zip(cached.episodes(), plain.episodes(), strict=True):
        assert [(c, t) for c, t, _ in with_cache] == [(c, t) for c, t, _ in without]
        for (_, _, a), (_, _, b) in zip(with_cache, without, strict=True):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-5, atol=1e-5)


@torch.no_grad()
@pytest.mark.parametrize("latency_seed", [0, 1, 2])
def test_kept_caches_give_the_tokens_and_log_probs_of_the_full_re_prefill(tokenizer, latency_seed):
    """With tools of random latency: every episode's turns (tokens) and log-probs equal those of today's decoding,
    which prefills each turn's whole context; the cached run prefilled the shared prefix once, each group's first
    context once, and on every rejoin only the turn's last token and the reply."""
    model = build_tiny_model(tokenizer, seed=1).eval()
    plain, _ = _run(model, tokenizer, None, latency_seed=latency_seed)
    cached, store = _run(model, tokenizer, 1 << 30, latency_seed=latency_seed)
    _assert_same_episodes(cached, plain)
    assert cached.joined_mid_decode
    rejoins = sum(len(turns) - 1 for turns in cached.episodes())
    assert store.stats["hits"] == store.stats["kept"] == rejoins > 0 and store.stats["evictions"] == 0
    prompts, replies = _prompts(tokenizer), cached.replies
    shared = len(store_prefix_tokens(prompts))
    first_turns = sum(len(p) - shared for p in prompts[::2])  # one row of each group
    after = sum(len(turns[i - 1][1][-1:]) + len(turns[i][0]) - len(turns[i - 1][0]) - len(turns[i - 1][1])
                for turns in cached.episodes() for i in range(1, len(turns)))  # fmt: skip
    assert store.stats["prefill_tokens"] == shared + first_turns + after
    assert all(len(r) > 0 for r in replies) and not store.entries and store.prefix is None  # released at the end


def store_prefix_tokens(prompts: list[list[int]]) -> list[int]:
    """The longest common prefix of `prompts` (all of them keep a token of their own)."""
    n = 0
    while n < min(map(len, prompts)) - 1 and len({p[n] for p in prompts}) == 1:
        n += 1
    return prompts[0][:n]


@torch.no_grad()
def _assert_plain_forward_logps(model, cached) -> None:
    """Each turn's log-probs in `cached` are those of a plain forward of `model` over its whole context."""
    for turns in cached.episodes():
        for context, turn, logps in turns:
            ids = torch.tensor([context + turn])
            expected = torch.log_softmax(model(input_ids=ids).logits[0, len(context) - 1 : -1].float(), dim=-1)
            expected = expected.gather(1, torch.tensor(turn)[:, None]).squeeze(1)
            torch.testing.assert_close(torch.tensor(logps), expected, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_the_log_probs_are_the_models_on_each_turns_context(tokenizer):
    """Each cached turn's log-probs are those of a plain forward over its whole context (nothing stale, no row
    reading another's keys)."""
    model = build_tiny_model(tokenizer, seed=2).eval()
    cached, _ = _run(model, tokenizer, 1 << 30)
    _assert_plain_forward_logps(model, cached)


@torch.no_grad()
@pytest.mark.parametrize("budget_rows", [0, 1, 3])
def test_a_small_budget_evicts_and_falls_back_to_the_full_prefill(tokenizer, budget_rows):
    """A budget that holds the shared prefix and a few rows' caches (or none): rows that do not fit are counted as
    evictions and re-prefill their whole context; tokens and log-probs are unchanged, and the kept bytes never pass
    the budget."""
    model = build_tiny_model(tokenizer, seed=1).eval()
    per_token = 2 * 2 * model.config.num_key_value_heads * (32 // 4) * 4  # layers x (K, V) x heads x head dim x fp32
    prefix = len(store_prefix_tokens(_prompts(tokenizer)))
    budget = per_token * (prefix + budget_rows * 40)
    plain, _ = _run(model, tokenizer, None)
    cached, store = _run(model, tokenizer, budget)
    _assert_same_episodes(cached, plain)
    assert store.stats["evictions"] > 0 and store.peak_bytes <= budget
    assert store.stats["kept"] + store.stats["evictions"] == sum(len(t) - 1 for t in cached.episodes())


@torch.no_grad()
def test_greedy_turns_are_greedy_generate_on_their_contexts(tokenizer):
    """`do_sample=False`: each turn is what greedy `model.generate` gives on the turn's context."""
    model = build_tiny_model(tokenizer, seed=3).eval()
    cached, _ = _run(model, tokenizer, 1 << 30, do_sample=False)
    ends = [i for i in range(len(tokenizer)) if i % 7 == 0]
    for turns in cached.episodes():
        for context, turn, _ in turns:
            out = model.generate(
                torch.tensor([context]), attention_mask=torch.ones(1, len(context), dtype=torch.long),
                do_sample=False, max_new_tokens=len(turn), eos_token_id=ends, pad_token_id=tokenizer.pad_token_id,
            )  # fmt: skip
            assert out[0, len(context) :].tolist() == turn


@torch.no_grad()
def test_repetition_penalty_reads_the_same_tokens_with_the_cache(tokenizer):
    """The repetition penalty reads every token of a row's context: the masked gap of a row on a kept cache holds
    none that the row does not have, so the penalised draws are those of the full re-prefill."""
    model = build_tiny_model(tokenizer, seed=4).eval()
    plain, _ = _run(model, tokenizer, None, repetition_penalty=1.7)
    cached, _ = _run(model, tokenizer, 1 << 30, repetition_penalty=1.7)
    _assert_same_episodes(cached, plain)


def test_entries_are_taken_only_by_contexts_that_begin_with_them():
    """`EpisodeCache.base`: an episode's own entry when its tokens begin the context (and leave some of it), else the
    shared prefix, else None; an entry that does not fit is an eviction, and nothing kept is dropped for it."""
    store = EpisodeCache(budget_bytes=48)  # an entry of two tokens: 2 x 2 x 2 floats x 4 bytes = 32

    def entry(tokens):
        return Entry(tokens, [RowState(torch.zeros(1, 1, len(tokens), 2), torch.zeros(1, 1, len(tokens), 2))])

    contexts = [list(range(20)) + [50, 51], list(range(20)) + [60]]
    assert store.shared_prefix_length(contexts) == 20 and store.shared_prefix_length(contexts) == 0  # chosen once
    store.keep("a", entry([1, 2]))
    store.keep("b", entry([3, 4]))  # over the budget
    assert store.stats == {
        "prefill_tokens": 0, "prefill_positions": 0, "reused_tokens": 0, "evictions": 1, "kept": 1, "hits": 0
    }  # fmt: skip
    assert store.base("a", [1, 2]) is None  # nothing left to prefill: not taken (and dropped)
    store.keep("a", entry([1, 2]))
    assert store.base("a", [1, 2, 3]).tokens == [1, 2] and store.used_bytes == 0 and store.stats["hits"] == 1
    store.keep("a", entry([1, 2]))
    assert store.base("a", [9, 2, 3]) is None and store.used_bytes == 0  # a context that does not begin with it


# ---- training: the cache on and off give the same run ---------------------------------------------------------------
def _assert_same_runs(runs: dict, on: str, off: str) -> None:
    """Runs `on` and `off` (the cache on and off) sampled the same completions and trained to the same parameters;
    the cached one rejoined on kept caches and evicted none."""
    for (ids, logps, _), (ids_off, logps_off, counts) in zip(runs[on]["rollouts"], runs[off]["rollouts"], strict=True):
        assert torch.equal(ids, ids_off) and counts is None
        if logps is not None:
            torch.testing.assert_close(logps, logps_off, rtol=1e-5, atol=1e-5)
    for name, value in runs[off]["params"].items():
        torch.testing.assert_close(runs[on]["params"][name], value, rtol=1e-5, atol=1e-6, msg=name)
    counts = [r[2] for r in runs[on]["rollouts"]]
    assert all(0 < c["hits"] <= c["kept"] and c["evictions"] == 0 for c in counts)  # a rolled-back reply: no rejoin
    logged = runs[on]["logs"]
    assert all(row["tools/cache_evictions"] == 0 and row["tools/reused_tokens_mean"] > 0 for row in logged)
    assert all("tools/prefill_tokens_mean" not in row for row in runs[off]["logs"])


@pytest.mark.parametrize("staleness", [0, 1])
def test_training_with_the_cache_is_training_without_it(tmp_path, staleness):
    """One process, tool episodes of three turns whose tool has a random latency, the episode cache on and off: the
    same completions, sampling log-probs and parameters after two steps, at max_staleness 0 and 1."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent / "distributed"))
    from episode_cache_step import RUNS, run

    runs = {name: run(tmp_path / name, *RUNS[name]) for name in (f"on{staleness}", f"off{staleness}")}
    _assert_same_runs(runs, f"on{staleness}", f"off{staleness}")


def test_two_processes_with_the_cache_train_as_without_it(tmp_path):
    """DDP with 2 processes (each its own episodes and cache; the metrics summed over both): the cache on and off
    give the same runs at max_staleness 0 and 1."""
    out = tmp_path / "episode_cache.pt"
    torchrun("episode_cache_step.py", out, timeout=900)
    runs = torch.load(out)
    _assert_same_runs(runs, "on0", "off0")
    _assert_same_runs(runs, "on1", "off1")


# ---- every cache layer kind: sliding windows, linear attention, convolution, Mamba, hybrids -------------------------
FAMILIES = ["qwen3_5", "qwen3_next", "gemma3", "gemma4_kv_shared", "gpt_oss", "lfm2", "falcon_h1"]


def _family_run(model, cache_bytes: int | None, latency_seed: int, **settings):
    """`_run`'s episodes on a `test_families` model (a vocabulary of 64): prompts that share a 20-token system block,
    replies longer and shorter than the sliding window (4), turns of up to 8 tokens, a sixteenth of the tokens ending
    a turn."""
    system = list(range(5, 25))
    prompts = [system + ask for ask in ([30, 31, 32], [40, 41, 42, 43, 44, 45, 46, 47], [50]) for _ in range(2)]
    replies = [[60, 61, 62], [52, 53, 54, 55, 56, 57, 58, 59, 60]]
    source = _Episodes(prompts, replies, turns=[3, 1, 4, 2, 3, 4], budget=8, latency_seed=latency_seed)
    config = GenerationConfig(do_sample=True, top_k=0, max_new_tokens=8, pad_token_id=0, **settings)
    store = EpisodeCache(cache_bytes) if cache_bytes is not None else None
    decode_turns(model, source, config, [1, 2, 3, 4], episode_cache=store)
    return source, store


@torch.no_grad()
@pytest.mark.parametrize("family", FAMILIES)
def test_every_layer_kind_keeps_its_rows_state_across_turns(family):
    """On hybrid (Gated DeltaNet, convolution, Mamba), sliding-window and KV-shared models, with tools of random
    latency: the episodes with the cache on are token for token those with it off (and their log-probs), rows joined
    mid-decode, and every rejoin took its kept state: only the turn's last token and the reply were prefilled."""
    from test_loop_families import sharpened

    model = sharpened(family)
    for latency_seed in (0, 1):
        plain, _ = _family_run(model, None, latency_seed)
        cached, store = _family_run(model, 1 << 30, latency_seed)
        _assert_same_episodes(cached, plain)
        assert cached.joined_mid_decode
        rejoins = sum(len(turns) - 1 for turns in cached.episodes())
        assert store.stats["hits"] == store.stats["kept"] == rejoins > 0 and store.stats["evictions"] == 0
        after = sum(len(turns[i][0]) - len(turns[i - 1][0]) - len(turns[i - 1][1]) + 1
                    for turns in cached.episodes() for i in range(1, len(turns)))  # fmt: skip
        first_turns = sum(
            len(turns[0][0]) - 20 for turns in cached.episodes()[::2]
        )  # one row a group, past the prefix
        assert store.stats["prefill_tokens"] == 20 + first_turns + after
    _assert_plain_forward_logps(model, cached)


# ---- entries of episodes that will not come back --------------------------------------------------------------------
class _SomeDie:
    """Eight episodes of distinct 10-token prompts: the first four end their turn after 4 tokens and call tools whose
    replies never come back (rolled back), and say so (`ended`) at the next poll; the other four end after 8 tokens,
    and come back at the next poll for a last turn."""

    def __init__(self):
        self.contexts = [[10 * k + j for j in range(10)] for k in range(1, 9)]
        self.ready, self.gone, self.done = list(range(8)), [], []

    def poll(self, block: bool):
        ready, self.ready = self.ready, []
        return [(k, list(self.contexts[k]), 4 if k < 4 else 8) for k in ready]

    def ended(self) -> list[int]:
        gone, self.gone = self.gone, []
        return gone

    def turn_done(self, k, turn, logps) -> bool:
        self.done.append(k)
        self.contexts[k] += turn
        if k < 4:
            self.gone.append(k)
        elif self.done.count(k) == 1:
            self.contexts[k] += [5, 6, 7]
            self.ready.append(k)
        else:
            return False
        return True


@torch.no_grad()
def test_entries_of_episodes_that_will_not_come_back_are_dropped_when_they_end(tokenizer):
    """A budget of four live rows' entries (17 tokens each): the four episodes whose replies are rolled back end their
    turns first; their entries (13 tokens each) go when the source says they ended, and the four live rows keep
    theirs: 0 evictions (4 when the dead entries were kept until the rollout's end)."""
    model = build_tiny_model(tokenizer, seed=1).eval()
    per_token = 2 * 2 * model.config.num_key_value_heads * (32 // 4) * 4  # layers x (K, V) x heads x head dim x fp32
    store = EpisodeCache(4 * 17 * per_token)
    source = _SomeDie()
    config = GenerationConfig(do_sample=False, max_new_tokens=8, pad_token_id=tokenizer.pad_token_id)
    decode_turns(model, source, config, [], episode_cache=store)
    assert sorted(source.done) == [0, 1, 2, 3] + [4, 4, 5, 5, 6, 6, 7, 7]
    assert store.stats["evictions"] == 0 and store.stats["hits"] == 4 and store.peak_bytes <= store.budget_bytes


def test_the_turns_source_names_the_episodes_that_will_not_come_back():
    """`episodes._Turns`: an episode whose tool calls are done but that is not ready for a turn here (its reply rolled
    back or filling the budget, or brought images, which `generate` goes on with) is named once by `ended`."""
    from types import SimpleNamespace

    from grpo_hf.rollout.episodes import _Turns

    episodes = [SimpleNamespace(image_row=None) for _ in range(5)]
    episodes[3].image_row = "images"
    runner = SimpleNamespace(_take_replies=lambda calling, counts: ([episodes[1], episodes[3]], [episodes[4]]))
    turns = _Turns(runner, episodes, seed=0)
    turns.ready, turns.in_flight = [], [0, 1, 2, 3, 4]
    turns._collect()
    assert turns.ready == [1] and turns.held == [3] and turns.in_flight == [4]
    assert sorted(turns.ended()) == [0, 2, 3] and turns.ended() == []


# ---- joins: rows of unlike rests prefill apart ----------------------------------------------------------------------
class _Replies:
    """Four episodes of 10-token prompts: a first turn of 4 tokens, then all four come back together with replies of
    `replies` tokens, for a last turn."""

    def __init__(self, replies: list[int]):
        self.contexts = [[10 * k + j for j in range(10)] for k in range(1, 5)]
        self.replies, self.ready, self.done = replies, list(range(4)), []

    def poll(self, block: bool):
        ready, self.ready = self.ready, []
        return [(k, list(self.contexts[k]), 4) for k in ready]

    def turn_done(self, k, turn, logps) -> bool:
        self.done.append((k, list(self.contexts[k]), list(turn)))
        self.contexts[k] += turn
        if sum(d[0] == k for d in self.done) == 2:
            return False
        self.contexts[k] += [20 + j % 200 for j in range(self.replies[k])]
        if all(sum(d[0] == j for d in self.done) == 1 for j in range(4)):
            self.ready = [0, 1, 2, 3]
        return True


@torch.no_grad()
def test_rows_rejoining_together_prefill_in_buckets_of_their_rest(tokenizer):
    """Replies of 5, 5, 5 and 400 tokens rejoining at once: the 401-token rest and the three 6-token rests prefill
    apart, 419 positions for 419 tokens (one padded prefill computed 4 x 401 = 1,604); the turns are those of the
    cache off, and `prefill_positions` counts what the forwards computed."""
    model = build_tiny_model(tokenizer, seed=1).eval()
    config = GenerationConfig(do_sample=False, max_new_tokens=4, pad_token_id=tokenizer.pad_token_id)
    runs = {}
    for cache_bytes in (None, 1 << 30):
        source, store = _Replies([5, 5, 5, 400]), EpisodeCache(cache_bytes) if cache_bytes else None
        decode_turns(model, source, config, [], episode_cache=store)
        runs[cache_bytes] = sorted(source.done)
    assert runs[None] == runs[1 << 30] and len(runs[None]) == 8
    assert store.stats["prefill_tokens"] == store.stats["prefill_positions"] == 4 * 10 + 3 * 6 + 401


def test_buckets_pad_within_the_slack_and_never_between_a_base_and_its_rest():
    """`loop._buckets`: longest rests first; a shorter rest joins a bucket while its positions stay within
    `PADDING_SLACK` x its tokens, and only a row that may be padded (full attention, or no base); equal rests share."""
    from grpo_hf.rollout.loop import PADDING_SLACK, _buckets

    assert PADDING_SLACK == 1.2
    assert _buckets([10, 9, 3, 9], [True] * 4) == [[0, 1, 3], [2]]  # 3 more rows x 10 = 40 > 1.2 x 31
    assert _buckets([10, 9, 3, 9], [True, False, True, False]) == [[0], [1, 3], [2]]
    assert _buckets([5, 5, 5, 400], [True] * 4) == [[3], [0, 1, 2]]
    rests = [random.Random(s).randint(1, 50) for s in range(40)]
    for bucket in _buckets(rests, [True] * 40):
        assert len(bucket) * max(rests[i] for i in bucket) <= PADDING_SLACK * sum(rests[i] for i in bucket)


@torch.no_grad()
def test_a_model_whose_layers_cannot_be_kept_counts_what_it_prefilled(monkeypatch):
    """A layer class that fails `cache_layers`' import-time check (here Gated DeltaNet's, taken out of `JOINABLE`): the
    turns are those with the cache off, nothing is kept, and the counts say that every turn prefilled its whole
    context (no "0.0" where every turn re-prefilled), padding included in the positions."""
    from test_loop_families import sharpened
    from transformers.cache_utils import LinearAttentionLayer

    from grpo_hf.cache_layers import SELECTABLE
    from grpo_hf.rollout import loop

    model = sharpened("qwen3_5")
    plain, _ = _family_run(model, None, latency_seed=0)
    monkeypatch.setattr(loop, "JOINABLE", tuple(c for c in SELECTABLE if c is not LinearAttentionLayer))
    cached, store = _family_run(model, 1 << 30, latency_seed=0)
    _assert_same_episodes(cached, plain)
    contexts = sum(len(context) for turns in cached.episodes() for context, _, _ in turns)
    assert store.stats["prefill_tokens"] == contexts and store.stats["prefill_positions"] >= contexts
    assert store.stats["kept"] == store.stats["hits"] == store.stats["reused_tokens"] == 0
