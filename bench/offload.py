"""Tables larger than the memory budget: training through the cached kernel against the same
model fully in memory, in one run.

Each case runs in its own process (so its peak RSS is its own): a sharded EmbeddingBagCollection
of ``--tables`` one-hot tables (``--rows`` x ``--dim``, row-wise Adagrad fused into backward)
feeding a linear layer, trained on batches of ``--batch`` rows with the pipeline's prefetch:

  memory   every table FUSED (in RAM): the baseline, where it fits on a bigger budget
  cached   every table fused_uvm_caching: backing files under --offload-dir, caches sized so
           that the process stays within --budget-gib; run twice, with every row read back from
           the files checked against its checksum (``verify``: true, the default) and without
           (false), to measure what the checks cost

ids are uniform or Zipf-skewed (``--zipf`` exponent, hot ids scattered over the table). Prints
one JSON line per case: samples/s, the ratio to the in-memory baseline with the same ids, the
cache hit rate, bytes read from and written to the backing files per step, peak RSS against
the budget, the setup time (filling the tables), the time of the flush that checks every row
before an export (``flush_s``), and the CPU (``lscpu``'s model name).

Usage: python bench/offload.py [--tables 8] [--rows 2000000] [--dim 64] [--batch 4096]
                               [--budget-gib 1.0] [--steps 20] [--zipf 1.05] [--offload-dir DIR]
                               [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
from common import add_flags, cpu_model
from torch import nn

from recsys_core import EmbeddingBagCollection, EmbeddingBagConfig, EmbOptimType, KeyedJaggedTensor
from recsys_core.distributed import (
    EmbeddingBagCollectionSharder,
    ShardingEnv,
    construct_module_sharding_plan,
    table_wise,
)
from recsys_core.distributed.table_init import SeededUniformInit
from recsys_core.distributed.train_pipeline import pipelined_batches
from recsys_core.kernels.cached_tbe import BOOKKEEPING_BYTES_PER_ROW, BOOKKEEPING_BYTES_PER_SLOT
from recsys_core.plan.params import CacheParams

GIB = 1024**3
# What the process holds besides the caches: torch and the FBGEMM libraries, the batches,
# the optimizer buffers, the backing pages of the blocks being moved (measured: the in-memory
# case's peak RSS less its tables is 0.54 GiB at the default sizes).
RUNTIME_BYTES = int(0.6 * GIB)


class Batches:
    """Batch ``i`` of the stream, made when asked for (seeded by ``i``, so every case sees the
    same ids at the same step); ``seconds`` is the time spent making them, which the
    measurement subtracts."""

    def __init__(self, args: argparse.Namespace, first: int, count: int) -> None:
        self.args, self.first, self.count = args, first, count
        rng = np.random.default_rng(7)
        self.perm = [rng.permutation(args.rows) for _ in range(args.tables)]
        self.seconds = 0.0

    def __iter__(self):
        for i in range(self.first, self.first + self.count):
            start = time.perf_counter()
            kjt = self.make(i)
            self.seconds += time.perf_counter() - start
            yield kjt

    def make(self, i: int) -> KeyedJaggedTensor:
        args = self.args
        rng = np.random.default_rng(1000 + i)
        ids = []
        for t in range(args.tables):
            if args.skew == "zipf":
                rank = (rng.zipf(args.zipf, args.batch) - 1) % args.rows
                ids.append(self.perm[t][rank])
            else:
                ids.append(rng.integers(0, args.rows, args.batch))
        values = torch.from_numpy(np.concatenate(ids).astype(np.int64))
        lengths = torch.ones(args.tables * args.batch, dtype=torch.int64)
        kjt = KeyedJaggedTensor(keys=[f"f{t}" for t in range(args.tables)], values=values,
                                lengths=lengths)
        kjt.offsets()
        return kjt


def load_factor(args: argparse.Namespace) -> float:
    rows = args.tables * args.rows
    row_bytes = 4 * (args.dim + 1)  # fp32 row + row-wise Adagrad state
    free = args.budget_gib * GIB - RUNTIME_BYTES - rows * BOOKKEEPING_BYTES_PER_ROW
    return max(0.001, min(1.0, free / (rows * (row_bytes + BOOKKEEPING_BYTES_PER_SLOT))))


def run_case(args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    verify = getattr(args, "verify_rows", "on") == "on"
    cached = args.case == "cached"
    configs = [
        EmbeddingBagConfig(name=f"t{t}", embedding_dim=args.dim, num_embeddings=args.rows,
                           feature_names=[f"f{t}"])
        for t in range(args.tables)
    ]
    ebc = EmbeddingBagCollection(configs, device=torch.device("meta"))
    kernel = "fused_uvm_caching" if cached else "fused"
    plan = construct_module_sharding_plan(
        ebc, {c.name: table_wise(rank=0, compute_kernel=kernel) for c in configs}, 1
    )
    lf = load_factor(args) if cached else None
    if cached:
        for c in configs:
            plan[c.name].cache_params = CacheParams(load_factor=lf)
    start = time.perf_counter()
    sharded = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05},
        table_init=SeededUniformInit(seed=1), offload_dir=args.offload_dir,
    ).shard(ebc, plan, ShardingEnv.from_local(1, 0))
    setup_s = time.perf_counter() - start
    head = nn.Linear(args.tables * args.dim, 1)
    dense_opt = torch.optim.SGD(head.parameters(), lr=0.01)
    labels = torch.randint(0, 2, (args.batch, 1), generator=torch.Generator().manual_seed(3)).float()
    kernels = [k for lk in sharded.lookups for k in lk.cached_kernels()]
    for k in kernels:
        k.set_row_verification(verify)
    # The cached case warms up until its caches are full (steady state: every miss evicts),
    # at most --max-warmup steps; the in-memory case is then measured on the same batches.
    first = 0 if cached else max(args.skip - args.warmup, 0)
    count = (args.max_warmup if cached else args.warmup) + args.steps
    data = Batches(args, first, count)
    warm = None if cached else first + args.warmup
    measured_from, start, made = None, 0.0, 0.0
    steps = 0
    stream = pipelined_batches(data, sharded, to_device=lambda b: b, features=lambda b: b)
    for i, kjt in enumerate(stream, start=first):
        if warm is None and (i >= first + args.max_warmup or (
                i >= args.warmup and all(k.occupancy() >= 1.0 for k in kernels))):
            warm = i
        if i == warm:
            for k in kernels:
                k.reset_stats()
            measured_from, start, made = i, time.perf_counter(), data.seconds
        if measured_from is not None and i >= measured_from + args.steps:
            break
        pooled = sharded(kjt).wait().values()
        loss = nn.functional.binary_cross_entropy_with_logits(head(pooled), labels)
        dense_opt.zero_grad()
        loss.backward()
        dense_opt.step()
        if measured_from is not None:
            steps += 1
    elapsed = time.perf_counter() - start - (data.seconds - made)
    stream.close()
    flushed = time.perf_counter()
    for k in kernels:
        k.flush()  # write back, and (verify) check every row of the files
    flush_s = time.perf_counter() - flushed
    stats = [k.stats for k in kernels]
    lookups = sum(s.lookups for s in stats)
    return {
        "case": args.case,
        "verify": verify if cached else None,
        "ids": args.skew,
        "samples_per_s": round(args.batch * steps / elapsed, 1),
        "step_ms": round(1e3 * elapsed / max(steps, 1), 2),
        "measured_from_step": measured_from,
        "load_factor": None if lf is None else round(lf, 4),
        "hit_rate": None if not kernels else round(1 - sum(s.misses for s in stats) / max(lookups, 1), 4),
        "id_hit_rate": None if not kernels else round(
            sum(s.id_hits for s in stats) / max(sum(s.ids for s in stats), 1), 4),
        "read_mb_per_step": None if not kernels else round(sum(s.bytes_read for s in stats) / steps / 1e6, 2),
        "written_mb_per_step": None if not kernels else round(sum(s.bytes_written for s in stats) / steps / 1e6, 2),
        "prefetched_share": None if not kernels else round(
            sum(s.prefetched for s in stats) / (len(kernels) * steps), 3),
        "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2, 3),
        "budget_gib": args.budget_gib,
        "tables_gib": round(args.tables * args.rows * 4 * (args.dim + 1) / GIB, 3),
        "setup_s": round(setup_s, 1),
        "flush_s": round(flush_s, 3) if cached else None,
        "cpu": cpu_model(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(parser, {"--tables": 8, "--rows": 2_000_000, "--dim": 64, "--batch": 4096,
                       "--budget-gib": 1.0, "--steps": 20, "--warmup": 5})
    parser.add_argument("--max-warmup", type=int, default=150,
                        help="most steps the cached case warms up for (until its caches are full)")
    parser.add_argument("--skip", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--zipf", type=float, default=1.05)
    parser.add_argument("--offload-dir", default=None)
    parser.add_argument("--quick", action="store_true",
                        help="small tables (8 x 100k rows) and budget, for a smoke run")
    parser.add_argument("--case", choices=["memory", "cached"], help=argparse.SUPPRESS)
    parser.add_argument("--skew", choices=["uniform", "zipf"], help=argparse.SUPPRESS)
    parser.add_argument("--verify-rows", choices=["on", "off"], default="on",
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.rows, args.batch, args.steps, args.warmup = 50_000, 1024, 6, 2
        # the runtime's allowance, the bookkeeping and caches of a quarter of the rows
        args.budget_gib = (RUNTIME_BYTES + args.tables * args.rows * (
            BOOKKEEPING_BYTES_PER_ROW + (4 * (args.dim + 1) + BOOKKEEPING_BYTES_PER_SLOT) / 4)) / GIB
    if args.case:
        print(json.dumps(run_case(args)), flush=True)
        return
    offload_dir = args.offload_dir or tempfile.mkdtemp(prefix="offload_bench_")
    base = [sys.executable, os.path.abspath(__file__), "--tables", str(args.tables),
            "--rows", str(args.rows), "--dim", str(args.dim), "--batch", str(args.batch),
            "--budget-gib", str(args.budget_gib), "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--zipf", str(args.zipf), "--offload-dir", offload_dir]
    for skew in ("zipf", "uniform"):
        results = {}
        for case, verify in (("cached", "on"), ("cached", "off"), ("memory", "on")):
            extra = ["--case", case, "--skew", skew, "--max-warmup", str(args.max_warmup),
                     "--verify-rows", verify]
            if case == "memory":
                extra += ["--skip", str(results["on"]["measured_from_step"])]
            out = subprocess.run(base + extra, capture_output=True, text=True, check=False)
            if out.returncode:
                raise SystemExit(f"case {case}/{skew} failed:\n{out.stderr[-3000:]}")
            results[verify if case == "cached" else case] = json.loads(
                out.stdout.strip().splitlines()[-1])
        memory = results["memory"]
        print(json.dumps(memory), flush=True)
        for verify in ("off", "on"):
            cached = results[verify]
            cached["vs_memory"] = round(cached["samples_per_s"] / memory["samples_per_s"], 3)
            cached["rss_within_budget"] = cached["peak_rss_gib"] <= args.budget_gib
            if verify == "on":  # the checksums' cost: same ids, same steps, one run apart
                cached["vs_unverified"] = round(
                    cached["samples_per_s"] / results["off"]["samples_per_s"], 3)
            print(json.dumps(cached), flush=True)

if __name__ == "__main__":
    main()
