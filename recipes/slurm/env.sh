# Sourced by recipes/slurm/grpo.sbatch before anything runs (ENV_SCRIPT names another file): the one place for what
# every node needs, since each srun step inherits this environment. Uncomment and adapt.

# The Python environment with grpo_hf (and vLLM, for the server node):
# source "$SLURM_SUBMIT_DIR/.venv/bin/activate"
# module load cuda/12.4

# The network interface the nodes talk over (`ip -4 addr` on a node lists them): NCCL's collectives, gloo's (the
# process group's object collectives), and the address recipes/slurm/node_ip.sh gives the server and the main node.
# export NCCL_SOCKET_IFNAME=ib0
# export GLOO_SOCKET_IFNAME=ib0

# Hugging Face caches on a file system every node reads, offline once the model and data are there:
# export HF_HOME=/shared/hf
# export HF_HUB_OFFLINE=1
