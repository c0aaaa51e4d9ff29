"""How long a checkpoint stops training: ``dlrm-app train``'s save (the whole write: DCP, the
files' sha256 manifest, the rename) against ``--background-checkpoints`` (the training thread
only copies the state; a thread writes it on a process group of its own), same run.

A sharded EmbeddingBagCollection (``--tables`` tables of ``--rows`` x ``--dim``, table-wise over
``--world`` gloo ranks, row-wise Adagrad state) saved through ``dlrm_app.training.checkpoint`` into
fresh directories, alternating in ``--rounds`` rounds (the first warms up). One JSON line per
way: the median milliseconds the training thread was held (``blocked_ms``) and until the
checkpoint was complete on disk (``complete_ms``), rank 0, and the CPU.

Then what training feels (``--batch`` > 0): training steps of the same collection (a batch of
``--batch`` ids per table, pooled, a sum loss, the fused optimizer's update in backward), first
``--steps`` without a save (``step_ms_no_save``), then as many with a background save started
before the first of them, enough to cover a whole save (``step_ms_during_save``: the mean of the
steps that ran while it was writing, on rank 0), and the same with the save in the foreground
(``step_ms_with_foreground_save``: the stall spread over the same number of steps). The ratios
to ``step_ms_no_save`` are what ``--background-checkpoints`` is for: 1.0 would be a free save.

Usage: python bench/background_checkpoint.py [--world 2] [--tables 26] [--rows 50000]
       [--dim 64] [--rounds 5] [--batch 2048] [--steps 20] [--writer-nice N]
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
from common import add_flags  # a sibling module (this folder is on sys.path)
from torchrec_program import cpu_name  # the sibling bench's (this folder is on sys.path)

from dlrm_app.training import checkpoint
from dlrm_app.training.checkpoint import BackgroundSaver, save_checkpoint
from recsys_core import EmbeddingBagCollection, EmbeddingBagConfig, EmbOptimType, KeyedJaggedTensor
from recsys_core.distributed import (
    EmbeddingBagCollectionSharder,
    ShardingEnv,
    construct_module_sharding_plan,
    table_wise,
)
from recsys_core.testing import run_gloo


def worker(rank: int, world: int, args: dict, out_dir: str) -> dict[str, dict[str, list]]:
    torch.set_num_threads(1)
    if args["writer_nice"] is not None:
        checkpoint.WRITER_NICE = args["writer_nice"]
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
    if args["batch"]:
        times["steps"] = _steps(sharded, optimizer, saver, tables, args, out_dir,
                                statistics.median(times["background"]["complete_ms"]))
    return times


def _steps(sharded: torch.nn.Module, optimizer: object, saver: BackgroundSaver,
           tables: list, args: dict, out_dir: str, save_ms: float) -> dict[str, float]:
    """Step times without a save, during a background save, and with a foreground one."""
    gen = torch.Generator().manual_seed(dist.get_rank())
    keys = [f"f{i}" for i in range(len(tables))]

    def step() -> float:
        ids = torch.randint(0, args["rows"], (len(keys) * args["batch"],), generator=gen)
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=keys, values=ids, lengths=torch.ones(len(ids), dtype=torch.int32))
        t0 = time.perf_counter()
        sharded(kjt).values().sum().backward()  # the fused optimizer updates in backward
        return (time.perf_counter() - t0) * 1e3

    for _ in range(3):
        step()
    base = [step() for _ in range(args["steps"])]
    # steps enough to cover a whole save (the same count on every rank: they exchange ids)
    need = torch.tensor([save_ms / statistics.median(base) * 1.5 + 2])
    dist.all_reduce(need, op=dist.ReduceOp.MAX)
    n = int(need.item())
    dist.barrier()
    saver.save(Path(out_dir, "steps_bg"), 1, model=sharded, optimizer=optimizer,
               extra={"step": 1})
    during = []
    for _ in range(n):
        writing = saver.writing
        ms = step()
        if writing:
            during.append(ms)
    saver.wait()
    dist.barrier()
    t0 = time.perf_counter()
    save_checkpoint(Path(out_dir, "steps_fg"), 1, model=sharded, optimizer=optimizer,
                    extra={"step": 1})
    stall = (time.perf_counter() - t0) * 1e3
    after = [step() for _ in range(n)]  # the same span: n steps, the stall in front
    return {"step_ms_no_save": statistics.mean(base),
            "step_ms_during_save": statistics.mean(during) if during else float("nan"),
            "steps_during_save": len(during),
            "step_ms_with_foreground_save": (sum(after) + stall) / n,
            "steps_per_save_span": n}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_flags(p, {"--world": 2, "--tables": 26, "--rows": 50_000, "--dim": 64, "--rounds": 5})
    p.add_argument("--batch", type=int, default=2048, help="ids per table a step; 0: no steps")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--writer-nice", type=int, default=None,
                   help="the writer thread's nice value (default: dlrm_app.training.checkpoint's)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = run_gloo(args.world, worker, vars(args), tmp, timeout_s=900.0)
    mb = args.tables * args.rows * args.dim * 4 / 2**20
    steps = results[0].pop("steps", None)
    for way, timing in results[0].items():
        print(json.dumps({"bench": "background_checkpoint", "way": way,
                          "blocked_ms": round(statistics.median(timing["blocked_ms"]), 1),
                          "complete_ms": round(statistics.median(timing["complete_ms"]), 1),
                          "weights_mb": round(mb), "world": args.world, "cpu": cpu_name()}))
    if steps is not None:
        base = steps["step_ms_no_save"]
        print(json.dumps({"bench": "background_checkpoint", "way": "training_steps",
                          **{k: round(v, 2) for k, v in steps.items()},
                          "ratio_during_background_save": round(
                              steps["step_ms_during_save"] / base, 3),
                          "ratio_with_foreground_save": round(
                              steps["step_ms_with_foreground_save"] / base, 3),
                          "batch_per_table": args.batch, "weights_mb": round(mb),
                          "writer_nice": (checkpoint.WRITER_NICE if args.writer_nice is None
                                          else args.writer_nice),
                          "world": args.world, "cpu": cpu_name()}))


if __name__ == "__main__":
    main()
