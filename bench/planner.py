"""Sharding-planner benchmark: planning time and plan quality, and a check of the cost model.

Prints one JSON line per case:

  plan        Criteo 1TB DLRM (26 tables, cardinalities capped at 40M rows, dim 128) on 8, 64 and
              128 CUDA ranks (8 per host), and 1000 seeded tables of mixed sizes on 128 ranks,
              each planned as the planner does (fast_first) and by the baseline that weighs
              every kernel (every_kernel), with whether the plans are the same: planning CPU
              time and quality = max rank cost / mean rank cost (1.0 is perfect
              balance; it says nothing of the total cost, which is printed too). Optimizer:
              EXACT_ROWWISE_ADAGRAD; batch 512 per rank; one-hot Criteo features.
  cost_model  FusedEmbeddingBagCollection forward + backward (CPU, FBGEMM, EXACT_ROWWISE_ADAGRAD)
              measured on this machine vs the planner's estimate for the same table on a
              one-rank CPU topology.

Usage: python bench/planner.py [--skip-cost-model] [--iters 10]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch
from criteo_sizes import CRITEO_1TB_ROWS

from recsys_core import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbOptimType,
    FusedEmbeddingBagCollection,
    KeyedJaggedTensor,
)
from recsys_core.distributed import EmbeddingBagCollectionSharder
from recsys_core.distributed.types import EmbeddingComputeKernel, ShardingType
from recsys_core.kernels import fbgemm_available
from recsys_core.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from recsys_core.planner.estimators import estimate_option
from recsys_core.planner.search import search as planner_module
from recsys_core.planner.types import Placement, TableSpec

ROW_CAP = 40_000_000
LOCAL = 8  # GPUs per host
GIB = 1024**3


def criteo_model() -> tuple[EmbeddingBagCollection, dict[str, ParameterConstraints]]:
    tables = [
        EmbeddingBagConfig(name=f"t_cat_{i}", embedding_dim=128, num_embeddings=min(r, ROW_CAP),
                           feature_names=[f"cat_{i}"])
        for i, r in enumerate(CRITEO_1TB_ROWS)
    ]
    return EmbeddingBagCollection(tables, device="meta"), {}


def mixed_model(count: int, seed: int) -> tuple[EmbeddingBagCollection, dict[str, ParameterConstraints]]:
    rng = random.Random(seed)
    tables, constraints = [], {}
    for i in range(count):
        rows = int(10 ** rng.uniform(3, 7.3))
        dim = rng.choice([16, 32, 64, 128, 256])
        tables.append(EmbeddingBagConfig(name=f"t{i}", embedding_dim=dim, num_embeddings=rows,
                                         feature_names=[f"f{i}"]))
        constraints[f"t{i}"] = ParameterConstraints(pooling_factors=[rng.choice([1, 2, 5, 10, 20, 50])])
    return EmbeddingBagCollection(tables, device="meta"), constraints


def bench_plan(case: str, world: int, model: tuple) -> None:
    """Plan ``model`` twice in this run: as the planner does (``fast_first``: where the tables
    clearly fit in memory, kernels over fast memory only, the rest only if that fails) and
    the baseline that always weighs every kernel (cached layouts too)."""
    ebc, constraints = model
    # 80 GiB GPUs on hosts of 128 GiB (16 GiB per rank)
    topology = Topology(world_size=world, compute_device="cuda", local_world_size=min(world, LOCAL),
                        hbm_cap=80 * GIB, ddr_cap=16 * GIB)
    # DLRM's usual optimizer: its row-wise state is sized, and it rules out column splits
    sharder = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.01}
    )
    plans = {}
    for mode, fraction in (("every_kernel", 0.0), ("fast_first", planner_module.MEMORY_ONLY_FRACTION)):
        saved = planner_module.MEMORY_ONLY_FRACTION
        planner_module.MEMORY_ONLY_FRACTION = fraction
        try:
            planner = EmbeddingShardingPlanner(topology=topology, batch_size=512,
                                               constraints=constraints)
            start = time.process_time()
            plan = planner.plan(ebc, [sharder])
            seconds = time.process_time() - start
        finally:
            planner_module.MEMORY_ONLY_FRACTION = saved
        plans[mode] = str(plan)
        stats = planner.stats
        assert stats is not None and len(plan.plan[""]) == len(ebc.embedding_bag_configs())
        print(json.dumps({
            "bench": "planner",
            "case": case,
            "mode": mode,
            "world_size": world,
            "tables": len(ebc.embedding_bag_configs()),
            "planning_cpu_s": round(seconds, 3),
            "quality_max_over_mean": round(stats.imbalance, 4),
            "max_rank_cost_ms": round(stats.max_cost_ms, 4),
            "total_cost_ms": round(stats.total_cost_ms, 3),
            "max_rank_hbm_gib": round(max(r.hbm_bytes for r in stats.ranks) / 2**30, 2),
            "layouts": dict(stats.layouts),
            "same_plan_as_every_kernel": plans[mode] == plans["every_kernel"],
        }), flush=True)



def bench_cost_model(rows: int, dim: int, pooling: int, batch: int, iters: int) -> None:
    config = EmbeddingBagConfig(name="t", embedding_dim=dim, num_embeddings=rows, feature_names=["f"])
    ebc = FusedEmbeddingBagCollection([config], EmbOptimType.EXACT_ROWWISE_ADAGRAD, {"learning_rate": 0.01})
    gen = torch.Generator().manual_seed(0)
    kjt = KeyedJaggedTensor(
        keys=["f"], values=torch.randint(0, rows, (batch * pooling,), generator=gen),
        lengths=torch.full((batch,), pooling),
    )
    grad = torch.randn(batch, dim, generator=gen)
    for _ in range(3):
        ebc(kjt).values().backward(grad)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        ebc(kjt).values().backward(grad)  # the optimizer step is fused into backward
        times.append(time.perf_counter() - start)
    measured = statistics.median(times) * 1e3
    spec = TableSpec(
        path="", config=config, pooled=True, optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        constraints=ParameterConstraints(), ids_per_batch=float(batch * pooling),
        bags_per_batch=float(batch), is_weighted=False,
    )
    option = estimate_option(
        spec, ShardingType.TABLE_WISE, EmbeddingComputeKernel.FUSED, Placement.ANY_RANKS,
        [rows], [dim], Topology(world_size=1, compute_device="cpu"),
    )
    estimated = float(option.cost.sum())
    print(json.dumps({
        "bench": "planner_cost_model",
        "rows": rows, "dim": dim, "pooling_factor": pooling, "batch_size": batch,
        "threads": torch.get_num_threads(),
        "estimated_ms": round(estimated, 3),
        "measured_ms": round(measured, 3),
        "measured_over_estimated": round(measured / estimated, 2),
    }), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-cost-model", action="store_true")
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    for world in (8, 64, 128):
        bench_plan("criteo_1tb_dlrm", world, criteo_model())
    bench_plan("mixed_1000_tables", 128, mixed_model(1000, seed=0))
    if args.skip_cost_model:
        return
    if not fbgemm_available():
        raise SystemExit("the cost-model check times FBGEMM kernels: install fbgemm-gpu-cpu==1.8.0")
    # FBGEMM-CPU's backward stalls (~35 ms a call on a 2-vCPU VM) until the OpenMP thread count
    # is set explicitly; setting it to its current value is enough.
    torch.set_num_threads(torch.get_num_threads())
    for rows, dim, pooling, batch in [
        (100_000, 64, 1, 2048), (1_000_000, 128, 1, 4096), (1_000_000, 128, 20, 1024),
        (10_000_000, 128, 10, 2048), (100_000, 256, 50, 512), (10_000, 32, 5, 8192),
        (1_000, 128, 20, 1024), (1_000_000, 32, 5, 8192),
    ]:
        bench_cost_model(rows, dim, pooling, batch, args.iters)


if __name__ == "__main__":
    main()
