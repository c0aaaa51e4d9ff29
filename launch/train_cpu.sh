#!/usr/bin/env bash
# DLRM training on one CPU machine: NPROC gloo ranks under torchrun.
# Usage: launch/train_cpu.sh NPROC DATA_DIR RUN_DIR [more `dlrm-app train` flags]
#   launch/train_cpu.sh 2 data/synthetic runs/cpu2 --batch-size 4096 --epochs 1
set -euo pipefail
nproc_per_node=${1:?usage: $0 NPROC DATA_DIR RUN_DIR [train flags]}
data=${2:?data directory (dataset.json) missing}
run=${3:?run directory missing}
shift 3
# Split the cores between the ranks: more threads than cores makes the ranks fight.
cores=$(nproc)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( cores / nproc_per_node > 0 ? cores / nproc_per_node : 1 ))}
exec torchrun --standalone --nproc-per-node "$nproc_per_node" \
    -m dlrm_app train --data "$data" --out "$run" "$@"
