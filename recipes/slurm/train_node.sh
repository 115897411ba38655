#!/bin/bash
# One training node of recipes/slurm/grpo.sbatch: `accelerate launch` with this node's --machine_rank, the rank of its
# task in the training step (one task per node). Every other argument is grpo.sbatch's.
#
# A stop (SIGUSR1 or SIGTERM, which srun passes on from grpo.sbatch) goes to this node's training processes, the
# launcher's children, not to the launcher: torchrun's agent (inside `accelerate launch`) would die of SIGUSR1, and on
# SIGTERM it kills its workers 30 s later, whatever they are doing. The launcher ignores SIGUSR1 (set before its exec);
# the training processes finish their step, save a checkpoint and exit with 75 (grpo_hf.checkpoint.STOPPED_EXIT_CODE).
# The launcher reports any non-zero exit of its processes as a failure (1), so after a stop this script exits with
# 75 itself unless the launcher ended cleanly (training had finished).
set -uo pipefail
STOPPED_EXIT_CODE=75
: "${SLURM_PROCID:?run by srun (SLURM_PROCID)}"

stopping=0
launcher=
stop() {
    stopping=1
    echo "train_node.sh: $1 on $(hostname): the training processes finish their step, save and stop" >&2
    [[ -n $launcher ]] && pkill -USR1 -P "$launcher" || true
}
trap 'stop SIGUSR1' USR1
trap 'stop SIGTERM' TERM
(trap '' USR1; exec accelerate launch --machine_rank "$SLURM_PROCID" "$@") &
launcher=$!
while true; do  # `wait` returns early when a trapped signal arrives: wait again
    wait "$launcher" && code=0 || code=$?
    kill -0 "$launcher" 2>/dev/null || break
done
if (( stopping && code != 0 )); then
    exit "$STOPPED_EXIT_CODE"
fi
exit "$code"
