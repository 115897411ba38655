"""TRL 1.16's entropy features: `top_entropy_quantile` (the policy term on the high-entropy tokens only),
`entropy_coef` (the entropy bonus) and adaptive entropy control (Skywork-OR1).

The maths in grpo_hf.core against the naive loops of tests/oracle.py (fp64, values and
gradients); the per-group backward with the entropy; and the trainer: both log-prob paths, the loss it logs against
the formula, evaluation, the adaptive coefficient across steps and across a resume.
"""

import dataclasses
import itertools
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch
from conftest import (
    TRAINING,
    build_tiny_model,
    id_sum_reward,
    make_dataset,
    make_trainer,
    tiny_run_args,
    torchrun,
    train_logs,
)
from oracle import F64, TIGHT, make_batch, naive_entropy_bonus, naive_loss, naive_quantile_mask
from test_logprobs import _batch as logprob_batch
from test_resume import assert_same_run, checkpointed_trainer

from grpo_hf import GRPOConfig
from grpo_hf.core import (
    EntropyControl,
    EntropySettings,
    check_entropy_settings,
    entropy_bonus,
    entropy_from_logits,
    entropy_with_grad,
    grpo_loss,
    grpo_loss_with,
    high_entropy_mask,
)
from grpo_hf.logprobs import backward_per_group, completion_logps, padded_logps

# ---------------------------------------------------------------------------------------------------------------
# The reference: tests/oracle.py's loops
# ---------------------------------------------------------------------------------------------------------------


def naive_entropy_loss(logps, entropy, old_logps, ref_logps, advantages, mask, *, rho, coef, **kwargs):
    """The oracle's loss with the policy term on the high-entropy tokens M (the 1 - rho quantile and above), minus
    coef times the mean entropy over M."""
    keep = naive_quantile_mask(entropy.detach(), mask, 1 - rho)
    loss, _ = naive_loss(logps, old_logps, ref_logps, advantages, mask, policy_mask=keep, **kwargs)
    return loss - naive_entropy_bonus(entropy, keep, coef)


def implementation(logps, entropy, old_logps, ref_logps, advantages, mask, *, rho, coef, **kwargs):
    """What the trainer's `Objective` composes (before its dapo rescaling): mask, grpo_loss, minus the bonus."""
    policy_mask = high_entropy_mask(entropy.detach(), mask, rho)
    loss, _ = grpo_loss(logps, old_logps, ref_logps, advantages, mask, policy_mask=policy_mask, **kwargs)
    return loss - entropy_bonus(entropy, mask * policy_mask, coef)


def entropy_batch(seed=0):
    """make_batch's rows (clipping on some tokens, an empty row) and distinct entropies in (0, 3)."""
    logps, old_logps, ref_logps, advantages, mask = make_batch(seed)
    entropy = 3 * torch.rand(logps.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=F64)  # [N, T]
    return logps, entropy, old_logps, ref_logps, advantages, mask


# ---------------------------------------------------------------------------------------------------------------
# The maths against the loops
# ---------------------------------------------------------------------------------------------------------------

FEATURES = {"rho0.3-coef0.1": (0.3, 0.1), "rho0-coef0.1": (0.0, 0.1), "rho1-coef0.1": (1.0, 0.1), "rho0.3": (0.3, 0.0)}
GRID = list(
    itertools.product(("grpo", "dapo", "dr_grpo", "sapo"), ("token", "sequence"), (0.0, 0.04), (None, 0.28), FEATURES)
)


@pytest.mark.parametrize(
    "loss_type, level, beta, epsilon_high, features",
    GRID,
    ids=[f"{lt}-{lvl}-beta{b}-eh{e}-{f}" for lt, lvl, b, e, f in GRID],
)
def test_mask_and_bonus_match_the_naive_loop(loss_type, level, beta, epsilon_high, features):
    logps, entropy, old_logps, ref_logps, advantages, mask = entropy_batch()
    rho, coef = FEATURES[features]
    kwargs = dict(
        loss_type=loss_type,
        epsilon=0.2,
        epsilon_high=epsilon_high,
        beta=beta,
        importance_sampling_level=level,
        max_completion_length=9,
        num_items_in_batch=int(mask.sum()) + 11,
    )
    results = []
    for fn in (implementation, naive_entropy_loss):
        x, h = logps.clone().requires_grad_(True), entropy.clone().requires_grad_(True)
        loss = fn(x, h, old_logps, ref_logps if beta else None, advantages, mask, rho=rho, coef=coef, **kwargs)
        results.append((loss, *torch.autograd.grad(loss, (x, h), allow_unused=True, materialize_grads=True)))
    (loss, grad, grad_h), (ref_loss, ref_grad, ref_grad_h) = results
    torch.testing.assert_close(loss, ref_loss, **TIGHT)
    torch.testing.assert_close(grad, ref_grad, **TIGHT)
    torch.testing.assert_close(grad_h, ref_grad_h, **TIGHT)
    assert grad.abs().sum() > 0 and (grad_h.abs().sum() > 0) == (coef != 0)


def test_the_fixture_makes_the_mask_bind():
    """rho = 0.3 keeps some completion tokens of rows with clipped and unclipped ratios, and drops others; the
    mask changes the loss and the bonus changes it again."""
    logps, entropy, old_logps, ref_logps, advantages, mask = entropy_batch()
    keep = high_entropy_mask(entropy, mask, 0.3)
    n = int(mask.sum())  # 24 tokens: x = 0.7 * 23 = 16.1, so the 7 above v_16 are kept
    assert n == 24 and int(keep.sum()) == 7 and bool((keep <= mask.bool()).all())
    kwargs = dict(epsilon_high=0.28, beta=0.04, rho=0.3)
    losses = [implementation(logps, entropy, old_logps, ref_logps, advantages, mask, coef=c, **kwargs) for c in (0, 1)]
    unmasked, _ = grpo_loss(logps, old_logps, ref_logps, advantages, mask, epsilon_high=0.28, beta=0.04)
    assert len({unmasked.item(), losses[0].item(), losses[1].item()}) == 3


def test_quantile_threshold_is_torch_quantile_and_the_edge_cases():
    g = torch.Generator().manual_seed(3)
    for n, rho in itertools.product((1, 2, 7, 100), (0.0, 0.05, 0.2, 0.5, 0.999, 1.0)):
        values = torch.rand(n, generator=g)  # float32, as the trainer's entropies
        keep = high_entropy_mask(values[None], torch.ones(1, n), rho)[0]
        assert torch.equal(keep, values >= torch.quantile(values, 1 - rho)), (n, rho)
    entropy = torch.tensor([[0.5, 2.0, 1.0, 9.0], [2.0, 0.1, 2.0, 0.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])  # 9.0 is padding: never kept, never in the pool
    assert torch.equal(high_entropy_mask(entropy, mask, 1.0), mask.bool())  # tau = min: every completion token
    only_top = torch.tensor([[0, 1, 0, 0], [1, 0, 1, 0]], dtype=torch.bool)  # 2.0 three times: ties are all kept
    assert torch.equal(high_entropy_mask(entropy, mask, 0.0), only_top)
    assert torch.equal(high_entropy_mask(entropy, mask, 0.2), only_top)  # tau = 2.0 still: ties go over rho
    pool = torch.tensor([0.0, 0.6, 1.2, 3.0])  # the pool (every process's tokens) sets tau: 0.6 + 0.5 * 0.6
    assert torch.equal(high_entropy_mask(entropy, mask, 0.5, pool), torch.tensor([[0, 1, 1, 0], [1, 0, 1, 0]]).bool())
    assert not high_entropy_mask(entropy, torch.zeros_like(mask), 0.2).any()  # no completion token: nothing kept
    with pytest.raises(ValueError, match=r"top_entropy_quantile=1.5 must be in \[0, 1\]"):
        high_entropy_mask(entropy, mask, 1.5)


def test_policy_mask_checks_and_defaults():
    logps, entropy, old_logps, ref_logps, advantages, mask = entropy_batch()
    plain, _ = grpo_loss(logps, old_logps, ref_logps, advantages, mask)
    every, _ = grpo_loss(logps, old_logps, ref_logps, advantages, mask, policy_mask=mask.bool())
    assert torch.equal(plain, every)  # an all-kept mask is the loss without one, bit for bit
    with pytest.raises(ValueError, match="policy_mask has shape"):
        grpo_loss(logps, old_logps, ref_logps, advantages, mask, policy_mask=mask[:, :3])
    with pytest.raises(ValueError, match="one policy term per sequence"):
        grpo_loss(
            logps, old_logps, ref_logps, advantages, mask, importance_sampling_level="sequence_sum", policy_mask=mask
        )
    assert entropy_bonus(entropy, torch.zeros_like(mask), 0.5).item() == 0.0  # no token: no bonus, no 0 / 0


def test_entropy_with_grad_matches_entropy_from_logits_and_the_derivative():
    """Values bit for bit those of the metric; the gradient dH/dz = -p (log p + H), in row chunks, through a
    non-contiguous slice; a -inf logit contributes nothing and gets a zero gradient."""
    torch.manual_seed(0)
    leaf = torch.randn(3, 5, 11, dtype=F64, requires_grad=True)
    weights = torch.randn(3, 4, dtype=F64)
    for chunk_size in (None, 1, 3):
        z = leaf[:, :-1]  # [3, 4, 11], not one view: walked row by row
        entropy = entropy_with_grad(z, chunk_size)
        assert torch.equal(entropy, entropy_from_logits(z.detach(), chunk_size))
        (grad,) = torch.autograd.grad((entropy * weights).sum(), leaf)
        p = torch.softmax(z.detach(), -1)
        expected = -p * (torch.log(p) + entropy.detach()[..., None]) * weights[..., None]  # [3, 4, 11]
        torch.testing.assert_close(grad[:, :-1], expected, **TIGHT)
        assert not grad[:, -1].any()
    assert torch.autograd.gradcheck(
        lambda z: entropy_with_grad(z, 2), (torch.randn(2, 3, 5, dtype=F64).requires_grad_(),)
    )
    z = torch.randn(2, 6, dtype=F64)
    with_inf = torch.cat([z[:, :2], torch.full((2, 1), -math.inf, dtype=F64), z[:, 2:]], 1).requires_grad_(True)
    finite = z.clone().requires_grad_(True)
    h_inf, h = entropy_with_grad(with_inf), entropy_with_grad(finite)
    torch.testing.assert_close(h_inf, h, **TIGHT)
    (g_inf,), (g,) = torch.autograd.grad(h_inf.sum(), with_inf), torch.autograd.grad(h.sum(), finite)
    assert torch.isfinite(g_inf).all() and not g_inf[:, 2].any()
    torch.testing.assert_close(torch.cat([g_inf[:, :2], g_inf[:, 3:]], 1), g, **TIGHT)
    bf16 = torch.randn(4, 9, dtype=torch.bfloat16, requires_grad=True)
    entropy = entropy_with_grad(bf16)
    assert entropy.dtype == torch.float32 and torch.equal(entropy, entropy_from_logits(bf16.detach()))
    entropy.sum().backward()
    assert bf16.grad.dtype == torch.bfloat16 and bf16.grad.abs().sum() > 0


# ---------------------------------------------------------------------------------------------------------------
# The adaptive coefficient and the settings
# ---------------------------------------------------------------------------------------------------------------


def test_adaptive_coefficient_goes_up_down_and_is_clamped_and_applied_only_at_or_below_target():
    control = EntropyControl(
        EntropySettings(
            entropy_coef=0.1,
            use_adaptive_entropy=True,
            entropy_coef_min=0.05,
            entropy_coef_max=0.12,
            entropy_coef_delta=0.015,
            entropy_target=0.5,
        )
    )
    assert control.enabled and control.applied == 0.0  # no measurement yet: H = +inf, no bonus in the first step
    # Two micro-batches of one window: the token mean 6 / 3 = 2.0 (the mean of their means would be 2.5).
    control.accumulate(torch.tensor([[1.0, 1.0, 7.0]], requires_grad=True), torch.tensor([[1, 1, 0]]))
    control.accumulate(torch.tensor([[4.0]]), torch.tensor([[1]]))
    assert control.window.tolist() == [6.0, 3.0] and not control.window.requires_grad
    control.step(control.window)
    assert control.last_entropy == 2.0 and control.window is None
    assert control.entropy_coef == pytest.approx(0.085) and control.applied == 0.0  # above target: down, not applied
    expected = [  # (H_w, coefficient after the step, applied in the next step)
        (0.4, 0.1, 0.1),  # at or below target: up, applied
        (0.5, 0.115, 0.115),  # exactly at target counts as below
        (0.1, 0.12, 0.12),  # clamped at entropy_coef_max
        (0.6, 0.105, 0.0),
        (0.6, 0.09, 0.0),
        (0.6, 0.075, 0.0),
        (0.6, 0.06, 0.0),
        (0.6, 0.05, 0.0),  # clamped at entropy_coef_min
        (0.6, 0.05, 0.0),
    ]
    for h, coef, applied in expected:
        control.step(torch.tensor([3 * h, 3.0]))
        assert (control.entropy_coef, control.applied) == (pytest.approx(coef), pytest.approx(applied)), h
    state = control.state()
    fresh = EntropyControl(EntropySettings(entropy_coef=0.1, use_adaptive_entropy=True, entropy_target=0.5))
    fresh.load_state(None)  # a checkpoint from before this feature: keep the configured start
    assert (fresh.entropy_coef, fresh.last_entropy) == (0.1, math.inf)
    fresh.load_state(state)
    assert (fresh.entropy_coef, fresh.last_entropy) == (pytest.approx(0.05), pytest.approx(0.6))
    static = EntropyControl(EntropySettings(entropy_coef=0.2, entropy_target=0.0))
    static.load_state(state)  # a fixed coefficient is the config's, never a checkpoint's
    assert static.enabled and static.applied == 0.2 and not EntropyControl().enabled


def test_settings_are_validated(tmp_path, caplog):
    def config(**kwargs):
        return GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", **kwargs)

    for kwargs, match in (
        (dict(top_entropy_quantile=1.5), r"top_entropy_quantile=1.5 must be in \[0, 1\]"),
        (dict(top_entropy_quantile=-0.1), r"must be in \[0, 1\]"),
        (dict(top_entropy_quantile=0.2, importance_sampling_level="sequence_sum"), "one policy term per sequence"),
        (dict(entropy_coef_min=0.5, entropy_coef_max=0.1), "entropy_coef_min=0.5 > entropy_coef_max=0.1"),
        (dict(entropy_coef_delta=-0.01), "entropy_coef_delta=-0.01 must be >= 0"),
        (dict(entropy_coef=math.nan), "must be finite"),
    ):
        with pytest.raises(ValueError, match=match):
            config(**kwargs)
    warnings = check_entropy_settings(use_adaptive_entropy=True, entropy_coef=2.0, entropy_target=0.0)
    assert len(warnings) == 2 and "clamps it" in warnings[0] and "never applies" in warnings[1]
    assert check_entropy_settings(entropy_coef=-0.1)[0].startswith("entropy_coef=-0.1 < 0 penalises entropy")
    defaults = config()
    assert (defaults.top_entropy_quantile, defaults.entropy_coef, defaults.use_adaptive_entropy) == (1.0, 0.0, False)
    assert defaults.entropy_settings() == EntropySettings()  # the config's defaults are the settings' own (TRL's)
    assert dataclasses.astuple(EntropySettings()) == (1.0, "token", 0.0, False, 0.0, 1.0, 0.005, 0.2)


# ---------------------------------------------------------------------------------------------------------------
# The per-group backward with the entropy bonus
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.kernel_paths
def test_backward_per_group_with_the_entropy_bonus_gives_the_full_backward(tokenizer):
    model = build_tiny_model(tokenizer, seed=5)
    batch = logprob_batch(tokenizer)
    mask = batch.completion_mask
    with torch.no_grad():
        old = completion_logps(model, batch, share_prefix=False)[0] + 0.05 * torch.randn(6, 7)
    advantages = torch.tensor([1.0, -0.5, -0.5, 0.3, 0.2, -0.5])

    def loss_fn(logps, entropy):
        loss, metrics = grpo_loss(logps, old, old - 0.1, advantages, mask, beta=0.04)
        return loss - entropy_bonus(entropy, mask, 0.3), metrics

    logps, entropy = padded_logps(model, batch, temperature=0.7, with_entropy=True, entropy_grad=True)
    full_loss, _ = loss_fn(logps, entropy)
    full_loss.backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    batch.old_logps = old
    results = []
    for entropy_grad in (True, False):
        loss, _, entropy = backward_per_group(
            model,
            batch,
            loss_fn,
            torch.Tensor.backward,
            entropy_in_loss=True,
            entropy_grad=entropy_grad,
            temperature=0.7,
        )
        loss.backward()
        results.append((loss, [p.grad.clone() for p in model.parameters()]))
        model.zero_grad()
        assert not entropy.requires_grad
    (loss, grads), (_, grads_without_bonus_gradient) = results
    torch.testing.assert_close(loss, full_loss, rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    assert any((a - b).abs().max() > 1e-4 for a, b in zip(grads, grads_without_bonus_gradient, strict=True))


# ---------------------------------------------------------------------------------------------------------------
# The trainer
# ---------------------------------------------------------------------------------------------------------------


def one_sgd_step(tmp_path, tokenizer, **overrides):
    """One optimizer step of plain SGD (lr 1, no clipping): the parameter change is the gradient."""
    model = build_tiny_model(tokenizer, seed=3)
    settings = dict(max_steps=1, optim="sgd", learning_rate=1.0, max_grad_norm=0.0, per_device_train_batch_size=8)
    args = tiny_run_args(tmp_path, TRAINING, **{**settings, **overrides})
    trainer = make_trainer(args, id_sum_reward, make_dataset(), tokenizer=tokenizer, model=model)
    trainer.train()
    initial = dict(build_tiny_model(tokenizer, seed=3).named_parameters())
    return trainer, {name: (p - initial[name]).detach() for name, p in model.named_parameters()}


PATH_CASES = {
    "mask and bonus": dict(top_entropy_quantile=0.2, entropy_coef=0.5),  # fast path: shared prefix, one backward
    "bonus": dict(entropy_coef=0.5),  # fast path: shared prefix, per-group backward, entropy with gradient
}


@pytest.fixture(scope="module")
def plain_update(tmp_path_factory, tokenizer):
    """The update without the entropy features, for the tests to show that they change it."""
    return one_sgd_step(tmp_path_factory.mktemp("plain"), tokenizer, share_prompt_prefix=True)[1]


@pytest.mark.kernel_paths
@pytest.mark.parametrize("case", list(PATH_CASES))
def test_padded_and_fast_paths_give_the_same_update(tmp_path, tokenizer, case, plain_update):
    """2 groups of 4 per micro-batch; the features change the update, identically on both log-prob paths."""
    features = PATH_CASES[case]
    (padded, padded_delta), (fast, fast_delta) = (
        one_sgd_step(tmp_path, tokenizer, share_prompt_prefix=share, **features) for share in (False, True)
    )
    assert (fast.logps.blocker(fast.model) is None) and padded.logps.blocker(padded.model) is not None
    assert train_logs(fast)[0]["loss"] == pytest.approx(train_logs(padded)[0]["loss"], rel=1e-5, abs=1e-7)
    for name, delta in padded_delta.items():
        torch.testing.assert_close(fast_delta[name], delta, rtol=1e-4, atol=1e-7)
    assert max((plain_update[n] - d).abs().max() for n, d in fast_delta.items()) > 1e-4


def formula_loss(policy, batch, args, accumulation=1, num_items=None) -> tuple[float, float]:
    """(policy loss, loss) of one micro-batch from grpo_loss, high_entropy_mask and entropy_bonus directly."""
    with torch.no_grad():
        logps, entropy = padded_logps(policy, batch, with_entropy=True)
    mask = batch.completion_mask
    keep = high_entropy_mask(entropy, mask, args.top_entropy_quantile)
    items = mask.sum() if num_items is None else num_items
    loss, _ = grpo_loss_with(
        logps,
        None,
        batch.ref_logps,
        batch.advantages,
        mask,
        args.loss_settings(),
        policy_mask=keep,
        num_items=items,
    )
    loss = loss * accumulation  # dapo: the trainer undoes Trainer's division by the accumulation steps
    return loss.item(), (loss - entropy_bonus(entropy, mask * keep, args.entropy_coef)).item()


def test_trainer_loss_policy_loss_and_eval_loss_are_the_formula(tmp_path, tokenizer):
    """dapo with 2 accumulated micro-batches: each micro-batch's loss is (accumulation x grpo_loss with the
    high-entropy mask) - coef x its mean entropy over the kept tokens; the bonus is not rescaled. Evaluation
    applies the same mask and bonus to the current policy, on-policy."""
    args = tiny_run_args(
        tmp_path,
        TRAINING,
        loss_type="dapo",
        beta=0.04,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=1,
        top_entropy_quantile=0.3,
        entropy_coef=0.5,
        per_device_eval_batch_size=4,
    )
    model = build_tiny_model(tokenizer, seed=3)
    dataset, eval_dataset = make_dataset(), make_dataset(1)
    trainer = make_trainer(args, id_sum_reward, dataset, tokenizer=tokenizer, model=model, eval_dataset=eval_dataset)
    trainer.train()
    initial = build_tiny_model(tokenizer, seed=3)
    slices = [formula_loss(initial, part, args, 2, part.num_items_in_batch) for part in trainer._buffer]
    log = train_logs(trainer)[0]
    assert log["loss"] == pytest.approx(sum(total for _, total in slices) / 2, rel=1e-5)
    assert log["policy_loss"] == pytest.approx(sum(policy for policy, _ in slices) / 2, rel=1e-5)
    assert log["entropy_coef"] == 0.5 and abs(log["loss"] - log["policy_loss"]) > 1e-3

    seen = []
    make = trainer.experience.eval_batch
    trainer.experience.eval_batch = lambda *a: seen.append(make(*a)) or seen[-1]
    metrics = trainer.evaluate()
    (batch,) = seen  # the eval batch: 1 prompt x 4 completions, with its ref_logps
    assert metrics["eval_loss"] == pytest.approx(formula_loss(model, batch, args)[1], rel=1e-5)


def test_adaptive_coefficient_is_logged_and_comes_back_on_resume(tmp_path):
    """The coefficient climbs 0.05 per step (entropy far below the target), the bonus applies from step 2 on, and a
    run resumed from checkpoint 2 goes on from 0.1 with the same losses and weights as the unbroken run."""
    settings = dict(
        use_adaptive_entropy=True,
        entropy_coef=0.0,
        entropy_coef_delta=0.05,
        entropy_target=100.0,
        top_entropy_quantile=0.5,
        steps_per_generation=2,
    )
    unbroken = checkpointed_trainer(tmp_path / "unbroken", **settings)
    unbroken.train()
    logs = [h for h in unbroken.state.log_history if "loss" in h]
    assert [h["entropy_coef"] for h in logs] == pytest.approx([0.05, 0.1, 0.15, 0.2])
    assert logs[0]["loss"] == pytest.approx(logs[0]["policy_loss"], rel=1e-6)  # step 1: no measurement, no bonus
    assert abs(logs[1]["loss"] - logs[1]["policy_loss"]) > 1e-3
    run = tmp_path / "killed"
    shutil.copytree(tmp_path / "unbroken" / "checkpoint-2", run / "checkpoint-2")
    resumed = checkpointed_trainer(run, **settings)
    resumed.train(resume_from_checkpoint=True)
    assert_same_run(resumed, unbroken, after=2)
    assert resumed.objective.entropy.state() == unbroken.objective.entropy.state()


def test_two_processes_take_the_threshold_and_the_adaptive_entropy_over_both(tmp_path):
    """A group of 8 as one micro-batch on 1 process (in this one) or 4 + 4 on 2 gloo processes: the quantile threshold
    is taken over the tokens of both processes (one that used its own tokens only moves the weights ~0.17 elsewhere),
    so the update is the same; the adaptive controller measures the same entropy and takes the same step."""
    sys.path.insert(0, str(Path(__file__).parent / "distributed"))
    import entropy_step

    entropy_step.main(str(tmp_path / "one.pt"), fast=True)
    torchrun("entropy_step.py", tmp_path / "two.pt", "fast", timeout=300)
    one, two = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    assert two["log"]["loss"] == pytest.approx(one["log"]["loss"], rel=1e-5)
    assert two["control"]["entropy_coef"] == one["control"]["entropy_coef"] == pytest.approx(0.05)
    assert two["control"]["last_entropy"] == pytest.approx(one["control"]["last_entropy"], rel=1e-6)
    for name, value in one["params"].items():
        torch.testing.assert_close(two["params"][name], value, rtol=1e-5, atol=1e-6)
