"""`rollout.weights.weight_buckets` on a tiny model sharded across 2 CPU processes (gloo), under FSDP2 and ZeRO-3:

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/distributed/weight_buckets.py OUT_PREFIX

For each case (fsdp2, fsdp2-lora, zero3, zero3-lora; the ZeRO-3 ones when DeepSpeed is installed) every process
builds the same model (a fixed seed), takes the weights vLLM would load from an unsharded copy (`named_weights`, the
reference), shards the model (FSDP2's `fully_shard` per decoder layer and on the root; DeepSpeed's `zero.Init` over
the built module, every tensor partitioned), and walks `weight_buckets` with a bound of about a fifth of the model.
A recorder plays the sender: at each bucket it counts the bytes of full weights alive on this process (every tensor
it was handed and has not let go, every DTensor's `full_tensor()` still alive, every ZeRO-3 parameter gathered at
that moment), then drops the bucket. A second walk keeps every bucket (a sender that never lets go) to show the count
sees what is kept. Writes OUT_PREFIX-<rank>.pt: per case the bound, the model's bytes, the buckets' sizes, the peak
alive bytes of both walks, and whether every weight equals the reference (names in order, values exactly).
"""

import gc
import importlib
import importlib.util
import os
import sys
import weakref
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for conftest's builders

from conftest import build_tiny_model, build_tiny_tokenizer, exit_without_teardown  # noqa: E402

from grpo_hf.rollout.weights import named_weights, weight_buckets  # noqa: E402


def build(lora: bool):
    model = build_tiny_model(build_tiny_tokenizer(), hidden_size=64, num_layers=4, seed=1)
    if lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(2)
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"]))
        for name, param in model.named_parameters():  # B is zero at init: a delta that shows
            if "lora_B" in name:
                param.data.normal_(0, 0.05)
    return model


def shard(model, layout: str):
    if layout == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.get_base_model().model.layers if hasattr(model, "peft_config") else model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        return model
    import deepspeed

    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # no shared-memory op build on CPU
    config = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}, "train_batch_size": 2}
    deepspeed.zero.Init(module=model, config_dict_or_path=config)
    return model


class Recorder:
    """The sender's stand-in: the peak bytes of full weights alive on this process when a bucket arrives."""

    def __init__(self, model, keep: bool):
        from torch.distributed.tensor import DTensor

        self.params = [p for p in model.parameters() if hasattr(p, "ds_id")]
        self.handed: list[weakref.ref] = []  # every tensor handed over, and every DTensor gathered (FSDP2)
        full_tensor = DTensor.full_tensor

        def recorded(dtensor, *args, **kwargs):
            tensor = full_tensor(dtensor, *args, **kwargs)
            self.handed.append(weakref.ref(tensor))
            return tensor

        DTensor.full_tensor = recorded
        self.restore = lambda: setattr(DTensor, "full_tensor", full_tensor)
        self.kept, self.keep, self.peak, self.sizes, self.weights = [], keep, 0, [], []

    def alive_bytes(self) -> int:
        storages = {}
        for ref in self.handed:
            if (tensor := ref()) is not None:
                storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        for param in self.params:
            if param.ds_status.name == "AVAILABLE":  # gathered (ZeRO-3)
                storages[param.data.untyped_storage().data_ptr()] = param.ds_numel * param.element_size()
        return sum(storages.values())

    def send(self, bucket) -> None:
        self.sizes.append(sum(t.numel() * t.element_size() for _, t in {id(t): (n, t) for n, t in bucket}.values()))
        self.handed += [weakref.ref(tensor) for _, tensor in bucket]
        self.peak = max(self.peak, self.alive_bytes())
        self.weights += [(name, tensor.clone()) for name, tensor in bucket] if not self.keep else []
        if self.keep:
            self.kept.append(bucket)


def run(layout: str, lora: bool) -> dict:
    model = build(lora)
    reference = [(name, tensor.clone()) for name, tensor in named_weights(model)]
    total = sum(t.numel() * t.element_size() for _, t in {id(p): (0, p) for p in model.parameters()}.values())
    model = shard(model, layout)
    bound = total // 5
    result = {"bound": bound, "model_bytes": total}
    for keep in (False, True):
        recorder = Recorder(model, keep)
        for bucket in weight_buckets(model, bound):
            recorder.send(bucket)
            del bucket
            gc.collect()
        recorder.restore()
        result["kept_peak" if keep else "peak"] = recorder.peak
        if not keep:
            result["sizes"] = recorder.sizes
            result["names"] = [name for name, _ in recorder.weights] == [name for name, _ in reference]
            pairs = zip(recorder.weights, reference, strict=False)  # the lengths: `names`
            result["equal"] = all(torch.equal(a, b) for (_, a), (_, b) in pairs)
        del recorder
        gc.collect()
    result["sharded"] = all(hasattr(p, "full_tensor") or hasattr(p, "ds_id") for p in model.parameters())
    return result


def main(prefix: str) -> None:
    dist.init_process_group("gloo")
    cases = ["fsdp2", "fsdp2-lora"]
    if importlib.util.find_spec("deepspeed") is not None:
        cases += ["zero3", "zero3-lora"]
    results = {case: run(case.split("-")[0], case.endswith("lora")) for case in cases}
    torch.save(results, f"{prefix}-{dist.get_rank()}.pt")
    dist.barrier()
    exit_without_teardown()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main(sys.argv[1])
