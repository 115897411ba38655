"""Server mode's weight push, files against the network (vLLM's weight-transfer protocol over grpo_hf's gloo group), on
vLLM's CPU build: seconds per push, bytes written to disk, the trainer's peak memory.

Starts one `python -m grpo_hf.vllm_serve` of the model (fp32; the gloo engine is selected on a CPU), then, once per
transport, a fresh trainer process that loads the model, connects (`VLLMServer`) and pushes it `--pushes` times,
timing each push (the first includes the check of the served model's parameter names). Bytes written: the
safetensors shards' sizes (files; they go to /dev/shm by default, which is memory, or to vllm_server_weights_dir), 0
for the network (nothing is written). Peak memory: the trainer process's peak RSS (`ru_maxrss`) after the pushes,
and its growth over the peak once the model is loaded and its pages resident (what the push added: files copy one
shard, at most 1 GiB, and serialise it; gloo sends each parameter as it is). Bandwidth: the bytes sent per push
(tied weights under each name) / median push seconds, and the median push of a 7B and a 72B model in bf16 worked out
from it (15.2 GB and 145 GB), at this machine's rate.

    .venv-vllm/bin/python benchmarks/vllm_server_push.py                 # SmolLM2-135M (grpo_hf.offline_model_path)
    .venv-vllm/bin/python benchmarks/vllm_server_push.py --tiny --pushes 1   # a tiny model: a check
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

SIZES = {"7B bf16": 15.2e9, "72B bf16": 145e9}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(model_dir: str, log_path: Path, extra: tuple[str, ...] = ()) -> tuple[str, subprocess.Popen]:
    """`python -m grpo_hf.vllm_serve` of `model_dir` (fp32) on a free port, `extra` server flags; (its URL, the
    process) once /health answers."""
    port, log = free_port(), open(log_path, "w")  # noqa: SIM115 (closed with the process)
    command = [sys.executable, "-m", "grpo_hf.vllm_serve", "--model", model_dir, "--host", "127.0.0.1"]
    command += ["--port", str(port), "--dtype", "float32", "--max-model-len", "512", *extra]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 300
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited: {log_path.read_text()[-3000:]}")
        try:
            urllib.request.urlopen(url + "/health", timeout=2).close()
            return url, process
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not start in 300 s") from None
            time.sleep(1)


def measure(transport: str, url: str, model_dir: str, pushes: int) -> dict:
    """In a fresh process: load, connect, push `pushes` times; seconds, bytes written, peak RSS."""
    import torch
    from transformers import AutoModelForCausalLM

    from grpo_hf import GRPOConfig
    from grpo_hf.rollout import vllm_server

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():  # every page of the weights resident before the baseline (a memory-mapped load's are not)
        [param.sum() for param in model.parameters()]
    loaded_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    written = []
    write_shards = vllm_server.write_shards

    def counted(weights, directory):
        write_shards(weights, directory)
        written.append(sum(path.stat().st_size for path in Path(directory).iterdir()))

    vllm_server.write_shards = counted
    args = GRPOConfig(output_dir=tempfile.mkdtemp(), use_vllm=True, vllm_mode="server", vllm_server_base_url=url,
                      vllm_server_weight_transfer=transport, vllm_group_port=free_port(), use_cpu=True,
                      report_to=[])  # fmt: skip
    client = vllm_server.VLLMServer(args, None, [0])
    seconds = [client.push(model) for _ in range(pushes)]
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    sent = sum(t.numel() * t.element_size() for _, t in vllm_server.named_weights(model))  # tied weights twice
    return {
        "transport": transport,
        "push_seconds": seconds,
        "push_seconds_median": statistics.median(seconds),
        "bytes_written_per_push": statistics.median(written) if written else 0,
        "model_bytes": model_bytes,
        "bytes_sent_per_push": sent,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "peak_rss_growth_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - loaded_peak,
    }


def tiny_model_dir(directory: Path) -> str:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from conftest import build_tiny_model, build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    build_tiny_model(tokenizer, hidden_size=128, seed=3, tied=True).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pushes", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="a tiny model instead of SmolLM2-135M")
    parser.add_argument("--measure", nargs=3, metavar=("TRANSPORT", "URL", "MODEL_DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(*args.measure, args.pushes)))
        return
    with tempfile.TemporaryDirectory() as scratch:
        if args.tiny:
            model_dir = tiny_model_dir(Path(scratch) / "tiny")
        else:
            from grpo_hf import offline_model_path

            model_dir = str(offline_model_path())
        url, server = start_server(model_dir, Path(scratch) / "server.log")
        try:
            results = []
            for transport in ("files", "gloo"):
                command = [
                    sys.executable,
                    __file__,
                    "--pushes",
                    str(args.pushes),
                    "--measure",
                    transport,
                    url,
                    model_dir,
                ]
                done = subprocess.run(command, capture_output=True, text=True, timeout=900, check=True)
                results.append(json.loads(done.stdout.strip().splitlines()[-1]))
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=60)
    for result in results:
        rate = result["bytes_sent_per_push"] / result["push_seconds_median"]
        result["bytes_per_second"] = rate
        result["worked_out_seconds"] = {name: size / rate for name, size in SIZES.items()}
    print(json.dumps({"model": model_dir, "results": results}, indent=1))
    print("| transport | s/push (median) | pushes | written/push | peak RSS | RSS growth | MB/s |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        each = ", ".join(f"{s:.3f}" for s in r["push_seconds"])
        print(f"| {r['transport']} | {r['push_seconds_median']:.3f} | {each} "
              f"| {r['bytes_written_per_push'] / 1e6:.1f} MB | {r['peak_rss_bytes'] / 1e9:.2f} GB "
              f"| {r['peak_rss_growth_bytes'] / 1e6:.0f} MB | {r['bytes_per_second'] / 1e6:.0f} |")  # fmt: skip


if __name__ == "__main__":
    main()
