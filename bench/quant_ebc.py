"""Quantized embedding-bag inference benchmark: lookup latency and table bytes per dtype.

Same tables, same ids, measured in one process under ``torch.no_grad`` (not
``torch.inference_mode``: FBGEMM 1.8's CPU training TBE, behind the fp32 baseline, has no kernel
outside autograd and raises under inference mode; the quantized collections run under both):

  fused_fp32       FusedEmbeddingBagCollection (fp32 tables, FBGEMM training TBE) fed a KJT
  quant_<dtype>    QuantEmbeddingBagCollection (FBGEMM int-n-bit TBE) fed a KJT
  raw_<dtype>      FBGEMM's IntNBitTableBatchedEmbeddingBagsCodegen on the same bytes, fed
                   (indices, offsets) directly: the kernel without our Python around it
  torch_<dtype>    QuantEmbeddingBagCollection on the pure-torch kernel (with --torch-kernel)

Prints one JSON line per (impl, batch size) with the median latency, then one line per dtype with
the bytes of every table and the relative error of the pooled outputs against fp32.
Usage: python bench/quant_ebc.py [--tables 8] [--rows 100000] [--dim 128] [--pooling 20]
                                 [--batch-sizes 1,64,512] [--iters 50] [--threads 1]
                                 [--torch-kernel]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch

# bench/ is sys.path[0] when this file runs as a script
from common import add_flags
from ebc import time_steps

from recsys_core import (
    DataType,
    EmbeddingBagConfig,
    EmbOptimType,
    FusedEmbeddingBagCollection,
    KernelBackend,
    KeyedJaggedTensor,
)
from recsys_core.inference import QuantEmbeddingBagCollection
from recsys_core.kernels import fbgemm_available
from recsys_core.kernels.quant_tbe import build_fbgemm_int_nbit_tbe

DTYPES = {"int8": DataType.INT8, "int4": DataType.INT4, "fp16": DataType.FP16}


def make_kjt(tables: int, rows: int, batch: int, pooling: int, seed: int) -> KeyedJaggedTensor:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 2 * pooling + 1, (tables * batch,), generator=gen)
    values = torch.randint(0, rows, (int(lengths.sum()),), generator=gen)
    kjt = KeyedJaggedTensor(keys=[f"f{i}" for i in range(tables)], values=values, lengths=lengths)
    kjt.offsets()  # every implementation gets precomputed offsets
    return kjt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_flags(parser, {"--tables": 8, "--rows": 100_000, "--dim": 128})
    parser.add_argument("--pooling", type=int, default=20, help="mean ids per bag")
    add_flags(parser, {"--batch-sizes": "1,64,512", "--dtypes": "int8,int4,fp16", "--iters": 50,
                       "--warmup": 5, "--seed": 0})
    parser.add_argument("--torch-kernel", action="store_true", help="also time the torch kernel")
    parser.add_argument("--threads", type=int, default=1,
                        help="intra-op threads (FBGEMM's parallel CPU kernels slow down badly when "
                             "their threads share cores with other processes)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    dtypes = [d for d in args.dtypes.split(",") if d]

    torch.manual_seed(args.seed)
    tables = [
        EmbeddingBagConfig(name=f"t{i}", num_embeddings=args.rows, embedding_dim=args.dim,
                           feature_names=[f"f{i}"])
        for i in range(args.tables)
    ]
    fused = FusedEmbeddingBagCollection(tables, EmbOptimType.EXACT_SGD, {"learning_rate": 0.01})
    fused.eval()
    impls: dict[str, tuple[str, Callable[[KeyedJaggedTensor], object]]] = {
        "fused_fp32": ("fp32", fused),
    }
    quants: dict[str, QuantEmbeddingBagCollection] = {}
    for name in dtypes:
        quant = QuantEmbeddingBagCollection.from_float(fused, DTYPES[name])
        quants[name] = quant
        impls[f"quant_{name}"] = (name, quant)
        if fbgemm_available():
            raw = build_fbgemm_int_nbit_tbe(
                quant.tbe.specs, quant.tbe.feature_table_map, list(quant.quantized_weights().values()),
                pooling_mean=False, device=torch.device("cpu"),
            )
            impls[f"raw_{name}"] = (name, lambda kjt, raw=raw: raw(kjt.values(), kjt.offsets()))
        if args.torch_kernel:
            impls[f"torch_{name}"] = (name, QuantEmbeddingBagCollection.from_float(
                fused, DTYPES[name], backend=KernelBackend.TORCH))

    common = {"bench": "quant_ebc", "tables": args.tables, "rows": args.rows, "dim": args.dim,
              "pooling": args.pooling, "threads": torch.get_num_threads()}
    with torch.no_grad():
        for batch in batch_sizes:
            kjt = make_kjt(args.tables, args.rows, batch, args.pooling, args.seed + batch)
            baseline = None
            for impl, (dtype, fn) in impls.items():
                ms = 1e3 * time_steps(lambda fn=fn, kjt=kjt: fn(kjt), args.iters, args.warmup)
                baseline = ms if impl == "fused_fp32" else baseline
                print(json.dumps({
                    **common, "impl": impl, "dtype": dtype, "batch_size": batch,
                    "ids": int(kjt.values().numel()), "latency_ms": round(ms, 4),
                    "samples_per_s": round(batch / ms * 1e3, 1),
                    "speedup_vs_fp32": round(baseline / ms, 3) if baseline else None,
                }), flush=True)

        kjt = make_kjt(args.tables, args.rows, max(batch_sizes), args.pooling, args.seed)
        reference = fused(kjt).values()
        fp32_bytes = args.rows * args.dim * 4
        for name, quant in quants.items():
            error = (quant(kjt).values() - reference).norm() / reference.norm()
            sizes = quant.table_bytes()
            print(json.dumps({
                **common, "impl": f"quant_{name}", "dtype": name,
                "bytes_per_table": sizes, "fp32_bytes_per_table": fp32_bytes,
                "compression": round(fp32_bytes * len(sizes) / sum(sizes.values()), 3),
                "relative_error_pooled": float(f"{float(error):.3g}"),
            }), flush=True)


if __name__ == "__main__":
    main()
