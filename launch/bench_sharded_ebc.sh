#!/usr/bin/env bash
# Sharded embedding-bag benchmark (bench/sharded_ebc.py): 2 gloo ranks on this host.
# Usage: launch/bench_sharded_ebc.sh [--batch-size 2048] [--max-rows 100000] [--dim 64] ...
set -euo pipefail
cd "$(dirname "$0")/.."

# One intra-op thread per rank: the ranks share the host's cores, and more threads than cores
# would make them fight (and the timings noisy).
export OMP_NUM_THREADS=1
# Keep large allocations on the malloc heap instead of fresh mmap()s: otherwise every step's
# big temporaries (pooled outputs, gradients, collective buffers) are unmapped when freed and
# page-faulted in again, zeroed, on the next step, which costs more than the work measured.
export MALLOC_MMAP_MAX_=0

exec torchrun --standalone --nproc_per_node 2 bench/sharded_ebc.py "$@"
