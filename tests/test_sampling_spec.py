"""One description of the sampling (`rollout.sampling_spec.SamplingSpec`), read by the engines and the replay.

- the stage before the warpers (n-grams, bad words, biases, min_new_tokens, suppressed tokens, repetition penalty)
  against transformers' own processors, on each row alone, position by position;
- vLLM's order (penalties, temperature, min-p, top-k, top-p) against a naive loop written from vLLM's sampler;
- a grid at `learning_rate=0`, `max_staleness=1`: engines (loop, generate, continuous_batching) x settings; every
  weight the loss applies is 1 within 1e-4, or the trainer refuses the setting when it is built, naming it.
"""

import math

import pytest
import torch
from conftest import TRAINING, build_tiny_model, build_tiny_tokenizer, make_trainer, tiny_run_args, train_logs
from test_sampling_replay import _assert_all_one, _config, _recording_weights, random_rows
from transformers import (
    MinNewTokensLengthLogitsProcessor,
    NoBadWordsLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
)

from grpo_hf.rollout.sampling import replayed_logps
from grpo_hf.rollout.sampling_spec import SamplingSpec

EOS = 3
STAGE = {
    "ngram1": dict(no_repeat_ngram_size=1),
    "ngram2": dict(no_repeat_ngram_size=2),
    "bad_words": dict(bad_words_ids=[[7], [11, 12], [5, 9, 13]]),
    "sequence_bias": dict(sequence_bias=[[[4], 2.5], [[6, 8], -1.5]]),
    "min_new_tokens": dict(min_new_tokens=4, eos_token_id=EOS),
    "suppress": dict(suppress_tokens=[1, 2, 9]),
    "begin_suppress": dict(begin_suppress_tokens=[5, 6]),
    "all": dict(no_repeat_ngram_size=2, bad_words_ids=[[7], [11, 12]], repetition_penalty=1.3, min_new_tokens=2,
                eos_token_id=EOS, sequence_bias=[[[6, 8], -1.5]], top_k=20, temperature=0.8),
}  # fmt: skip


def transformers_stage(config, prompt_length: int) -> list:
    """transformers' processors for `config`, in `generate`'s order, for a context whose first `prompt_length` tokens
    are the prompt (`_get_logits_processor`), and the warpers after them."""
    processors = []
    if config.sequence_bias:
        processors.append(SequenceBiasLogitsProcessor({tuple(ids): bias for ids, bias in config.sequence_bias}))
    if config.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(config.repetition_penalty))
    if config.no_repeat_ngram_size:
        processors.append(NoRepeatNGramLogitsProcessor(config.no_repeat_ngram_size))
    if config.bad_words_ids:
        processors.append(NoBadWordsLogitsProcessor(config.bad_words_ids, eos_token_id=None))
    if config.min_new_tokens:
        processors.append(MinNewTokensLengthLogitsProcessor(prompt_length, config.min_new_tokens, [EOS]))
    if config.suppress_tokens:
        processors.append(SuppressTokensLogitsProcessor(config.suppress_tokens))
    if config.begin_suppress_tokens:
        processors.append(SuppressTokensAtBeginLogitsProcessor(config.begin_suppress_tokens, prompt_length))
    return processors + list(SamplingSpec.from_config(config).warpers())


def naive_stage_replay(logits, completion_ids, prompt_ids, prompt_mask, mask, config) -> torch.Tensor:
    """Row by row, position by position: the row's real prompt tokens and its completion so far as input_ids (no
    padding), transformers' processors applied one by one, log-softmax at the token."""
    n, t, _ = logits.shape
    expected = torch.zeros((n, t))
    for i in range(n):
        prompt = prompt_ids[i][prompt_mask[i].bool()]
        processors = transformers_stage(config, len(prompt))
        for c in range(t):
            if mask[i, c]:
                input_ids = torch.cat([prompt, completion_ids[i, :c]])[None]  # [1, p + c]
                scores = logits[i, c][None].float()
                for processor in processors:
                    scores = processor(input_ids, scores)
                expected[i, c] = torch.log_softmax(scores, dim=-1)[0, completion_ids[i, c]]
    return expected


@pytest.mark.parametrize("name", STAGE)
def test_the_stage_matches_transformers_processors_on_each_row_alone(name):
    """Left padding read by no processor, each position's own context and count: the replay equals transformers'
    processors applied to the unpadded row, position by position; and the case bites (tokens banned or moved)."""
    logits, completion_ids, prompt_ids, prompt_mask, mask = random_rows(seed=4, n=6, P=6, t=9, V=16)
    completion_ids[:, 3] = completion_ids[:, 2]  # repeats, so that the n-grams bite
    completion_ids[1, 5:7] = torch.tensor([11, 12])
    completion_ids[0, 0], completion_ids[2, 1] = EOS, EOS  # an early EOS where min_new_tokens forbids it
    config = _config(**STAGE[name])
    spec = SamplingSpec.from_config(config, skip_padding=True)
    got = replayed_logps(logits, completion_ids, prompt_ids, prompt_mask, mask, spec)
    expected = naive_stage_replay(logits, completion_ids, prompt_ids, prompt_mask, mask, config)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    chunked = replayed_logps(logits, completion_ids, prompt_ids, prompt_mask, mask, spec, chunk_size=4)
    torch.testing.assert_close(chunked, got, rtol=0, atol=0)
    plain = torch.log_softmax(logits, dim=-1).gather(2, completion_ids[..., None]).squeeze(-1)
    assert (got - plain).abs()[mask == 1].max() > 0.05  # the processors change the distribution here


def naive_vllm_logprob(row: list[float], token: int, seen: set, temperature, min_p, top_k, top_p, penalty) -> float:
    """One position, in plain Python, as vLLM 0.32's sampler processes it (`v1/sample/sampler.py`): the repetition
    penalty on the prompt's and output's tokens, temperature, min-p (`MinPLogitsProcessor`: below min_p times the top
    probability), then top-k and top-p (`apply_top_k_top_p`: the k largest, then drop the smallest while their
    cumulative probability stays within 1 - p, the largest always kept); the log-softmax at `token`."""
    logits = [(x / penalty if x > 0 else x * penalty) if v in seen else x for v, x in enumerate(row)]
    logits = [x / temperature for x in logits]
    total = sum(math.exp(x) for x in logits)
    probs = [math.exp(x) / total for x in logits]
    logits = [x if p >= min_p * max(probs) else -math.inf for x, p in zip(logits, probs, strict=True)]
    kth = sorted(logits, reverse=True)[top_k - 1]
    logits = [x if x >= kth else -math.inf for x in logits]
    order = sorted(range(len(logits)), key=lambda v: logits[v])  # ascending, as vLLM sorts
    total = sum(math.exp(x) for x in logits)
    cumulative, drop = 0.0, set()
    for rank, v in enumerate(order):
        cumulative += math.exp(logits[v]) / total
        if cumulative <= 1 - top_p and rank < len(order) - 1:
            drop.add(v)
    logits = [-math.inf if v in drop else x for v, x in enumerate(logits)]
    total = sum(math.exp(x) for x in logits)
    return logits[token] - math.log(total) if logits[token] > -math.inf else -math.inf


def test_the_vllm_replay_applies_vllms_order_min_p_and_top_p_together():
    settings = dict(temperature=0.8, min_p=0.05, top_k=12, top_p=0.85, repetition_penalty=1.2)
    logits, completion_ids, prompt_ids, prompt_mask, mask = random_rows(seed=5, V=40)
    completion_ids[:, 1] = logits[:, 1].argmax(dim=-1)  # kept in both orders
    spec = SamplingSpec.from_config(_config(**settings), kind="vllm", skip_padding=True)
    got = replayed_logps(logits, completion_ids, prompt_ids, prompt_mask, mask, spec)
    n, t, _ = logits.shape
    for i in range(n):
        prompt = prompt_ids[i][prompt_mask[i].bool()].tolist()
        for c in range(t):
            if mask[i, c]:
                seen = set(prompt) | set(completion_ids[i, :c].tolist())
                expected = naive_vllm_logprob(logits[i, c].double().tolist(), int(completion_ids[i, c]), seen,
                                              **{k: settings[k] for k in ("temperature", "min_p", "top_k", "top_p")},
                                              penalty=settings["repetition_penalty"])  # fmt: skip
                if math.isinf(expected):
                    assert got[i, c] == -math.inf, (i, c)
                else:
                    assert abs(float(got[i, c]) - expected) < 1e-5, (i, c)
    in_transformers_order = replayed_logps(logits, completion_ids, prompt_ids, prompt_mask, mask, spec.for_kind(
        "transformers"))  # fmt: skip
    finite = got.isfinite() & in_transformers_order.isfinite() & (mask == 1)
    assert (got - in_transformers_order).abs()[finite].max() > 1e-3  # the order matters here


# ---- the grid: engines x settings at learning_rate 0 ----------------------------------------------------------------
VOCAB = len(build_tiny_tokenizer())
GRID = {
    "plain": {},
    "qwen": dict(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05),
    "min_p": dict(min_p=0.1),
    "suppress_tokens": dict(generation_kwargs={"suppress_tokens": list(range(3, 120))}),
    "bad_words_ids": dict(generation_kwargs={"bad_words_ids": [[i] for i in range(3, 100)] + [[120, 121]]}),
    "no_repeat_ngram_size": dict(generation_kwargs={"no_repeat_ngram_size": 1}),
    "top_k=-1": dict(top_k=-1),
    "top_k>=vocab": dict(top_k=VOCAB + 3),
    "min_new_tokens": dict(generation_kwargs={"min_new_tokens": 6}),
    "sequence_bias": dict(generation_kwargs={"sequence_bias": [[[i], 3.0] for i in range(3, 40)]}),
}
# transformers' continuous batching penalises its own way and fails on bad words and n-grams: refused, named
REFUSED = {
    ("continuous_batching", name): setting
    for name, setting in [
        ("qwen", "repetition_penalty"),
        ("suppress_tokens", "suppress_tokens"),
        ("bad_words_ids", "bad_words_ids"),
        ("no_repeat_ngram_size", "no_repeat_ngram_size"),
        ("min_new_tokens", "min_new_tokens"),
        ("sequence_bias", "sequence_bias"),
    ]
}
UNCHANGED = {"plain", "top_k=-1", "top_k>=vocab"}  # the trainer's own softmax: nothing to replay


@pytest.mark.parametrize("engine", ["loop", "generate", "continuous_batching"])
@pytest.mark.parametrize("name", GRID)
def test_every_weight_is_one_at_learning_rate_zero_or_the_setting_is_refused(tmp_path, monkeypatch, engine, name):
    weights = _recording_weights(monkeypatch)
    settings = {**TRAINING, "max_steps": 2, "learning_rate": 0.0, "rollout_engine": engine, "max_staleness": 1}
    if engine == "continuous_batching":  # a small paged cache: seconds, not a minute, on a CPU
        settings["transformers_continuous_batching_config"] = {"num_blocks": 16, "max_batch_tokens": 256}
    args = tiny_run_args(tmp_path, preset={**settings, **GRID[name]})
    if (engine, name) in REFUSED:
        with pytest.raises(ValueError, match=REFUSED[engine, name]):
            make_trainer(args, model=build_tiny_model(build_tiny_tokenizer(), seed=3))
        return
    trainer = make_trainer(args, model=build_tiny_model(build_tiny_tokenizer(), seed=3))
    trainer.train()
    logs = [row for row in train_logs(trainer) if row["async/staleness_max"] == 1.0]
    assert len(logs) == 1  # step 2 trains on the batch sampled a step before
    assert (trainer.experience.replay is None) == (name in UNCHANGED)
    if name in UNCHANGED:  # no replay: the recorded log-probs are the plain softmax's
        assert all(w is None or torch.allclose(w, torch.ones_like(w), atol=1e-4) for w, _ in weights)
        return
    _assert_all_one(weights, logs, expected_batches=1)


@pytest.mark.parametrize("engine", ["loop", "generate"])
def test_a_vlms_image_tokens_are_blocked_in_the_replay_as_in_the_engines(tmp_path, monkeypatch, engine):
    """The engines never sample a VLM's image tokens (-inf); the replay blocks them too (the spec's blocked tokens),
    so a stale batch weighs 1 at learning_rate 0 (it weighed ~0.88 a sequence with the image tokens' mass in)."""
    from test_vision import dataset, trainer_for

    weights = _recording_weights(monkeypatch)
    settings = dict(max_staleness=1, max_steps=2, learning_rate=0.0, rollout_engine=engine, logging_steps=1, seed=0)
    trainer = trainer_for(tmp_path, dataset("parts"), **settings)
    assert trainer.experience.replay is not None and trainer.experience.replay.spec.blocked_token_ids
    trainer.train()
    logs = [row for row in train_logs(trainer) if row["async/staleness_max"] == 1.0]
    corrected = sum(w is not None for w, _ in weights)
    assert corrected >= 1 and len(logs) == 1
    _assert_all_one(weights, logs, expected_batches=corrected)


def test_top_k_that_truncates_nothing_is_none_for_every_engine(tokenizer):
    """-1 (vLLM's "off") and at least the vocabulary: no top-k when resolved (loop, cuda_graph, generate's recorder),
    vLLM's -1, and no replay; below -1 is refused by the config."""
    from grpo_hf import GRPOConfig
    from grpo_hf.rollout.sampling import resolve_sampling_settings
    from grpo_hf.rollout.vllm_engine import sampling_settings

    model = build_tiny_model(tokenizer)
    for top_k in (-1, 0, len(tokenizer), len(tokenizer) + 1):
        config = _config(top_k=top_k, max_new_tokens=4)
        assert resolve_sampling_settings(model, config).top_k == 0
        assert sampling_settings(model, config)["top_k"] == -1
        assert not SamplingSpec.of(model, config).changes_distribution(1.0)
    assert sampling_settings(model, _config(top_k=7, max_new_tokens=4))["top_k"] == 7
    with pytest.raises(ValueError, match="top_k=-2"):
        GRPOConfig(output_dir="unused", top_k=-2)


def test_a_setting_the_replay_cannot_describe_is_refused_with_a_correction_only(tmp_path):
    """typical_p (a warper no spec describes) is refused, named, when a correction replays the sampling; without one,
    `generate` samples it as before."""
    settings = {**TRAINING, "max_steps": 1, "generation_kwargs": {"typical_p": 0.9}}
    with pytest.raises(ValueError, match="typical_p=0.9"):
        make_trainer(tiny_run_args(tmp_path / "async", preset={**settings, "max_staleness": 1}))
    trainer = make_trainer(tiny_run_args(tmp_path / "sync", preset=settings))
    assert trainer.experience.replay is None


@pytest.mark.parametrize("engine_name", ["loop", "generate"])
def test_the_engines_draw_through_the_stage(tokenizer, engine_name):
    """n-grams of 1 (no token of the context again), suppressed tokens and min_new_tokens hold in what `loop` and
    `generate` sample, their recorded log-probs being the replay's (the grid's weights)."""
    from grpo_hf.rollout import make_engine, tokenize_prompts

    model = build_tiny_model(tokenizer, seed=3).eval()
    suppressed = list(range(60, 200))
    config = _config(max_new_tokens=10, pad_token_id=tokenizer.pad_token_id, eos_token_id=[tokenizer.eos_token_id],
                     no_repeat_ngram_size=1, suppress_tokens=suppressed, min_new_tokens=10)  # fmt: skip
    engine, why = make_engine(engine_name, model, config, [tokenizer.eos_token_id])
    assert engine.name == engine_name, why
    prompt_ids, prompt_mask, _ = tokenize_prompts(tokenizer, ["Hi", "Hi", "A longer prompt here", "Why?"])
    torch.manual_seed(0)
    completion_ids = engine.generate(model, prompt_ids, prompt_mask).completion_ids
    assert completion_ids.shape == (4, 10)  # no EOS before min_new_tokens
    for ids, prompt, mask in zip(completion_ids.tolist(), prompt_ids.tolist(), prompt_mask.tolist(), strict=True):
        real_prompt = {token for token, m in zip(prompt, mask, strict=True) if m}
        assert len(set(ids)) == len(ids) and not set(ids) & real_prompt and not set(ids) & set(suppressed)


def test_refusals_name_the_setting_and_the_alternative():
    """What each engine kind refuses, with and without a correction, and in tool episodes."""

    def refusal(kind, corrected, multi_turn=False, **settings):
        spec = SamplingSpec.from_config(_config(**settings), kind=kind)
        return spec.refusal(corrected=corrected, multi_turn=multi_turn)

    assert refusal("transformers", True, no_repeat_ngram_size=2, suppress_tokens=[3], repetition_penalty=1.1) is None
    why = refusal("vllm", False, no_repeat_ngram_size=2)  # vLLM cannot sample it at all
    assert "no_repeat_ngram_size" in why and "use_vllm=False" in why
    assert refusal("vllm", True, repetition_penalty=1.1, top_k=5, min_p=0.1) is None
    why = refusal("continuous_batching", False, bad_words_ids=[[3]], repetition_penalty=1.1)  # fails in transformers
    assert "bad_words_ids" in why and "repetition_penalty" not in why and "rollout_engine='loop'" in why
    assert "repetition_penalty" in refusal("continuous_batching", True, repetition_penalty=1.1)  # its own penalty
    assert refusal("continuous_batching", False, repetition_penalty=1.1) is None
    assert refusal("transformers", True, multi_turn=True, no_repeat_ngram_size=2) is None
    assert "min_new_tokens" in refusal("transformers", True, multi_turn=True, min_new_tokens=2)
    assert refusal("transformers", False, multi_turn=True, min_new_tokens=2) is None


MODEL_STAGE = dict(suppress_tokens=list(range(40, 120)), sequence_bias=[[[i], 3.0] for i in range(3, 40)])


@pytest.mark.parametrize("engine", ["loop", "generate", "continuous_batching"])
def test_the_models_own_stage_settings_are_applied_once_and_replayed(tmp_path, monkeypatch, engine):
    """Stage settings in the model's own `generation_config` (not generation_kwargs): each engine applies them once
    (`generate` merges the model's config into the one it is given, where a setting is None: the spec's stage must be
    the only one that runs; before, `sequence_bias` counted twice) and the replay reads them too, so every weight is 1
    at learning_rate 0, and no completion holds a suppressed token; continuous batching refuses them, named."""
    weights = _recording_weights(monkeypatch)
    model = build_tiny_model(build_tiny_tokenizer(), seed=3)
    for name, value in MODEL_STAGE.items():
        setattr(model.generation_config, name, value)
    settings = {**TRAINING, "max_steps": 2, "learning_rate": 0.0, "rollout_engine": engine, "max_staleness": 1}
    if engine == "continuous_batching":
        with pytest.raises(ValueError, match="continuous_batching.*sequence_bias, suppress_tokens"):
            make_trainer(tiny_run_args(tmp_path, preset=settings), model=model)
        return
    trainer = make_trainer(tiny_run_args(tmp_path, preset=settings), model=model)
    assert trainer.experience.replay.spec.stage_settings() == ["sequence_bias", "suppress_tokens"]
    trainer.train()
    logs = [row for row in train_logs(trainer) if row["async/staleness_max"] == 1.0]
    assert len(logs) == 1
    _assert_all_one(weights, logs, expected_batches=1)
    sampled = torch.cat([batch.completion_ids[batch.completion_mask.bool()] for _, batch in weights])
    assert sampled.numel() and not set(sampled.tolist()) & set(MODEL_STAGE["suppress_tokens"])


def test_vllm_refuses_the_models_own_stage_settings(tokenizer):
    """vLLM applies no stage setting but the penalty, whoever sets it: the model's own `generation_config` too (vLLM
    is given every sampling setting by the trainer, and never reads the model's), refused with or without a
    correction, named."""
    model = build_tiny_model(tokenizer)
    for name, value in MODEL_STAGE.items():
        setattr(model.generation_config, name, value)
    spec = SamplingSpec.of(model, _config(max_new_tokens=4), kind="vllm")
    for corrected in (False, True):
        assert "sequence_bias, suppress_tokens" in spec.refusal(corrected=corrected)
