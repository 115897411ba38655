"""The NCCL weight push's trainer side on GPUs, without vLLM: `weight_transfer.NetworkPush(transport="nccl")` sends the
J1 model (Qwen2.5-0.5B's shape, bf16, random) bucket by bucket from GPU 0 to a receiver process on GPU 1 that plays
vLLM's NCCL worker: it cuts the same buckets from the same metadata (`wire_buckets`: vLLM's packed consumer's rule),
receives each as one broadcast, unpacks it and compares every tensor with its own copy of the model (exactly). Only
the transport's peer differs from a server: the HTTP routes are a stand-in that records them, and the communicator
is torch.distributed's NCCL group (vLLM's PyNcclCommunicator has the same `broadcast(tensor, src, stream)`).

Seconds per push (after one untimed push), GB/s, and the 7B / 72B bf16 pushes worked out from that rate. NCCL cannot
join two ranks on one GPU: with fewer than two GPUs the script says so and exits 0.

    python benchmarks/nccl_push.py [--pushes 3] [--bucket-bytes 1073741824] [--layers 24]
    python benchmarks/nccl_push.py --cpu --layers 2 --bucket-bytes 50000000   # the same on CPUs over gloo: a check
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

SIZES = {"7B bf16": 15.2e9, "72B bf16": 145e9}


def j1_model(layers: int, device: str):
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _worker import SHAPES, VOCAB

    config = Qwen2Config(vocab_size=VOCAB["0.5B"], num_key_value_heads=2, tie_word_embeddings=True,
                         **{**SHAPES["0.5B"], "num_hidden_layers": layers})  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)


class TorchNccl:
    """torch.distributed's NCCL broadcast behind vLLM's PyNcclCommunicator's signature."""

    def broadcast(self, tensor, src=0, stream=None):
        import torch.distributed as dist

        dist.broadcast(tensor, src=src)


def run(rank: int, args) -> None:
    import torch
    import torch.distributed as dist

    from grpo_hf.rollout.weight_transfer import NetworkPush, unpack, update_info, wire_buckets
    from grpo_hf.rollout.weights import named_weights

    device = "cpu" if args.cpu else f"cuda:{rank}"
    if args.cpu:
        dist.init_process_group("gloo", rank=rank, world_size=2)
    else:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=2, device_id=torch.device(device))
    model = j1_model(args.layers, device)
    sync = (lambda: None) if args.cpu else torch.cuda.synchronize
    model_bytes = sum(t.numel() * t.element_size() for _, t in named_weights(model))
    if rank == 0:
        routes = []
        link = NetworkPush(lambda route, body=None: routes.append(route), "nccl", "127.0.0.1", 0, 2,
                           bucket_bytes=args.bucket_bytes, communicator=TorchNccl())  # fmt: skip
        seconds = []
        for push in range(args.pushes + 1):
            sync()
            start = time.perf_counter()
            link.push(named_weights(model))
            sync()
            if push:  # the first push warms NCCL up
                seconds.append(time.perf_counter() - start)
        rate = model_bytes / statistics.median(seconds)
        print(json.dumps({
            "model_bytes": model_bytes, "bucket_bytes": args.bucket_bytes, "push_seconds": seconds,
            "push_seconds_median": statistics.median(seconds), "GB_per_s": rate / 1e9,
            "worked_out_seconds": {name: size / rate for name, size in SIZES.items()},
            "routes_per_push": routes[: len(routes) // (args.pushes + 1)],
        }, indent=1))  # fmt: skip
    else:
        mine = list(named_weights(model))
        for _ in range(args.pushes + 1):
            received = []
            for bucket in wire_buckets(mine, args.bucket_bytes):
                info = update_info(bucket)
                sizes = [t.numel() * t.element_size() for _, t in bucket]
                packed = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
                dist.broadcast(packed, src=0)
                received.extend(unpack(packed, **info))
            equal = all(torch.equal(a, b) for (_, a), (_, b) in zip(received, mine, strict=True))
            if not equal:
                raise SystemExit("the received weights differ from the sent ones")
        print(json.dumps({"receiver": "every push equal", "tensors": len(mine)}))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pushes", type=int, default=3)
    parser.add_argument("--bucket-bytes", type=int, default=1 << 30)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--cpu", action="store_true", help="a check on CPUs: gloo in NCCL's place (try --layers 2)")
    args = parser.parse_args()
    import torch

    if "RANK" in os.environ:
        run(int(os.environ["RANK"]), args)
        return
    if torch.cuda.device_count() < 2 and not args.cpu:
        print(f"nccl_push: skipped: NCCL needs two GPUs (trainer and receiver), this machine has "
              f"{torch.cuda.device_count()}")  # fmt: skip
        return
    import subprocess

    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__]
    command += ["--pushes", str(args.pushes), "--bucket-bytes", str(args.bucket_bytes), "--layers", str(args.layers)]
    command += ["--cpu"] if args.cpu else []
    sys.exit(subprocess.run(command).returncode)


if __name__ == "__main__":
    main()
