"""The MoE load-balancing loss split into the groups' shares (`grpo_hf.logprobs`: `ExpertLoad`, `RouterTally.share`,
`backward_per_group(router_aux=True)`): a routing pass fixes the expert fractions, then one group's backward at a
time gives the padded forward's loss and gradients; the loss is the formula, checked against a loop over tokens."""

import math

import pytest
import torch
import transformers
from test_families import ATTENTION, COMMON, EXPERTS, build, make_batch
from transformers import AutoModelForCausalLM
from transformers.models.qwen3_moe import modeling_qwen3_moe

from grpo_hf.core import prompt_runs
from grpo_hf.logprobs import (
    ExpertLoad,
    LogprobPath,
    RouterTally,
    backward_per_group,
    completion_logps,
    expert_load,
    router_loss_splits,
    shared_prefix_logits,
)

SPLIT = ["qwen3_moe", "gpt_oss", "mixtral"]  # Switch Transformer's loss, each modeling module's own copy


def policy_and_aux(batch, logps, router_aux):
    """A loss whose gradient is mostly the load-balancing loss's: a small policy term (every row) plus the aux."""
    return 0.01 * (logps * batch.completion_mask).sum() + router_aux[0], {}


def grads(model):
    return [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in model.parameters()]


def one_backward(model, batch, share: bool):
    """Loss, aux and gradients of one forward (padded, or the shared prefix with `RouterTally.loss`) and one
    backward."""
    aux = []
    logps, _ = completion_logps(model, batch, share_prefix=share, router_aux=aux)
    loss, _ = policy_and_aux(batch, logps, aux)
    model.zero_grad()
    loss.backward()
    return loss.detach(), aux[0].detach(), grads(model)


@pytest.mark.parametrize("family", SPLIT)
def test_one_group_at_a_time_gives_the_padded_loss_and_gradients(family):
    model = build(family)
    assert router_loss_splits(model) is None
    batch = make_batch()  # three groups, prompts of 7, 10 and 2 tokens, completions of 1 to 12 (padded)
    assert len(prompt_runs(batch.prompt_ids, batch.prompt_mask)) == 3
    auxes = []

    def loss_fn(logps, router_aux):
        auxes.append(router_aux[0].detach())
        return policy_and_aux(batch, logps, router_aux)

    model.zero_grad()
    router_aux = []
    loss, _, _ = backward_per_group(model, batch, loss_fn, lambda part: part.backward(), router_aux=router_aux)
    loss.backward()
    got = grads(model)
    for share in (False, True):  # the padded forward, and the shared prefix with one backward (today's path)
        want_loss, want_aux, want = one_backward(model, batch, share)
        assert want_aux > 1.0
        torch.testing.assert_close(auxes[-1], want_aux, rtol=1e-6, atol=0.0)
        torch.testing.assert_close(router_aux[0].detach(), want_aux, rtol=1e-6, atol=0.0)
        torch.testing.assert_close(loss.detach(), want_loss, rtol=1e-6, atol=1e-6)
        atol = 1e-6 * max(g.abs().max().item() for g in want)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=atol)
    assert auxes[0] < auxes[1] < auxes[2]  # each group's share joins the detached earlier ones


def naive_load_balancing_loss(gate_logits, counts, num_experts: int, top_k: int) -> float:
    """E x sum_i f_i x P_i, one token and one layer at a time: f_i, the count-weighted share of tokens whose top-k
    includes expert i, and P_i, the count-weighted mean router probability of expert i, over every layer and token."""
    assigned, probability, total = [0.0] * num_experts, [0.0] * num_experts, 0.0
    for layer in gate_logits:
        for token, logits in enumerate(layer.tolist()):
            weight = float(counts[token])
            exps = [math.exp(x) for x in logits]
            probs = [e / sum(exps) for e in exps]
            for expert in sorted(range(num_experts), key=lambda i: -probs[i])[:top_k]:
                assigned[expert] += weight
            for expert in range(num_experts):
                probability[expert] += weight * probs[expert]
            total += weight
    return num_experts * sum((a / total) * (p / total) for a, p in zip(assigned, probability, strict=True))


def test_the_loss_and_its_shares_are_the_formula():
    """The padded forward's `aux_loss` (the model's own function), the shares of the groups' forwards, and a loop
    over layers and tokens written from the formula agree."""
    model = build("qwen3_moe").eval()
    batch = make_batch()
    input_ids = torch.cat([batch.prompt_ids, batch.completion_ids], dim=1)  # [N, P + T]
    mask = torch.cat([batch.prompt_mask, batch.completion_mask], dim=1)  # [N, P + T]
    with torch.no_grad():
        output = model(input_ids=input_ids, attention_mask=mask, output_router_logits=True)
        naive = naive_load_balancing_loss(output.router_logits, mask.reshape(-1), 4, 2)
        load, shares = expert_load(model, batch), []
        for start, stop in prompt_runs(batch.prompt_ids, batch.prompt_mask):
            tally = RouterTally()
            for _ in shared_prefix_logits(model, batch.rows(start, stop), tally):
                pass
            shares.append(tally.share(load))
    assert output.aux_loss > 1.0
    assert output.aux_loss.item() == pytest.approx(naive, rel=1e-6)
    assert sum(shares).item() == pytest.approx(naive, rel=1e-6)
    tokens = 2 * int(mask.sum())  # layers x real tokens: the shared forwards count each prompt token once per row
    assert load.total.item() == tokens and load.assigned.sum().item() == 2 * tokens  # top-2


def test_the_routing_pass_draws_the_dropout_masks_of_the_forwards_after_it():
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(**COMMON, **ATTENTION, **EXPERTS, attention_dropout=0.5)
    model = AutoModelForCausalLM.from_config(config).float().train()
    batch = make_batch()
    load, forwards = expert_load(model, batch), ExpertLoad(4, 2, torch.device("cpu"))
    for start, stop in prompt_runs(batch.prompt_ids, batch.prompt_mask):  # as `backward_per_group` runs them
        for _ in shared_prefix_logits(model, batch.rows(start, stop), forwards):
            pass
    torch.testing.assert_close(load.assigned, forwards.assigned, rtol=0.0, atol=0.0)
    assert not torch.equal(expert_load(model, batch).assigned, load.assigned)  # other masks route otherwise


def test_a_loss_of_another_form_keeps_one_backward(monkeypatch):
    model = build("qwen3_moe")
    settings = dict(forward_settings={}, micro_batch_size=9, share_prompt_prefix=None, router_aux_loss_coef=0.01)
    path = LogprobPath(None, **settings, sharded=False, module=model)
    assert path.planner.one_backward is None  # a routing pass, then one group's backward at a time
    switch = modeling_qwen3_moe.load_balancing_loss_func
    monkeypatch.setattr(
        modeling_qwen3_moe, "load_balancing_loss_func", lambda *args: switch(*args) ** 2
    )  # a loss not linear in the probabilities: no exact split
    assert "is not Switch Transformer's" in router_loss_splits(model)
    path = LogprobPath(None, **settings, sharded=False, module=model)
    assert "router_aux_loss_coef=0.01, whose expert counts span every group" in path.planner.one_backward
