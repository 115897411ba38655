"""Every grpo_hf engine records the sampler's own log-probs when asked (`RolloutEngine.record_logps`).

Each recorded log-prob is checked against a naive recomputation: one full forward of the model on prompt + completion,
the logits divided by the temperature and truncated by transformers' own top-k / top-p warpers, log-softmax, gathered
at the sampled token. Recording never changes what is sampled: the same seed draws the same tokens with it on and off.
"""

from types import SimpleNamespace

import pytest
import torch
from conftest import build_tiny_model
from test_tools import add, args_for, call_of, sums_dataset, tool_tokenizer, trainer_for, with_eos_tokens, zero
from transformers import GenerationConfig, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from grpo_hf.rollout import RolloutEngine, make_engine, register_engine, tokenize_prompts
from grpo_hf.rollout.sampling import RowDraws

PROMPTS = ["Hello there"] * 2 + ["A much longer prompt, with more tokens"] * 3 + ["Why?"] * 2 + ["Count: 1 2 3 4"]
SETTINGS = dict(temperature=0.7, top_k=40, top_p=0.9)
TOLERANCE = dict(rtol=0, atol=1e-5)


def _model(tokenizer):
    return build_tiny_model(tokenizer, seed=3).eval()


def _eos(tokenizer) -> list[int]:
    """One id in eight ends a completion, so that some rows end early and are padded, and some do not."""
    return [tokenizer.eos_token_id, *range(8, len(tokenizer), 8)]


def _config(tokenizer, **overrides) -> GenerationConfig:
    settings = dict(max_new_tokens=10, do_sample=True, pad_token_id=tokenizer.pad_token_id, **SETTINGS)
    return GenerationConfig(eos_token_id=_eos(tokenizer), **{**settings, **overrides})


def naive_logps(model, prompt_ids, prompt_mask, completion_ids, attended, settings=SETTINGS) -> torch.Tensor:
    """log p(token) [N, T] under the warped distribution, from one forward over prompt + completion (`attended`
    [N, T]: the completion's tokens the model reads, sampled or not), one step at a time."""
    ids = torch.cat([prompt_ids, completion_ids], dim=1)  # [N, P + T]
    mask = torch.cat([prompt_mask, attended], dim=1)  # [N, P + T]
    positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits.float()  # [N, P + T, V]
    warpers = [TemperatureLogitsWarper(settings["temperature"])]
    if settings.get("top_k"):
        warpers.append(TopKLogitsWarper(settings["top_k"]))
    if settings.get("top_p", 1.0) < 1.0:
        warpers.append(TopPLogitsWarper(settings["top_p"]))
    P, T = prompt_ids.size(1), completion_ids.size(1)
    logps = torch.zeros(completion_ids.shape)  # [N, T]
    for t in range(T):
        scores = logits[:, P + t - 1]  # [N, V]: the distribution of completion token t
        for warper in warpers:
            scores = warper(ids[:, : P + t], scores)
        logps[:, t] = torch.log_softmax(scores, dim=-1).gather(1, completion_ids[:, t : t + 1]).squeeze(1)
    return logps


def _check(engine, model, prompt_ids, prompt_mask, **kwargs):
    """Sample with recording off then on from one seed: the same tokens, and log-probs equal to the naive ones on
    the completion mask, 0 off it. Returns the completions."""
    engine.record_logps = False
    torch.manual_seed(0)
    plain = engine.generate(model, prompt_ids, prompt_mask, **kwargs)
    assert engine.sampling_logps is None
    engine.record_logps = True
    torch.manual_seed(0)
    recorded = engine.generate(model, prompt_ids, prompt_mask, **kwargs)
    assert torch.equal(recorded.completion_ids, plain.completion_ids)
    assert torch.equal(recorded.completion_mask, plain.completion_mask)
    logps, mask = engine.sampling_logps, recorded.completion_mask
    assert logps.shape == mask.shape and logps.dtype == torch.float32 and logps.device == mask.device
    assert torch.all(logps[mask == 0] == 0)
    expected = naive_logps(model, prompt_ids, prompt_mask, recorded.completion_ids, mask).masked_fill(mask == 0, 0)
    torch.testing.assert_close(logps, expected, **TOLERANCE)
    # The warpers matter: the model's plain log-probs are far from the sampler's.
    plain_logps = naive_logps(model, prompt_ids, prompt_mask, recorded.completion_ids, mask, {"temperature": 1.0})
    assert (plain_logps - logps).abs()[mask == 1].max() > 0.05
    assert mask.sum() > len(PROMPTS) and (mask == 0).any() and mask[:, -1].any()  # some rows ended early, some not
    return recorded


@pytest.mark.parametrize("name", ["loop", "generate", "generate_static", "cuda_graph", "continuous_batching"])
def test_each_engine_records_the_log_probs_its_tokens_were_drawn_with(tokenizer, name):
    model = _model(tokenizer)
    prompt_ids, prompt_mask, _ = tokenize_prompts(tokenizer, PROMPTS)
    config = _config(tokenizer)
    options = {"compile": False} if name == "cuda_graph" else {}
    if name == "continuous_batching":  # a paged cache of a fixed size (sized from free memory, it takes half of it)
        options["args"] = SimpleNamespace(transformers_continuous_batching_config={"num_blocks": 16})
    engine, why = make_engine(name, model, config, _eos(tokenizer), record_logps=True, **options)
    assert engine.name == name and engine.record_logps, why
    _check(engine, model, prompt_ids, prompt_mask)


def test_generate_records_the_log_probs_of_tokens_drawn_from_the_rows_own_streams(tokenizer):
    """With per-row streams (`DrawFromStreams`, tool episodes) the recorder sits before the draw, whose scores are
    0 on the drawn token and -inf elsewhere: it still records the warped distribution's log-prob."""
    model = _model(tokenizer)
    prompt_ids, prompt_mask, _ = tokenize_prompts(tokenizer, PROMPTS)
    engine, _ = make_engine("generate", model, _config(tokenizer), _eos(tokenizer))

    def draws():
        return RowDraws(7, torch.arange(len(PROMPTS)), torch.zeros(len(PROMPTS), dtype=torch.long))

    first = _check(engine, model, prompt_ids, prompt_mask, draws=draws())
    engine.record_logps = False
    torch.manual_seed(123)  # the streams, not the global generator, decide
    assert torch.equal(engine.generate(model, prompt_ids, prompt_mask, draws=draws()).completion_ids, first[0])


def test_the_compiled_cuda_graph_step_records_without_a_graph_break(tokenizer):
    """fullgraph=True fails on any graph break; the compiled step records what the eager step records."""
    model = _model(tokenizer)
    prompt_ids, prompt_mask, _ = tokenize_prompts(tokenizer, PROMPTS)
    config = _config(tokenizer, repetition_penalty=1.3, min_p=0.02)
    eager, _ = make_engine("cuda_graph", model, config, _eos(tokenizer), compile=False, record_logps=True)
    compiled, _ = make_engine("cuda_graph", model, config, _eos(tokenizer), compile=True, record_logps=True)
    compiled.compile_kwargs = {"fullgraph": True, "backend": "eager", "dynamic": False}
    torch.manual_seed(0)
    expected = eager.generate(model, prompt_ids, prompt_mask)
    torch.manual_seed(0)
    got = compiled.generate(model, prompt_ids, prompt_mask)
    assert all(b.compiled and not b.eager for b in compiled._buckets.values())
    assert torch.equal(got.completion_ids, expected.completion_ids)
    torch.testing.assert_close(compiled.sampling_logps, eager.sampling_logps, rtol=0, atol=0)
    assert (compiled.sampling_logps * got.completion_mask).abs().sum() > 0
    # A recording engine's buckets are its own: turning recording off builds a bucket without the buffer.
    compiled.record_logps = False
    torch.manual_seed(0)
    assert torch.equal(compiled.generate(model, prompt_ids, prompt_mask).completion_ids, got.completion_ids)
    assert compiled.sampling_logps is None and len(compiled._buckets) == 2


class _NoLogps(RolloutEngine):
    name = "no_logps"

    def sample(self, model, prompt_ids, prompt_mask):
        return prompt_ids[:, :2]


register_engine("no_logps", _NoLogps)


def test_engines_that_cannot_record_are_skipped_or_say_so(tokenizer):
    model = _model(tokenizer)
    prompt_ids, prompt_mask, _ = tokenize_prompts(tokenizer, PROMPTS)
    with pytest.raises(ValueError, match="does not record the sampler's log-probs"):
        make_engine("no_logps", model, _config(tokenizer), _eos(tokenizer), record_logps=True)
    engine = _NoLogps(_config(tokenizer), _eos(tokenizer))
    engine.record_logps = True
    with pytest.raises(ValueError, match="'no_logps' rollout engine does not record.*make_engine"):
        engine.generate(model, prompt_ids, prompt_mask)
    greedy = _config(tokenizer, typical_p=0.5)
    engine, _ = make_engine("generate", model, greedy, _eos(tokenizer), record_logps=True)
    with pytest.raises(ValueError, match="cannot record.*typical_p=0.5"):
        engine.generate(model, prompt_ids, prompt_mask)


@pytest.mark.parametrize("engine", ["loop", "generate"])
def test_tool_episodes_carry_each_turns_log_probs_and_zero_on_tool_replies(tmp_path, engine):
    """Episodes of two turns around a tool reply, sampled by the trainer's `Sampler` with `record_logps`: the
    `loop` engine's joining decoder and `generate`'s one call per round both give `Sampled.sampling_logps` equal to the
    naive log-probs on every sampled token, and 0 on the reply's tokens."""
    tokenizer = tool_tokenizer()
    settings = dict(temperature=0.8, top_k=30, top_p=0.95)
    config = args_for(tmp_path, rollout_engine=engine, max_completion_length=120, **settings)
    trainer = trainer_for(tmp_path, tokenizer, reward_funcs=zero, args=config, dataset=sums_dataset(2), tools=[add])
    sampler = with_eos_tokens(trainer, [i for i in range(len(tokenizer)) if i % 3 == 0])

    def parse(tok, ids, context, tools):
        if "<tool_response>" in tok.decode(context):
            return {"role": "assistant", "content": "done"}
        return {"role": "assistant", "content": "", "tool_calls": [call_of("add", a=1, b=2)]}

    sampler.episodes.parse = parse
    prompts = [row["prompt"] for row in sums_dataset(2) for _ in range(2)]
    torch.manual_seed(0)
    plain = sampler.sample(prompts, {})
    assert plain.sampling_logps is None  # off: the policy's own draw, nothing to correct
    sampler.record_logps = True
    torch.manual_seed(0)
    sampled = sampler.sample(prompts, {})
    tokens = sampled.tokens
    assert torch.equal(tokens.completion_ids, plain.tokens.completion_ids)
    assert sampled.turns == [2] * 4 and int(tokens.context_mask.sum()) > 0
    logps, mask = sampled.sampling_logps, tokens.completion_mask
    assert logps.shape == mask.shape and torch.all(logps[tokens.context_mask == 1] == 0)
    model = trainer.model.eval()
    attended = mask + tokens.context_mask
    expected = naive_logps(model, tokens.prompt_ids, tokens.prompt_mask, tokens.completion_ids, attended, settings)
    torch.testing.assert_close(logps, expected.masked_fill(mask == 0, 0), **TOLERANCE)
