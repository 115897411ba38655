#!/bin/bash
# One training node of recipes/slurm/grpo.sbatch: `accelerate launch` with this node's --machine_rank, the rank of
# its task in the training step (one task per node). Every other argument is grpo.sbatch's.
set -euo pipefail
exec accelerate launch --machine_rank "${SLURM_PROCID:?run by srun (SLURM_PROCID)}" "$@"
