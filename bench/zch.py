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

``ms_per_batch`` is the median over ``--repeats`` runs of ``--steps`` batches; ``vs_in_range_ms``
the difference to ``ebc_in_range``. Every line names the CPU (``lscpu`` model name, AVX-512 /
AVX2) and the thread count.

Usage: python bench/zch.py [--zch-size 1000000] [--dim 64] [--eviction-intervals 1,100]
       python bench/zch.py --quick      # tiny sizes, for tests
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from collections.abc import Callable

import torch

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
    name = "unknown"
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                name = line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        pass
    simd = "avx512" if " avx512f" in flags else "avx2" if " avx2" in flags else "none"
    return {"cpu": name, "simd": simd}


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


def timed(args: argparse.Namespace, step: Callable[[int], None], interval: int = 1) -> float:
    """Median ms per batch over ``repeats`` runs of ``steps`` batches (after warm-up). With
    table updates every ``interval`` batches, the warm-up lasts at least one update (the tables
    are full) and each run at least ``interval`` batches (it holds an update)."""
    warmup, steps = max(args.warmup, interval), max(args.steps, interval)
    for i in range(warmup):
        step(i)
    runs, i = [], warmup
    for _ in range(args.repeats):
        start = time.perf_counter()
        for _ in range(steps):
            step(i)
            i += 1
        runs.append((time.perf_counter() - start) * 1000 / steps)
    return statistics.median(runs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--features", type=int, default=26)
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--zch-size", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--vocab-factor", type=int, default=4)
    p.add_argument("--eviction-intervals", default="1,100")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=3)
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

    def emit(case: str, ms: float, **extra: object) -> None:
        line = {**common, "case": case, "ms_per_batch": round(ms, 3), **extra}
        if case != "ebc_in_range":
            line["vs_in_range_ms"] = round(ms - in_range, 3)
        print(json.dumps(line), flush=True)

    fused, _ = build(args, intervals[0], None)
    in_range_data = [
        KeyedJaggedTensor(keys=b.keys(), values=b.values() % args.zch_size, lengths=b.lengths())
        for b in data
    ]

    def plain(i: int) -> None:
        fused(in_range_data[i % len(data)]).values().sum().backward()

    in_range = timed(args, plain)
    emit("ebc_in_range", in_range)

    def modulo(i: int) -> None:
        b = data[i % len(data)]
        kjt = KeyedJaggedTensor(keys=b.keys(), values=b.values() % args.zch_size, lengths=b.lengths())
        fused(kjt).values().sum().backward()

    emit("ebc_modulo", timed(args, modulo))

    for interval in intervals:
        _, mc = build(args, interval, fused)

        def mc_step(i: int, mc: ManagedCollisionEmbeddingBagCollection = mc) -> None:
            mc(data[i % len(data)])[0].values().sum().backward()

        emit("mc_ebc", timed(args, mc_step, interval), eviction_interval=interval)
        mcc = build(args, interval, fused)[1]._managed_collision_collection

        def remap(i: int, mcc: ManagedCollisionCollection = mcc) -> None:
            mcc(data[i % len(data)])

        emit("remap", timed(args, remap, interval), eviction_interval=interval)
        if interval == intervals[-1]:
            mcc.eval()
            emit("remap_eval", timed(args, remap), eviction_interval=interval)


if __name__ == "__main__":
    main()
