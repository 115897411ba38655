#!/bin/bash
# This node's IPv4 address, the one the other nodes reach it at (run by recipes/slurm/grpo.sbatch through srun on the
# node): the address on GLOO_SOCKET_IFNAME when recipes/slurm/env.sh names an interface, else the first address
# `hostname -I` lists, which never holds the loopback 127.0.1.1 that a host name can resolve to.
set -euo pipefail
ifname=${GLOO_SOCKET_IFNAME:-}
if [[ -n $ifname && $ifname != ^* ]]; then
    ip -4 -o addr show dev "${ifname%%,*}" | awk '{ split($4, a, "/"); print a[1]; exit }'
else
    hostname -I | awk '{ print $1 }'
fi
