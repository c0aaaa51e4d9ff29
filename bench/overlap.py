"""The embedding exchange overlapped with the bottom MLP, against the plain order, in one run.

``DLRM.overlap_exchange`` (dlrm_app/model.py): the bottom MLP runs while the pooled embeddings
travel between ranks, and in backward the embeddings' gradients travel while the bottom MLP's
backward runs. Both orders train the same sharded DLRM (reference sizes: 26 one-hot tables of
``--rows`` rows, dim 128, bottom 512-256-128, top 1024-1024-512-256-1) on the same generated
data, interleaved (plain, overlapped, plain, overlapped, ...), on ``--nproc`` gloo ranks of one
thread each, pipelined batches as in ``dlrm-app train``. One JSON line per precision:
samples/s of each order per round, their ratio, and whether the losses of every step are
equal (they must be: the same operations in another order).

Usage: python bench/overlap.py [--nproc 2] [--rounds 2] [--steps 20] [--batch-size 2048]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from common import add_flags


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import dlrm_app.model as model_module
    from dlrm_app.config import ModelConfig
    from dlrm_app.data.loader import ParquetLoader
    from dlrm_app.data.schema import DatasetSpec
    from dlrm_app.training.build import build_model, build_optimizer
    from dlrm_app.training.config import TrainConfig
    from dlrm_app.training.pipeline import device_batches
    from dlrm_app.training.runtime import autocast, init_distributed

    device = init_distributed(600)
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = DatasetSpec.load(args.data)
    for amp in (False, True):
        config = TrainConfig.from_flags(
            data=args.data, out=args.out, batch_size=args.batch_size, amp=amp,
            model=ModelConfig(embedding_dim=128, dense_arch_layer_sizes=(512, 256, 128),
                              over_arch_layer_sizes=(1024, 1024, 512, 256, 1),
                              wide=False))  # the reference DLRM
        rates: dict[bool, list[float]] = {False: [], True: []}
        losses: dict[bool, list[float]] = {}
        for _ in range(args.rounds):
            for overlap in (False, True):
                model_module.DLRM.overlap_exchange = overlap
                torch.manual_seed(0)
                dmp = build_model(config, spec, device)
                optimizer = build_optimizer(config.optimizer, dmp)
                loader = ParquetLoader(args.data, "train", batch_size=args.batch_size, rank=rank,
                                       world_size=world, shuffle=False, drop_last=True)
                seen, start = [], 0.0
                for i, batch in enumerate(device_batches(loader, device, dmp, True)):
                    if i == args.warmup:
                        dist.barrier()
                        start = time.perf_counter()
                    with autocast(device, amp):
                        logits = dmp(batch.dense, batch.sparse).squeeze(1)
                    loss = F.binary_cross_entropy_with_logits(logits.float(), batch.labels,
                                                              reduction="sum")
                    optimizer.zero_grad()
                    (loss / (args.batch_size * world)).backward()
                    optimizer.step()
                    seen.append(float(loss))
                    if i == args.warmup + args.steps - 1:
                        break
                dist.barrier()
                rates[overlap].append(args.steps * args.batch_size * world
                                      / (time.perf_counter() - start))
                losses[overlap] = seen
        if rank == 0:
            plain, overlapped = (max(rates[k]) for k in (False, True))
            print(json.dumps({
                "bench": "overlap_exchange", "precision": "bf16" if amp else "fp32",
                "world_size": world, "batch_size_per_rank": args.batch_size,
                "plain_samples_per_s": [round(r) for r in rates[False]],
                "overlapped_samples_per_s": [round(r) for r in rates[True]],
                "ratio_best": round(overlapped / plain, 3),
                "same_losses": losses[False] == losses[True],
            }), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_flags(parser, {"--nproc": 2, "--rounds": 2, "--steps": 20, "--warmup": 3,
                       "--batch-size": 2048})
    parser.add_argument("--rows", type=int, default=100_000, help="rows per table")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    from dlrm_app.data.synthetic import generate

    with tempfile.TemporaryDirectory() as tmp:
        rows = args.nproc * args.batch_size * (args.warmup + args.steps + 2) * 8 // 7 + 1
        generate(f"{tmp}/data", rows=rows, num_dense=13, cardinalities=[args.rows] * 26,
                 pooling_factors=[1.0] * 26, zipf_alpha=1.05, seed=0)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc-per-node", str(args.nproc), __file__, "--worker",
                        "--data", f"{tmp}/data", "--out", f"{tmp}/run",
                        "--rounds", str(args.rounds), "--steps", str(args.steps),
                        "--warmup", str(args.warmup), "--batch-size", str(args.batch_size)],
                       check=True, env=env)


if __name__ == "__main__":
    main()
