"""Sharded embedding-bag training-step benchmark: TW / RW / CW / DP over gloo (world size 2).

The Criteo-like workload of ``bench/ebc.py`` (its CRITEO_ROWS capped by ``--max-rows``, one
feature per table, ``--batch-size`` samples per rank, mean pooling factor ``--pooling``) is
sharded over the ranks of a torchrun job in each of these ways, all with the same fused
optimizer:

  tw   table_wise: tables sorted by rows, dealt to ranks in snake order (0, 1, 1, 0, ...)
  rw   row_wise: every table in row blocks on every rank
  cw   column_wise: every table in ``world`` column blocks, block j on rank j
  dp   data_parallel: a replica per rank, table gradients all-reduced in backward

One step = forward (input dist -> lookup -> output dist) + backward (with the fused update);
each rank feeds its own batch (seed ``--seed + rank``) and the same output gradient every step.
Rank 0 prints one JSON line per sharding type with:

  step_ms / samples_per_s   the un-instrumented step (median over --iters of the slowest rank;
                            ranks meet at a barrier before each step, outside the timed region);
                            samples/s is global: world * batch / step time
  phases_ms                 input_dist / lookup / output_dist / backward measured SERIALIZED in a
                            separate instrumented step, with a barrier after each phase (so each
                            phase includes waiting for the slowest rank and nothing overlaps)
  bytes_per_step            computed from the data and the plan, not measured (see traffic())

and, first, one line for the unsharded FusedEmbeddingBagCollection on one rank's batch (rank 0
alone; the other ranks wait at a barrier), the baseline that ``speedup_vs_unsharded`` refers to.

Usage (2 ranks on this host; defaults finish in a few minutes on 2 CPU cores):
  launch/bench_sharded_ebc.sh [--batch-size 2048] [--max-rows 100000] [--dim 64] [--iters 5]
Full Criteo Kaggle size (33.8M rows; ~8.6 GB of fp32 weights at dim 64, held whole by the
unsharded baseline on rank 0, split by tw/rw/cw; dp would replicate and all-reduce every table
each step, so leave it out):
  launch/bench_sharded_ebc.sh --max-rows 100000000 --batch-size 4096 --dim 64 --types tw,rw,cw
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

# bench/ is sys.path[0] when this file runs as a script (as torchrun runs it)
from ebc import CRITEO_ROWS, LR, make_batch

from recsys_core import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbOptimType,
    FusedEmbeddingBagCollection,
    JaggedTensor,
    KeyedJaggedTensor,
    PoolingType,
)
from recsys_core.distributed import (
    EmbeddingBagCollectionSharder,
    EmbeddingModuleShardingPlan,
    ShardedEmbeddingBagCollection,
    ShardingEnv,
    ShardingType,
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    shm_comm,
    table_wise,
)
from recsys_core.distributed.sharding_plan import ParameterShardingGenerator
from recsys_core.kernels.tbe import kernel_backend

SHARDING_TYPES = {
    "tw": ShardingType.TABLE_WISE,
    "rw": ShardingType.ROW_WISE,
    "cw": ShardingType.COLUMN_WISE,
    "dp": ShardingType.DATA_PARALLEL,
}
OPTIMIZERS = {"sgd": EmbOptimType.EXACT_SGD, "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD}
FLOAT_BYTES = 4  # pooled embeddings and their gradients are fp32
BYTES_NOTE = (
    "computed, not measured; per_rank: the rank's send buffer of the collective (including "
    "the slice it keeps); remote: the part addressed to other ranks (all-gather: input x "
    "(world-1)); input_dist = lengths + values (+ weights) of the KJT all-to-all, not counting "
    "the 2 int64 split sizes per destination; output_dist = pooled all-to-all (tw, cw) + "
    "reduce-scatter input (rw); backward = the reverse all-to-all / all-gather; dp_allreduce = "
    "per data-parallel table, the touched rows padded to the most any rank touched (int64 id + "
    "fp32 row) when world * that < rows, else rows * (dim + 1) fp32 (gradient + touched flag)"
)


def table_configs(rows: Sequence[int], dim: int) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            name=f"t_{i}", embedding_dim=dim, num_embeddings=r, feature_names=[f"cat_{i}"],
            pooling=PoolingType.SUM,
        )
        for i, r in enumerate(rows)
    ]


def plan_generators(
    kind: str, configs: Sequence[EmbeddingBagConfig], world: int
) -> dict[str, ParameterShardingGenerator]:
    if kind == "tw":
        # Largest first, snake order: both the table count and the rows stay balanced.
        by_rows = sorted(configs, key=lambda c: -c.num_embeddings)
        snake = [p % (2 * world) for p in range(len(by_rows))]
        ranks = [p if p < world else 2 * world - 1 - p for p in snake]
        return {c.name: table_wise(rank=r, compute_kernel="fused") for c, r in zip(by_rows, ranks, strict=True)}
    if kind == "rw":
        return {c.name: row_wise(compute_kernel="fused") for c in configs}
    if kind == "cw":
        return {c.name: column_wise(ranks=list(range(world)), compute_kernel="fused") for c in configs}
    return {c.name: data_parallel(compute_kernel="fused") for c in configs}


@dataclass(frozen=True)
class Traffic:
    """Bytes one rank hands to one kind of collective in one step."""

    buffer: int  # the send buffer, including the slice the rank keeps
    remote: int | None  # the part addressed to other ranks (None: depends on the algorithm)


def traffic(
    plan: EmbeddingModuleShardingPlan,
    configs: Sequence[EmbeddingBagConfig],
    features: KeyedJaggedTensor,
    rank: int,
    world: int,
) -> dict[str, Traffic]:
    """What this rank sends per step, from its batch and the plan (mirrors the strategies).

    Table/column-wise: each feature's lengths and ids go to every rank holding a shard of its
    table; each rank sends the pooled ``[batch, cols]`` of its shards back to every rank.
    Row-wise: lengths go to every rank, each id to the rank owning its row; the reduce-scatter
    input is ``[world * batch, sum of dims]``. Data-parallel: no forward traffic.
    """
    batch = features.stride()
    weights = features.weights_or_none()
    lengths_bytes = features.lengths().element_size()
    id_bytes = features.values().element_size() + (0 if weights is None else weights.element_size())
    per_feature = features.to_dict()
    input_buffer = input_remote = rw_dim = dp_bytes = 0
    tw_dims = [0] * world  # pooled columns computed on each rank (table/column-wise)
    for config in configs:
        sharding = plan[config.name]
        kind = sharding.sharding_type
        if kind is ShardingType.DATA_PARALLEL:
            dp_bytes += dp_exchange_bytes(config, per_feature, world)
            continue
        for feature in config.feature_names:
            ids = per_feature[feature].values()
            for shard in sharding.shards:
                if kind is ShardingType.ROW_WISE:
                    lo = shard.shard_offsets[0]
                    n = int(((ids >= lo) & (ids < lo + shard.shard_sizes[0])).sum())
                else:
                    n = ids.numel()
                    tw_dims[shard.rank] += shard.shard_sizes[1]
                sent = batch * lengths_bytes + n * id_bytes
                input_buffer += sent
                input_remote += sent if shard.rank != rank else 0
            if kind is ShardingType.ROW_WISE:
                rw_dim += config.embedding_dim
    pooled = batch * FLOAT_BYTES
    mine, total = tw_dims[rank], sum(tw_dims)
    return {
        "input_dist": Traffic(input_buffer, input_remote),
        "output_dist": Traffic(
            pooled * (world * mine + world * rw_dim),
            pooled * ((world - 1) * mine + (world - 1) * rw_dim),
        ),
        "backward": Traffic(
            pooled * (total + rw_dim),
            pooled * (total - mine + (world - 1) * rw_dim),
        ),
        "dp_allreduce": Traffic(dp_bytes, None),
    }


def dp_exchange_bytes(
    config: EmbeddingBagConfig, per_feature: dict[str, JaggedTensor], world: int
) -> int:
    """Bytes this rank sends to sum a data-parallel table's gradient (mirrors the strategy):
    when ``world * most_touched < rows`` it all-gathers its touched rows padded to the most any
    rank touched (int64 id + fp32 row each), else it all-reduces ``[rows, dim + 1]`` fp32."""
    ids = torch.cat([per_feature[f].values() for f in config.feature_names])
    most = torch.tensor([torch.unique(ids).numel()])
    if dist.is_initialized():
        dist.all_reduce(most, op=dist.ReduceOp.MAX)  # the strategy decides on the global max
    most_rows = int(most)
    if world * most_rows < config.num_embeddings:
        return most_rows * (8 + config.embedding_dim * FLOAT_BYTES)
    return config.num_embeddings * (config.embedding_dim + 1) * FLOAT_BYTES


@dataclass(frozen=True)
class RankReport:
    """What each rank contributes to rank 0's JSON line for one sharding type."""

    traffic: dict[str, Traffic]
    ids: int  # ids in the rank's batch
    params: int  # rows * cols of the shards it holds
    backends: list[str]  # its lookup kernels' backends (fbgemm / torch)


def summarize(per_rank: list[dict[str, Traffic]]) -> dict[str, dict[str, object]]:
    out: dict[str, dict[str, object]] = {}
    for name in per_rank[0]:
        buffers = [t[name].buffer for t in per_rank]
        remotes = [t[name].remote for t in per_rank]
        known = all(r is not None for r in remotes)
        out[name] = {
            "per_rank": buffers,
            "total": sum(buffers),
            "remote_per_rank": remotes if known else None,
            "remote_total": sum(r or 0 for r in remotes) if known else None,
        }
    return out


def time_steps(step: Callable[[], None], iters: int, warmup: int, sync: bool) -> list[float]:
    """Seconds per step; with ``sync`` the ranks meet at a barrier before each (untimed)."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(iters):
        if sync:
            dist.barrier()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return times


def slowest_rank(times: Sequence[float]) -> list[float]:
    t = torch.tensor(list(times), dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def phased_step(
    sharded: ShardedEmbeddingBagCollection,
    features: KeyedJaggedTensor,
    grad: torch.Tensor,
    dims: Mapping[str, int],
) -> dict[str, float]:
    """One step split into phases with a barrier after each: the calls of ``forward`` /
    ``compute_and_output_dist``, reordered so that every strategy finishes a phase first."""
    strategies = sharded.strategies
    keys = features.keys()
    marks: list[float] = []

    def mark() -> None:
        dist.barrier()
        marks.append(time.perf_counter())

    mark()
    received = [a.wait() for a in sharded.input_dist(features)]
    mark()
    pooled = [s.lookup(kjt) for s, kjt in zip(strategies, received, strict=True)]
    mark()
    parts = [
        s.output_dist(p, features.permute([keys.index(f) for f in s.output_features])).wait()
        for s, p in zip(strategies, pooled, strict=True)
    ]
    values = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    order = [f for s in strategies for f in s.output_features]
    if order != keys:  # back to the key order, as the module's awaitable does
        start = {f: sum(dims[g] for g in order[: order.index(f)]) for f in order}
        columns = torch.tensor([start[f] + d for f in keys for d in range(dims[f])])
        values = values.index_select(1, columns)
    mark()
    values.backward(grad)
    sharded.fused_optimizer.step()
    mark()
    names = ["input_dist", "lookup", "output_dist", "backward"]
    durations = [b - a for a, b in zip(marks[:-1], marks[1:], strict=True)]
    return dict(zip(names, durations, strict=True))


def bench_sharded(
    kind: str,
    configs: list[EmbeddingBagConfig],
    features: KeyedJaggedTensor,
    grad: torch.Tensor,
    fused_params: dict[str, object],
    args: argparse.Namespace,
) -> dict[str, object] | None:
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    rank, world = env.rank, env.world_size
    # Built on meta: each rank materializes only its own shards.
    ebc = EmbeddingBagCollection(configs, device="meta")
    plan = construct_module_sharding_plan(
        ebc, plan_generators(kind, configs, world), world, env.local_world_size
    )
    sharded = EmbeddingBagCollectionSharder(fused_params=fused_params).shard(
        ebc, plan, env, torch.device("cpu")
    )
    opt = sharded.fused_optimizer

    def step() -> None:
        sharded(features).wait().values().backward(grad)
        opt.step()

    step_times = slowest_rank(time_steps(step, args.iters, args.warmup, sync=True))
    dims = {f: c.embedding_dim for c in configs for f in c.feature_names}
    phased_step(sharded, features, grad, dims)  # warm-up of the instrumented path
    phases = [phased_step(sharded, features, grad, dims) for _ in range(args.iters)]
    phase_ms = {
        name: round(statistics.median(slowest_rank([p[name] for p in phases])) * 1e3, 2)
        for name in phases[0]
    }
    shards = [sh for lk in sharded.lookups for group in lk.kernel_shards for sh in group]
    local = RankReport(
        traffic=traffic(plan, configs, features, rank, world),
        ids=int(features.values().numel()),
        params=sum(sh.rows * sh.cols for sh in shards),
        backends=sorted({kernel_backend(k).value for lk in sharded.lookups for k in lk.kernels}),
    )
    gathered: list[RankReport] = [local] * world
    dist.all_gather_object(gathered, local)
    if rank != 0:
        return None
    sec = statistics.median(step_times)
    return {
        "impl": f"sharded_{kind}",
        "sharding_type": SHARDING_TYPES[kind].value,
        "world_size": world,
        "step_ms": round(sec * 1e3, 2),
        "samples_per_s": round(world * args.batch_size / sec, 1),
        "phases_ms": phase_ms,
        "phases_sum_ms": round(sum(phase_ms.values()), 2),
        "phases_measured": "serialized (barrier after each phase; median of the slowest rank)",
        "bytes_per_step": summarize([g.traffic for g in gathered]),
        "bytes_note": BYTES_NOTE,
        "ids_per_rank": [g.ids for g in gathered],
        "local_params_per_rank": [g.params for g in gathered],
        "kernel_backends_per_rank": [g.backends for g in gathered],
    }


def bench_unsharded(
    configs: list[EmbeddingBagConfig],
    features: KeyedJaggedTensor,
    grad: torch.Tensor,
    optimizer: EmbOptimType,
    args: argparse.Namespace,
) -> float:
    ebc = FusedEmbeddingBagCollection(configs, optimizer, {"learning_rate": LR})
    opt = ebc.fused_optimizer

    def step() -> None:
        ebc(features).values().backward(grad)
        opt.step()

    return statistics.median(time_steps(step, args.iters, args.warmup, sync=False))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=2048, help="samples per rank")
    parser.add_argument("--max-rows", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--pooling", type=int, default=1, help="mean pooling factor (1 = one-hot)")
    parser.add_argument("--tables", type=int, default=len(CRITEO_ROWS), help="first N tables")
    parser.add_argument("--types", default="tw,rw,cw,dp", help=f"from {','.join(SHARDING_TYPES)}")
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="sgd")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    kinds = args.types.split(",")
    unknown = [k for k in kinds if k not in SHARDING_TYPES]
    if unknown:
        raise SystemExit(f"unknown sharding type(s) {unknown}; choose from {list(SHARDING_TYPES)}")
    if not 1 <= args.tables <= len(CRITEO_ROWS):
        raise SystemExit(f"--tables must be in [1, {len(CRITEO_ROWS)}], got {args.tables}")
    if "RANK" not in os.environ:
        raise SystemExit("run under torchrun, e.g. launch/bench_sharded_ebc.sh (2 ranks)")
    # comm.py calls reduce_scatter_tensor / all_gather_into_tensor, which torch 2.13 deprecates:
    # a note about the library, not about this run, so keep it out of the benchmark's output.
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = [min(r, args.max_rows) for r in CRITEO_ROWS[: args.tables]]
    configs = table_configs(rows, args.dim)
    features = make_batch(rows, args.batch_size, args.pooling, seed=args.seed + rank)
    gen = torch.Generator().manual_seed(args.seed + 1000 + rank)
    grad = torch.randn(args.batch_size, args.dim * len(rows), generator=gen)
    optimizer = OPTIMIZERS[args.optimizer]
    common = {
        "bench": "sharded_ebc_train_step",
        "backend": dist.get_backend(),
        # shm: the collectives go through shared memory (all ranks on this host);
        # RECSYS_SHM_COMM=0 in the environment keeps them on the backend
        "transport": ("shm" if world > 1 and shm_comm.for_group(dist.group.WORLD,
                                                                torch.device("cpu")) is not None
                      else dist.get_backend()),
        "mean_pooling_factor": args.pooling,
        "batch_size_per_rank": args.batch_size,
        "tables": len(rows),
        "total_rows": sum(rows),
        "dim": args.dim,
        "optimizer": optimizer.value,
        "learning_rate": LR,
        "iters": args.iters,
        "seed": args.seed,
        "malloc_mmap_max": os.environ.get("MALLOC_MMAP_MAX_"),
        "threads": torch.get_num_threads(),
    }
    baseline = None
    if rank == 0:
        baseline = bench_unsharded(configs, features, grad, optimizer, args)
        gc.collect()
        print(json.dumps({
            **common,
            "impl": "unsharded_fused",
            "world_size": 1,
            "step_ms": round(baseline * 1e3, 2),
            "samples_per_s": round(args.batch_size / baseline, 1),
            "note": f"rank 0 alone on its batch while the other {world - 1} rank(s) wait",
        }), flush=True)
    dist.barrier()
    fused_params: dict[str, object] = {"optimizer": optimizer, "learning_rate": LR}
    for kind in kinds:
        result = bench_sharded(kind, configs, features, grad, fused_params, args)
        gc.collect()  # free this type's shards before building the next
        if result is not None and baseline is not None:
            rate = result["samples_per_s"]
            assert isinstance(rate, float)
            speedup = rate * baseline / args.batch_size
            result["speedup_vs_unsharded"] = round(speedup, 3)
            print(json.dumps({**common, **result}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
