#!/usr/bin/env bash
# DLRM training on one multi-GPU machine: one NCCL rank per GPU under torchrun.
# Usage: launch/train_gpu.sh DATA_DIR RUN_DIR [more `dlrm-app train` flags]
#   NGPUS=4 launch/train_gpu.sh data/criteo_1tb runs/gpu4 --batch-size 8192 --amp
set -euo pipefail
data=${1:?usage: $0 DATA_DIR RUN_DIR [train flags]}
run=${2:?run directory missing}
shift 2
ngpus=${NGPUS:-$(nvidia-smi -L | wc -l)}
if [ "$ngpus" -lt 1 ]; then
    echo "no GPU found (nvidia-smi -L is empty); use launch/train_cpu.sh" >&2
    exit 1
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
exec torchrun --standalone --nproc-per-node "$ngpus" \
    -m dlrm_app train --data "$data" --out "$run" "$@"
