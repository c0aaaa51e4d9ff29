#!/usr/bin/env bash
# DLRM training on one CPU machine: NPROC gloo ranks under torchrun.
# Usage: launch/train_cpu.sh NPROC DATA_DIR RUN_DIR [more `dlrm-app train` flags]
#   launch/train_cpu.sh 2 data/synthetic runs/cpu2 --batch-size 4096 --epochs 1
set -euo pipefail
nproc_per_node=${1:?usage: $0 NPROC DATA_DIR RUN_DIR [train flags]}
data=${2:?data directory (dataset.json) missing}
run=${3:?run directory missing}
shift 3
# Threads: dlrm-app chooses them per rank from the CPUs it may use (affinity, cgroup quota,
# ranks on this host, less the data loader's thread); torchrun sets OMP_NUM_THREADS=1 for
# several ranks, and an OMP_NUM_THREADS you export wins over both.
exec torchrun --standalone --nproc-per-node "$nproc_per_node" \
    -m dlrm_app train --data "$data" --out "$run" "$@"
