"""GRPOTrainer behaviour on tiny models built from configs (offline, CPU, seconds each)."""

import asyncio
import json
import logging
import warnings

import pytest
import torch
from conftest import (
    ONE_PROCESS_CASES,
    TRAINING,
    assert_same_step,
    build_tiny_model,
    id_sum_reward,
    make_dataset,
    make_trainer,
    tiny_run_args,
    train_logs,
)
from datasets import Dataset

from grpo_hf.rollout import RepeatSampler, completion_mask, tokenize_prompts


# ---------------------------------------------------------------------------------------------------
# pieces
# ---------------------------------------------------------------------------------------------------
def test_repeat_sampler_keeps_groups_and_repeats_batches():
    sampler = RepeatSampler(num_prompts=7, num_generations=2, prompts_per_batch=3, repeat_count=2, shuffle=False)
    assert list(sampler) == [0, 0, 1, 1, 2, 2] * 2 + [3, 3, 4, 4, 5, 5] * 2
    assert len(sampler) == 24
    shuffled = list(RepeatSampler(7, 2, 3, shuffle=True, seed=1))
    again = list(RepeatSampler(7, 2, 3, shuffle=True, seed=1))
    assert shuffled == again  # deterministic under the seed
    assert all(shuffled[i] == shuffled[i + 1] for i in range(0, len(shuffled), 2))  # copies stay together
    assert len(set(shuffled)) == 6 and shuffled != sorted(shuffled)


def test_completion_mask_up_to_first_eos():
    ids = torch.tensor([[5, 2, 7, 2], [5, 6, 7, 8], [2, 0, 0, 0]])
    mask, truncated = completion_mask(ids, [2])
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    assert truncated.tolist() == [False, True, False]


def test_tokenize_prompts_left_pads_truncates_and_encodes_groups_once(tokenizer):
    calls = []
    original = tokenizer.__class__.__call__

    def counting_call(self, texts, **kwargs):
        calls.append(len(texts))
        return original(self, texts, **kwargs)

    prompts = ["ab"] * 3 + ["abcdef"] * 3
    tokenizer.__class__.__call__ = counting_call
    try:
        ids, mask, truncated = tokenize_prompts(tokenizer, prompts, max_prompt_length=4)
    finally:
        tokenizer.__class__.__call__ = original
    assert calls == [2]  # two distinct prompts encoded, not six
    assert ids.shape == (6, 4)
    assert mask[0].tolist() == [0, 0, 1, 1] and mask[3].tolist() == [1, 1, 1, 1]
    assert tokenizer.decode(ids[3]) == "cdef"  # left-truncated: the end of the prompt is kept
    assert truncated.tolist() == [False] * 3 + [True] * 3


# ---------------------------------------------------------------------------------------------------
# construction errors
# ---------------------------------------------------------------------------------------------------
def test_missing_prompt_column_is_named(tmp_path, tokenizer, tiny_llama):
    dataset = Dataset.from_dict({"question": ["a", "b"]})
    with pytest.raises(ValueError, match=r"no 'prompt' column \(found: \['question'\]\)"):
        make_trainer(tiny_run_args(tmp_path, TRAINING), id_sum_reward, dataset, tokenizer=tokenizer, model=tiny_llama)


CHAT = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.mark.parametrize(
    ("columns", "suggested"),
    [
        ({"problem": ["1 + 1?", "2 + 2?"], "answer": ["2", "4"]}, "'problem'"),
        ({"solution": ["2", "4"], "id": [1, 2], "query": ["1 + 1?", "2 + 2?"]}, "'query'"),
        ({"answer": ["2", "4"], "body": ["1 + 1?", "2 + 2?"]}, "'body'"),  # a text column, not the answers'
        ({"id": [1, 2], "conversations": [CHAT, CHAT]}, "'conversations'"),  # chat messages
    ],
)
def test_missing_prompt_column_error_names_the_datasets_columns_and_a_likely_one(
    tmp_path, tiny_llama, columns, suggested
):
    """The error lists the dataset's own columns and suggests renaming the one that likely holds the prompts (a text
    or chat column, by its name), not a fixed 'question'."""
    with pytest.raises(ValueError) as info:
        make_trainer(tiny_run_args(tmp_path, TRAINING), dataset=Dataset.from_dict(columns), model=tiny_llama)
    message = str(info.value)
    assert f"no 'prompt' column (found: {list(columns)})" in message
    assert f"dataset.rename_column({suggested}, 'prompt')" in message and "'question'" not in message


def test_missing_prompt_column_without_a_text_column_suggests_building_one(tmp_path, tiny_llama):
    dataset = Dataset.from_dict({"id": [1, 2], "a": [3, 4]})
    with pytest.raises(ValueError, match=r"\(found: \['id', 'a'\]\)\..*dataset\.map\(lambda row: \{'prompt'") as info:
        make_trainer(tiny_run_args(tmp_path, TRAINING), dataset=dataset, model=tiny_llama)
    assert "rename_column" not in str(info.value)


def test_empty_dataset_is_rejected(tmp_path, tokenizer, tiny_llama):
    dataset = Dataset.from_dict({"prompt": []})
    with pytest.raises(ValueError, match="train_dataset is empty"):
        make_trainer(tiny_run_args(tmp_path, TRAINING), id_sum_reward, dataset, tokenizer=tokenizer, model=tiny_llama)


def test_batch_not_divisible_by_num_generations_names_the_settings(tmp_path):
    with pytest.raises(ValueError, match="num_generations=4"):
        tiny_run_args(tmp_path, TRAINING, per_device_train_batch_size=6)


def test_wrong_number_of_reward_weights(tmp_path, tokenizer, tiny_llama):
    with pytest.raises(ValueError, match="reward_weights has 1 entries but there are 2"):
        make_trainer(
            tiny_run_args(tmp_path, TRAINING, reward_weights=[1.0]),
            [id_sum_reward, "accuracy"],
            make_dataset(),
            tokenizer=tokenizer,
            model=tiny_llama,
        )


def test_unknown_reward_name_lists_known_names(tmp_path, tokenizer, tiny_llama):
    with pytest.raises(ValueError, match="accuracy"):
        make_trainer(
            tiny_run_args(tmp_path, TRAINING), "no_such_reward", make_dataset(), tokenizer=tokenizer, model=tiny_llama
        )


# ---------------------------------------------------------------------------------------------------
# training
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_training_changes_every_trainable_parameter(tmp_path, tokenizer, arch):
    model = build_tiny_model(tokenizer, arch)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    trainer = make_trainer(
        tiny_run_args(tmp_path, TRAINING), id_sum_reward, make_dataset(), tokenizer=tokenizer, model=model
    )
    trainer.train()
    unchanged = [name for name, p in model.named_parameters() if torch.equal(p, before[name])]
    assert unchanged == []
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in train_logs(trainer))


@pytest.mark.parametrize("precision", ["bf16_autocast", "bf16_weights"])
def test_bf16_trains(tmp_path, tokenizer, precision):
    """bf16=True over fp32 weights (autocast: rotary keys stay fp32, values bf16 in the KV cache), or bf16 weights."""
    model = build_tiny_model(tokenizer, "llama")
    if precision == "bf16_weights":
        model = model.to(torch.bfloat16)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    args = tiny_run_args(tmp_path, TRAINING, bf16=precision == "bf16_autocast")
    trainer = make_trainer(args, id_sum_reward, make_dataset(), tokenizer=tokenizer, model=model)
    trainer.train()
    assert [name for name, p in model.named_parameters() if torch.equal(p, before[name])] == []
    logs = train_logs(trainer)
    assert len(logs) == 2 and all(torch.isfinite(torch.tensor([h["loss"], h["kl"]])).all() for h in logs)


def test_lora_trains_adapters_and_keeps_base_weights(tmp_path, tokenizer, tiny_llama):
    from peft import LoraConfig

    base = {name: p.detach().clone() for name, p in tiny_llama.named_parameters()}
    trainer = make_trainer(
        tiny_run_args(tmp_path, TRAINING, beta=0.04),
        id_sum_reward,
        make_dataset(),
        tokenizer=tokenizer,
        model=tiny_llama,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights="gaussian"),
    )
    assert trainer.ref_model is None  # the reference is the base model with adapters off: no copy
    lora_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" in n}
    trainer.train()
    params = dict(trainer.model.named_parameters())
    for name, value in base.items():
        peft_name = "base_model.model." + name.replace("q_proj.weight", "q_proj.base_layer.weight").replace(
            "v_proj.weight", "v_proj.base_layer.weight"
        )
        assert torch.equal(params[peft_name], value), name
    assert lora_before and all(not torch.equal(params[n], p) for n, p in lora_before.items())
    assert "kl" in train_logs(trainer)[0]


def test_lora_adapters_are_initialised_from_seed(tmp_path, tokenizer):
    """The adapters' random init draws from `args.seed`: the same seed gives the same adapters whatever the global
    RNG held before, another seed other adapters (sharded runs stitch each process's shard of this init)."""
    from peft import LoraConfig

    def adapters(seed, rng_before):
        model = build_tiny_model(tokenizer, seed=3)  # the same base model each time
        torch.manual_seed(rng_before)  # what ran before the trainer must not matter
        config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights="gaussian")
        trainer = make_trainer(
            tiny_run_args(tmp_path, TRAINING, seed=seed),
            id_sum_reward,
            make_dataset(),
            tokenizer=tokenizer,
            model=model,
            peft_config=config,
        )
        return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" in n}

    first, again, other = adapters(0, rng_before=1), adapters(0, rng_before=2), adapters(1, rng_before=1)
    assert first and first.keys() == again.keys() == other.keys()
    assert all(torch.equal(first[n], again[n]) for n in first)
    assert all(not torch.equal(first[n], other[n]) for n in first if "lora_A" in n)  # lora_B starts at zero


@pytest.mark.parametrize(
    "loss_type,scale_rewards,level",
    [
        (loss, scale, level)
        for loss in ("grpo", "bnpo", "dr_grpo", "dapo")
        for scale in ("group", "batch", "none")
        for level in ("token", "sequence", "sequence_sum")
        if not (level == "sequence_sum" and loss != "grpo")
    ]
    + [(loss, "group", level) for loss in ("cispo", "sapo", "luspo", "vespo") for level in ("token", "sequence")],
)
def test_loss_variants_train_to_finite_losses(tmp_path, tokenizer, tiny_llama, loss_type, scale_rewards, level):
    args = tiny_run_args(
        tmp_path,
        TRAINING,
        loss_type=loss_type,
        scale_rewards=scale_rewards,
        importance_sampling_level=level,
        max_steps=2,
        num_iterations=2,
    )
    trainer = make_trainer(args, id_sum_reward, make_dataset(), tokenizer=tokenizer, model=tiny_llama)
    trainer.train()
    losses = [h["loss"] for h in train_logs(trainer)]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))


@pytest.mark.parametrize(
    "overrides,expected_calls",
    [
        (dict(num_iterations=2, max_steps=4), 2),  # each rollout serves 2 optimizer steps
        (dict(steps_per_generation=2, max_steps=4), 2),  # each rollout serves 2 micro-batches = 2 steps
        (dict(gradient_accumulation_steps=2, max_steps=2), 2),  # one rollout per optimizer step
        (dict(max_steps=3), 3),
    ],
)
def test_rollouts_are_reused(tmp_path, tokenizer, tiny_llama, overrides, expected_calls):
    trainer = make_trainer(
        tiny_run_args(tmp_path, TRAINING, **overrides),
        id_sum_reward,
        make_dataset(16),
        tokenizer=tokenizer,
        model=tiny_llama,
    )
    trainer.train()
    assert trainer.num_generate_calls == expected_calls
    assert trainer.state.global_step == overrides["max_steps"]


def test_old_logps_only_when_the_policy_moved(tmp_path, tokenizer, tiny_llama):
    on_policy = make_trainer(
        tiny_run_args(tmp_path, TRAINING), id_sum_reward, make_dataset(), tokenizer=tokenizer, model=tiny_llama
    )
    assert on_policy.experience.needs_old_logps is False
    reused = make_trainer(
        tiny_run_args(tmp_path, TRAINING, num_iterations=2),
        id_sum_reward,
        make_dataset(),
        tokenizer=tokenizer,
        model=tiny_llama,
    )
    assert reused.experience.needs_old_logps is True


def test_without_shuffle_rollouts_cover_rows_in_order(tmp_path, tokenizer, tiny_llama):
    seen = []

    def recording_reward(prompts, completions, index, **kwargs):
        seen.extend(index)
        return [0.0] * len(prompts)

    dataset = make_dataset(6, index=list(range(6)))
    args = tiny_run_args(tmp_path, TRAINING, shuffle_dataset=False, max_steps=3, per_device_train_batch_size=8)
    trainer = make_trainer(args, recording_reward, dataset, tokenizer=tokenizer, model=tiny_llama)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    assert seen == [i for i in range(6) for _ in range(4)]


def test_beta_zero_builds_no_reference_and_logs_no_kl(tmp_path, tokenizer, tiny_llama):
    trainer = make_trainer(
        tiny_run_args(tmp_path, TRAINING, beta=0.0),
        id_sum_reward,
        make_dataset(),
        tokenizer=tokenizer,
        model=tiny_llama,
    )
    assert trainer.ref_model is None
    trainer.train()
    assert all("kl" not in h for h in train_logs(trainer))


def test_beta_positive_logs_kl_zero_at_first_step(tmp_path, tokenizer, tiny_llama):
    trainer = make_trainer(
        tiny_run_args(tmp_path, TRAINING, beta=0.04),
        id_sum_reward,
        make_dataset(),
        tokenizer=tokenizer,
        model=tiny_llama,
    )
    assert trainer.ref_model is not None and not trainer.ref_model.training
    trainer.train()
    logs = train_logs(trainer)
    assert logs[0]["kl"] == pytest.approx(0.0, abs=1e-7)  # policy == reference before the first update
    assert logs[1]["kl"] > 0


def test_weighted_constant_rewards(tmp_path, tokenizer, tiny_llama):
    def ones(completions, **kwargs):
        return [1.0] * len(completions)

    def zeros(completions, **kwargs):
        return [0.0] * len(completions)

    args = tiny_run_args(tmp_path, TRAINING, reward_weights=[0.7, 0.3], max_steps=1)
    trainer = make_trainer(args, [ones, zeros], make_dataset(), tokenizer=tokenizer, model=tiny_llama)
    trainer.train()
    log = train_logs(trainer)[0]
    assert log["reward"] == pytest.approx(0.7)
    assert log["rewards/ones/mean"] == 1.0 and log["rewards/zeros/mean"] == 0.0
    assert log["reward_std"] == 0.0 and log["frac_reward_zero_std"] == 1.0


def test_all_none_rewards_train_with_a_warning(tmp_path, tokenizer, tiny_llama, caplog):
    def not_applicable(completions, **kwargs):
        return [None] * len(completions)

    trainer = make_trainer(
        tiny_run_args(tmp_path, TRAINING, max_steps=1),
        not_applicable,
        make_dataset(),
        tokenizer=tokenizer,
        model=tiny_llama,
    )
    with caplog.at_level(logging.WARNING, logger="grpo_hf"):
        trainer.train()
    assert any("All reward functions returned None" in r.getMessage() for r in caplog.records)
    assert trainer.state.global_step == 1


def test_columns_and_trainer_state_reach_reward_functions(tmp_path, tokenizer, tiny_llama):
    received = {}

    def inspecting(prompts, completions, completion_ids, trainer_state, answer, topic, **kwargs):
        received.update(answer=list(answer), topic=list(topic), step=trainer_state.global_step, n=len(prompts))
        return [1.0] * len(prompts)

    dataset = make_dataset(4, topic=["t0", "t1", "t2", "t3"])
    args = tiny_run_args(tmp_path, TRAINING, max_steps=1, shuffle_dataset=False)
    trainer = make_trainer(args, inspecting, dataset, tokenizer=tokenizer, model=tiny_llama)
    trainer.train()
    assert received == {"answer": ["0"] * 4, "topic": ["t0"] * 4, "step": 0, "n": 4}


def test_async_reward_function(tmp_path, tokenizer, tiny_llama):
    async def async_reward(completion_ids, **kwargs):
        await asyncio.sleep(0)
        return [float(len(ids)) for ids in completion_ids]

    trainer = make_trainer(
        tiny_run_args(tmp_path, TRAINING, max_steps=1),
        async_reward,
        make_dataset(),
        tokenizer=tokenizer,
        model=tiny_llama,
    )
    trainer.train()
    assert train_logs(trainer)[0]["rewards/async_reward/mean"] > 0


def test_all_truncated_and_masked_leaves_parameters_unchanged(tmp_path, tokenizer, tiny_llama):
    before = {n: p.detach().clone() for n, p in tiny_llama.named_parameters()}
    args = tiny_run_args(
        tmp_path,
        TRAINING,
        mask_truncated_completions=True,
        generation_kwargs={"min_new_tokens": 8},  # EOS is blocked: every completion is truncated
    )
    trainer = make_trainer(args, id_sum_reward, make_dataset(), tokenizer=tokenizer, model=tiny_llama)
    trainer.train()
    logs = train_logs(trainer)
    assert logs[0]["completions/clipped_ratio"] == 1.0
    assert all(torch.equal(p, before[n]) for n, p in tiny_llama.named_parameters())
    # num_tokens counts every generated token, masked or not (TRL): step 2's prompts plus 4 x 8 completion tokens
    (batch,) = trainer._buffer
    assert batch.completion_mask.sum() == 0
    assert logs[1]["num_tokens"] - logs[0]["num_tokens"] == batch.prompt_mask.sum().item() + 4 * 8


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "cispo", "vespo", "sapo"])
def test_gradient_accumulation_invariance(tmp_path, tokenizer, loss_type):
    """One optimizer step on 8 completions equals 2 accumulated micro-batches of 4, same rollouts."""
    updated = []
    for per_device, accumulation in ((8, 1), (4, 2)):
        model = build_tiny_model(tokenizer, seed=3)
        args = tiny_run_args(
            tmp_path,
            TRAINING,
            per_device_train_batch_size=per_device,
            gradient_accumulation_steps=accumulation,
            num_generations=4,
            max_steps=1,
            optim="sgd",
            learning_rate=1.0,
            max_grad_norm=0.0,
            loss_type=loss_type,
            beta=0.04,
        )
        trainer = make_trainer(args, id_sum_reward, make_dataset(), tokenizer=tokenizer, model=model)
        trainer.train()
        assert trainer.num_generate_calls == 1
        updated.append({n: p.detach().clone() for n, p in model.named_parameters()})
    initial = dict(build_tiny_model(tokenizer, seed=3).named_parameters())
    assert sum((updated[0][n] - initial[n]).abs().sum() for n in initial) > 0
    for name in initial:
        delta_full, delta_accum = updated[0][name] - initial[name], updated[1][name] - initial[name]
        torch.testing.assert_close(delta_accum, delta_full, rtol=1e-4, atol=1e-7)


def test_eval_during_training_logs_eval_reward(tmp_path, tokenizer, tiny_llama):
    args = tiny_run_args(
        tmp_path, TRAINING, eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=4, max_steps=2
    )
    trainer = make_trainer(
        args, id_sum_reward, make_dataset(), tokenizer=tokenizer, model=tiny_llama, eval_dataset=make_dataset(2)
    )
    trainer.train()
    eval_logs = [h for h in trainer.state.log_history if "eval_reward" in h]
    assert len(eval_logs) == 2
    assert "eval_rewards/id_sum_reward/mean" in eval_logs[0] and "eval_completions/mean_length" in eval_logs[0]
    standalone = trainer.evaluate()
    assert "eval_reward" in standalone


def test_conversational_prompts_and_log_completions(tmp_path, tokenizer, tiny_llama):
    seen = {}

    def chat_reward(prompts, completions, **kwargs):
        seen["prompt"], seen["completion"] = prompts[0], completions[0]
        return [float(len(c[0]["content"])) for c in completions]

    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Say {i}"}] for i in range(4)]})
    args = tiny_run_args(tmp_path, TRAINING, max_steps=1, log_completions=True, max_prompt_length=None)
    trainer = make_trainer(args, chat_reward, dataset, tokenizer=tokenizer, model=tiny_llama)
    trainer.train()
    assert seen["prompt"][0]["role"] == "user"
    assert seen["completion"][0]["role"] == "assistant"
    rows = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and set(rows[0]) == {"step", "prompt", "completion", "rewards", "advantage"}
    assert train_logs(trainer)[0]["prompts/num_truncated"] == 0  # no limit: nothing cut


@pytest.mark.parametrize("case", ONE_PROCESS_CASES)
def test_two_processes_match_one_process(distributed_steps, case):
    """A group of 8 split over 2 gloo processes: same advantages, loss and (clipped) update as 1 process, on the
    fast path (shared prompt prefix and per-group backward, DDP's forward bypassed, gradients averaged by the
    trainer) and on the padded path (through DDP), with and without gradient accumulation."""
    one, two = distributed_steps[1][case], distributed_steps[2][case]
    assert one["fast_path"] is two["fast_path"] is case.endswith("fast")
    assert_same_step(one, two)


# ---------------------------------------------------------------------------------------------------
# the classic walkthrough: a toy task learned from scratch
# ---------------------------------------------------------------------------------------------------
TAGS = ["<think>", "</think>", "<answer>", "</answer>"]
LETTERS = [chr(ord("a") + k) for k in range(26)]


def build_toy_tokenizer():
    """32 ids: pad, eos, the four tags and 26 letters; one word per token."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(["<pad>", "<eos>", *TAGS, *LETTERS])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>")


def toy_dataset(tokenizer, size: int = 512) -> Dataset:
    """Prompts of a worked example plus 10 random letters; `label_id`: the last letter, to copy into the answer."""
    generator = torch.Generator().manual_seed(0)
    prompts, labels = [], []
    for _ in range(size):
        question = [LETTERS[int(k)] for k in torch.randint(0, 4, (10,), generator=generator)]
        prompts.append(" ".join(["<think> a b c </think> <answer> y </answer>", *question, "<think>"]))
        labels.append(tokenizer.convert_tokens_to_ids(question[-1]))  # the answer: copy the last question token
    return Dataset.from_dict({"prompt": prompts, "label_id": labels})


def build_toy_model(seed: int = 0):
    """A 2-layer Llama of ~270k parameters over the toy tokenizer's 32 ids, randomly initialised under `seed`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=32,
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )
    return LlamaForCausalLM(config)


def toy_reward(completion_ids, label_id, **kwargs):
    """0.25 for each of `</think>`, `<answer>`, `</answer>` in order; +1 for `<answer> label </answer>`."""
    close_think, open_answer, close_answer = 3, 4, 5
    scores = []
    for ids, label in zip(completion_ids, label_id, strict=True):
        score, position = 0.0, 0
        for tag in (close_think, open_answer, close_answer):
            if tag not in ids[position:]:
                break
            found = ids.index(tag, position)
            if tag == close_answer and ids[position:found] == [label]:
                score += 1.0
            score, position = score + 0.25, found + 1
        scores.append(score)
    return scores


def test_toy_task_learns_from_scratch(tmp_path):
    tokenizer = build_toy_tokenizer()
    assert len(tokenizer) == 32 and tokenizer.convert_tokens_to_ids(TAGS) == [2, 3, 4, 5]
    dataset = toy_dataset(tokenizer)
    model = build_toy_model()
    assert 100_000 < model.num_parameters() < 1_000_000
    args = tiny_run_args(
        tmp_path,
        TRAINING,
        per_device_train_batch_size=32,
        num_generations=8,
        max_completion_length=6,
        max_steps=60,
        learning_rate=3e-3,
        beta=0.0,
        loss_type="dr_grpo",
        scale_rewards="none",
        lr_scheduler_type="constant",
    )
    trainer = make_trainer(args, toy_reward, dataset, tokenizer=tokenizer, model=model)
    trainer.train()
    rewards = [h["reward"] for h in train_logs(trainer)]
    start, end = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    # A random model scores ~0.1; learning the tag structure alone is worth 0.75.
    assert end > start + 0.3, (start, end)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({}, "log-prob path: shared prompt prefix, one group's backward at a time"),
        (
            {"share_prompt_prefix": False},
            "one padded forward over prompt + completion rows, one backward (share_prompt_prefix=False)",
        ),
        ({"gradient_checkpointing": True}, "(gradient checkpointing drops the prompt's cache)"),
        ({"rollout_engine": "generate"}, "rollout engine: generate | log-prob path: shared prompt prefix"),
    ],
)
def test_log_prob_path_and_why_are_logged_at_start_up(tmp_path, tiny_llama, tokenizer, caplog, overrides, expected):
    """One line at the start of training names the rollout engine and the log-prob path, each with its reason."""
    args = tiny_run_args(tmp_path, TRAINING, max_steps=1, **overrides)
    trainer = make_trainer(args, id_sum_reward, make_dataset(), tokenizer=tokenizer, model=tiny_llama)
    with caplog.at_level(logging.INFO, logger="grpo_hf"):
        trainer.train()
    (start,) = [record.getMessage() for record in caplog.records if record.name == "grpo_hf.callbacks"]
    assert start.startswith("rollout engine: ") and " | log-prob path: " in start and expected in start
