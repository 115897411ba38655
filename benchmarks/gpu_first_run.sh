#!/usr/bin/env bash
# The first run of grpo_hf on a GPU machine, one command of under 10 minutes: J1 against TRL, where a step's time
# goes, and J3 (LoRA).
#
#   bash benchmarks/gpu_first_run.sh [OUT_DIR]        # OUT_DIR (default ./gpu_first_run): first_run.log, j1/j3.json
#
# Needs torch with CUDA, transformers, datasets, trl and peft (no hub, no internet: the models are built from a
# config). With TORCH_LOGS=recompiles,graph_breaks,cudagraphs,perf_hints, each phase under a time limit so that one
# slow phase cannot eat the others':
#   1. the versions and the GPU;
#   2. J1 against TRL (benchmarks/vs_trl.py: TRL, grpo_hf, grpo_hf without fp32 master weights; 3 rounds each, the
#      first untimed), which fails a grpo_hf run whose CUDA graph was lost;
#   3. where a grpo_hf J1 step spends its time (benchmarks/profile_step.py);
#   4. J3 (LoRA) with grpo_hf alone, for the LoRA step against the full one.
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
phase versions 30 python3 -c "import torch, transformers, trl, peft, accelerate, datasets as d; \
print('torch', torch.__version__, torch.cuda.get_device_name(), 'transformers', transformers.__version__, \
'trl', trl.__version__, 'peft', peft.__version__, 'accelerate', accelerate.__version__, 'datasets', d.__version__)"
phase J1 300 python3 benchmarks/vs_trl.py --device cuda --configs J1 --rollouts 3 --trainers trl,grpo_hf,ablated \
    --ablate '{"fp32_master_weights": false}' --json "$out/j1.json"
phase profile 120 python3 benchmarks/profile_step.py --device cuda --config J1 --steps 3
phase J3 100 python3 benchmarks/vs_trl.py --device cuda --configs J3 --rollouts 3 --trainers grpo_hf --json "$out/j3.json"
echo "--- summary" | tee -a "$log"
grep -E "^\| (J1|J3|generate|loss|total) |speedup=|failed|lost|runs eagerly" "$log" | cut -c1-400 | tee "$out/summary.txt"
