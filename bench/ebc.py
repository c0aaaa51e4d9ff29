"""Embedding-bag training-step benchmark on a Criteo-like workload.

One step = forward + backward + optimizer update, same ids and output gradient for every
implementation, measured in the same process:

  torch_dense_sgd      26 x nn.EmbeddingBag (dense gradients) + torch.optim.SGD
  torch_sparse_adam    26 x nn.EmbeddingBag(sparse=True) + torch.optim.SparseAdam
  fbgemm_tbe           raw FBGEMM SplitTableBatchedEmbeddingBagsCodegen (EXACT_SGD)
  recsys_core_fused    FusedEmbeddingBagCollection (EXACT_SGD, FBGEMM kernel) fed a KJT
  recsys_core_torch    FusedEmbeddingBagCollection on the pure-torch kernel (fallback)

Prints one JSON line per (implementation, hotness) with samples/s and the ratio to raw FBGEMM.
Usage: python bench/ebc.py [--batch-size 4096] [--max-rows 1000000] [--dim 128] [--iters 5]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from collections.abc import Callable

import torch
from common import add_flags
from torch import nn

from recsys_core import (
    EmbeddingBagConfig,
    EmbOptimType,
    FusedEmbeddingBagCollection,
    KernelBackend,
    KeyedJaggedTensor,
    PoolingType,
)
from recsys_core.kernels import fbgemm_available
from recsys_core.kernels.config import FusedOptimizerConfig
from recsys_core.kernels.tbe import build_table_batched_embedding

# Criteo Kaggle (DLRM) cardinalities of the 26 categorical features.
CRITEO_ROWS = [
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27,
    14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
]
LR = 0.01


def make_batch(rows: list[int], batch: int, mean_pooling: int, seed: int) -> KeyedJaggedTensor:
    gen = torch.Generator().manual_seed(seed)
    keys = [f"cat_{i}" for i in range(len(rows))]
    if mean_pooling <= 1:
        lengths = torch.ones(len(rows) * batch, dtype=torch.int64)
    else:  # uniform in [0, 2 * mean] -> mean pooling factor ~= mean
        lengths = torch.randint(0, 2 * mean_pooling + 1, (len(rows) * batch,), generator=gen)
    values = torch.cat([
        torch.randint(0, r, (int(lengths[i * batch : (i + 1) * batch].sum()),), generator=gen)
        for i, r in enumerate(rows)
    ])
    kjt = KeyedJaggedTensor(keys=keys, values=values, lengths=lengths)
    kjt.offsets()  # every implementation gets precomputed offsets
    return kjt


def time_steps(step: Callable[[], object], iters: int, warmup: int = 2) -> float:
    """Median seconds of one ``step`` over ``iters`` timed calls after ``warmup`` untimed."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def feature_slices(kjt: KeyedJaggedTensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for jt in kjt.to_dict().values():
        out.append((jt.values(), jt.offsets()))
    return out


def bench_torch(rows: list[int], dim: int, kjt: KeyedJaggedTensor, grad: torch.Tensor, sparse: bool, iters: int) -> float:
    bags = nn.ModuleList(
        nn.EmbeddingBag(r, dim, mode="sum", sparse=sparse, include_last_offset=True) for r in rows
    )
    opt = torch.optim.SparseAdam(bags.parameters(), lr=LR) if sparse else torch.optim.SGD(bags.parameters(), lr=LR)
    inputs = feature_slices(kjt)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        out = torch.cat([bag(v, o) for bag, (v, o) in zip(bags, inputs, strict=True)], dim=1)
        out.backward(grad)
        opt.step()

    return time_steps(step, iters)


def bench_raw_fbgemm(rows: list[int], dim: int, kjt: KeyedJaggedTensor, grad: torch.Tensor, iters: int) -> float:
    kernel = build_table_batched_embedding(
        rows=rows, dims=[dim] * len(rows), feature_table_map=list(range(len(rows))),
        pooling_mean=False, optimizer=FusedOptimizerConfig(learning_rate=LR),
        device=torch.device("cpu"), backend=KernelBackend.FBGEMM,
    )
    tbe = kernel._emb_module  # the raw FBGEMM module, no wrapper in the timed path
    values, offsets = kjt.values(), kjt.offsets()

    def step() -> None:
        tbe(values, offsets).backward(grad)

    return time_steps(step, iters)


def bench_fused(rows: list[int], dim: int, kjt: KeyedJaggedTensor, grad: torch.Tensor, backend: KernelBackend, iters: int) -> float:
    tables = [
        EmbeddingBagConfig(name=f"t_{i}", embedding_dim=dim, num_embeddings=r, feature_names=[k], pooling=PoolingType.SUM)
        for i, (r, k) in enumerate(zip(rows, kjt.keys(), strict=True))
    ]
    ebc = FusedEmbeddingBagCollection(tables, EmbOptimType.EXACT_SGD, {"learning_rate": LR}, backend=backend)
    opt = ebc.fused_optimizer

    def step() -> None:
        ebc(kjt).values().backward(grad)
        opt.step()

    return time_steps(step, iters)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_flags(parser, {"--batch-size": 4096, "--max-rows": 1_000_000, "--dim": 128, "--iters": 5})
    parser.add_argument("--pooling", default="1,20", help="mean pooling factors to run (1 = one-hot)")
    parser.add_argument(
        "--impls",
        default="fbgemm_tbe,recsys_core_fused,recsys_core_torch,torch_sparse_adam,torch_dense_sgd",
    )
    args = parser.parse_args()
    rows = [min(r, args.max_rows) for r in CRITEO_ROWS]
    impls = args.impls.split(",")
    if not fbgemm_available():
        impls = [i for i in impls if i not in ("fbgemm_tbe", "recsys_core_fused")]
    for pooling in [int(p) for p in args.pooling.split(",")]:
        kjt = make_batch(rows, args.batch_size, pooling, seed=0)
        grad = torch.randn(args.batch_size, args.dim * len(rows), generator=torch.Generator().manual_seed(1))
        results: dict[str, float] = {}
        for impl in impls:
            if impl == "torch_dense_sgd":
                sec = bench_torch(rows, args.dim, kjt, grad, sparse=False, iters=args.iters)
            elif impl == "torch_sparse_adam":
                sec = bench_torch(rows, args.dim, kjt, grad, sparse=True, iters=args.iters)
            elif impl == "fbgemm_tbe":
                sec = bench_raw_fbgemm(rows, args.dim, kjt, grad, args.iters)
            elif impl == "recsys_core_fused":
                sec = bench_fused(rows, args.dim, kjt, grad, KernelBackend.FBGEMM, args.iters)
            elif impl == "recsys_core_torch":
                sec = bench_fused(rows, args.dim, kjt, grad, KernelBackend.TORCH, args.iters)
            else:
                raise SystemExit(f"unknown implementation {impl!r}; choose from {parser.get_default('impls')}")
            results[impl] = sec
            gc.collect()
        raw, dense = results.get("fbgemm_tbe"), results.get("torch_dense_sgd")
        for impl, sec in results.items():
            print(json.dumps({
                "bench": "ebc_train_step",
                "impl": impl,
                "mean_pooling_factor": pooling,
                "ids_per_batch": int(kjt.values().numel()),
                "batch_size": args.batch_size,
                "tables": len(rows),
                "total_rows": sum(rows),
                "dim": args.dim,
                "step_ms": round(sec * 1e3, 2),
                "samples_per_s": round(args.batch_size / sec, 1),
                "ratio_to_raw_fbgemm": None if raw is None else round(raw / sec, 3),
                "speedup_vs_torch_dense": None if dense is None else round(dense / sec, 2),
                "malloc_mmap_max": os.environ.get("MALLOC_MMAP_MAX_"),
                "threads": torch.get_num_threads(),
            }), flush=True)


if __name__ == "__main__":
    main()
