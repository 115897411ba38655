#!/usr/bin/env bash
# The first run of grpo_hf on a GPU machine, in one command of under 10 minutes: a verdict on the cuda_graph engine.
#
#   bash benchmarks/gpu_first_run.sh [OUT_DIR]        # OUT_DIR (default ./gpu_first_run) gets first_run.log, .json
#
# Needs torch with CUDA, transformers, datasets, trl and peft installed (no hub, no internet; the models are built
# from a config). With TORCH_LOGS=recompiles,graph_breaks,cudagraphs,perf_hints it runs, each phase under a time
# limit so that one slow phase cannot eat the others':
#   1. the versions and the GPU;
#   2. a probe of the engine alone (benchmarks/gpu_probe.py), 64 rows x 256 tokens of the Qwen2.5-0.5B shape: as
#      shipped (compile time, ms/token, launches per token, a profiler kernel table, an in-place weight update that
#      must change the tokens without a recompile), with grouped-query decode attention off, and with top-p on;
#   3. J1 against TRL (benchmarks/gpu_vs_trl.py: grpo_hf, grpo_hf without fp32 master weights, TRL; 3 steps each),
#      which fails a job whose CUDA graph was lost, and one more grpo_hf step under torch.profiler (where the
#      training half of a step goes: on the first H200 run it took 3.7 s of 4.4, against TRL's 1.4 s);
#   4. J3 (LoRA) with grpo_hf alone, for the LoRA step against the full one.
# Everything goes into OUT_DIR/first_run.log, and the probe's and the benchmarks' records into one
# OUT_DIR/first_run.json.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-gpu_first_run}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TORCH_LOGS="${TORCH_LOGS:-recompiles,graph_breaks,cudagraphs,perf_hints}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
log="$out/first_run.log"
: >"$log"
phase() {  # phase NAME SECONDS COMMAND...: run under a time limit, everything into the log, the rc into the summary
    local name=$1 limit=$2
    shift 2
    echo "=== $name ($(date -u +%H:%M:%S), limit ${limit}s): $*" | tee -a "$log"
    timeout "$limit" "$@" >>"$log" 2>&1
    local rc=$?
    echo "=== $name: exit $rc" | tee -a "$log"
    echo "$name $rc" >>"$out/phases.txt"
}
: >"$out/phases.txt"
phase versions 30 python3 -c "import torch, transformers, trl, peft, accelerate, datasets; \
print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name()); \
print('transformers', transformers.__version__, 'trl', trl.__version__, 'peft', peft.__version__, \
'accelerate', accelerate.__version__, 'datasets', datasets.__version__)"
phase probe 150 python3 benchmarks/gpu_probe.py --variants compile,top_p,no_gqa --calls 2 --json "$out/probe.json"
phase J1 280 python3 benchmarks/gpu_vs_trl.py --jobs J1 --steps 3 --profile-step --json "$out/j1.json"
phase J3 100 python3 benchmarks/gpu_vs_trl.py --jobs J3 --steps 3 --trainers grpo_hf --json "$out/j3.json"
python3 - "$out" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
merged = {"phases": dict(line.split() for line in (out / "phases.txt").read_text().splitlines())}
for name in ("probe", "j1", "j3"):
    path = out / f"{name}.json"
    merged[name] = json.loads(path.read_text()) if path.exists() else None
(out / "first_run.json").write_text(json.dumps(merged, indent=1, default=str))
PY
echo "--- summary" | tee -a "$log"
grep -E "^(compile|no_gqa|top_p):|^\| J[13]|speedup=|FAILED|lost|runs eagerly" "$log" | cut -c1-400 | tee -a "$log.summary"
cat "$out/phases.txt"
