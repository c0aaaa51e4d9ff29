"""Zero-collision hashing (managed collisions): what the remap costs a training step.

One process, the reference sizes by default: 26 features (one table each, one id per sample),
batch 4096, ``--zch-size`` rows per table, dim ``--dim``, a fused EmbeddingBagCollection with
rowwise Adagrad. Raw ids are 64-bit values from a skewed vocabulary ``--vocab-factor`` times
larger than a table (new ids keep arriving, tables stay full and evict). One JSON line each:

  mc_ebc           ManagedCollisionEmbeddingBagCollection (LFU, ``eviction_interval`` i)
                   forward + backward per batch: remap, table updates, evicted-row resets,
                   lookup, fused update
  ebc_in_range     the same fused collection, ids already in range: forward + backward
  ebc_modulo       the same, plain hashing: ``raw % zch_size`` then forward + backward
  remap            the ManagedCollisionCollection alone (training: counting, table updates
                   every i batches, remap)
  remap_eval       the ManagedCollisionCollection in eval mode (lookups only)

``ms_per_batch`` is the median over ``--repeats`` rounds (the cases take turns) of ``--steps``
batches (at least ``eviction_interval``); ``vs_in_range_ms`` (full steps only) the difference
to ``ebc_in_range``. Every line names the CPU (``lscpu`` model name, AVX-512 /
AVX2) and the thread count.

Usage: python bench/zch.py [--zch-size 1000000] [--dim 64] [--eviction-intervals 1,100]
       python bench/zch.py --quick      # tiny sizes, for tests
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
from common import add_flags, cpu_model
from torch import nn

from recsys_core import EmbeddingBagConfig, KeyedJaggedTensor
from recsys_core.modules.fused_embedding_modules import FusedEmbeddingBagCollection
from recsys_core.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
from recsys_core.modules.mc_modules import (
    LFU_EvictionPolicy,
    ManagedCollisionCollection,
    MCHManagedCollisionModule,
)
from recsys_core.optim import EmbOptimType

_SPREAD = 0x9E3779B97F4A7C15 & ((1 << 62) - 1)  # odd: a bijection of ids mod 2**62


def cpu_info() -> dict[str, str]:
    """The CPU's model name (lscpu) and its widest vector extension."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        pass
    simd = "avx512" if " avx512f" in flags else "avx2" if " avx2" in flags else "none"
    return {"cpu": cpu_model(), "simd": simd}


def batches(args: argparse.Namespace, count: int) -> list[KeyedJaggedTensor]:
    """``count`` batches of skewed 64-bit raw ids (one per feature and sample)."""
    g = torch.Generator().manual_seed(0)
    vocab = args.zch_size * args.vocab_factor
    keys = [f"f{i}" for i in range(args.features)]
    out = []
    for _ in range(count):
        u = torch.rand(args.features * args.batch_size, generator=g, dtype=torch.float64)
        rank = (u**3 * vocab).long()  # a few ids often, most rarely
        feature = torch.arange(args.features).repeat_interleave(args.batch_size)
        raw = ((rank + feature * vocab) * _SPREAD) % (1 << 62)
        out.append(KeyedJaggedTensor(
            keys=keys, values=raw, lengths=torch.ones(raw.numel(), dtype=torch.int64)))
    return out


def build(args: argparse.Namespace, interval: int, fused: FusedEmbeddingBagCollection | None
          ) -> tuple[FusedEmbeddingBagCollection, ManagedCollisionEmbeddingBagCollection]:
    tables = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=args.dim, num_embeddings=args.zch_size,
                           feature_names=[f"f{i}"])
        for i in range(args.features)
    ]
    if fused is None:
        fused = FusedEmbeddingBagCollection(
            tables, optimizer_type=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
            optimizer_kwargs={"learning_rate": 0.01, "eps": 1e-8})
    mcc = ManagedCollisionCollection({
        c.name: MCHManagedCollisionModule(
            zch_size=args.zch_size, device=torch.device("cpu"),
            eviction_policy=LFU_EvictionPolicy(), eviction_interval=interval,
            input_hash_size=1 << 62)
        for c in tables
    }, tables)
    return fused, ManagedCollisionEmbeddingBagCollection(fused, mcc)


def timed_rounds(
    args: argparse.Namespace, cases: dict[str, tuple[Callable[[int], None], int]]
) -> dict[str, float]:
    """Median ms per batch of each case over ``repeats`` rounds; the cases take turns within
    a round, so a busy machine's drift hits them alike. A case whose tables update every
    ``interval`` batches warms up for at least one update (the tables are full) and runs at
    least ``interval`` batches per round (each round holds an update)."""
    counters = dict.fromkeys(cases, 0)
    for name, (step, interval) in cases.items():
        for _ in range(max(args.warmup, interval)):
            step(counters[name])
            counters[name] += 1
    runs: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.repeats):
        for name, (step, interval) in cases.items():
            steps = max(args.steps, interval)
            start = time.perf_counter()
            for _ in range(steps):
                step(counters[name])
                counters[name] += 1
            runs[name].append((time.perf_counter() - start) * 1000 / steps)
    return {name: statistics.median(r) for name, r in runs.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_flags(p, {"--features": 26, "--batch-size": 4096, "--zch-size": 1_000_000, "--dim": 64,
                  "--vocab-factor": 4, "--eviction-intervals": "1,100", "--steps": 10,
                  "--repeats": 3, "--warmup": 3})
    p.add_argument("--threads", type=int, default=0, help="0: torch's default")
    p.add_argument("--quick", action="store_true", help="tiny sizes (tests)")
    args = p.parse_args()
    if args.quick:
        args.features, args.batch_size, args.zch_size, args.dim = 3, 64, 50, 8
        args.steps, args.repeats, args.warmup, args.eviction_intervals = 2, 2, 1, "1,3"
    if args.threads:
        torch.set_num_threads(args.threads)
    intervals = [int(x) for x in args.eviction_intervals.split(",")]
    common = {
        "bench": "zch", "features": args.features, "batch_size": args.batch_size,
        "zch_size": args.zch_size, "dim": args.dim, "vocab_factor": args.vocab_factor,
        "threads": torch.get_num_threads(), **cpu_info(),
    }
    data = batches(args, 16)
    fused, _ = build(args, intervals[0], None)
    in_range_data = [
        KeyedJaggedTensor(keys=b.keys(), values=b.values() % args.zch_size, lengths=b.lengths())
        for b in data
    ]

    def plain(i: int) -> None:
        fused(in_range_data[i % len(data)]).values().sum().backward()

    def modulo(i: int) -> None:
        b = data[i % len(data)]
        kjt = KeyedJaggedTensor(keys=b.keys(), values=b.values() % args.zch_size, lengths=b.lengths())
        fused(kjt).values().sum().backward()

    cases: dict[str, tuple[Callable[[int], None], int]] = {
        "ebc_in_range": (plain, 1), "ebc_modulo": (modulo, 1),
    }
    for interval in intervals:
        mc = build(args, interval, fused)[1]  # the same tables behind a fresh remapping
        mcc = mc._managed_collision_collection

        def mc_step(i: int, mc: nn.Module = mc) -> None:
            mc(data[i % len(data)])[0].values().sum().backward()

        def remap(i: int, mcc: nn.Module = mcc) -> None:
            mcc(data[i % len(data)])

        cases[f"mc_ebc/{interval}"] = (mc_step, interval)
        cases[f"remap/{interval}"] = (remap, interval)
    results = timed_rounds(args, cases)
    mcc.eval()  # the last interval's collection, its tables full: lookups only
    results[f"remap_eval/{intervals[-1]}"] = timed_rounds(args, {"eval": (remap, 1)})["eval"]
    in_range = results["ebc_in_range"]
    for name, ms in results.items():
        case, _, interval = name.partition("/")
        line = {**common, "case": case, "ms_per_batch": round(ms, 3)}
        if interval:
            line["eviction_interval"] = int(interval)
        if case in ("ebc_modulo", "mc_ebc"):
            line["vs_in_range_ms"] = round(ms - in_range, 3)
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
