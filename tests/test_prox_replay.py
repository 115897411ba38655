"""pi_prox from the training forward's own logits (`logprobs.ProxReplay`), not from a no-grad forward of its own.

Where no optimizer step separates a corrected micro-batch's start from its training forward (no old log-probs, the
default), the proximal policy of the correction's weight pi_prox / pi_behav is the policy that forward runs. Its
log-probs under the sampler's distribution are replayed on that forward's logits, detached. Checked here: the loss,
its gradient, the weights and their metrics equal the two-forward computation (a no-grad forward for pi_prox, then the
training forward) on every log-prob path and ratio level, in float64; whole runs run one forward per micro-batch where
they ran two, and keep every weight at 1 at `learning_rate=0`; with old log-probs the no-grad forward stays.
"""

import threading
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from conftest import TRAINING, build_tiny_model, make_trainer, tiny_run_args, train_logs

from grpo_hf import GRPOConfig, GRPOTrainer
from grpo_hf.core import EntropySettings, LossSettings, SamplingCorrection
from grpo_hf.experience import ExperienceMaker
from grpo_hf.forward_plan import ForwardPlan
from grpo_hf.logprobs import LogprobPath, backward_per_group, completion_logps, logps_and_replayed
from grpo_hf.objective import Objective
from grpo_hf.rollout import MicroBatch, tokenize_prompts

QWEN = dict(top_p=0.8, top_k=20, repetition_penalty=1.05)  # Qwen2.5-Instruct's sampling settings
TEMPERATURE = 0.9
PROMPTS = ["Hello there"] * 3 + ["A much longer prompt, with more tokens"] * 2 + ["Why?"] * 3


# ---- one micro-batch: the training forward's replay against the two-forward computation, float64 ----------------
def top_k_replay(batch, rows, logits):
    """A stand-in for `rollout.sampling.SamplingReplay` (the plumbing is under test, not the processors): the
    log-probs [n, t] float32 of `rows`' completion tokens under temperature 0.7 and top-k 40 over logits [n, t, V], 0
    off their mask, as the replay leaves them."""
    t = logits.size(1)
    scores = logits.float() / 0.7
    kth = scores.topk(40, dim=-1).values[..., -1:]  # [n, t, 1]
    scores = scores.masked_fill(scores < kth, -torch.inf).log_softmax(dim=-1)
    logps = scores.gather(-1, batch.completion_ids[rows, :t, None]).squeeze(-1)  # [n, t]
    return torch.where(batch.completion_mask[rows, :t].bool(), logps, 0.0)


@pytest.fixture(scope="module")
def corrected(tokenizer):
    """A tiny model in float64 and a micro-batch of completions in its top 40 tokens, with sampler log-probs that are
    the replayed ones moved by noise (so that weights differ from 1, some past the clip bounds)."""
    model = build_tiny_model(tokenizer, seed=3).double()
    prompt_ids, prompt_mask, _ = tokenize_prompts(tokenizer, PROMPTS)
    generator = torch.Generator().manual_seed(0)
    completion_ids = torch.randint(3, 200, (len(PROMPTS), 9), generator=generator)
    mask = (torch.arange(9)[None, :] < torch.tensor([9, 4, 7, 9, 2, 9, 5, 1])[:, None]).long()  # [B, T]
    batch = MicroBatch(
        prompt_ids, prompt_mask, completion_ids, mask,
        advantages=torch.linspace(-1.0, 1.0, len(PROMPTS), dtype=torch.float64), num_items_in_batch=mask.sum(),
    )  # fmt: skip
    with torch.no_grad():  # completions the top-k keeps: each token replaced by a token of its position's top 40
        logits = completion_logits(model, batch)
        top = logits.topk(40, dim=-1).indices  # [B, T, 40]
        pick = torch.randint(0, 40, (*completion_ids.shape, 1), generator=generator)
        batch.completion_ids = top.gather(-1, pick).squeeze(-1)
        # the next position's logits change with the token: redo it one position at a time
        for k in range(9):
            logits = completion_logits(model, batch)
            batch.completion_ids[:, k] = logits[:, k].topk(40, dim=-1).indices.gather(-1, pick[:, k]).squeeze(-1)
        replayed = top_k_replay(batch, torch.arange(len(PROMPTS)), completion_logits(model, batch))
    noise = 0.08 * torch.randn(mask.shape, generator=generator) * mask
    batch.sampling_logps = replayed + noise
    assert torch.isfinite(batch.sampling_logps).all()
    return model.train(), top_k_replay, batch


def completion_logits(model, batch):
    """The logits [B, T, V] predicting each completion token, from one padded forward."""
    input_ids = torch.cat([batch.prompt_ids, batch.completion_ids], dim=1)
    attention = torch.cat([batch.prompt_mask, torch.ones_like(batch.completion_ids)], dim=1)
    T = batch.completion_ids.size(1)
    return model(input_ids=input_ids, attention_mask=attention).logits[:, -T - 1 : -1]


def _path() -> LogprobPath:
    return LogprobPath(SimpleNamespace(device=torch.device("cpu")), {"temperature": TEMPERATURE}, 8, None, 0.0, False)


def _train_step(model, batch, objective, plan: ForwardPlan, kwargs: dict):
    """The loss, metrics and gradients of one training micro-step of `batch` on `plan`'s path (as `compute_loss`)."""
    model.zero_grad()
    if plan.per_group:
        loss, metrics, _ = backward_per_group(
            model, batch, objective.loss_of(batch, 1), lambda part: part.backward(), entropy_in_loss=True, **kwargs
        )
    else:
        logps, entropy = completion_logps(model, batch, share_prefix=plan.share_prefix, with_entropy=True, **kwargs)
        loss, metrics = objective(logps, batch, entropy, accumulation_steps=1)
    loss.backward()
    return loss.detach(), metrics, [p.grad.clone() for p in model.parameters()]


PATHS = {
    "padded": ForwardPlan(False, False, None, "test"),
    "shared prefix": ForwardPlan(True, False, None, "test"),
    "shared prefix, per group": ForwardPlan(True, True, None, "test"),
}


# (ratio level, correction mode): sequence_sum's per-sequence terms take a sequence-level weight
LEVELS = [(level, mode) for level in ("token", "sequence") for mode in ("sequence_mask", "token_truncate")]
LEVELS.append(("sequence_sum", "sequence_truncate"))


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize(("level", "mode"), LEVELS)
def test_the_training_forwards_replay_equals_the_two_forward_computation(corrected, path, level, mode):
    """Loss, gradients, weights and their metrics, and `old_sampling_logps`: from the training forward's own logits
    (`LogprobPath.kwargs` with the replay) as from a no-grad forward before it (`logps_and_replayed`), in float64, for
    every log-prob path, ratio level (GSPO's included) and a token and a sequence correction, the off-policy mask
    on."""
    model, replay, batch = corrected
    settings = LossSettings(importance_sampling_level=level, beta=0.0, off_policy_mask_threshold=0.05)
    entropy = EntropySettings(importance_sampling_level=level)
    objective = Objective(SimpleNamespace(num_processes=1), settings, entropy, SamplingCorrection(mode, 0.9, 1.1),
                          router_aux_loss_coef=0.0)  # fmt: skip
    plan, logprob_path = PATHS[path], _path()
    with torch.no_grad():  # the two-forward computation: pi_prox's replay from a no-grad forward (dropout off)
        _, replayed = logps_and_replayed(
            model.eval(), batch, replay, share_prefix=plan.share_prefix, temperature=TEMPERATURE
        )
    model.train()
    two = replace(batch, old_sampling_logps=replayed)
    kwargs = logprob_path.kwargs(plan)
    kwargs.pop("share_prefix")
    want_loss, want_metrics, want_grads = _train_step(model, two, objective, plan, kwargs)

    one = replace(batch)  # no old_sampling_logps: this forward's
    kwargs = logprob_path.kwargs(plan, one, replay)
    assert one.old_sampling_logps is not None and "prox_replay" in kwargs
    kwargs.pop("share_prefix")
    loss, metrics, grads = _train_step(model, one, objective, plan, kwargs)

    torch.testing.assert_close(one.old_sampling_logps, replayed, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-12)
    for got, want in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-12)
    assert metrics.keys() == want_metrics.keys()
    for name, value in want_metrics.items():
        assert metrics[name] == pytest.approx(value, rel=1e-6, abs=1e-12, nan_ok=True), name
    ratios = [want_metrics[f"sampling/importance_sampling_ratio/{k}"] for k in ("min", "max")]
    assert ratios[1] - ratios[0] > 0.05  # the weights are not all alike: the comparison means something


def test_only_a_corrected_batch_without_old_logps_is_replayed_by_its_training_forward(corrected):
    """`LogprobPath.kwargs`: no replay without one, for a batch without the sampler's log-probs, for a batch with old
    log-probs (pi_prox is then the policy before an optimizer step: the no-grad forward's), or for a no-grad pass."""
    model, replay, batch = corrected
    path, plan = _path(), PATHS["padded"]
    assert "prox_replay" not in path.kwargs(plan, replace(batch), None)
    assert "prox_replay" not in path.kwargs(plan, replace(batch, sampling_logps=None), replay)
    with_old_logps = replace(batch, old_logps=torch.zeros(batch.completion_ids.shape))
    assert "prox_replay" not in path.kwargs(plan, with_old_logps, replay)
    assert "prox_replay" not in path.kwargs(plan)


# ---- whole runs: forwards counted per micro-batch, weights at learning_rate 0 --------------------------------------
class ForwardCount:
    """The policy decoder's forwards in the main thread, while `ExperienceMaker.set_old_logps` runs (pi_prox's and the
    old log-probs' no-grad forward) and while `GRPOTrainer.compute_loss` runs (the training forward), and the
    micro-batches each saw. Generation (in the producer's thread, or in the sampler) is not counted."""

    def __init__(self, monkeypatch):
        self.phase, self.calls, self.batches = None, {"set_old_logps": 0, "compute_loss": 0}, {"compute_loss": 0}
        self.weights: list = []
        for cls, name in ((ExperienceMaker, "set_old_logps"), (GRPOTrainer, "compute_loss")):
            monkeypatch.setattr(cls, name, self._counting(getattr(cls, name), name))
        original = Objective.sampling_weight

        def recording(objective, logps, batch):
            weight, metrics = original(objective, logps, batch)
            self.weights.append((weight, batch.completion_mask))
            return weight, metrics

        monkeypatch.setattr(Objective, "sampling_weight", recording)

    def _counting(self, method, name):
        def counted(*args, **kwargs):
            self.phase = name
            self.batches[name] = self.batches.get(name, 0) + 1
            try:
                return method(*args, **kwargs)
            finally:
                self.phase = None

        return counted

    def hook(self, trainer) -> None:
        def count(module, args, kwargs):
            if self.phase is not None and threading.current_thread() is threading.main_thread():
                self.calls[self.phase] += 1

        trainer.model.get_decoder().register_forward_pre_hook(count, with_kwargs=True)

    def all_weights_one(self) -> int:
        """The number of corrected micro-steps, each of whose weights is 1 (learning_rate 0)."""
        corrected = [(w, mask) for w, mask in self.weights if w is not None]
        for weight, mask in corrected:
            values = weight.flatten() if weight.size(1) == 1 else weight[mask.bool()]
            torch.testing.assert_close(values, torch.ones_like(values), rtol=0, atol=1e-4)
        return len(corrected)


def _counted_run(tmp_path, monkeypatch, name, **overrides) -> tuple[GRPOTrainer, ForwardCount]:
    counts = ForwardCount(monkeypatch)
    settings = {**TRAINING, "max_steps": 2, "learning_rate": 0.0, "rollout_engine": "loop", "beta": 0.0, **QWEN}
    trainer = make_trainer(tiny_run_args(tmp_path / name, preset={**settings, **overrides}))
    counts.hook(trainer)
    return trainer, counts


@pytest.mark.parametrize("share_prompt_prefix", [False, True])
def test_a_stale_batch_takes_one_forward_per_micro_batch(tmp_path, monkeypatch, share_prompt_prefix):
    """max_staleness 1, Qwen2.5's top-k, top-p and repetition penalty, learning_rate 0, no reference model: the decoder
    runs in the training forward only (one padded forward per micro-batch; where pi_prox had a no-grad forward of its
    own, two), and every weight is still 1."""
    trainer, counts = _counted_run(
        tmp_path, monkeypatch, "stale", max_staleness=1, share_prompt_prefix=share_prompt_prefix
    )
    trainer.train()
    assert trainer.experience.replay is not None and not trainer.experience.needs_old_logps
    steps = counts.batches["compute_loss"]
    assert counts.all_weights_one() >= 1 and steps == trainer.state.global_step
    assert counts.calls["set_old_logps"] == 0
    if not share_prompt_prefix:
        assert counts.calls["compute_loss"] == steps  # one padded forward per micro-batch
    else:
        assert counts.calls["compute_loss"] >= 2 * steps  # each group's prompt, then its completions


def test_the_synchronous_vllm_correction_takes_one_forward_per_micro_batch(tmp_path, monkeypatch):
    """vLLM's correction in a synchronous run (use_vllm's; the `loop` engine records the processed log-probs as vLLM
    does) with top_p < 1 and the padded path: one forward per micro-batch, every weight 1."""
    as_with_vllm = GRPOConfig.sampling_correction
    monkeypatch.setattr(GRPOConfig, "sampling_correction", lambda self, producer=False: as_with_vllm(self, True))
    trainer, counts = _counted_run(tmp_path, monkeypatch, "vllm", top_p=0.7, top_k=0, share_prompt_prefix=False)
    trainer.experience.sampler.record_logps = True  # as with vLLM: every rollout carries the sampler's log-probs
    trainer.train()
    assert counts.all_weights_one() == counts.batches["compute_loss"] == 2
    assert counts.calls == {"set_old_logps": 0, "compute_loss": 2}


def test_with_old_logps_pi_prox_keeps_its_no_grad_forward(tmp_path, monkeypatch):
    """steps_per_generation 2: an optimizer step separates a batch's start from its second micro-batch, so pi_prox is
    the policy before it, from the no-grad forward of the old log-probs (which also replays it), as before."""
    trainer, counts = _counted_run(
        tmp_path, monkeypatch, "old", max_staleness=1, steps_per_generation=2, max_steps=4, share_prompt_prefix=False
    )
    trainer.train()
    assert trainer.experience.needs_old_logps
    assert counts.calls == {"set_old_logps": counts.batches["set_old_logps"], "compute_loss": 4}
    assert counts.all_weights_one() >= 1
    assert train_logs(trainer)
