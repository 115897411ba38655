"""`rollout.weights.weight_buckets`: the weights vLLM loads, gathered a bucket at a time. On one process: the buckets'
bound, tied names, a bad bound. On 2 processes (gloo) under FSDP2 and ZeRO-3, with and without LoRA
(`tests/distributed/weight_buckets.py`): the same weights as an unsharded copy, and at most a bucket of full weights
alive at any time on a process, where a sender that keeps every bucket holds the whole model."""

import pytest
import torch
from conftest import build_tiny_model, torchrun

from grpo_hf.rollout.weights import named_weights, weight_buckets


def _bytes(bucket) -> int:
    unique = {id(tensor): tensor for _, tensor in bucket}
    return sum(t.numel() * t.element_size() for t in unique.values())


def test_buckets_hold_at_most_the_bound_and_every_weight_once_in_order(tokenizer):
    """A bound of a quarter of the model: several buckets, each within the bound, together the model's parameters in
    its order; tied lm_head and embeddings come under both names, in one bucket, counted once."""
    model = build_tiny_model(tokenizer, hidden_size=64, num_layers=3, tied=True)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    biggest = max(p.numel() * p.element_size() for p in model.parameters())
    bound = max(total // 4, biggest)
    buckets = list(weight_buckets(model, bound))
    assert len(buckets) >= 4
    assert all(_bytes(bucket) <= bound for bucket in buckets)
    flat = [pair for bucket in buckets for pair in bucket]
    names = [name for name, _ in model.named_parameters(remove_duplicate=False)]
    assert sorted(name for name, _ in flat) == sorted(names)  # in the model's order, tied names with the first
    untied = [name for name in names if name != "lm_head.weight"]
    assert [name for name, _ in flat if name != "lm_head.weight"] == untied
    tied = [bucket for bucket in buckets if "lm_head.weight" in dict(bucket)]
    assert len(tied) == 1 and dict(tied[0])["lm_head.weight"] is dict(tied[0])["model.embed_tokens.weight"]
    assert sum(_bytes(bucket) for bucket in buckets) == total


def test_a_weight_over_the_bound_is_a_bucket_alone_and_a_bad_bound_is_refused(tokenizer):
    model = build_tiny_model(tokenizer, hidden_size=32, num_layers=1)
    buckets = list(weight_buckets(model, 1))
    assert [len(bucket) for bucket in buckets] == [1] * len(list(model.parameters()))
    assert dict(named_weights(model, 1)).keys() == dict(model.named_parameters()).keys()
    with pytest.raises(ValueError, match="bucket_bytes=0 must be > 0"):
        next(weight_buckets(model, 0))


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    prefix = tmp_path_factory.mktemp("buckets") / "out"
    torchrun("weight_buckets.py", prefix, processes=2, timeout=300)
    return [torch.load(f"{prefix}-{rank}.pt") for rank in range(2)]


@pytest.mark.parametrize("case", ["fsdp2", "fsdp2-lora", "zero3", "zero3-lora"])
def test_sharded_weights_are_gathered_a_bucket_at_a_time(sharded, case):
    """Every process gets the unsharded copy's weights (names in order, values exactly: LoRA deltas merged from the
    gathered A and B), in at least 4 buckets, and never holds more than the bound of full weights (a fifth of the
    model) while a bucket is sent; a sender that keeps the buckets holds the whole model, which the count sees."""
    if case not in sharded[0]:
        pytest.skip("DeepSpeed is not installed")
    for results in sharded:
        result = results[case]
        assert result["sharded"] and result["names"] and result["equal"]
        assert len(result["sizes"]) >= 4
        assert 0 < result["peak"] <= result["bound"] < result["model_bytes"] / 4
        assert result["kept_peak"] >= 0.95 * result["model_bytes"]


@pytest.mark.parametrize(("engine", "gathers"), [("vllm", False), ("loop", True)])
def test_only_engines_that_decode_with_the_model_get_it_gathered(monkeypatch, tokenizer, engine, gathers):
    """Under ZeRO-3 (and FSDP2) the sampler gathers the whole model around a rollout for engines that run its forward;
    the vllm engine decodes with vLLM's copy and gets the model as it is: its push gathers a bucket at a time."""
    import contextlib
    from types import SimpleNamespace

    import trl.models.utils

    from grpo_hf.rollout import sampler as sampler_module

    model, gathered = build_tiny_model(tokenizer), []

    @contextlib.contextmanager
    def gather_all(wrapped, accelerator, gather_deepspeed3_params):
        gathered.append(wrapped)
        yield wrapped

    monkeypatch.setattr(sampler_module, "is_zero3", lambda accelerator: True)
    monkeypatch.setattr(trl.models.utils, "unwrap_model_for_generation", gather_all)
    args = SimpleNamespace(rollout_engine=engine, ds3_gather_for_generation=True)
    sampler = SimpleNamespace(wrapped=lambda: model, gathers=True, args=args, accelerator=SimpleNamespace(
        unwrap_model=lambda wrapped: wrapped))  # fmt: skip
    with sampler_module.Sampler.model_for_generation(sampler) as given:
        assert given is model
    assert bool(gathered) == gathers
