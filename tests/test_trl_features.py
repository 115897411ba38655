"""TRL 1.16 features, each with TRL's field name, default and meaning: multi_objective_aggregation (GDPO),
sync_ref_model (TR-DPO), pad_to_multiple_of, cast_lm_head_to_fp32, trust_remote_code, router_aux_loss_coef (MoE),
log_extra / log_metric, reward_processing_classes and rollout_func. Tiny models, CPU, offline."""

import json
import logging
import math

import pytest
import torch
from conftest import TRAINING, build_tiny_model, id_sum_reward, make_dataset, make_trainer, tiny_run_args, train_logs
from test_reward_models import build_model as build_reward_model
from test_reward_models import build_tokenizer as build_reward_tokenizer
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    MixtralConfig,
    MixtralForCausalLM,
    TrainerCallback,
)

from grpo_hf import GRPOConfig, GRPOTrainer
from grpo_hf.config import TRL_DEFAULTS
from grpo_hf.core import decoupled_advantages, group_advantages, grpo_loss_with
from grpo_hf.heads import FP32LMHead, cast_lm_head_to_fp32
from grpo_hf.logprobs import padded_logps
from grpo_hf.rewards import compute_rewards
from grpo_hf.rewards.calling import RewardLogs
from grpo_hf.rollout import Sequences, split_into_micro_batches

NEW_FIELDS = {
    "multi_objective_aggregation": "sum_then_normalize",
    "sync_ref_model": False,
    "ref_model_mixup_alpha": 0.6,
    "ref_model_sync_steps": 512,
    "pad_to_multiple_of": "auto",
    "cast_lm_head_to_fp32": False,
    "trust_remote_code": False,
    "router_aux_loss_coef": None,
}


def test_defaults_are_trls(tmp_path):
    from trl import GRPOConfig as TRLConfig

    ours = GRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    theirs = TRLConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    for name, default in NEW_FIELDS.items():
        assert getattr(ours, name) == default and name not in TRL_DEFAULTS
        if name != "pad_to_multiple_of":  # TRL resolves "auto" in __post_init__ (None off Neuron); we, in the trainer
            assert getattr(theirs, name) == default, name
    assert theirs.pad_to_multiple_of is None


# ---------------------------------------------------------------------------------------------------------------
# 1. multi_objective_aggregation
# ---------------------------------------------------------------------------------------------------------------
def naive_gdpo(rewards: list[list[float | None]], G: int, weights: list[float]) -> list[float]:
    """GDPO from its formula, one Python float at a time: z_ik within the group, s_i = sum_k w_k z_ik, A over the
    batch. Unbiased std; + 1e-4; fewer than two values or all equal -> 0; None skipped; all-None row -> A = 0."""

    def normalise(value, values):
        if len(values) < 2 or max(values) == min(values):
            return 0.0
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
        return (value - mean) / (std + 1e-4)

    N, R = len(rewards), len(rewards[0])
    z = [[None] * R for _ in range(N)]
    for start in range(0, N, G):
        for k in range(R):
            column = [rewards[i][k] for i in range(start, start + G) if rewards[i][k] is not None]
            for i in range(start, start + G):
                if rewards[i][k] is not None:
                    z[i][k] = normalise(rewards[i][k], column)
    s = [
        None if all(v is None for v in row) else sum(w * v for w, v in zip(weights, row, strict=True) if v is not None)
        for row in z
    ]
    valid = [v for v in s if v is not None]
    return [0.0 if v is None else normalise(v, valid) for v in s]


def test_decoupled_advantages_match_the_formula_in_fp64():
    G, R = 4, 3
    generator = torch.Generator().manual_seed(0)
    rewards = torch.randn(6 * G, R, generator=generator, dtype=torch.float64)
    rewards[torch.rand(6 * G, R, generator=generator) < 0.25] = math.nan  # None rewards here and there
    rewards[0:G, 1] = 2.0  # a group whose function 1 gives one value to all
    rewards[G : 2 * G, 2] = math.nan  # ... no reward from function 2
    rewards[G + 1 : 2 * G, 0] = math.nan  # ... a single reward from function 0
    rewards[2 * G + 3] = math.nan  # a completion with no reward at all
    weights = [1.0, 0.5, -2.0]
    rows = [[None if math.isnan(v) else v for v in row] for row in rewards.tolist()]
    got = decoupled_advantages(rewards, G, torch.tensor(weights, dtype=torch.float64))
    assert got.dtype == torch.float64 and got[2 * G + 3] == 0.0
    torch.testing.assert_close(
        got, torch.tensor(naive_gdpo(rows, G, weights), dtype=torch.float64), rtol=1e-12, atol=1e-12
    )
    # one reward function: GDPO is the group advantage renormalised over the batch
    single = rewards[:, :1].nan_to_num(0.0)
    expected = group_advantages(group_advantages(single[:, 0], G, "group"), single.numel(), "group")
    torch.testing.assert_close(decoupled_advantages(single, G), expected, rtol=1e-12, atol=1e-12)


def length_reward(completion_ids, **kwargs):
    """Another objective; None for every third completion."""
    return [None if i % 3 == 0 else float(len(ids)) for i, ids in enumerate(completion_ids)]


def rollouts_of(trainer) -> list[dict]:
    """Record every rollout round's output (its `all_rewards` [N, R])."""
    seen, rollout_round = [], trainer.experience.rollout_round
    trainer.experience.rollout_round = lambda *a: seen.append(rollout_round(*a)) or seen[-1]
    return seen


@pytest.mark.parametrize("aggregation", ["sum_then_normalize", "normalize_then_sum"])
def test_trainer_advantages_follow_the_aggregation(tmp_path, tokenizer, aggregation):
    args = tiny_run_args(
        tmp_path, TRAINING, max_steps=1, beta=0.0, reward_weights=[1.0, 0.5], multi_objective_aggregation=aggregation
    )
    model = build_tiny_model(tokenizer)
    trainer = make_trainer(args, [id_sum_reward, length_reward], make_dataset(), tokenizer=tokenizer, model=model)
    seen = rollouts_of(trainer)
    trainer.train()
    (rollout,) = seen
    rewards, weights = rollout.all_rewards, torch.tensor([1.0, 0.5])
    if aggregation == "normalize_then_sum":
        expected = decoupled_advantages(rewards, 4, weights)
    else:
        expected = group_advantages(rollout.combined_rewards, 4, "group")
    assert not torch.equal(
        decoupled_advantages(rewards, 4, weights), group_advantages(rollout.combined_rewards, 4, "group")
    )
    torch.testing.assert_close(torch.cat([part.advantages for part in trainer._buffer]), expected)


def test_aggregation_choice_is_checked(tmp_path, caplog):
    with pytest.raises(ValueError, match="multi_objective_aggregation='mean' is not one of"):
        tiny_run_args(tmp_path, TRAINING, multi_objective_aggregation="mean")
    with caplog.at_level(logging.WARNING, logger="grpo_hf.config"):
        tiny_run_args(tmp_path, TRAINING, multi_objective_aggregation="normalize_then_sum", scale_rewards="none")
    assert "scale_rewards='none' does not apply" in caplog.text


# ---------------------------------------------------------------------------------------------------------------
# 2. sync_ref_model (TR-DPO)
# ---------------------------------------------------------------------------------------------------------------
class RecordWeights(TrainerCallback):
    """At each step end, before the reference sync (user callbacks run first): policy and reference weights."""

    def __init__(self):
        self.trainer, self.steps = None, []

    def on_step_end(self, args, state, control, **kwargs):
        clone = lambda m: {n: p.detach().clone() for n, p in m.named_parameters()}  # noqa: E731
        self.steps.append((clone(self.trainer.model), clone(self.trainer.ref_model)))


def test_reference_becomes_the_tr_dpo_mixture_every_n_steps(tmp_path, tokenizer):
    alpha = 0.6
    args = tiny_run_args(tmp_path, TRAINING, max_steps=2, beta=0.04, sync_ref_model=True, ref_model_sync_steps=2)
    assert args.ref_model_mixup_alpha == alpha
    record = RecordWeights()
    trainer = make_trainer(args, id_sum_reward, make_dataset(), tokenizer=tokenizer, callbacks=[record])
    record.trainer = trainer
    initial = {n: p.detach().clone() for n, p in trainer.ref_model.named_parameters()}
    trainer.train()
    (policy_1, ref_1), (policy_2, ref_2) = record.steps  # recorded before the sync of that step
    synced = dict(trainer.ref_model.named_parameters())
    for name, before in initial.items():
        assert torch.equal(ref_1[name], before) and torch.equal(ref_2[name], before)  # no sync after step 1
        assert not torch.equal(policy_2[name], policy_1[name])
        expected = torch.add(before * (1 - alpha), policy_2[name], alpha=alpha)  # after step 2: from its policy
        assert torch.equal(synced[name], expected), name


def test_synced_reference_is_saved_with_the_run_state(tmp_path, tokenizer):
    """A checkpoint holds the mixed reference (process 0's run state), and resuming loads it back."""
    from grpo_hf import checkpoint

    args = tiny_run_args(tmp_path, TRAINING, beta=0.04, sync_ref_model=True)
    build = lambda: make_trainer(  # noqa: E731
        args, id_sum_reward, make_dataset(), tokenizer=tokenizer
    )
    saved, resumed = build(), build()
    for p in saved.ref_model.parameters():
        p.data.mul_(0.5)
    checkpoint.save_run_state(str(tmp_path), 0, saved._run_state_to_save())
    resumed._load_run_state(str(tmp_path), resumed._saved_run_state(str(tmp_path)))
    for (name, p), q in zip(saved.ref_model.named_parameters(), resumed.ref_model.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_sync_ref_model_errors(tmp_path, tokenizer):
    with pytest.raises(ValueError, match="sync_ref_model=True with beta=0.0"):
        tiny_run_args(tmp_path, TRAINING, sync_ref_model=True, beta=0.0)
    with pytest.raises(ValueError, match="ref_model_mixup_alpha=1.5"):
        tiny_run_args(tmp_path, TRAINING, ref_model_mixup_alpha=1.5)
    with pytest.raises(ValueError, match="ref_model_sync_steps=0"):
        tiny_run_args(tmp_path, TRAINING, ref_model_sync_steps=0)
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    with pytest.raises(NotImplementedError, match="sync_ref_model=True with a PEFT model"):
        make_trainer(
            tiny_run_args(tmp_path, TRAINING, sync_ref_model=True),
            id_sum_reward,
            make_dataset(),
            tokenizer=tokenizer,
            model=build_tiny_model(tokenizer),
            peft_config=lora,
        )


# ---------------------------------------------------------------------------------------------------------------
# 3. pad_to_multiple_of and cast_lm_head_to_fp32
# ---------------------------------------------------------------------------------------------------------------
def test_pad_to_multiple_of_pads_the_rollout_and_leaves_the_loss(tmp_path, tokenizer):
    assert tiny_run_args(tmp_path, TRAINING, pad_to_multiple_of="16").pad_to_multiple_of == 16  # the CLI passes text
    assert tiny_run_args(tmp_path, TRAINING, pad_to_multiple_of="None").pad_to_multiple_of is None
    with pytest.raises(ValueError, match="pad_to_multiple_of=0"):
        tiny_run_args(tmp_path, TRAINING, pad_to_multiple_of=0)
    args = tiny_run_args(tmp_path, TRAINING, max_steps=1, beta=0.04, pad_to_multiple_of=16, share_prompt_prefix=False)
    trainer = make_trainer(args, id_sum_reward, make_dataset(), tokenizer=tokenizer)
    seen = rollouts_of(trainer)
    trainer.train()
    (batch,) = trainer._buffer
    assert len(seen) == 1  # one rollout round
    # the micro-batch every forward reads, padded once (the rollout round's own tensors are not padded)
    assert batch.prompt_ids.size(1) % 16 == 0 and batch.completion_ids.size(1) % 16 == 0
    assert batch.ref_logps.shape == batch.completion_ids.shape
    trimmed = split_into_micro_batches(batch, 4)[0]  # the same rows without the padding columns
    assert trimmed.prompt_ids.size(1) % 16 and trimmed.completion_ids.size(1) % 16
    initial = build_tiny_model(tokenizer)

    def loss_of(b):
        with torch.no_grad():
            logps, _ = padded_logps(initial, b)
        return grpo_loss_with(logps, None, b.ref_logps, b.advantages, b.completion_mask, args.loss_settings())[0]

    assert loss_of(batch).item() == pytest.approx(loss_of(trimmed).item(), rel=1e-5, abs=1e-7)
    assert train_logs(trainer)[0]["loss"] == pytest.approx(loss_of(trimmed).item(), rel=1e-5, abs=1e-7)
    trainer.args.pad_to_multiple_of = "auto"
    assert trainer.experience.pad_multiple() is None  # "auto": 128 on Neuron only (TRL)


def test_cast_lm_head_to_fp32_computes_fp32_logits(tokenizer):
    model = build_tiny_model(tokenizer).to(torch.bfloat16)
    weight = model.lm_head.weight.detach().clone()  # bf16
    cast_lm_head_to_fp32(model)
    assert isinstance(model.lm_head, FP32LMHead) and model.lm_head.weight.dtype == torch.float32
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    assert torch.equal(model.lm_head.weight, weight.float())  # exact: bf16 -> fp32
    ids = torch.tensor([tokenizer("What is 2 + 2?")["input_ids"]])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(input_ids=ids).logits
        hidden = model.model(input_ids=ids).last_hidden_state
    assert logits.dtype == torch.float32 and hidden.dtype == torch.bfloat16
    torch.testing.assert_close(logits, hidden.float() @ weight.float().T, rtol=1e-6, atol=1e-6)
    batch = Sequences(
        prompt_ids=ids[:, :-3],
        prompt_mask=torch.ones_like(ids[:, :-3]),
        completion_ids=ids[:, -3:],
        completion_mask=torch.ones_like(ids[:, -3:]),
    )
    logps, _ = padded_logps(model, batch)
    expected = torch.log_softmax(logits[:, -4:-1].double(), -1).gather(-1, ids[:, -3:, None]).squeeze(-1)
    torch.testing.assert_close(logps.double(), expected, rtol=1e-5, atol=1e-5)
    # tied embeddings: the shared matrix becomes fp32, the embedding output keeps the model's dtype
    torch.manual_seed(0)
    tied = type(model)(type(model.config)(**{**model.config.to_dict(), "tie_word_embeddings": True})).to(
        torch.bfloat16
    )
    cast_lm_head_to_fp32(tied)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight and tied.lm_head.weight.dtype == torch.float32
    assert tied.model.embed_tokens(ids).dtype == torch.bfloat16 and tied(input_ids=ids).logits.dtype == torch.float32


def test_cast_lm_head_to_fp32_in_the_trainer(tmp_path, tokenizer):
    args = tiny_run_args(tmp_path, TRAINING, max_steps=1, beta=0.04, cast_lm_head_to_fp32=True)
    model = build_tiny_model(tokenizer).to(torch.bfloat16)
    trainer = make_trainer(args, id_sum_reward, make_dataset(), tokenizer=tokenizer, model=model)
    for m in (trainer.model, trainer.ref_model):
        assert isinstance(m.lm_head, FP32LMHead) and m.lm_head.weight.dtype == torch.float32
    before = trainer.model.lm_head.weight.detach().clone()
    trainer.train()
    assert math.isfinite(train_logs(trainer)[0]["loss"])
    assert not torch.equal(trainer.model.lm_head.weight, before)  # the fp32 head trains
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"])
    with pytest.raises(ValueError, match="cast_lm_head_to_fp32=True needs the LM head to be a torch.nn.Linear"):
        make_trainer(
            args,
            id_sum_reward,
            make_dataset(),
            tokenizer=tokenizer,
            model=build_tiny_model(tokenizer),
            peft_config=lora,
        )


# ---------------------------------------------------------------------------------------------------------------
# 4. trust_remote_code, router_aux_loss_coef
# ---------------------------------------------------------------------------------------------------------------
def test_trust_remote_code_reaches_every_from_pretrained(tmp_path, tokenizer, monkeypatch):
    policy_dir, reward_dir = tmp_path / "policy", tmp_path / "reward"
    build_tiny_model(tokenizer).save_pretrained(policy_dir)
    tokenizer.save_pretrained(policy_dir)
    reward_tokenizer = build_reward_tokenizer()
    build_reward_model(len(reward_tokenizer)).save_pretrained(reward_dir)
    reward_tokenizer.save_pretrained(reward_dir)
    calls = []
    for cls in (AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer):
        original = cls.from_pretrained

        def spy(path, *args, _original=original, _cls=cls, **kwargs):
            calls.append((_cls.__name__, str(path), kwargs.get("trust_remote_code")))
            return _original(path, *args, **kwargs)

        monkeypatch.setattr(cls, "from_pretrained", spy)
    args = tiny_run_args(tmp_path / "out", TRAINING, beta=0.04, trust_remote_code=True)
    trainer = GRPOTrainer(str(policy_dir), [id_sum_reward, str(reward_dir)], args, train_dataset=make_dataset())
    assert sorted(calls) == sorted(
        [
            ("AutoModelForCausalLM", str(policy_dir), True),  # the policy
            ("AutoModelForCausalLM", str(policy_dir), True),  # the reference model
            ("AutoTokenizer", str(policy_dir), True),
            ("AutoModelForSequenceClassification", str(reward_dir), True),
            ("AutoTokenizer", str(reward_dir), True),
        ]
    )
    assert trainer.reward_processing_classes[0] is None
    assert trainer.reward_processing_classes[1].vocab_size == reward_tokenizer.vocab_size
    calls.clear()
    GRPOTrainer(
        str(policy_dir),
        id_sum_reward,
        tiny_run_args(tmp_path / "out", TRAINING, beta=0.0),
        train_dataset=make_dataset(),
    )
    assert {call[2] for call in calls} == {False}


def build_tiny_moe(tokenizer, seed=0) -> MixtralForCausalLM:
    torch.manual_seed(seed)
    config = MixtralConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=512,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    return MixtralForCausalLM(config)


def test_router_aux_loss_is_added_to_the_loss(tmp_path, tokenizer, caplog):
    coef = 0.5
    args = tiny_run_args(tmp_path, TRAINING, max_steps=1, beta=0.0, router_aux_loss_coef=coef)
    trainer = make_trainer(args, id_sum_reward, make_dataset(), tokenizer=tokenizer, model=build_tiny_moe(tokenizer))
    assert trainer.router_aux_loss_coef == coef
    with caplog.at_level(logging.INFO, logger="grpo_hf"):
        trainer.train()
    # the shared prompt prefix counts each prompt token once per row, as the padded forward does (checked below), and
    # after a routing pass backpropagates its groups' shares of the loss one group at a time
    assert "shared prompt prefix, one group's backward at a time (auto on cpu" in caplog.text
    assert "a group at a time runs a no-grad routing pass first" in caplog.text
    (batch,) = trainer._buffer
    initial = build_tiny_moe(tokenizer)
    input_ids = torch.cat([batch.prompt_ids, batch.completion_ids], dim=1)
    attention_mask = torch.cat([batch.prompt_mask, batch.completion_mask], dim=1)
    with torch.no_grad():
        aux = initial(input_ids=input_ids, attention_mask=attention_mask, output_router_logits=True).aux_loss
        logps, _ = padded_logps(initial, batch)
    policy_loss, _ = grpo_loss_with(logps, None, None, batch.advantages, batch.completion_mask, args.loss_settings())
    log = train_logs(trainer)[0]
    assert aux > 0 and log["aux_loss"] == pytest.approx(aux.item(), rel=1e-5)
    assert log["loss"] == pytest.approx((policy_loss + coef * aux).item(), rel=1e-5)
    assert abs(log["loss"] - policy_loss.item()) > 0.1
    assert trainer.aux_loss_enabled  # TRL's attribute
    assert trainer.state.log_history[-1]["aux_loss"] == log["aux_loss"]  # the end-of-training row (TRL reads it)


def test_router_aux_loss_coef_defaults_and_errors(tmp_path, tokenizer):
    dataset = make_dataset()
    moe = make_trainer(
        tiny_run_args(tmp_path, TRAINING), id_sum_reward, dataset, tokenizer=tokenizer, model=build_tiny_moe(tokenizer)
    )
    assert moe.router_aux_loss_coef == 0.001  # None: the model config's own coefficient (TRL)
    off = make_trainer(
        tiny_run_args(tmp_path, TRAINING, router_aux_loss_coef=0.0),
        id_sum_reward,
        dataset,
        tokenizer=tokenizer,
        model=build_tiny_moe(tokenizer),
    )
    assert off.router_aux_loss_coef == 0.0 and (off.logps.blocker(off.model) is None)
    assert moe.aux_loss_enabled and not off.aux_loss_enabled
    dense = make_trainer(
        tiny_run_args(tmp_path, TRAINING),
        id_sum_reward,
        dataset,
        tokenizer=tokenizer,
        model=build_tiny_model(tokenizer),
    )
    assert dense.router_aux_loss_coef == 0.0
    with pytest.raises(ValueError, match="router_aux_loss_coef=0.1 but LlamaForCausalLM is not a Mixture-of-Experts"):
        make_trainer(
            tiny_run_args(tmp_path, TRAINING, router_aux_loss_coef=0.1),
            id_sum_reward,
            dataset,
            tokenizer=tokenizer,
            model=build_tiny_model(tokenizer),
        )


def test_end_of_training_row_repeats_the_last_steps_metrics(tmp_path, tokenizer):
    """TRL logs every 10 steps, so its end-of-training row holds the metrics not yet logged, and ported code reads
    `log_history[-1]["reward"]`. With grpo_hf's logging_steps=1 nothing is left unlogged there: the row repeats the
    last step's metrics. With metrics still unlogged (logging_steps=2, 3 steps), it holds their means, as TRL's."""
    args = tiny_run_args(tmp_path, TRAINING, max_steps=3, beta=0.0)
    trainer = make_trainer(args, id_sum_reward, make_dataset(), tokenizer=tokenizer)
    trainer.train()
    *_, last, summary = trainer.state.log_history
    assert "train_runtime" in summary and "loss" in last and last["step"] == 3
    assert {k: summary[k] for k in last if k not in ("loss", "grad_norm", "learning_rate", "epoch")} == {
        k: v for k, v in last.items() if k not in ("loss", "grad_norm", "learning_rate", "epoch")
    }
    assert len(train_logs(trainer)) == 3  # counted once: the summary row has no "loss"

    args = tiny_run_args(tmp_path / "every2", TRAINING, max_steps=3, beta=0.0, logging_steps=2)
    every2 = make_trainer(args, id_sum_reward, make_dataset(), tokenizer=tokenizer)
    every2.train()
    *_, logged, summary = every2.state.log_history
    assert logged["step"] == 2 and summary["num_tokens"] > logged["num_tokens"]  # step 3's own metrics


# ---------------------------------------------------------------------------------------------------------------
# 5. log_extra / log_metric
# ---------------------------------------------------------------------------------------------------------------
def logging_reward(completions, log_extra=None, log_metric=None, **kwargs):
    log_extra("length", [len(c) for c in completions])
    log_metric("custom/mean_length", sum(len(c) for c in completions) / len(completions))
    log_metric("custom/calls", 1.0)
    return [float(len(c) % 5) for c in completions]


def plain_reward(prompts, completions, completion_ids, trainer_state, answer=None):  # gets no log callables
    return [1.0] * len(completions)


def test_compute_rewards_passes_log_callables_and_keeps_what_succeeded():
    def flaky(completions, log_extra, **kwargs):
        log_extra("seen", list(completions))
        if "bad" in completions:
            raise RuntimeError("bad sample")
        return [0.5] * len(completions)

    logs = RewardLogs(3)
    rewards, errors = compute_rewards(
        [logging_reward, plain_reward, flaky], ["p"] * 3, ["a", "bad", "ccc"], error_policy="skip", logs=logs
    )
    assert rewards[0][2] == 0.5 and math.isnan(rewards[1][2]) and rewards[2][2] == 0.5 and errors["flaky"] == 1
    assert logs.extra == {"length": [1, 3, 3], "seen": ["a", None, "ccc"]}  # the failing call's logs are dropped
    assert logs.metrics == {"custom/mean_length": [7 / 3], "custom/calls": [1.0]}
    with pytest.raises(RuntimeError, match=r"log_extra\('x', \.\.\.\) with 1 values for 2 completions"):
        compute_rewards(
            [lambda completions, **kw: kw["log_extra"]("x", [1]) or [0.0] * len(completions)],
            ["p"] * 2,
            ["a", "b"],
            logs=RewardLogs(2),
        )
    with pytest.raises(RuntimeError, match="'NoneType' object is not callable"):  # no logs: nothing passed
        compute_rewards([logging_reward], ["p"], ["a"])


def test_logged_metrics_and_columns_reach_the_logs(tmp_path, tokenizer):
    args = tiny_run_args(tmp_path, TRAINING, max_steps=1, log_completions=True, num_completions_to_print=1)
    trainer = make_trainer(args, [logging_reward, plain_reward], make_dataset(), tokenizer=tokenizer)
    trainer.train()
    rows = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all(row["length"] == len(row["completion"]) for row in rows)
    assert list(rows[0]) == ["step", "prompt", "completion", "rewards", "length", "advantage"]
    for step, log in enumerate(train_logs(trainer)):
        lengths = [row["length"] for row in rows[4 * step : 4 * step + 4]]
        assert log["custom/mean_length"] == pytest.approx(sum(lengths) / 4) and log["custom/calls"] == 1.0


# ---------------------------------------------------------------------------------------------------------------
# 6. reward_processing_classes
# ---------------------------------------------------------------------------------------------------------------
def test_reward_processing_classes_attribute_and_trls_error(tmp_path, tokenizer):
    reward_tokenizer = build_reward_tokenizer()
    reward_model = build_reward_model(len(reward_tokenizer))
    args, dataset = tiny_run_args(tmp_path, TRAINING), make_dataset()
    trainer = make_trainer(
        args,
        [id_sum_reward, reward_model],
        dataset,
        tokenizer=tokenizer,
        model=build_tiny_model(tokenizer),
        reward_processing_classes=[None, reward_tokenizer],
    )
    assert trainer.reward_processing_classes == [None, reward_tokenizer]
    with pytest.raises(ValueError) as error:
        make_trainer(
            args,
            [id_sum_reward, reward_model],
            dataset,
            tokenizer=tokenizer,
            model=build_tiny_model(tokenizer),
            reward_processing_classes=[reward_tokenizer],
        )
    assert (
        str(error.value)
        == "The number of reward processing classes (1) must match the number of reward functions (2)."
    )


# ---------------------------------------------------------------------------------------------------------------
# 7. rollout_func
# ---------------------------------------------------------------------------------------------------------------
def make_rollout_func(tokenizer, calls):
    def rollout_func(prompts, trainer):
        calls.append(list(prompts))
        prompt_ids = [tokenizer(p)["input_ids"] for p in prompts]
        completion_ids = [
            tokenizer(str(i % 4) * (1 + i % 3))["input_ids"] + [tokenizer.eos_token_id] for i in range(len(prompts))
        ]
        completion_ids[1] = completion_ids[1][:-1]  # one without EOS: truncated
        return {
            "prompt_ids": prompt_ids,
            "completion_ids": completion_ids,
            "logprobs": [[0.0] * len(ids) for ids in completion_ids],
            "source": [f"custom-{i}" for i in range(len(prompts))],
            "round": len(calls),
        }

    return rollout_func


def test_rollout_func_replaces_the_engine(tmp_path, tokenizer):
    calls, seen = [], []

    def reward(completions, completion_ids, **kwargs):
        seen.append((kwargs["source"], kwargs["round"], kwargs["answer"]))
        return [float(len(ids)) for ids in completion_ids]

    args = tiny_run_args(tmp_path, TRAINING, max_steps=1, mask_truncated_completions=True)
    trainer = make_trainer(
        args,
        reward,
        make_dataset(),
        tokenizer=tokenizer,
        model=build_tiny_model(tokenizer),
        rollout_func=make_rollout_func(tokenizer, calls),
    )
    trainer.train()
    assert trainer.rollout is None and trainer.num_generate_calls == 1
    (prompts,) = calls
    assert len(prompts) == 4 and len(set(prompts)) == 1  # the G copies of one prompt, as the sampler serves them
    ((source, round_, answer),) = seen
    assert source == [f"custom-{i}" for i in range(4)] and round_ == [1] * 4 and len(answer) == 4
    (batch,) = trainer._buffer
    expected = make_rollout_func(tokenizer, [])(prompts, trainer)
    for i, ids in enumerate(expected["completion_ids"]):
        n = len(ids)
        assert (
            batch.completion_ids[i, :n].tolist() == ids and batch.prompt_ids[i].tolist() == expected["prompt_ids"][i]
        )
        assert batch.completion_mask[i].sum() == (0 if i == 1 else n)  # row 1 has no EOS: truncated, masked
    assert batch.advantages.abs().sum() > 0


@pytest.mark.parametrize(
    "broken, message",
    [
        (lambda out: out.pop("logprobs"), r"rollout_func must return keys \['logprobs'\] in its output dict\."),
        (lambda out: out["completion_ids"].pop(), "rollout_func returned 3 completion_ids for 4 prompt rows"),
        (lambda out: out.update(env_mask=[[1]] * 4), r"rollout_func returned env_mask\[0\] with 1 values for 2"),
        (lambda out: out["logprobs"].pop(), "rollout_func returned 3 logprobs for 4 prompt rows"),
        (lambda out: out.update(source=["x"]), "rollout_func returned 'source' with 1 values for 4 rows"),
    ],
)
def test_rollout_func_contract_errors(tmp_path, tokenizer, broken, message):
    good = make_rollout_func(tokenizer, [])

    def rollout_func(prompts, trainer):
        out = good(prompts, trainer)
        broken(out)
        return out

    args = tiny_run_args(tmp_path, TRAINING, max_steps=1)
    trainer = make_trainer(
        args,
        id_sum_reward,
        make_dataset(),
        tokenizer=tokenizer,
        model=build_tiny_model(tokenizer),
        rollout_func=rollout_func,
    )
    with pytest.raises(ValueError, match=message):
        trainer.train()
