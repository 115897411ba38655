"""The correction's weight under truncated or penalised sampling (`rollout.sampling.SamplingReplay`).

Every engine records the log-probs of the distribution it drew from (repetition penalty, temperature, top-k, top-p,
min-p). The weight pi_old / pi_sampler compares them with pi_old replayed under the same processors, so with unchanged
weights it is 1: checked here for the replay against a naive per-position loop over transformers' processors, for the
log-prob forwards against an engine's recorded log-probs (vLLM's stand-in), and for whole runs at `learning_rate=0`.
"""

import pytest
import torch
from conftest import TRAINING, build_tiny_model, make_trainer, tiny_run_args, train_logs
from transformers import (
    GenerationConfig,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from grpo_hf import AsyncGRPOTrainer, GRPOConfig
from grpo_hf.core import sampling_importance_weights
from grpo_hf.logprobs import completion_logps, logps_and_replayed
from grpo_hf.objective import Objective
from grpo_hf.rollout import Sequences, make_engine, tokenize_prompts
from grpo_hf.rollout.sampling import GENERATE_SKIPS_PADDING, SamplingReplay, replayed_logps
from grpo_hf.rollout.sampling_spec import SamplingSpec

# Qwen2.5-Instruct's own sampling settings (its generation_config), at the trainer's temperature 1.0
QWEN = dict(top_p=0.8, top_k=20, repetition_penalty=1.05)
SETTINGS = {
    "top_k": dict(top_k=5),
    "top_p": dict(top_p=0.7),
    "min_p": dict(min_p=0.3),
    "penalty": dict(repetition_penalty=1.3),
    "temperature": dict(temperature=0.6),
    "all": dict(temperature=0.8, top_k=12, top_p=0.9, min_p=0.05, repetition_penalty=1.2),
    "qwen": QWEN,
}


def _config(**settings) -> GenerationConfig:
    base = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, min_p=None, repetition_penalty=1.0)
    return GenerationConfig(**{**base, **settings})


def _spec(**settings) -> SamplingSpec:
    return SamplingSpec.from_config(_config(**settings))


def naive_replay(logits, completion_ids, prompt_ids, prompt_mask, mask, settings) -> torch.Tensor:
    """One row and one position at a time: the row's prompt tokens that `generate`'s repetition penalty reads (the
    real ones; with transformers < 5.23, whose `generate` penalises the left padding, `GENERATE_SKIPS_PADDING`, the
    padding too) and its completion so far as input_ids, then transformers' processors in `generate`'s order, applied
    one by one; log-softmax at the token."""
    config = _config(**settings)
    processors = []
    if config.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(config.repetition_penalty))
    if config.temperature != 1.0:
        processors.append(TemperatureLogitsWarper(config.temperature))
    if config.top_k:
        processors.append(TopKLogitsWarper(config.top_k))
    if config.top_p < 1.0:
        processors.append(TopPLogitsWarper(config.top_p))
    if config.min_p:
        processors.append(MinPLogitsWarper(config.min_p))
    n, t, _ = logits.shape
    expected = torch.zeros((n, t))
    for i in range(n):
        prompt = prompt_ids[i][prompt_mask[i].bool()] if GENERATE_SKIPS_PADDING else prompt_ids[i]
        for c in range(t):
            if not mask[i, c]:
                continue
            input_ids = torch.cat([prompt, completion_ids[i, :c]])[None]  # [1, p + c]
            scores = logits[i, c][None].double()  # [1, V]
            for processor in processors:
                scores = processor(input_ids, scores)
            expected[i, c] = torch.log_softmax(scores, dim=-1)[0, completion_ids[i, c]].float()
    return expected


def random_rows(seed=0, n=5, P=6, t=7, V=50):
    """Logits [n, t, V], completion ids (some tokens repeated from the prompt, so the penalty bites), left-padded
    prompts and a completion mask with holes (a tool reply, a row that ended early)."""
    g = torch.Generator().manual_seed(seed)
    logits = 2.0 * torch.randn((n, t, V), generator=g)
    prompt_ids = torch.randint(0, V, (n, P), generator=g)
    prompt_mask = torch.ones((n, P), dtype=torch.long)
    prompt_mask[1, :2] = prompt_mask[3, :4] = 0
    prompt_ids[prompt_mask == 0] = 0  # the pad token: penalised for the padding only before transformers 5.23
    completion_ids = torch.randint(0, V, (n, t), generator=g)
    completion_ids[:, 2] = prompt_ids[:, -1]  # a repeat of the prompt
    completion_ids[:, 4] = completion_ids[:, 1]  # a repeat of the completion
    mask = torch.ones((n, t), dtype=torch.long)
    mask[0, 3] = 0  # a tool reply inside the completion: in the context, out of the loss
    mask[2, 5:] = 0  # ended early
    return logits, completion_ids, prompt_ids, prompt_mask, mask


@pytest.mark.parametrize("name", SETTINGS)
def test_the_replay_matches_a_naive_loop_over_transformers_processors(name):
    logits, completion_ids, prompt_ids, prompt_mask, mask = random_rows()
    config = _spec(**SETTINGS[name])
    got = replayed_logps(logits, completion_ids, prompt_ids, prompt_mask, mask, config)
    expected = naive_replay(logits, completion_ids, prompt_ids, prompt_mask, mask, SETTINGS[name])
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)  # -inf where expected is -inf, too
    assert bool((got[mask == 0] == 0).all())
    # chunks of 3 positions, and the logits as a strided view (the padded forward's [:, :T]): the same values
    padded = torch.cat([logits, logits[:, :1]], dim=1)[:, :-1]
    chunked = replayed_logps(padded, completion_ids, prompt_ids, prompt_mask, mask, config, chunk_size=3)
    torch.testing.assert_close(chunked, got, rtol=0, atol=0)
    # the case bites: the distribution is not the plain softmax
    plain = torch.log_softmax(logits, dim=-1).gather(2, completion_ids[..., None]).squeeze(-1)
    assert (got - plain).abs()[(mask == 1) & got.isfinite()].max() > 0.05


def test_generate_skips_the_padding_in_its_repetition_penalty_as_the_probe_says(tokenizer):
    """`GENERATE_SKIPS_PADDING` (probed once, on the processor's signature) against what the installed `generate`
    does: the processed scores of its first step (`output_scores`) against the raw logits (`output_logits`) at the pad
    token, which only the left padding of the shorter row holds."""
    model = build_tiny_model(tokenizer, seed=3).eval()
    prompt_ids, prompt_mask, _ = tokenize_prompts(tokenizer, ["A much longer prompt, with more tokens", "Why?"])
    pad = tokenizer.pad_token_id
    assert (
        not prompt_mask[0].eq(0).any()
        and prompt_mask[1].eq(0).any()
        and not prompt_ids[1][prompt_mask[1] == 1].eq(pad).any()
    )
    config = GenerationConfig(max_new_tokens=1, do_sample=False, repetition_penalty=2.0, pad_token_id=pad)
    out = model.generate(
        input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=config,
        return_dict_in_generate=True, output_scores=True, output_logits=True,
    )  # fmt: skip
    scores, logits = out.scores[0], out.logits[0]  # [2, V] processed, raw
    assert not torch.equal(scores[1, prompt_ids[1, -1]], logits[1, prompt_ids[1, -1]])  # a real token: penalised
    assert torch.equal(scores[1, pad], logits[1, pad]) == GENERATE_SKIPS_PADDING  # the padding's pad token
    assert torch.equal(scores[0, pad], logits[0, pad])  # the unpadded row has none


@pytest.mark.parametrize("skip_padding", [True, False, None])
def test_the_repetition_penalty_reads_the_padding_as_asked_on_every_version(skip_padding):
    """The spec's repetition penalty (its own formula, `sampling_spec.repetition_penalty`): skipping the left padding,
    penalising it, or as `generate` does (None); each row against transformers' processor on the tokens it must read,
    alone."""
    _, completion_ids, prompt_ids, prompt_mask, _ = random_rows(seed=2)
    scores = 2.0 * torch.randn((len(prompt_ids), 50), generator=torch.Generator().manual_seed(3))  # [n, V]
    history = torch.cat([prompt_ids, completion_ids], dim=1)  # [n, P + t]
    spec = SamplingSpec.from_config(_config(repetition_penalty=1.7), skip_padding=skip_padding)
    got = spec.processors(prompt_mask, sampling=False)(history, scores)
    skips = GENERATE_SKIPS_PADDING if skip_padding is None else skip_padding
    past_padding = SamplingSpec.from_config(_config(repetition_penalty=1.7), skip_padding=True)
    past_padding = past_padding.processors(prompt_mask, sampling=False)(history, scores)
    for i in range(len(history)):
        read = history[i, (prompt_mask[i] == 0).sum() if skips else 0 :]  # the padding is the first columns
        expected = RepetitionPenaltyLogitsProcessor(1.7)(read[None], scores[i : i + 1])
        assert torch.equal(got[i : i + 1], expected), i
        if skips:
            assert torch.equal(past_padding[i : i + 1], expected), i
    assert not torch.equal(past_padding, RepetitionPenaltyLogitsProcessor(1.7)(history, scores))  # the case bites


def test_a_token_outside_the_kept_support_gets_minus_infinity():
    logits, completion_ids, prompt_ids, prompt_mask, mask = random_rows(seed=1)
    completion_ids[:, 0] = logits[:, 0].argmin(dim=-1)  # never in the top 5
    completion_ids[:, 1] = logits[:, 1].argmax(dim=-1)  # always kept
    got = replayed_logps(logits, completion_ids, prompt_ids, prompt_mask, mask, _spec(top_k=5))
    assert bool((got[:, 0] == float("-inf")).all()) and bool(got[:, 1].isfinite().all())
    weight, _ = sampling_importance_weights(got, torch.full_like(got, -1.0) * mask, mask, "token_truncate", None, 3.0)
    assert bool((weight[:, 0] == 0).all())  # pi_old gives the token no chance: the weight is 0, not NaN


def test_no_replay_where_the_sampler_draws_from_the_trainers_own_softmax(tokenizer):
    model = build_tiny_model(tokenizer)
    assert SamplingReplay.of(SamplingSpec.of(model, _config()), temperature=1.0) is None
    assert SamplingReplay.of(SamplingSpec.of(model, _config(temperature=0.7)), temperature=0.7) is None
    assert SamplingReplay.of(SamplingSpec.of(model, _config(temperature=0.7)), temperature=1.0) is not None
    # top_k that truncates nothing: -1 (vLLM's "off") and the whole vocabulary or more
    for top_k in (-1, len(tokenizer), len(tokenizer) + 5):
        assert SamplingReplay.of(SamplingSpec.of(model, _config(top_k=top_k)), temperature=1.0) is None, top_k
    # unset settings are resolved as the engines resolve them: the model's own generation_config fills them
    model.generation_config.top_p = 0.8
    replay = SamplingReplay.of(SamplingSpec.of(model, _config(top_p=None)), temperature=1.0)
    assert replay is not None and replay.spec.top_p == 0.8


# ---- the forwards, against an engine's recorded log-probs (vLLM's stand-in: processed log-probs) -------------------
PROMPTS = ["Hello there", "Hello there", "A much longer prompt, with more tokens", "Why?", "Why?", "Count: 1 2 3"]


@pytest.mark.parametrize("share_prefix", [True, False])
def test_replayed_old_logps_give_a_weight_of_one_against_the_samplers_own(tokenizer, share_prefix):
    """The loop engine records the processed log-probs, as vLLM's `processed_logprobs` are; pi_old replayed from the
    trainer's forward gives w = 1 up to float noise, where the temperature-only pi_old gives w = the kept mass."""
    model = build_tiny_model(tokenizer, seed=3).eval()
    eos = [tokenizer.eos_token_id, *range(8, len(tokenizer), 8)]
    config = _config(max_new_tokens=12, pad_token_id=tokenizer.pad_token_id, eos_token_id=eos, temperature=0.9, **QWEN)
    engine, why = make_engine("loop", model, config, eos, record_logps=True)
    assert engine is not None, why
    prompt_ids, prompt_mask, _ = tokenize_prompts(tokenizer, PROMPTS)
    torch.manual_seed(0)
    sampled = engine.generate(model, prompt_ids, prompt_mask)
    recorded, mask = engine.sampling_logps, sampled.completion_mask
    batch = Sequences(prompt_ids, prompt_mask, sampled.completion_ids, mask)
    replay = SamplingReplay.of(SamplingSpec.of(model, config), temperature=0.9)
    with torch.no_grad():
        old, replayed = logps_and_replayed(model, batch, replay, share_prefix=share_prefix, temperature=0.9)
        plain, _ = completion_logps(model, batch, share_prefix=share_prefix, temperature=0.9)
    assert torch.equal(old, plain)  # the temperature-only log-probs of the same forward, bit for bit
    torch.testing.assert_close(replayed * mask, recorded, rtol=0, atol=1e-5)
    for mode in ("sequence_mask", "token_truncate"):
        weight, metrics = sampling_importance_weights(replayed, recorded, mask, mode, None, 3.0)
        assert (metrics["importance_sampling_ratio/min"] - 1).abs() < 1e-4
        assert (metrics["importance_sampling_ratio/max"] - 1).abs() < 1e-4
        _, before = sampling_importance_weights(old, recorded, mask, mode, None, 3.0)  # the bias this removes
        assert before["importance_sampling_ratio/mean"] < 0.9


# ---- whole runs at learning_rate 0: the weights unchanged, so every weight is 1 -----------------------------------
def _recording_weights(monkeypatch) -> list:
    """Every weight the loss applies (None where none), as the objective computes it, and the drift from the sampler
    the off-policy mask would measure (`Objective.off_policy_logps`)."""
    weights, original = [], Objective.sampling_weight

    def recording(self, logps, batch):
        weight, metrics = original(self, logps, batch)
        if weight is not None:
            drift = (logps.detach() - Objective.off_policy_logps(logps, batch))[batch.completion_mask.bool()]
            torch.testing.assert_close(drift, torch.zeros_like(drift), rtol=0, atol=1e-4)
        weights.append((None if weight is None else weight.detach().clone(), batch))
        return weight, metrics

    monkeypatch.setattr(Objective, "sampling_weight", recording)
    return weights


def _run(tmp_path, name, trainer_cls=None, **overrides):
    settings = {**TRAINING, "max_steps": 3, "learning_rate": 0.0, "rollout_engine": "loop", **QWEN, **overrides}
    trainer = make_trainer(tiny_run_args(tmp_path / name, preset=settings), trainer_cls=trainer_cls)
    trainer.train()
    return trainer


def _assert_all_one(weights, logs, expected_batches):
    corrected = [(w, batch) for w, batch in weights if w is not None]
    assert len(corrected) == expected_batches
    for weight, batch in corrected:
        values = weight.flatten() if weight.size(1) == 1 else weight[batch.completion_mask.bool()]
        torch.testing.assert_close(values, torch.ones_like(values), rtol=0, atol=1e-4)
        assert batch.old_sampling_logps is not None
    ratios = [row[f"sampling/importance_sampling_ratio/{k}"] for row in logs for k in ("min", "mean", "max")]
    assert ratios and all(abs(r - 1) < 1e-4 for r in ratios)
    assert all(row["sampling/sampling_logp_difference/max"] < 1e-4 for row in logs)


@pytest.mark.parametrize("engine", ["loop", "generate"])
def test_stale_batches_weigh_one_when_the_weights_do_not_change(tmp_path, monkeypatch, engine):
    """max_staleness 1, Qwen2.5's sampling settings, learning_rate 0: every stale batch's weight is 1; at max_staleness
    0 nothing is corrected and nothing is replayed."""
    weights = _recording_weights(monkeypatch)
    stale = _run(tmp_path, f"stale-{engine}", rollout_engine=engine, max_staleness=1)
    logs = [row for row in train_logs(stale) if row["async/staleness_max"] == 1.0]
    assert len(logs) == 2  # steps 2 and 3 train on batches sampled a step before
    _assert_all_one(weights, logs, expected_batches=2)
    weights.clear()
    fresh = _run(tmp_path, f"fresh-{engine}", trainer_cls=AsyncGRPOTrainer, rollout_engine=engine, max_staleness=0)
    assert fresh.experience.replay is None and all(w is None and b.old_sampling_logps is None for w, b in weights)
    assert not any(key.startswith("sampling/") for row in train_logs(fresh) for key in row)


def test_a_stale_batch_with_old_logps_weighs_one_too(tmp_path, monkeypatch):
    """An optimizer step between the rollout and its last use (steps_per_generation 2): old log-probs are computed,
    and the replayed ones come from the same forward; the truncating 'sequence_mask' default keeps every sequence."""
    weights = _recording_weights(monkeypatch)
    trainer = _run(tmp_path, "old", max_staleness=1, steps_per_generation=2, max_steps=4)
    assert trainer.experience.needs_old_logps
    logs = [row for row in train_logs(trainer) if "sampling/importance_sampling_ratio/min" in row]
    _assert_all_one(weights, logs, expected_batches=sum(w is not None for w, _ in weights))
    assert all(batch.old_logps is not None for w, batch in weights if w is not None) and logs


def test_the_synchronous_vllm_correction_weighs_one_with_recorded_processed_logps(tmp_path, monkeypatch):
    """vLLM's correction (use_vllm=True; vLLM does not run here): the `loop` engine records the processed log-probs as
    vLLM's `processed_logprobs` are, and the correction is on as it is with vLLM. Every weight is 1."""
    weights = _recording_weights(monkeypatch)
    as_with_vllm = GRPOConfig.sampling_correction
    monkeypatch.setattr(GRPOConfig, "sampling_correction", lambda self, producer=False: as_with_vllm(self, True))
    settings = {**TRAINING, "max_steps": 2, "learning_rate": 0.0, "rollout_engine": "loop", **QWEN}
    trainer = make_trainer(tiny_run_args(tmp_path / "vllm", preset=settings))
    trainer.experience.sampler.record_logps = True  # as with vLLM: every rollout carries the sampler's log-probs
    trainer.train()
    assert trainer.experience.replay is not None
    _assert_all_one(weights, train_logs(trainer), expected_batches=2)
