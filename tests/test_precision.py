"""bf16 weights that learn: fp32 master weights keep the updates rounding would lose, and a guard measures it."""

import copy
import logging
import math

import pytest
import torch
from conftest import build_tiny_model, tiny_run_args
from datasets import Dataset

from grpo_hf import GRPOConfig, GRPOTrainer
from grpo_hf.precision import LostUpdateProbe, MasterWeights, predicted_lost_fraction

LR = 1e-5


def _train(tmp_path, tokenizer, dtype, steps=4, **overrides):
    model = build_tiny_model(tokenizer, hidden_size=64).to(dtype)
    initial = {id(p): p.detach().float().clone() for p in model.parameters()}
    settings = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=8,
        max_steps=steps,
        learning_rate=LR,
        lr_scheduler_type="constant",
        bf16=dtype == torch.bfloat16,
        lost_update_check_steps=1,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    args = GRPOConfig(**{**settings, **overrides})
    dataset = Dataset.from_dict({"prompt": [f"Question {i}?" for i in range(32)]})

    def reward(completion_ids, **kwargs):  # varies within every group, so every step has a gradient
        return [float(sum(ids) % 5) for ids in completion_ids]

    trainer = GRPOTrainer(model, reward, args, train_dataset=dataset, processing_class=tokenizer)
    trainer.train()
    steps = [row for row in trainer.state.log_history if "loss" in row]  # not the end-of-training summary
    lost = [row["precision/lost_updates"] for row in steps if "precision/lost_updates" in row]
    return trainer, initial, lost


def _optimizer_values(trainer, initial):
    """(start, end) of every value the optimizer updates: the fp32 masters where there are any."""
    guard = trainer.precision_guard
    masters = dict(zip(map(id, guard.masters.params), guard.masters.masters, strict=True)) if guard.masters else {}
    model = trainer.accelerator.unwrap_model(trainer.model)
    pairs = [(initial[id(p)], masters.get(id(p), p).detach().float()) for p in model.parameters()]
    return torch.cat([a.flatten() for a, _ in pairs]), torch.cat([b.flatten() for _, b in pairs])


def test_bf16_weights_with_master_weights_move_as_fp32_weights_do(tmp_path, tokenizer):
    fp32, fp32_initial, _ = _train(tmp_path / "fp32", tokenizer, torch.float32)
    bf16, bf16_initial, lost = _train(tmp_path / "bf16", tokenizer, torch.bfloat16)
    start32, end32 = _optimizer_values(fp32, fp32_initial)
    start16, end16 = _optimizer_values(bf16, bf16_initial)
    changed32 = (end32 != start32).float().mean()
    changed16 = (end16 != start16).float().mean()
    moved32 = (end32 - start32).abs().sum()
    moved16 = (end16 - start16).abs().sum()
    assert changed32 > 0.9
    assert changed16 > 0.95 * changed32  # every update kept (today: ~14% of the values change)
    assert 0.8 < moved16 / moved32 < 1.25  # Adam steps of ~lr: the same distance, although the rollouts differ
    assert len(lost) == 4 and max(lost) < 0.01  # logged every step here (check every 1); under 1% is the promise
    # The model's bf16 weights are the masters rounded to nearest.
    guard = bf16.precision_guard
    for param, master in zip(guard.masters.params, guard.masters.masters, strict=True):
        assert param.dtype == torch.bfloat16
        torch.testing.assert_close(param, master.to(torch.bfloat16), rtol=0, atol=0)


def test_the_guard_fires_on_plain_bf16_updates_and_is_silent_on_master_weights(tmp_path, tokenizer, caplog):
    with caplog.at_level(logging.WARNING, logger="grpo_hf.precision"):
        _, _, lost = _train(tmp_path / "plain", tokenizer, torch.bfloat16, fp32_master_weights=False)
    assert min(lost) > 0.5  # most updates round away (measured)
    messages = [r.getMessage() for r in caplog.records if "lost to rounding" in r.getMessage()]
    assert "predicted from the weights' dtypes and the learning rate" in messages[0]  # before the first step
    assert any("measured at optimizer step 1" in m for m in messages)
    assert "fp32_master_weights=True" in messages[0]  # says how to fix it

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="grpo_hf.precision"):
        _, _, lost = _train(tmp_path / "masters", tokenizer, torch.bfloat16, steps=2)
    assert len(lost) == 2 and max(lost) < 0.01
    assert not [r for r in caplog.records if "lost to rounding" in r.getMessage()]


def test_on_lost_updates_raise_stops_before_the_first_step(tmp_path, tokenizer):
    with pytest.raises(RuntimeError, match=r"lost to rounding.*on_lost_updates='raise'"):
        _train(tmp_path, tokenizer, torch.bfloat16, fp32_master_weights=False, on_lost_updates="raise")


def _bf16_spacing(x: float) -> float:
    """Distance from |x| to the next bf16 number away from zero, by the format: 7 stored mantissa bits."""
    exponent = math.floor(math.log2(abs(x)))
    return 2.0 ** (max(exponent, -126) - 7)


def test_predicted_lost_fraction_follows_the_bf16_spacing():
    torch.manual_seed(0)
    values = (torch.randn(2000) * torch.logspace(-4, 1, 2000)).to(torch.bfloat16)  # magnitudes 1e-4 .. 10
    for step in (1e-6, 1e-5, 1e-3):
        expected = sum(_bf16_spacing(float(v)) / 2 > step for v in values) / len(values)
        assert predicted_lost_fraction([values], step, sample_size=len(values)) == pytest.approx(expected, abs=1e-12)
    assert predicted_lost_fraction([values.float()], 1e-6, sample_size=len(values)) == 0.0  # fp32: nothing lost


def test_lost_update_probe_counts_unchanged_values_with_a_gradient():
    param = torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    param.grad = torch.tensor([0.5, 0.5, 0.0, 0.5])  # the third has no gradient: never counted
    probe = LostUpdateProbe([param])
    probe.before()
    with torch.no_grad():
        param[0] += 1  # changed
        param[2] += 1  # changed, no gradient
    assert probe.after() == pytest.approx(2 / 3)  # elements 1 and 3 kept their value despite a gradient


def test_master_weights_survive_a_state_dict_round_trip_exactly():
    def make():
        torch.manual_seed(0)
        layer = torch.nn.Linear(16, 16).to(torch.bfloat16)
        optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-5)
        return layer, optimizer, MasterWeights(optimizer)

    def step(layer, optimizer, seed):
        torch.manual_seed(seed)
        layer(torch.randn(4, 16, dtype=torch.bfloat16)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    layer, optimizer, masters = make()
    for seed in range(3):
        step(layer, optimizer, seed)
    saved, weights = copy.deepcopy(optimizer.state_dict()), copy.deepcopy(layer.state_dict())  # as torch.save would
    step(layer, optimizer, 3)

    resumed, resumed_optimizer, resumed_masters = make()
    resumed.load_state_dict(weights)
    resumed_optimizer.load_state_dict(saved)
    step(resumed, resumed_optimizer, 3)
    for a, b in zip(masters.masters, resumed_masters.masters, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # the fp32 values, not the rounded ones, came back
    assert all(m.dtype == torch.float32 for m in masters.masters) and len(masters) == 2


def test_fp32_weights_with_bf16_train_the_fast_path_under_autocast(tmp_path, tokenizer):
    """The shared-prefix path calls the decoder and LM head directly, not the autocast-wrapped forward: it must
    still compute in bf16 when bf16=True (fp32 weights), as the padded forward would."""
    model = build_tiny_model(tokenizer, hidden_size=64)
    seen = set()
    layer = model.model.layers[0].self_attn.q_proj
    layer.register_forward_hook(
        lambda module, inputs, output: seen.add(output.dtype) if torch.is_grad_enabled() else None
    )
    args = tiny_run_args(tmp_path, bf16=True)
    reward = lambda completion_ids, **kw: [float(len(ids)) for ids in completion_ids]  # noqa: E731
    trainer = GRPOTrainer(
        model, reward, args, train_dataset=Dataset.from_dict({"prompt": ["a", "b"]}), processing_class=tokenizer
    )
    assert trainer.logps.blocker(model) is None
    trainer.train()
    assert seen == {torch.bfloat16}  # the policy's forward with gradients ran under autocast
    assert all(p.dtype == torch.float32 for p in model.parameters()) and trainer.precision_guard.masters is None


def test_master_weights_move_gradients_and_weights_in_batches_exactly(monkeypatch):
    """SGD at lr 1 on the masters, the gradients moved in batches of 2 KiB (several tensors per kernel, one tensor
    alone when it is larger): each fp32 master is w - g exactly, each bf16 weight its rounding, no gradient left."""
    from grpo_hf import precision

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, dtype=torch.bfloat16)) for n in (100, 300, 50, 700, 10)]
    optimizer = torch.optim.SGD(params, lr=1.0)
    masters = MasterWeights(optimizer)
    initial = [p.detach().float().clone() for p in params]
    grads = [torch.randn(p.shape, dtype=torch.bfloat16) for p in params]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    params[2].grad = None  # a parameter without a gradient is left alone
    monkeypatch.setattr(precision, "GRADIENT_BATCH_BYTES", 2048)
    batches = precision._batches(list(zip(params, masters.masters, strict=True)))
    assert [len(batch) for batch in batches] == [3, 1, 1]  # 400 + 1200 + 200 bytes, 2800 alone, 40
    optimizer.step()
    for k, (p, master) in enumerate(zip(params, masters.masters, strict=True)):
        expected = initial[k] if k == 2 else initial[k] - grads[k].float()
        torch.testing.assert_close(master.detach(), expected, rtol=0, atol=0)
        torch.testing.assert_close(p.detach(), expected.to(torch.bfloat16), rtol=0, atol=0)
        assert p.grad is None and master.grad is None
