"""Sharded state dicts and checkpoint saves on several ranks: the global layouts gathered once
against torch's per-tensor construction, in the same run.

A sharded EmbeddingBagCollection (``--tables`` tables of ``--rows`` x ``--dim``, row-wise
Adagrad state per row; table-wise over the ranks, or ``--sharding row_wise``) on
``--world`` gloo ranks on this host. Per implementation, alternating in ``--rounds`` rounds:

  layouts          recsys_core as shipped: each tensor's global ``ShardedTensorMetadata``
                   comes from ``GlobalLayouts`` (one ``all_gather_object`` for the whole
                   collection, on its first export; none after)
  per_tensor       the same module with the layouts switched off: every weight and optimizer
                   state built by torch's ``init_from_local_shards`` (an all-gather of its
                   metadata per tensor, per call), what the exports did before

Timed (median ms over the rounds, rank 0; every rank does the same work):

  state_dict_ms    ``module.state_dict()`` + ``fused_optimizer.state_dict()`` (what a
                   checkpoint save, and a load's template, builds first)
  save_ms          ``recsys_core.distributed.checkpoint.save`` of both into a fresh directory
                   (DCP planning, writing the files, its own collectives)

One JSON line per (impl, timing); ``ratio_to_baseline`` is per_tensor's time over ours;
``same_checkpoint``: the two implementations' checkpoints of the last round hold the same data
files, byte for byte, and the same DCP metadata (tensors, chunks, where each is stored; all but
the save's own id and path): the layouts change how the state is described to DCP, not what
is saved.
Usage: python bench/checkpoint.py [--world 2] [--tables 52] [--rows 10000] [--dim 16]
[--rounds 7] [--sharding table_wise]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torchrec_program import cpu_name  # the sibling bench's (lscpu model + vector extension)

from recsys_core import EmbeddingBagCollection, EmbeddingBagConfig, EmbOptimType
from recsys_core.distributed import (
    EmbeddingBagCollectionSharder,
    ShardingEnv,
    checkpoint,
    construct_module_sharding_plan,
    row_wise,
    sharded_state,
    table_wise,
)
from recsys_core.testing import run_gloo

IMPLS = ("layouts", "per_tensor")


def worker(rank: int, world: int, args: dict, out_dir: str) -> dict[str, dict[str, list[float]]]:
    torch.set_num_threads(1)
    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=args["dim"],
                                 num_embeddings=args["rows"], feature_names=[f"f{i}"])
              for i in range(args["tables"])]
    ebc = EmbeddingBagCollection(tables=tables, device="meta")
    generators = {t.name: (row_wise(compute_kernel="fused") if args["sharding"] == "row_wise"
                           else table_wise(rank=i % world, compute_kernel="fused"))
                  for i, t in enumerate(tables)}
    plan = construct_module_sharding_plan(ebc, generators, world)
    sharded = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1},
    ).shard(ebc, plan, ShardingEnv.from_process_group(dist.group.WORLD), torch.device("cpu"))
    optimizer = sharded.fused_optimizer
    layouts_get = sharded_state.GlobalLayouts.get
    times: dict[str, dict[str, list[float]]] = {i: {"state_dict_ms": [], "save_ms": []}
                                                for i in IMPLS}
    for r in range(args["rounds"] + 1):  # the first round warms up (and gathers the layouts)
        for impl in (IMPLS if r % 2 == 0 else IMPLS[::-1]):
            sharded_state.GlobalLayouts.get = (  # type: ignore[method-assign]
                layouts_get if impl == "layouts" else (lambda self, table, name: None))
            try:
                dist.barrier()
                t0 = time.perf_counter()
                sharded.state_dict()
                optimizer.state_dict()
                t1 = time.perf_counter()
                dist.barrier()
                t2 = time.perf_counter()
                checkpoint.save(os.path.join(out_dir, f"{impl}_{r}"), model=sharded,
                                optimizer=optimizer)
                t3 = time.perf_counter()
            finally:
                sharded_state.GlobalLayouts.get = layouts_get  # type: ignore[method-assign]
            if r:
                times[impl]["state_dict_ms"].append((t1 - t0) * 1e3)
                times[impl]["save_ms"].append((t3 - t2) * 1e3)
    return times


def _contents(directory: Path) -> tuple[dict[str, str], tuple]:
    """(sha256 of each data file, the DCP metadata less the save's id and path)."""
    files = {f.name: hashlib.sha256(f.read_bytes()).hexdigest()
             for f in sorted(directory.iterdir()) if f.is_file() and f.name != ".metadata"}
    meta = FileSystemReader(str(directory)).read_metadata()
    return files, (meta.state_dict_metadata, meta.storage_data, meta.planner_data)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--tables", type=int, default=52,
                   help="default 52: the DLRM's 26 tables and its wide part's 26 on Criteo")
    p.add_argument("--rows", type=int, default=10_000)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--sharding", choices=["table_wise", "row_wise"], default="table_wise")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = run_gloo(args.world, worker, vars(args), tmp, timeout_s=600.0)
        last = args.rounds
        same = _contents(Path(tmp, f"layouts_{last}")) == _contents(Path(tmp, f"per_tensor_{last}"))
    rank0 = results[0]
    for timing in ("state_dict_ms", "save_ms"):
        base = statistics.median(rank0["per_tensor"][timing])
        for impl in IMPLS:
            ms = statistics.median(rank0[impl][timing])
            print(json.dumps({
                "bench": "sharded_checkpoint", "impl": impl, "timing": timing,
                "ms": round(ms, 2), "ms_rounds": [round(t, 2) for t in rank0[impl][timing]],
                "ratio_to_baseline": round(base / ms, 2) if impl == "layouts" else None,
                "world": args.world, "tables": args.tables, "rows": args.rows, "dim": args.dim,
                "sharding": args.sharding, "rounds": args.rounds, "same_checkpoint": same,
                "cpu": cpu_name(),
                "load_avg_1m": round(os.getloadavg()[0], 2),
            }), flush=True)


if __name__ == "__main__":
    main()
