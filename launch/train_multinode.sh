#!/usr/bin/env bash
# DLRM training over several machines: run this once on every node, with the same endpoint.
# Rendezvous is torchrun's c10d store on RDZV_HOST:RDZV_PORT (the first node is a good choice);
# the run directory must be on a file system every node sees (checkpoints are written by all
# ranks and committed by rank 0).
# Usage: launch/train_multinode.sh NNODES NODE_RANK RDZV_HOST:RDZV_PORT NPROC_PER_NODE \
#            DATA_DIR RUN_DIR [more `dlrm-app train` flags]
# NNODES may be a range MIN:MAX (elastic): a node that leaves restarts the group on the nodes
# left (at least MIN), which resumes from the newest checkpoint on the new world size; a node
# that joins does the same. MAX_RESTARTS (default 3) bounds the restarts.
#   node 0: launch/train_multinode.sh 2 0 10.0.0.1:29500 8 /shared/criteo /shared/runs/a
#   node 1: launch/train_multinode.sh 2 1 10.0.0.1:29500 8 /shared/criteo /shared/runs/a
# GPUs: NCCL is chosen automatically when CUDA is available, gloo otherwise.
set -euo pipefail
nnodes=${1:?usage: $0 NNODES NODE_RANK HOST:PORT NPROC_PER_NODE DATA_DIR RUN_DIR [flags]}
node_rank=${2:?node rank missing}
endpoint=${3:?rendezvous HOST:PORT missing}
nproc_per_node=${4:?processes per node missing}
data=${5:?data directory missing}
run=${6:?run directory missing}
shift 6
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec torchrun --nnodes "$nnodes" --node-rank "$node_rank" --nproc-per-node "$nproc_per_node" \
    --max-restarts "${MAX_RESTARTS:-3}" \
    --rdzv-backend c10d --rdzv-endpoint "$endpoint" --rdzv-id "${RDZV_ID:-dlrm}" \
    ${RDZV_CONF:+--rdzv-conf "$RDZV_CONF"} \
    -m dlrm_app train --data "$data" --out "$run" "$@"
