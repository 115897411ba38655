"""`grpo_hf.cache_layers` checks transformers' cache layers at import instead of trusting them: a layer attribute it
does not know, a copy that changes the prompt's layer, or a rollback count left unset takes the class out of
`REPEATABLE` with the reason logged, and a model with it trains with the padded forward instead of crashing inside the
model (transformers 5.25 did both: `recurrent_states_to_keep=None` read as a count, and an in-place token counter)."""

import inspect
import logging

import pytest
import torch
import transformers
from test_families import CONFIGS, build, logps_grads_aux, make_batch
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionLayer

from grpo_hf import cache_layers
from grpo_hf.cache_layers import KNOWN_ATTRIBUTES, LAYER_PROBLEMS, REPEATABLE, SELECTABLE
from grpo_hf.logprobs import shared_prefix_blocker

COUNTER = "cumulative_length_linear"  # transformers 5.25's in-place token counter of linear-attention layers
HAS_COUNTER = COUNTER in vars(LinearAttentionLayer())
HAS_KEEP_COUNT = (
    "recurrent_states_to_keep" in inspect.signature(LinearAttentionLayer.activate_past_recording).parameters
)


def test_every_cache_layer_class_of_the_installed_transformers_passes_the_check():
    """A release that adds an attribute, or changes what a copy shares, fails here (and in `make test-latest`), not
    silently in users' runs: the padded fallback is for users, not for the suite."""
    assert LAYER_PROBLEMS == {}, LAYER_PROBLEMS
    assert REPEATABLE == SELECTABLE


class _LayerWithANewCounter(DynamicLayer):
    """A release's layer that keeps one more tensor, written in place by each update."""

    def update(self, key_states, value_states, *args, **kwargs):
        if "tokens_seen" not in vars(self):
            self.tokens_seen = torch.zeros((), dtype=torch.long)
        self.tokens_seen.add_(key_states.shape[-2])
        return super().update(key_states, value_states, *args, **kwargs)


def test_a_layer_attribute_grpo_hf_does_not_know_takes_the_class_out_with_the_reason(monkeypatch, caplog):
    reason = cache_layers._check_layer_class(_LayerWithANewCounter)
    assert reason is not None and "tokens_seen" in reason and "KNOWN_ATTRIBUTES" in reason
    layer = _LayerWithANewCounter()
    cache_layers._probe_step(layer, rows=1, tokens=2)
    with pytest.raises(ValueError, match="tokens_seen"):
        cache_layers._copy_repeated(layer, 2)
    assert layer.keys.shape[0] == 1 and int(layer.tokens_seen) == 2  # the prompt's layer is left as it was

    monkeypatch.setattr(cache_layers, "SELECTABLE", (*SELECTABLE, _LayerWithANewCounter))
    with caplog.at_level(logging.WARNING, logger="grpo_hf.cache_layers"):
        repeatable, problems = cache_layers._repeatable_classes()
    assert _LayerWithANewCounter not in repeatable and set(repeatable) == set(SELECTABLE)
    assert set(problems) == {"_LayerWithANewCounter"}
    assert "_LayerWithANewCounter" in caplog.text and "tokens_seen" in caplog.text and "padded forward" in caplog.text


def test_a_model_whose_layers_fail_the_check_trains_with_the_padded_forward(monkeypatch):
    """Qwen3.5 with its linear-attention layers taken out: the shared prefix is refused with the check's reason, and
    `completion_logps` with share_prefix=True gives the padded forward's log-probs (no crash inside the model)."""
    problem = "ValueError: cannot repeat a LinearAttentionLayer cache layer: ... tokens_seen ..."
    monkeypatch.setattr(cache_layers, "REPEATABLE", tuple(c for c in REPEATABLE if c is not LinearAttentionLayer))
    monkeypatch.setattr(cache_layers, "LAYER_PROBLEMS", {"LinearAttentionLayer": problem})
    model = build("qwen3_5")
    reason = shared_prefix_blocker(model, model, share_prompt_prefix=True, router_aux_loss_coef=0.0, sharded=False)
    assert reason is not None and "LinearAttentionLayer (layers 0)" in reason and "tokens_seen" in reason
    batch = make_batch()
    with pytest.raises(ValueError, match="LinearAttentionLayer"):  # asked to share, it says why it cannot
        logps_grads_aux(model, batch, share=True, router=False)
    padded, _, _ = logps_grads_aux(model, batch, share=False, router=False)
    assert torch.isfinite(padded).all()


@pytest.mark.skipif(not HAS_COUNTER, reason=f"transformers {transformers.__version__} has no {COUNTER}")
def test_a_shared_attribute_the_copy_writes_in_place_takes_the_class_out(monkeypatch):
    """Were the counter shared rather than cloned, the copy's next token would move the prompt's count."""
    assert cache_layers._check_layer_class(LinearAttentionLayer) is None
    monkeypatch.setattr(cache_layers, "_CLONED", ())
    monkeypatch.setattr(cache_layers, "KNOWN_ATTRIBUTES", KNOWN_ATTRIBUTES | {COUNTER})
    reason = cache_layers._check_layer_class(LinearAttentionLayer)
    assert reason == f"a step of its copy changed the prompt's {COUNTER}"


@pytest.mark.skipif(not HAS_KEEP_COUNT, reason="activate_past_recording takes no recurrent_states_to_keep")
def test_activate_past_recording_gets_an_explicit_count(monkeypatch):
    """transformers 5.25's default (None) is what crashed Qwen3.5's first step (`min(None, seq_len)`)."""
    layer = LinearAttentionLayer()
    cache_layers._probe_step(layer, rows=1, tokens=2)
    assert cache_layers._copy_repeated(layer, 2).recurrent_states_to_keep == 0
    monkeypatch.setattr(cache_layers, "_record_past", lambda layer: layer.activate_past_recording())
    reason = cache_layers._check_layer_class(LinearAttentionLayer)
    assert reason == "its copy keeps recurrent_states_to_keep=None, which the models read as a count"


@pytest.mark.parametrize("family", [f for f in ("qwen3_5", "falcon_h1", "lfm2") if f in CONFIGS])
def test_the_prompt_layer_keeps_its_states_and_count_after_its_copies_run(family):
    """Two repeats of one prompt's cache, each run on its own completions, leave the prompt's states, flags and token
    counts exactly as the model made them, and the second repeat gives what the first gave."""
    model = build(family)
    prompt = torch.randint(3, 64, (1, 6))
    keyword = cache_layers.cache_keyword(model)
    with torch.no_grad():
        cache = model(input_ids=prompt, use_cache=True).past_key_values
        before = [cache_layers._snapshot(layer) for layer in cache.layers]
        completions = torch.randint(3, 64, (3, 4))
        first, second = (model(input_ids=completions, **{keyword: cache_layers.repeat_cache(cache, 3)}) for _ in "ab")
    torch.testing.assert_close(first.logits, second.logits, rtol=0, atol=0)
    for layer, saved in zip(cache.layers, before, strict=True):
        assert cache_layers._same(saved, layer)


# ---- rows kept between tool turns (`loop.decode_turns`) ------------------------------------------------------------
def test_every_layer_class_the_loop_serves_keeps_its_rows_between_turns():
    """Each class of `SELECTABLE` passes `_check_joinable` on the installed transformers (cut a row, stack it back,
    pad, drop and join), so tool episodes on every family keep their rows' states."""
    assert cache_layers.JOIN_PROBLEMS == {}, cache_layers.JOIN_PROBLEMS
    assert cache_layers.JOINABLE == SELECTABLE


class _LayerThatInitialisesOtherwise(DynamicLayer):
    """A release's layer whose lazy initialisation takes another argument."""

    def lazy_initialization(self, key_states, value_states, max_length):
        super().lazy_initialization(key_states, value_states)

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states, 8)
        return super().update(key_states, value_states, *args, **kwargs)


class _LayerThatKeepsTheWholeWindow(DynamicSlidingWindowLayer):
    """A release's sliding-window layer that keeps the last `window` keys, not `window - 1`."""

    def update(self, key_states, value_states, *args, **kwargs):
        full = super().update(key_states, value_states, *args, **kwargs)
        self.keys, self.values = (x[:, :, -self.sliding_window :] for x in full)
        return full


def test_a_layer_the_row_functions_do_not_fit_is_named_and_keeps_nothing(monkeypatch, caplog):
    """A class whose rows cannot be cut and stacked back exactly is left out of `JOINABLE` with the reason logged, and
    `decode_turns` on a model with it keeps nothing between turns, saying so once."""
    assert "TypeError" in cache_layers._check_joinable(_LayerThatInitialisesOtherwise)
    assert cache_layers._check_joinable(_LayerThatKeepsTheWholeWindow) is not None
    monkeypatch.setattr(cache_layers, "SELECTABLE", (*SELECTABLE, _LayerThatInitialisesOtherwise))
    with caplog.at_level(logging.WARNING, logger="grpo_hf.cache_layers"):
        joinable, problems = cache_layers._joinable_classes()
    assert set(problems) == {"_LayerThatInitialisesOtherwise"} and _LayerThatInitialisesOtherwise not in joinable
    assert "_LayerThatInitialisesOtherwise" in caplog.text and "whole context" in caplog.text

    from grpo_hf.rollout import loop

    model = build("qwen3_5")
    monkeypatch.setattr(loop, "JOINABLE", tuple(c for c in SELECTABLE if c is not LinearAttentionLayer))
    monkeypatch.setattr(loop, "JOIN_PROBLEMS", {"LinearAttentionLayer": "a reason"})
    loop._LOGGED.clear()
    with caplog.at_level(logging.WARNING, logger="grpo_hf.rollout.loop"):
        assert not loop._joins_mid_decode(model.config) and not loop._joins_mid_decode(model.config)
    logged = [r.getMessage() for r in caplog.records if r.name == "grpo_hf.rollout.loop"]
    assert len(logged) == 1 and "LinearAttentionLayer (layers 0): a reason" in logged[0]
