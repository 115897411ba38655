"""`grpo_hf.forward_plan`: the log-prob path chosen by device and memory, its estimate, and that every choice gives
the same update. A CUDA device's memory is simulated by replacing `available_bytes`; everything runs on the CPU."""

import logging
from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator
from conftest import build_tiny_model, id_sum_reward, make_dataset, make_trainer, tiny_run_args, train_logs

from grpo_hf import forward_plan
from grpo_hf.core import CHUNK_ELEMENTS
from grpo_hf.forward_plan import ForwardPlan, Planner, activation_bytes_per_token, gpu_chunk_logits
from grpo_hf.rollout import MicroBatch, tokenize_prompts

GIB = 2**30


def _batch(tokenizer, rows=8, length=12):
    prompts = ["A prompt"] * (rows // 2) + ["Another, longer prompt"] * (rows - rows // 2)
    prompt_ids, prompt_mask, _ = tokenize_prompts(tokenizer, prompts)
    torch.manual_seed(0)
    completion_ids = torch.randint(3, 200, (rows, length))
    return MicroBatch(prompt_ids, prompt_mask, completion_ids, torch.ones_like(completion_ids), torch.zeros(rows))


@pytest.fixture
def device_memory(monkeypatch):
    """Set `memory[0]` to the bytes a simulated CUDA device has available."""
    memory = [None]
    monkeypatch.setattr(forward_plan, "available_bytes", lambda device: memory[0])
    return memory


def _saved_bytes(model, batch) -> int:
    """Bytes of the tensors the padded forward over the whole batch saves for its backward, counted directly."""
    params = {p.untyped_storage().data_ptr() for p in [*model.parameters(), *model.buffers()]}
    storages = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    ids = torch.cat([batch.prompt_ids, batch.completion_ids], 1)
    mask = torch.cat([batch.prompt_mask, batch.completion_mask], 1)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.eval()(input_ids=ids, attention_mask=mask, logits_to_keep=1, use_cache=False)
    return sum(storages.values())


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_one_row_measures_the_activations_of_the_whole_micro_batch(tokenizer, arch):
    """Measured on the first row, scaled by the rows, the estimate is the whole batch's saved tensors (padding
    included), within 10%; and it is at least what the residual stream alone keeps (hidden x layers x 4 bytes)."""
    model = build_tiny_model(tokenizer, arch, hidden_size=64, num_layers=3).train()
    batch = _batch(tokenizer, rows=8, length=24)
    per_token = activation_bytes_per_token(model, batch)
    assert model.training  # the mode is restored
    tokens = batch.prompt_ids.numel() + batch.completion_ids.numel()
    assert per_token * tokens == pytest.approx(_saved_bytes(model, batch), rel=0.1)
    assert per_token >= 64 * 3 * 4


def test_gpu_chunks_grow_with_memory_within_their_bounds():
    assert gpu_chunk_logits(1 * GIB) == CHUNK_ELEMENTS  # 1 GiB / 256 is below the CPU's chunk: the floor
    assert gpu_chunk_logits(16 * GIB) == 16 * GIB // 256
    assert gpu_chunk_logits(140 * GIB) == 1 << 28


# (share_prompt_prefix, backward_per_group) -> the plan with plenty of memory, and with too little
CHOICES = {
    (None, None): ((False, False), (True, True)),
    (True, None): ((True, False), (True, True)),
    (None, True): ((True, True), (True, True)),
    (None, False): ((False, False), (True, False)),
    (False, None): ((False, False), (False, False)),
    (True, True): ((True, True), (True, True)),
    (True, False): ((True, False), (True, False)),
}


@pytest.mark.parametrize("fields", list(CHOICES))
def test_the_plan_follows_the_fields_and_the_memory(tokenizer, device_memory, fields):
    model, batch = build_tiny_model(tokenizer), _batch(tokenizer)
    planner = Planner(Accelerator(cpu=True), *fields, chunk_size=None)
    vocab = len(tokenizer)
    for memory, expected in zip((80 * GIB, 1 << 20), CHOICES[fields], strict=True):
        device_memory[0] = memory
        plan = planner.plan(model, batch, blocker=None)
        assert (plan.share_prefix, plan.per_group) == expected, memory
        assert plan.chunk_size == gpu_chunk_logits(memory) // vocab  # on CUDA, sized to the memory
    device_memory[0] = None  # off CUDA: the auto fields resolve to the shared prefix, a group at a time
    assert Planner(Accelerator(cpu=True), None, None, None).plan(model, batch, None)[:3] == (True, True, None)


def test_a_blocked_shared_prefix_is_padded_whatever_the_memory(tokenizer, device_memory):
    model, batch = build_tiny_model(tokenizer), _batch(tokenizer)
    device_memory[0] = 1 << 20
    plan = Planner(Accelerator(cpu=True), None, None, None).plan(model, batch, blocker="FSDP shards the weights")
    assert plan == ForwardPlan(False, False, max(1, CHUNK_ELEMENTS // len(tokenizer)), "FSDP shards the weights")
    device_memory[0] = None
    plan = Planner(Accelerator(cpu=True), None, None, 7).plan(model, batch, blocker="FSDP shards the weights")
    assert plan == ForwardPlan(False, False, 7, "FSDP shards the weights")


def test_the_estimate_decides_and_the_plan_is_logged_when_it_changes(tokenizer, device_memory, caplog):
    model, batch = build_tiny_model(tokenizer), _batch(tokenizer)
    planner = Planner(Accelerator(cpu=True), None, None, None)
    needed = planner._needed(model, batch, len(tokenizer), CHUNK_ELEMENTS // len(tokenizer), grad=True)
    with caplog.at_level(logging.INFO, logger="grpo_hf.forward_plan"):
        for memory in (needed / 0.69, needed / 0.69, needed / 0.71):  # the padded step may take 70% of it
            device_memory[0] = int(memory)
            planner.plan(model, batch, blocker=None)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines  # the second call planned the same: not logged again
    assert lines[0].startswith("log-prob path: one padded forward over prompt + completion rows, one backward, ")
    assert "(auto on cuda: 8 rows x 34 tokens need ~" in lines[0] and "MiB available)" in lines[0]
    assert lines[1].startswith("log-prob path: shared prompt prefix, one group's backward at a time, log-softmax")


def test_every_process_takes_the_padded_path_or_none_does():
    accelerator = SimpleNamespace(num_processes=2, device=torch.device("cpu"))
    accelerator.gather = lambda flag: torch.cat([flag, torch.zeros(1)])  # the other process does not fit
    assert Planner(accelerator, None, None, None)._everywhere(True) is False
    accelerator.gather = lambda flag: torch.cat([flag, torch.ones(1)])
    assert Planner(accelerator, None, None, None)._everywhere(True) is True


def _one_sgd_step(tmp_path, tokenizer, **overrides):
    """One optimizer step of plain SGD (lr 1, no clipping): the parameter change is the gradient."""
    model = build_tiny_model(tokenizer, seed=3)
    settings = dict(max_steps=1, optim="sgd", learning_rate=1.0, max_grad_norm=0.0, per_device_train_batch_size=8)
    args = tiny_run_args(tmp_path, **{**settings, **overrides})
    trainer = make_trainer(args, id_sum_reward, make_dataset(), tokenizer=tokenizer, model=model)
    trainer.train()
    initial = dict(build_tiny_model(tokenizer, seed=3).named_parameters())
    return trainer, {name: (p - initial[name]).detach() for name, p in model.named_parameters()}


def test_the_cuda_default_gives_the_cpu_defaults_update(tmp_path, tokenizer, device_memory, caplog):
    """The same step with the defaults, on the CPU (shared prefix, per-group backward) and with a simulated GPU of
    80 GiB (padded forward, one backward, GPU-sized chunks): the same loss and update."""
    cpu, cpu_delta = _one_sgd_step(tmp_path / "cpu", tokenizer)
    device_memory[0] = 80 * GIB
    with caplog.at_level(logging.INFO, logger="grpo_hf"):
        gpu, gpu_delta = _one_sgd_step(tmp_path / "gpu", tokenizer)
    assert any("one padded forward" in r.getMessage() and "auto on cuda" in r.getMessage() for r in caplog.records)
    assert train_logs(gpu)[0]["loss"] == pytest.approx(train_logs(cpu)[0]["loss"], rel=1e-5, abs=1e-7)
    for name, delta in cpu_delta.items():
        torch.testing.assert_close(gpu_delta[name], delta, rtol=1e-4, atol=1e-6)
    assert max(d.abs().max() for d in cpu_delta.values()) > 1e-3  # the step moved the model
