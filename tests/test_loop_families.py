"""The `loop` engine on every kind of cache layer transformers builds: sliding windows (Gemma 3/4, GPT-OSS), Gated
DeltaNet beside full attention (Qwen3.5, Qwen3-Next), convolution (LFM2) and Mamba (GraniteMoeHybrid, Falcon-H1).

Each distinct prompt is prefilled once and its cache (keys, values, conv and recurrent states) repeated to its rows,
and finished rows leave the batch (`cache_layers.select_rows`); the tokens are those `model.generate` draws with the
same uniforms. The tiny configs are `test_families`' (a window of 4, prompts of up to 10 tokens, completions of up to
24), with their weights scaled up so that what a row samples depends on its whole context: a row decoded on another
row's state, or on a window that lost a key, samples other tokens (checked by hand, breaking `select_rows`).
`cuda_graph` serves the sliding windows (its step's mask per layer type): the same tokens, eager and compiled (checked
by hand too: with the full mask on its sliding layers it samples others).
"""

import copy

import pytest
import torch
import transformers
from test_families import ATTENTION, COMMON, CONFIGS, VOCAB, WINDOW, build
from transformers import AutoModelForCausalLM, DynamicCache, GenerationConfig, LlamaConfig, cache_utils

from grpo_hf.cache_layers import cache_keyword, select_rows
from grpo_hf.rollout import loop, make_engine
from grpo_hf.rollout.cuda_graph import CUDAGraphEngine
from grpo_hf.rollout.loop import LoopEngine
from grpo_hf.rollout.sampling import DrawFromStreams, resolve_sampling_settings

FAMILIES = [
    "qwen3_5",
    "qwen3_next",
    "gemma3",
    "gemma4",
    "gemma4_kv_shared",  # its last two layers read the keys of earlier ones (`DummyLayer`s in the cache)
    "gpt_oss",
    "lfm2",
    "granitemoehybrid",
    "falcon_h1",
]
ENDS = [1, 2, 3, 4]  # a sixteenth of the vocabulary ends a completion: rows finish at many lengths
# transformers >= 5.23 puts a `DummyLayer` in the cache for each of Gemma 4's KV-shared layers, which `cuda_graph` does
# not serve; before, the cache has no layer for them, and both engines serve the model
_HAS_DUMMY_LAYER = hasattr(cache_utils, "DummyLayer")
N, P, T = 9, 10, 24


def sharpened(family: str):
    """`test_families.build(family)` in eval mode, its matrices (but the embeddings) scaled by 3."""
    model = (build(family) if family in CONFIGS else _gemma4_kv_shared()).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() >= 2 and "embed" not in name:
                parameter.mul_(3.0)
    return model


def _gemma4_kv_shared():
    if not hasattr(transformers, "Gemma4TextConfig"):
        pytest.skip(f"transformers {transformers.__version__} has no Gemma4TextConfig")
    layers = dict(layer_types=["sliding_attention", "full_attention"] * 2, num_hidden_layers=4)
    layers.update(vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8)  # not 262,144 x 256 per layer
    config = transformers.Gemma4TextConfig(
        **{**COMMON, **layers}, **ATTENTION, sliding_window=WINDOW, num_kv_shared_layers=2
    )
    kinds = [type(layer).__name__ for layer in DynamicCache(config=config).layers]
    if _HAS_DUMMY_LAYER:  # transformers >= 5.23: a `DummyLayer` stands for each shared layer
        assert kinds[2:] == ["DummyLayer"] * 2, kinds
    else:  # before: no cache layer for them; they read the earlier layers' keys from the forward's `shared_kv_states`
        assert kinds == ["DynamicSlidingWindowLayer", "DynamicLayer"], kinds
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).float()


def prompts() -> tuple[torch.Tensor, torch.Tensor]:
    """Three groups of three rows, prompts of 7, 10 and 2 tokens left-padded to 10: ids and mask [N, P]."""
    generator = torch.Generator().manual_seed(0)
    prompt_ids = torch.zeros(N, P, dtype=torch.long)
    for group, length in enumerate((7, 10, 2)):
        prompt_ids[3 * group : 3 * group + 3, P - length :] = torch.randint(5, 64, (length,), generator=generator)
    return prompt_ids, (prompt_ids != 0).long()


class _GlobalDraws:
    """`RowDraws`' interface on the global generator: one uniform per row and step, drawn as the `loop` engine draws
    them (`torch.rand((N, 1))`, finished rows included)."""

    def uniform(self, dtype=torch.float64) -> torch.Tensor:
        return torch.rand((N, 1), dtype=dtype)


def generate_with_loop_draws(model, prompt_ids, prompt_mask, config) -> torch.Tensor:
    """`model.generate`'s completions [N, T'] with the `loop` engine's uniforms: `DrawFromStreams` draws each token
    from the configured distribution, and `generate` (greedy, so it draws no random number of its own) takes it."""
    greedy = GenerationConfig(max_new_tokens=T, do_sample=False, pad_token_id=0, eos_token_id=ENDS)
    draw = DrawFromStreams(resolve_sampling_settings(model, config), _GlobalDraws())
    ids = model.generate(
        input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=greedy, logits_processor=[draw]
    )
    return ids[:, P:]


@pytest.mark.parametrize("family", FAMILIES)
def test_loop_draws_the_tokens_generate_draws(family, monkeypatch):
    model = sharpened(family)
    prompt_ids, prompt_mask = prompts()
    config = GenerationConfig(
        max_new_tokens=T, do_sample=True, temperature=0.8, top_k=0, pad_token_id=0, eos_token_id=ENDS
    )
    engine, why = make_engine("loop", model, config, ENDS)
    assert isinstance(engine, LoopEngine), why
    batch_sizes = []  # the rows each `select_rows` call of the engine leaves in the batch
    monkeypatch.setattr(
        loop, "select_rows", lambda cache, index: batch_sizes.append(len(index)) or select_rows(cache, index)
    )
    torch.manual_seed(5)
    ours = engine.sample(model, prompt_ids, prompt_mask)  # [N, T']
    torch.manual_seed(5)
    reference = generate_with_loop_draws(model, prompt_ids, prompt_mask, config)
    assert ours.shape == reference.shape and torch.equal(ours, reference)
    # 3 prompts prefilled, repeated to 9 rows; then rows left the batch, more than once
    assert batch_sizes[0] == N and len(batch_sizes) >= 3 and batch_sizes[-1] < N, batch_sizes
    ends = [next((t for t, token in enumerate(row) if token in ENDS), T) for row in ours.tolist()]
    assert len(set(ends[:3])) > 1, ends  # rows of one prompt finish at different lengths


# sdpa: a boolean mask; eager (GPT-OSS's sinks): additive; Gemma 4's KV sharing where its cache has no DummyLayer
@pytest.mark.parametrize("family", ["gemma3", "gemma4", "gpt_oss", "gemma4_kv_shared"])
@pytest.mark.parametrize("compiled", [False, True])
def test_cuda_graph_gives_sliding_windows_their_window(family, compiled):
    """`cuda_graph` on full and sliding-window layers (a window of 4, shorter than prompt + completion): the step's
    mask per layer type (`step_masks`) draws the tokens `generate` draws, eagerly and compiled as one graph."""
    if family == "gemma4_kv_shared" and _HAS_DUMMY_LAYER:
        pytest.skip(f"transformers {transformers.__version__} caches Gemma 4's KV-shared layers as DummyLayers")
    model = sharpened(family)
    prompt_ids, prompt_mask = prompts()
    config = GenerationConfig(
        max_new_tokens=T, do_sample=True, temperature=0.8, top_k=0, pad_token_id=0, eos_token_id=ENDS
    )
    assert CUDAGraphEngine.unsupported_reason(model, config) is None
    engine = CUDAGraphEngine(config, ENDS, compile=compiled)
    engine.compile_kwargs = {"fullgraph": True, "backend": "eager", "dynamic": False}
    torch.manual_seed(5)
    ours = engine.sample(model, prompt_ids, prompt_mask)  # [N, T']
    torch.manual_seed(5)
    reference = generate_with_loop_draws(model, prompt_ids, prompt_mask, config)
    assert ours.shape == reference.shape and torch.equal(ours, reference)
    assert engine._buckets and all(bucket.state.window.item() == WINDOW for bucket in engine._buckets.values())


def test_a_layer_the_loop_does_not_serve_falls_back_to_generate_naming_it():
    config = LlamaConfig(**COMMON, **ATTENTION, layer_types=["full_attention", "indexed_attention"])
    model = AutoModelForCausalLM.from_config(config).eval()
    settings = GenerationConfig(max_new_tokens=4, do_sample=True, pad_token_id=0)
    engine, why = make_engine("loop", model, settings, ENDS)
    assert engine.name == "generate" and "DynamicIndexedLayer (layers 1)" in why, why
    # cuda_graph serves full attention and sliding windows: a linear-attention state is named, layer by layer (and so
    # is a layer reading another's keys: test_cuda_graph_names_the_layers_that_read_another_layers_keys)
    reason = CUDAGraphEngine.unsupported_reason(build("qwen3_5"), settings)
    assert reason.endswith("LinearAttentionLayer (layers 0)"), reason
    engine, why = make_engine("auto", build("qwen3_5"), settings, ENDS, device=torch.device("cuda"))
    assert engine.name != "cuda_graph" and "cuda_graph: the model's cache has layers" in why, why


@pytest.mark.skipif(
    not _HAS_DUMMY_LAYER, reason=f"transformers {transformers.__version__} has no cache_utils.DummyLayer"
)
def test_cuda_graph_names_the_layers_that_read_another_layers_keys():
    """Gemma 4's KV-shared layers, `DummyLayer`s in the cache (transformers >= 5.23), are named, layer by layer: the
    step's static cache has no keys of their own for them to read."""
    settings = GenerationConfig(max_new_tokens=4, do_sample=True, pad_token_id=0)
    reason = CUDAGraphEngine.unsupported_reason(sharpened("gemma4_kv_shared"), settings)
    assert reason.endswith("DummyLayer (layers 2, 3)"), reason


@torch.no_grad()
@pytest.mark.parametrize("family", ["qwen3_5", "gemma3", "falcon_h1"])
def test_selected_rows_are_independent_of_each_other_and_of_the_prompts_cache(family):
    """`select_rows` repeats a prompt's conv, recurrent, key and value states into tensors of their own: a state
    written in place in one row (as linear-attention layers write theirs) reaches no other row and not the source."""
    model = build(family).eval()
    prompt_ids, prompt_mask = prompts()
    cache = DynamicCache(config=model.config)
    model(input_ids=prompt_ids[:1], attention_mask=prompt_mask[:1], use_cache=True, **{cache_keyword(model): cache})
    source = copy.deepcopy(cache)
    select_rows(cache, torch.tensor([0, 0, 0]))
    states = [state for layer in cache.layers for state in _states(layer)]
    assert states and all(state.size(0) == 3 for state in states)
    for state, before in zip(states, [s for layer in source.layers for s in _states(layer)], strict=True):
        assert torch.equal(state, before.expand_as(state))
        state[1].add_(1.0)  # one row's state, written in place
        assert torch.equal(state[0], before[0]) and torch.equal(state[2], before[0])
    for layer, before in zip(cache.layers, source.layers, strict=True):  # the source cache is its own too
        assert not any(s.data_ptr() == b.data_ptr() for s in _states(layer) for b in _states(before))


def _states(layer) -> list[torch.Tensor]:
    """A cache layer's tensors: keys and values, conv and recurrent states (those it holds)."""
    tensors = [getattr(layer, name, None) for name in ("keys", "values")]
    for name in ("conv_states", "recurrent_states"):
        tensors += list(getattr(layer, name, {}).values())
    return [tensor for tensor in tensors if tensor is not None]


class _TwoTurns:
    """Tool episodes for `decode_turns`: each context samples two turns, its second (the context, the first turn
    and `reply`) ready at the first poll after its first turn ends."""

    def __init__(self, contexts: list[list[int]], reply: list[int], budget: int):
        self.contexts, self.reply, self.budget = [list(c) for c in contexts], reply, budget
        self.ready, self.done, self.polled_mid_decode = list(range(len(contexts))), [], False
        self.turns = [0] * len(contexts)

    def poll(self, block: bool):
        ready, self.ready = self.ready, []
        self.polled_mid_decode |= not block
        return [(k, list(self.contexts[k]), self.budget) for k in ready]

    def turn_done(self, k: int, turn: list[int], logps: list[float]) -> None:
        self.done.append((list(self.contexts[k]), list(turn), list(logps)))
        self.contexts[k] += turn
        self.turns[k] += 1
        if self.turns[k] == 1:
            self.contexts[k] += self.reply
            self.ready.append(k)


@torch.no_grad()
@pytest.mark.parametrize("family", ["qwen3_5", "gemma3", "lfm2"])
def test_tool_turns_on_a_hybrid_cache_read_their_own_context(family):
    """`decode_turns` on caches with sliding windows or linear-attention states: a turn that comes back while others
    decode joins the batch at the next step (`cache_layers` pads and joins every layer kind by row); finished rows
    leave the batch; every sampled token's log-prob is the one a plain forward over its context gives."""
    model = sharpened(family)
    contexts = [[5, 6, 7], list(range(10, 22)), [30, 31, 32, 33, 34, 35]]
    source = _TwoTurns(contexts, reply=[40, 41, 42], budget=10)
    config = GenerationConfig(do_sample=True, top_k=0, max_new_tokens=10, pad_token_id=0)
    torch.manual_seed(0)
    loop.decode_turns(model, source, config, ENDS)
    assert len(source.done) == 6 and source.polled_mid_decode
    assert len({len(turn) for _, turn, _ in source.done}) > 1  # turns of several lengths: rows left the batch
    for context, turn, logps in source.done:
        ids = torch.tensor([context + turn])
        expected = torch.log_softmax(model(input_ids=ids).logits[0, len(context) - 1 : -1].float(), dim=-1)
        expected = expected.gather(1, torch.tensor(turn)[:, None]).squeeze(1)
        torch.testing.assert_close(torch.tensor(logps), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["qwen3_5", "gemma3", "lfm2", "falcon_h1"])
def test_loop_records_the_log_probs_its_tokens_were_drawn_with(family):
    """`record_logps` on a hybrid or sliding-window cache: each token's log-prob under the distribution it was drawn
    from is the one a padded forward over prompt + completion gives."""
    model = sharpened(family)
    prompt_ids, prompt_mask = prompts()
    config = GenerationConfig(
        max_new_tokens=T, do_sample=True, temperature=0.8, top_k=0, pad_token_id=0, eos_token_id=ENDS
    )
    engine, why = make_engine("loop", model, config, ENDS, record_logps=True)
    assert isinstance(engine, LoopEngine), why
    torch.manual_seed(5)
    completions = engine.generate(model, prompt_ids, prompt_mask)
    mask = completions.completion_mask  # [N, T']
    ids, attended = torch.cat([prompt_ids, completions.completion_ids], 1), torch.cat([prompt_mask, mask], 1)
    positions = (attended.cumsum(-1) - 1).masked_fill(attended == 0, 1)  # as `generate` numbers them
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attended, position_ids=positions).logits[:, P - 1 : -1]
    expected = torch.log_softmax(logits.float() / 0.8, dim=-1).gather(2, ids[:, P:, None]).squeeze(2)
    expected = expected.masked_fill(mask == 0, 0)  # [N, T']
    torch.testing.assert_close(engine.sampling_logps, expected, rtol=1e-5, atol=1e-5)
