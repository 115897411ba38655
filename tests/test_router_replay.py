"""Routing replay on the training side (`grpo_hf.replay`, issue 61): R3 replays the rollout's experts and R2 the old
forward's in every training-side forward (padded, shared prefix, a group at a time, in chunks; LoRA), the router still
gets gradients, "off" changes nothing, and the router metrics count a forced mismatch as a naive loop does.

The "rollout" here is a tiny MoE whose routers were perturbed: its routes differ from the training model's. Each
replayed forward is checked against the same forward done by hand under `routers.replaying`."""

import dataclasses
import logging
import math
import types

import pytest
import torch
from test_families import build, make_batch
from test_routers import perturbed

from grpo_hf import GRPOConfig
from grpo_hf.logprobs import backward_per_group, completion_logps, logps_in_chunks, watch_logps
from grpo_hf.metrics import Metrics
from grpo_hf.replay import RouterReplay, logp_gap_sums
from grpo_hf.routers import recording, replaying, router_sites

FAMILIES = ["qwen3_moe", "gpt_oss", "mixtral"]
PATHS = ["padded", "shared", "per_group"]


class FakeAccelerator:
    num_processes = 1
    device = torch.device("cpu")


def full_mask(batch):
    return torch.cat([batch.prompt_mask, batch.attention_mask], dim=1)  # [B, P + T]


def padded_routes(model, batch):
    """The routes [B, P + T, L, k] of one padded forward of `model` over `batch`, -1 off the tokens (the rollout's)."""
    input_ids = torch.cat([batch.prompt_ids, batch.completion_ids], dim=1)
    mask = full_mask(batch)
    with recording(model) as recorder, torch.no_grad():
        model(input_ids=input_ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0))
    routes = recorder.pop(len(batch)).to(torch.int16)
    return routes.masked_fill(~mask.bool()[:, :, None, None], -1)


def by_hand(model, batch, routes):
    """Log-probs [B, T] of one padded forward of `model` under `replaying(routes)` (None: live), done by hand."""
    input_ids = torch.cat([batch.prompt_ids, batch.completion_ids], dim=1)
    mask = full_mask(batch)
    T = batch.completion_ids.size(1)
    context = replaying(model, routes) if routes is not None else torch.enable_grad()
    with context:
        logits = model(input_ids=input_ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0)).logits
    logps = torch.log_softmax(logits[:, -T - 1 : -1].float(), dim=-1)
    return logps.gather(-1, batch.completion_ids[..., None])[..., 0] * batch.completion_mask


def rollout_batch(family, model=None):
    """`make_batch()` (three groups, two length buckets) with the perturbed model's routes as the rollout's."""
    batch = make_batch()
    batch.routes = padded_routes(perturbed(family), batch)
    return batch


def training_logps(model, batch, routing, path):
    """The loss forward's masked log-probs [B, T] along `path`, their sum backpropagated (per_group: one group at a
    time, the log-probs kept by `watch_logps`)."""
    if path == "per_group":
        seen = routing if routing is not None else types.SimpleNamespace(logps=None)
        loss_fn = watch_logps(seen, lambda logps, entropy: ((logps * batch.completion_mask).sum(), {}))
        loss, _, _ = backward_per_group(
            model, batch, loss_fn, lambda part: part.backward(), entropy_in_loss=True, routing=routing
        )
        loss.backward()
        return seen.logps.detach() * batch.completion_mask
    logps, _ = completion_logps(model, batch, share_prefix=path == "shared", routing=routing)
    (logps * batch.completion_mask).sum().backward()
    return logps.detach() * batch.completion_mask


def router_grads(model):
    return [site.module.weight.grad.clone() for site in router_sites(model)]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("family", FAMILIES)
def test_r3_routes_every_path_as_the_rollout_and_the_router_gets_gradients(family, path):
    model = build(family)
    batch = rollout_batch(family)
    live = by_hand(model, batch, None).detach()
    model.zero_grad()
    want = by_hand(model, batch, batch.routes)
    want.sum().backward()
    want_grads = router_grads(model)
    assert (want.detach() - live).abs().max() > 1e-3  # the rollout's experts differ from the live ones
    model.zero_grad()
    replay = RouterReplay.of("r3", model)
    got = training_logps(model, batch, replay.training(batch), path)
    torch.testing.assert_close(got, want.detach(), rtol=0, atol=2e-5)
    grads = router_grads(model)
    assert all(g.abs().sum() > 0 for g in grads)  # the weights come from the live logits: the router learns
    for a, b in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("share", [False, True])
def test_r3_old_and_reference_forwards_in_chunks_replay_the_rollout(share):
    family = "qwen3_moe"
    model = build(family).eval()
    batch = rollout_batch(family)
    want = by_hand(model, batch, batch.routes).detach()
    replay = RouterReplay.of("r3", model)
    for routing in (replay.old(batch), replay.reference(batch)):
        got = logps_in_chunks(model, batch, 4, share_prefix=share, routing=routing)  # rows 0-3, 4-7, 8
        torch.testing.assert_close(got * batch.completion_mask, want, rtol=0, atol=2e-5)


def test_r3_with_a_lora_policy():
    peft = pytest.importorskip("peft")
    family = "qwen3_moe"
    batch = rollout_batch(family)
    torch.manual_seed(0)
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = peft.get_peft_model(build(family), config)
    want = by_hand(model, batch, batch.routes).detach()
    assert (want - by_hand(model, batch, None).detach()).abs().max() > 1e-3
    replay = RouterReplay.of("r3", model)
    for path in PATHS:
        model.zero_grad()
        got = training_logps(model, batch, replay.training(batch), path)
        torch.testing.assert_close(got, want, rtol=0, atol=2e-5)
        lora = [p.grad for name, p in model.named_parameters() if "lora_" in name]
        assert lora and all(g is not None and g.abs().sum() > 0 for g in lora)


@pytest.mark.parametrize("path", PATHS)
def test_off_is_todays_forward_bit_for_bit_and_still_measures(path):
    family = "mixtral"
    model = build(family)
    batch = rollout_batch(family)
    model.zero_grad()
    want = training_logps(model, batch, None, path)
    want_grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad()
    metrics = Metrics()
    replay = RouterReplay.of("off", model, metrics)
    routing = replay.training(batch)
    assert routing.replay is None
    got = training_logps(model, batch, routing, path)
    assert torch.equal(got, want)
    for a, b in zip([p.grad for p in model.parameters() if p.grad is not None], want_grads, strict=True):
        assert torch.equal(a, b)
    replay.record(routing, batch)
    row = metrics.pop_means("train", FakeAccelerator())
    assert row["router/route_mismatch"] > 0.05 and row["router/token_mismatch"] >= row["router/route_mismatch"]


def rows(batch, start, stop):
    """Rows [start, stop) of every per-row tensor of `batch` (its columns as they are)."""
    tensors = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
    return dataclasses.replace(
        batch, **{k: v[start:stop] for k, v in tensors.items() if isinstance(v, torch.Tensor) and v.dim() > 0}
    )


def naive_mismatch(rollout, live, mask):
    """(differing (token, layer) routes, routes, tokens with any, tokens): one token and layer at a time, as sets."""
    B, W, L, _ = rollout.shape
    differ = routes = tokens_differ = tokens = 0
    for b in range(B):
        for j in range(W):
            if not mask[b, j] or any(int(x) < 0 for x in rollout[b, j].flatten()):
                continue
            tokens += 1
            flips = sum(set(rollout[b, j, layer].tolist()) != set(live[b, j, layer].tolist()) for layer in range(L))
            differ, routes, tokens_differ = differ + flips, routes + L, tokens_differ + (flips > 0)
    return differ, routes, tokens_differ, tokens


@pytest.mark.parametrize("family", FAMILIES)
def test_a_forced_mismatch_is_counted_and_r3_removes_the_log_prob_gap(family):
    model = build(family)
    batch = rollout_batch(family)
    batch.sampling_logps = by_hand(model, batch, batch.routes).detach()  # the rollout: this model, other experts
    live = padded_routes(model, batch)
    differ, routes, tokens_differ, tokens = naive_mismatch(batch.routes, live, full_mask(batch))
    assert differ > 0
    logged = {}
    for mode in ("off", "r3"):
        metrics = Metrics()
        replay = RouterReplay.of(mode, model, metrics)
        for part in (rows(batch, 0, 3), rows(batch, 3, 9)):  # two micro-batches of different sizes: sum, then divide
            routing = replay.training(part)
            logps = training_logps(model, part, routing, "padded")
            replay.record(routing, part, logps)
        logged[mode] = metrics.pop_means("train", FakeAccelerator())
    assert logged["off"]["router/route_mismatch"] == pytest.approx(differ / routes, abs=1e-12)
    assert logged["off"]["router/token_mismatch"] == pytest.approx(tokens_differ / tokens, abs=1e-12)
    off, r3 = logged["off"], logged["r3"]
    assert off["router/logp_gap"] > 1e-4 and off["router/k3_kl"] > 0
    assert r3["router/logp_gap"] < 1e-6 < off["router/logp_gap"] / 100  # only the routes differed: replay removes it
    assert r3["router/k3_kl"] < 1e-12
    assert r3["router/route_mismatch"] > 0.05  # the live choice, before replay: what replay overrode


def test_logp_gap_sums_is_the_formula():
    logps = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -3.0, 0.0]])
    sampled = torch.tensor([[-1.5, -1.0, float("nan")], [-0.1, -2.0, -9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    total, k3, count = 0.0, 0.0, 0
    for b in range(2):
        for t in range(3):
            d = logps[b, t].item() - sampled[b, t].item()
            if mask[b, t] and math.isfinite(d):
                total, k3, count = total + abs(d), k3 + math.exp(d) - 1 - d, count + 1
    got = logp_gap_sums(logps, sampled, mask).tolist()
    assert got[:3] == pytest.approx([total, k3, count], rel=1e-6)


def test_metrics_ratios_sum_then_divide():
    metrics = Metrics()
    metrics.add_ratio("train", "x", 1.0, 4.0)
    metrics.add_ratio("train", "x", 6.0, 6.0)
    metrics.add_ratio("train", "none", 0.0, 0.0)
    metrics["train"]["y"].append(2.0)
    assert metrics.pop_means("train", FakeAccelerator()) == {"x": 0.7, "y": 2.0}


def test_r2_replays_the_old_forwards_routes():
    family = "qwen3_moe"
    model = build(family)
    batch = make_batch()  # no rollout routes: r2 needs none
    replay = RouterReplay.of("r2", model)
    old = replay.old(batch)
    logps_in_chunks(model, batch, 4, share_prefix=True, routing=old)  # the old forward, in chunks, shared prefix
    want_routes, read = padded_routes(model, batch), full_mask(batch).bool()
    ran = (batch.old_routes >= 0).all(-1).all(-1)  # [B, P + T] the tokens whose routes the old forward recorded
    assert torch.equal(batch.old_routes[ran], want_routes[ran])
    assert (ran <= read).all() and ((read & ~ran).sum(1) <= 1).all()  # all it read but a row's last, if not run
    with torch.no_grad():  # an optimizer step moves the routers: the live experts change, the replayed do not
        for site in router_sites(model):
            site.module.weight.add_(torch.randn_like(site.module.weight) * site.module.weight.std())
    want = by_hand(model, batch, batch.old_routes).detach()
    assert (want - by_hand(model, batch, None).detach()).abs().max() > 1e-3
    for path in PATHS:
        model.zero_grad()
        torch.testing.assert_close(training_logps(model, batch, replay.training(batch), path), want, rtol=0, atol=2e-5)
    torch.testing.assert_close(
        logps_in_chunks(model, batch, 9, share_prefix=False, routing=replay.reference(batch)) * batch.completion_mask,
        want,
        rtol=0,
        atol=2e-5,
    )


def test_a_dense_model_with_replay_on_is_refused(tiny_llama):
    assert RouterReplay.of("off", tiny_llama) is None
    for mode in ("r2", "r3"):
        with pytest.raises(ValueError, match="not a Mixture-of-Experts model.*router_replay='off'"):
            RouterReplay.of(mode, tiny_llama)


def test_an_moe_family_grpo_hf_does_not_know_is_refused_by_name_with_replay_on():
    import transformers
    from test_families import ATTENTION, COMMON
    from transformers import AutoModelForCausalLM

    config = transformers.OlmoeConfig(**COMMON, **ATTENTION, num_experts=4, num_experts_per_tok=2)
    model = AutoModelForCausalLM.from_config(config)
    assert RouterReplay.of("off", model) is None  # no metrics then, and no error
    with pytest.raises(ValueError, match="OlmoeForCausalLM is a Mixture-of-Experts model .*OlmoeTopKRouter"):
        RouterReplay.of("r3", model)


def test_the_setting_is_checked():
    assert GRPOConfig(output_dir="unused", router_replay="r3").router_replay == "r3"
    with pytest.raises(ValueError, match="router_replay='r4' is not one of the choices"):
        GRPOConfig(output_dir="unused", router_replay="r4")


# ---- the trainer: the setting wired into every forward of a step ------------------------------------------------
def tiny_moe(tokenizer, seed: int = 0):
    """A tiny Qwen3-MoE over the byte tokenizer's vocabulary."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, moe_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
    )  # fmt: skip
    return AutoModelForCausalLM.from_config(config)


def replay_spy(monkeypatch) -> list:
    """Every routes tensor a forward replays (`replay.BatchRouting` -> `routers.replaying`), in order."""
    from grpo_hf import replay as replay_module

    replayed, real = [], replay_module.replaying

    def spy(model, routes):
        replayed.append(routes.clone())
        return real(model, routes)

    monkeypatch.setattr(replay_module, "replaying", spy)
    return replayed


def assert_rows_of(replayed: list, routes: torch.Tensor) -> None:
    """Each row of each replayed tensor is a row of `routes` [B, W, L, k] cut to its columns."""
    W = routes.size(1)
    for part in replayed:
        w = part.size(1)
        for row in part:
            assert any(torch.equal(row, routes[i, j : j + w]) for i in range(len(routes)) for j in range(W - w + 1))


def test_the_trainer_refuses_replay_on_a_dense_model(tiny_llama, tokenizer):
    from conftest import make_trainer, tiny_run_args

    with pytest.raises(ValueError, match="router_replay='r3', but LlamaForCausalLM is not a Mixture-of-Experts"):
        make_trainer(tiny_run_args(router_replay="r3"), model=tiny_llama, tokenizer=tokenizer)


def test_the_trainer_under_r2_replays_the_old_forwards_routes_in_the_reference_and_loss_forwards(
    tokenizer, monkeypatch
):
    """One step, beta > 0, LoRA off: each micro-batch's old forward records its routes (no old log-probs are needed:
    it runs for them), and every reference and loss forward replays exactly those routes."""
    from conftest import make_trainer, tiny_run_args

    replayed = replay_spy(monkeypatch)
    args = tiny_run_args(router_replay="r2", beta=0.1, rollout_engine="loop")
    trainer = make_trainer(args, model=tiny_moe(tokenizer), tokenizer=tokenizer)
    assert trainer.experience.needs_old_logps is False  # the old forward runs for its routes only
    trainer.train()
    (batch,) = trainer._buffer
    assert batch.old_logps is None and batch.old_routes is not None
    ran = (batch.old_routes >= 0).all(-1).all(-1)
    assert ran.float().mean() > 0.5 and int(batch.old_routes.max()) < 4
    assert len(replayed) >= 2  # the reference forward's and the loss forward's
    assert_rows_of(replayed, batch.old_routes)


@pytest.mark.parametrize(("num_iterations", "warned"), [(1, True), (2, False)])
def test_r2_without_an_optimizer_step_before_the_loss_forward_warns(tokenizer, caplog, num_iterations, warned):
    """r2 where no optimizer step separates the old forward from the loss forwards (num_iterations=1,
    steps_per_generation = gradient_accumulation_steps) replays what the loss forward chooses anyway, for one extra
    forward: the trainer says so when it is built, and not where a step does separate them."""
    from conftest import make_trainer, tiny_run_args

    args = tiny_run_args(router_replay="r2", rollout_engine="loop", num_iterations=num_iterations)
    with caplog.at_level(logging.WARNING, logger="grpo_hf.experience"):
        make_trainer(args, model=tiny_moe(tokenizer), tokenizer=tokenizer)
    said = [r.getMessage() for r in caplog.records if "router_replay='r2'" in r.getMessage()]
    assert bool(said) is warned, said
    if warned:
        assert "extra no-grad forward" in said[0] and "router_replay='r3'" in said[0]


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_r3_load_balancing_loss_is_the_familys_own_on_every_path(family):
    """The load-balancing loss under replay: the family's function of the live router logits of the replayed forward,
    the same whether it comes from the padded forward's `aux_loss`, the shared prefix's tally or one group at a time
    (whose routing pass runs under replay too)."""
    model = build(family)
    batch = rollout_batch(family)
    replay = RouterReplay.of("r3", model)
    auxes = {}
    for share in (False, True):
        aux = []
        completion_logps(model, batch, share_prefix=share, router_aux=aux, routing=replay.training(batch))
        auxes[share] = aux[0].detach()
    aux = []
    loss_fn = lambda logps, entropy, router_aux: (router_aux[0], {})  # noqa: E731
    backward_per_group(model, batch, loss_fn, lambda part: part.backward(), entropy_in_loss=True, router_aux=aux,
                       routing=replay.training(batch))  # fmt: skip
    live = []
    completion_logps(model, batch, share_prefix=False, router_aux=live)
    assert (auxes[False] - live[0].detach()).abs() > 1e-5  # replay moved the later layers' logits (by ~2e-5)
    torch.testing.assert_close(auxes[True], auxes[False], rtol=0, atol=1e-6)
    torch.testing.assert_close(aux[0].detach(), auxes[False], rtol=0, atol=1e-6)


@pytest.mark.parametrize(("max_staleness", "lora"), [(0, False), (1, False), (0, True)])
def test_the_trainer_under_r3_replays_the_rollouts_routes_and_logs_the_mismatch(
    tokenizer, monkeypatch, max_staleness, lora
):
    """The loop engine records the routes; every old, reference and loss forward of the step replays rows of exactly
    them; the router metrics are logged (with max_staleness=1, the log-prob gap against the stale sampler too). With
    LoRA (the reference: the policy with its adapters off) and num_iterations=2 (old log-probs, and two steps on one
    rollout), every forward of the run replays that rollout's routes."""
    from conftest import TRAINING, make_trainer, tiny_run_args, train_logs

    replayed = replay_spy(monkeypatch)
    args = tiny_run_args(
        preset=TRAINING, router_replay="r3", beta=0.1, rollout_engine="loop", max_staleness=max_staleness,
        num_iterations=2 if lora else 1,
    )  # fmt: skip
    peft = (
        {"peft_config": pytest.importorskip("peft").LoraConfig(r=4, target_modules=["q_proj", "v_proj"])}
        if lora
        else {}
    )
    trainer = make_trainer(args, model=tiny_moe(tokenizer), tokenizer=tokenizer, **peft)
    trainer.train()
    (batch,) = trainer._buffer
    assert batch.routes is not None and (batch.routes >= 0).any()
    if lora:  # one rollout: its old, reference and two loss forwards
        assert batch.old_logps is not None and len(replayed) >= 4
        assert_rows_of(replayed, batch.routes)
    else:
        assert len(replayed) >= 2
        assert_rows_of(replayed[-2:], batch.routes)  # the last step's reference and loss forwards
    logs = train_logs(trainer)
    assert all(0.0 <= h["router/route_mismatch"] <= h["router/token_mismatch"] <= 1.0 for h in logs)
    # the engine's own log-probs: recorded for the metric in a synchronous run, the stale sampler's at staleness 1
    assert all(h["router/logp_gap"] >= 0 and h["router/k3_kl"] >= 0 for h in logs[max_staleness:])
    if max_staleness:  # weights one optimizer step older than the trainer's
        assert logs[-1]["router/logp_gap"] > 0


def test_off_trains_as_without_the_router_metrics(tokenizer):
    """An MoE run with router_replay='off' (its loss forwards recorded and the engine's log-probs kept, for the
    metrics) trains bit for bit as the same run with the routing module out of the step (`experience.router = None`,
    the engine recording no log-probs)."""
    from conftest import make_trainer, tiny_run_args, train_logs

    runs = []
    for involved in (True, False):
        args = tiny_run_args(rollout_engine="loop", learning_rate=1e-2)  # one step
        trainer = make_trainer(args, model=tiny_moe(tokenizer), tokenizer=tokenizer)
        if not involved:
            trainer.experience.router, trainer.experience.sampler.metric_logps = None, False
        trainer.train()
        runs.append((train_logs(trainer), [p.detach().clone() for p in trainer.model.parameters()]))
    (logs, weights), (plain_logs, plain_weights) = runs
    assert {"router/route_mismatch", "router/logp_gap"} <= set(logs[0]) and "router/logp_gap" not in plain_logs[0]
    assert [h["loss"] for h in logs] == [h["loss"] for h in plain_logs]
    assert all(torch.equal(a, b) for a, b in zip(weights, plain_weights, strict=True))
