"""Routing replay as users run it (issue 61): short trainer runs over the settings a run meets, on the MoE families,
with router_replay 'off', 'r2' and 'r3'; and several trainers built and trained one after another in one process.

Each case is one trainer run of 1 or 2 steps on a tiny fp32 MoE model, its rollout on the same weights as its first
training forward. What every case checks:

- the router metrics are logged every step, shares in [0, 1], the token share at least the route share;
- on the first step (fp32 rollout = fp32 training, same weights) no route differs and the log-prob gap is ~0, also
  when the sampler truncates (top-k, top-p: the trainer's log-probs are then compared under the sampler's
  distribution, `replay.trainer_logps`);
- under 'r3', every routes tensor a forward replays is rows of the rollout's routes, and every router call under
  replay returns exactly the replayed experts for the tokens that have them (a spy hook registered after grpo_hf's).

The cases pick distinct code paths: buffered generation batches over several optimizer steps (old log-probs),
micro-batches that cut groups, the shared-prompt forward a group at a time with gradient checkpointing, LoRA with its
reference (adapters off), the reference model with beta > 0 and none with beta = 0, the load-balancing loss, the
asynchronous producer, dynamic sampling, the generate engine, bf16 autocast, and the families' own routers
(GPT-OSS, Mixtral, DeepSeek-V3, GraniteMoeHybrid, Qwen3-Next)."""

import pytest
import torch
import transformers
from conftest import build_tiny_tokenizer, make_dataset, make_trainer, tiny_run_args, train_logs
from test_families import COMMON, CONFIGS
from test_router_replay import replay_spy
from test_routers import OWN_CONFIGS
from transformers import AutoModelForCausalLM

from grpo_hf import routers
from grpo_hf.routers import router_sites

RUN = dict(
    per_device_train_batch_size=4, num_generations=2, max_completion_length=4, max_steps=1, learning_rate=1e-3,
    use_cpu=True, save_strategy="no", logging_steps=1, disable_tqdm=True, seed=0, rollout_engine="loop",
)  # fmt: skip
GRID = [  # (family, router_replay, settings beyond RUN)
    ("qwen3_moe", "r3", dict(gradient_accumulation_steps=2, steps_per_generation=4, num_iterations=2, max_steps=2)),
    ("qwen3_moe", "r3", dict(per_device_train_batch_size=2, num_generations=3, steps_per_generation=3)),
    ("qwen3_moe", "r2", dict(steps_per_generation=2, num_iterations=2, max_steps=2, beta=0.0)),
    ("gpt_oss", "r3", dict(share_prompt_prefix=True, backward_per_group=True, gradient_checkpointing=True)),
    ("mixtral", "r3", dict(lora=True, beta=0.1, num_iterations=2, max_steps=2)),
    ("mixtral", "r2", dict(rollout_engine="generate", generation_kwargs={"top_k": 5}, temperature=0.7)),
    ("deepseek_v3", "r3", dict(share_prompt_prefix=False)),
    ("granitemoehybrid", "r3", dict(beta=0.0, router_aux_loss_coef=0.01)),
    ("qwen3_next", "r3", {}),
    ("qwen3_moe", "r3", dict(max_staleness=1, max_steps=2)),
    ("qwen3_moe", "r3", dict(dynamic_sampling=True)),
    ("qwen3_moe", "r3", dict(bf16=True)),
    ("qwen3_moe", "off", dict(top_k=5, temperature=0.7)),
    ("qwen3_moe", "off", dict(top_p=0.8, steps_per_generation=2, num_iterations=2, max_steps=2)),
]
TOKENIZER = build_tiny_tokenizer()


def moe(family: str, seed: int = 0):
    """A tiny fp32 MoE model of `family` (test_families' or test_routers' config) over the byte tokenizer."""
    name, kwargs = {**CONFIGS, **OWN_CONFIGS}[family]
    config_class = getattr(transformers, name, None)
    if config_class is None:
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    common = {**COMMON, "vocab_size": len(TOKENIZER), "eos_token_id": TOKENIZER.eos_token_id, "pad_token_id": 0}
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config_class(**common, **kwargs)).float()


def spy_replayed_experts(model) -> list[int]:
    """A forward hook after grpo_hf's on every router of `model`: under replay, the experts the router returns must
    be the replayed ones for every token that has a route. Returns a one-element list counting the calls checked."""
    checked = [0]

    def hook(module, args, outputs):
        state = getattr(module, routers._STATE)
        if state.routes is None:
            return
        recorded = state.routes[:, :, state.layer].reshape(-1, state.routes.size(-1))  # [N, k]
        use = (recorded >= 0).all(dim=-1)
        assert torch.equal(outputs[state.layout.indices][use], recorded[use].to(torch.long))
        checked[0] += 1

    for site in router_sites(model):
        site.module.register_forward_hook(hook)
    return checked


@pytest.mark.parametrize(
    ("family", "mode", "settings"), GRID, ids=lambda x: "+".join(x) if isinstance(x, dict) else str(x)
)
def test_a_run_logs_sane_router_metrics_and_replays_the_rollouts_experts(family, mode, settings, monkeypatch):
    settings = dict(settings)
    lora = settings.pop("lora", False)
    peft = {}
    if lora:
        peft = {"peft_config": pytest.importorskip("peft").LoraConfig(r=4, target_modules=["q_proj", "v_proj"])}
    replayed = replay_spy(monkeypatch)
    args = tiny_run_args(preset=RUN, router_replay=mode, **settings)
    trainer = make_trainer(args, model=moe(family), tokenizer=TOKENIZER, **peft)
    checked = spy_replayed_experts(trainer.model)
    trainer.train()
    logs = train_logs(trainer)
    assert len(logs) == args.max_steps
    for row in logs:
        assert 0.0 <= row["router/route_mismatch"] <= row["router/token_mismatch"] <= 1.0
    first = logs[0]
    assert first["router/route_mismatch"] == 0.0 and first["router/token_mismatch"] == 0.0
    if not args.max_staleness:  # a fresh batch of the async producer carries no sampler log-probs
        assert first["router/logp_gap"] < 1e-5 and 0.0 <= first["router/k3_kl"] < 1e-9
    if args.max_staleness or args.num_iterations > 1:  # a step on weights newer than the rollout's: measured
        assert logs[-1]["router/logp_gap"] > 1e-4
    if mode == "off":
        assert not replayed and checked[0] == 0
        return
    assert replayed and checked[0] > 0  # r3: the rollout's routes; r2: the old forward's
    recorded = [batch.routes if mode == "r3" else batch.old_routes for batch in trainer._buffer]
    for part in replayed[-2:]:  # the last step's reference (or old) and loss forwards
        assert any(rows_of(part, routes) for routes in recorded)


def rows_of(part: torch.Tensor, routes: torch.Tensor) -> bool:
    """Whether each row of `part` [n, w, L, k] is a row of `routes` [B, W, L, k] cut to w consecutive columns."""
    w, W = part.size(1), routes.size(1)
    return all(
        any(torch.equal(row, routes[i, j : j + w].to(row.dtype)) for i in range(len(routes)) for j in range(W - w + 1))
        for row in part
    )


def test_a_load_balancing_weight_for_a_model_without_that_loss_is_refused_by_name():
    """DeepSeek-V3 balances its experts without an auxiliary loss (its forward returns none): a weight for it is an
    error naming the model when the trainer is built, not a TypeError in the first loss; its config's own is 0."""
    model = moe("deepseek_v3")
    with pytest.raises(ValueError, match="router_aux_loss_coef=0.01, but DeepseekV3ForCausalLM computes no load-bal"):
        make_trainer(tiny_run_args(preset=RUN, router_aux_loss_coef=0.01), model=model, tokenizer=TOKENIZER)
    model.config.router_aux_loss_coef = 0.001
    assert make_trainer(tiny_run_args(preset=RUN), model=model, tokenizer=TOKENIZER).router_aux_loss_coef == 0.0


def hooks_of(module) -> int:
    return sum(hook is routers._hook for hook in module._forward_hooks.values())


def test_trainers_built_one_after_another_in_one_process_keep_their_hooks_apart():
    """A notebook sweep: trainers of other settings built, trained and dropped one after another, on fresh models
    and on one model trained again: every router has one grpo_hf hook, idle between runs, and each run routes as
    its own rollout (the first step's routes all agree)."""
    shared = moe("qwen3_moe", seed=1)
    runs = [("off", moe("mixtral")), ("r3", shared), ("r2", shared), ("r3", moe("qwen3_moe")), ("off", shared)]
    for mode, model in runs:
        args = tiny_run_args(preset=RUN, router_replay=mode, beta=0.1)
        trainer = make_trainer(args, model=model, tokenizer=TOKENIZER)
        trainer.train()
        (row,) = train_logs(trainer)
        assert row["router/route_mismatch"] == 0.0 and row["router/logp_gap"] < 1e-5, mode
        sites = router_sites(trainer.model)
        assert [site.layer for site in sites] == list(range(len(sites)))
        for site in sites:
            state = getattr(site.module, routers._STATE)
            assert hooks_of(site.module) == 1 and state.recorder is None and state.routes is None
        if trainer.experience.models.reference is not None:  # the reference model's routers: its own states
            for site in router_sites(trainer.experience.models.reference):
                assert hooks_of(site.module) == 1 and getattr(site.module, routers._STATE).routes is None
        del trainer


def test_a_resumed_moe_run_trains_the_checkpoints_experts(tmp_path):
    """transformers writes an MoE checkpoint one tensor per expert and `Trainer` resumes it with a plain
    `load_state_dict`, which misses the fused expert weights (`checkpoint.load_converted_weights` loads them): the
    run resumed from step 1 (its buffered batch with its routes, under r3) repeats the uninterrupted step 2 exactly."""
    settings = dict(max_steps=2, steps_per_generation=2, save_strategy="steps", save_steps=1)
    runs = []
    for resume in (None, str(tmp_path / "checkpoint-1")):
        args = tiny_run_args(tmp_path, RUN, router_replay="r3", **settings)
        trainer = make_trainer(args, model=moe("qwen3_moe"), tokenizer=TOKENIZER)
        trainer.train(resume_from_checkpoint=resume)
        runs.append((train_logs(trainer)[-1], dict(trainer.model.named_parameters())))
    (logs, weights), (resumed_logs, resumed_weights) = runs
    assert resumed_logs["kl"] == logs["kl"] and resumed_logs["grad_norm"] == logs["grad_norm"]
    assert any("experts.gate_up_proj" in name for name in weights)
    for name, weight in weights.items():
        assert torch.equal(resumed_weights[name], weight), name


def step_penalised_reward(completion_ids, trainer_state, **kwargs):
    """Varies within a group (advantages non-zero), and falls by 100 a step: the first evaluation scores best."""
    return [float(sum(ids) % 7) - 100.0 * trainer_state.global_step for ids in completion_ids]


def test_load_best_model_at_end_loads_the_best_checkpoints_experts(tmp_path):
    """`Trainer._load_best_model` reads the best checkpoint with a plain `load_state_dict` too, which misses an MoE
    model's fused expert weights (written one tensor per expert): after a run whose best checkpoint is its first of
    two, every weight of the trained model is that checkpoint's as `from_pretrained` reads it, experts included."""
    args = tiny_run_args(
        tmp_path, RUN, max_steps=2, save_strategy="steps", save_steps=1, eval_strategy="steps", eval_steps=1,
        per_device_eval_batch_size=4, load_best_model_at_end=True, metric_for_best_model="eval_reward",
    )  # fmt: skip
    trainer = make_trainer(
        args, step_penalised_reward, model=moe("qwen3_moe"), tokenizer=TOKENIZER, eval_dataset=make_dataset(2)
    )
    trainer.train()
    assert trainer.state.best_model_checkpoint == str(tmp_path / "checkpoint-1")
    best, last = (
        AutoModelForCausalLM.from_pretrained(tmp_path / name, dtype=torch.float32).state_dict()
        for name in ("checkpoint-1", "checkpoint-2")
    )
    experts = [name for name in best if "experts.gate_up_proj" in name]
    assert experts and not any(torch.equal(best[name], last[name]) for name in experts)  # step 2 moved them
    weights = trainer.model.state_dict()
    assert weights.keys() == best.keys()
    for name, weight in weights.items():
        assert torch.equal(weight, best[name]), name
