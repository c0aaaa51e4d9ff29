"""How long a checkpoint stops training: ``dlrm-app train``'s save (the whole write: DCP, the
files' sha256 manifest, the rename) against ``--background-checkpoints`` (the training thread
only copies the state; a thread writes it on a process group of its own), same run.

A sharded EmbeddingBagCollection (``--tables`` tables of ``--rows`` x ``--dim``, table-wise over
``--world`` gloo ranks, row-wise Adagrad state) saved through ``dlrm_app.checkpoint`` into
fresh directories, alternating in ``--rounds`` rounds (the first warms up). One JSON line per
way: the median milliseconds the training thread was held (``blocked_ms``) and until the
checkpoint was complete on disk (``complete_ms``), rank 0, and the CPU.

Usage: python bench/background_checkpoint.py [--world 2] [--tables 26] [--rows 50000]
       [--dim 64] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torchrec_program import cpu_name  # the sibling bench's (this folder is on sys.path)

from dlrm_app.checkpoint import BackgroundSaver, save_checkpoint
from recsys_core import EmbeddingBagCollection, EmbeddingBagConfig, EmbOptimType
from recsys_core.distributed import (
    EmbeddingBagCollectionSharder,
    ShardingEnv,
    construct_module_sharding_plan,
    table_wise,
)
from recsys_core.testing import run_gloo


def worker(rank: int, world: int, args: dict, out_dir: str) -> dict[str, dict[str, list]]:
    torch.set_num_threads(1)
    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=args["dim"],
                                 num_embeddings=args["rows"], feature_names=[f"f{i}"])
              for i in range(args["tables"])]
    ebc = EmbeddingBagCollection(tables=tables, device="meta")
    plan = construct_module_sharding_plan(
        ebc, {t.name: table_wise(rank=i % world, compute_kernel="fused")
              for i, t in enumerate(tables)}, world)
    sharded = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1},
    ).shard(ebc, plan, ShardingEnv.from_process_group(dist.group.WORLD), torch.device("cpu"))
    optimizer, saver = sharded.fused_optimizer, BackgroundSaver()
    times: dict[str, dict[str, list]] = {w: {"blocked_ms": [], "complete_ms": []}
                                         for w in ("foreground", "background")}
    for r in range(args["rounds"] + 1):
        for way in ("foreground", "background") if r % 2 == 0 else ("background", "foreground"):
            directory = Path(out_dir, f"{way}_{r}")
            dist.barrier()
            t0 = time.perf_counter()
            if way == "foreground":
                save_checkpoint(directory, r, model=sharded, optimizer=optimizer,
                                extra={"step": r})
                t1 = t2 = time.perf_counter()
            else:
                saver.save(directory, r, model=sharded, optimizer=optimizer, extra={"step": r})
                t1 = time.perf_counter()
                saver.wait()
                t2 = time.perf_counter()
            if r:
                times[way]["blocked_ms"].append((t1 - t0) * 1e3)
                times[way]["complete_ms"].append((t2 - t0) * 1e3)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--tables", type=int, default=26)
    p.add_argument("--rows", type=int, default=50_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = run_gloo(args.world, worker, vars(args), tmp, timeout_s=900.0)
    mb = args.tables * args.rows * args.dim * 4 / 2**20
    for way, timing in results[0].items():
        print(json.dumps({"bench": "background_checkpoint", "way": way,
                          "blocked_ms": round(statistics.median(timing["blocked_ms"]), 1),
                          "complete_ms": round(statistics.median(timing["complete_ms"]), 1),
                          "weights_mb": round(mb), "world": args.world, "cpu": cpu_name()}))


if __name__ == "__main__":
    main()
