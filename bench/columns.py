"""The 2-rank table-wise output assembly alone, forward + backward: ``cat`` + block
``index_select`` (backward: zero fill + ``index_add``) against ``permute_parts`` (one slice copy
per run each way). Tables are dealt to the ranks alternately, as the planner does for equal
tables. Runs alternate between the ways, so load on a shared machine hits them alike. The
parts are views of one received buffer, as in training: their gradients are concatenated into
the buffer's by the split's backward, except with ``permute_received``, which writes it whole.
``permute_received`` copies row by row in C (``recsys_core/sparse/_native.c``) where the helper
was built; ``permute_received_torch`` is the same with its torch fallback, one strided slice
copy per run.

    python bench/columns.py [--tables 26 --dim 128 --batch 2048 --ranks 2 --repeats 30]

Prints one JSON line per dtype: median, min and max milliseconds per forward + backward, and
the CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import torch
from torchrec_program import cpu_name

from dlrm_app.training.runtime import reuse_freed_memory
from recsys_core.kernels.packed import (
    column_permutation,
    permute_parts,
    permute_received,
    select_columns_by_index,
)
from recsys_core.sparse import _native_lib


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tables", type=int, default=26)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2048, help="rows per rank")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--threads", type=int, default=1,
                        help="intra-op threads (1: as each rank of bench/train.py)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    reuse_freed_memory()  # as training does: per-step buffers stay on the heap, no page faults
    owned = [[t for t in range(args.tables) if t % args.ranks == r] for r in range(args.ranks)]
    received = [t for tables in owned for t in tables]  # rank by rank, as the all-to-all
    dims = [len(t) * args.dim for t in owned]
    start = {t: i * args.dim for i, t in enumerate(received)}
    columns = column_permutation(
        [start[t] + c for t in range(args.tables) for c in range(args.dim)]
    )
    def split(flat: torch.Tensor) -> list[torch.Tensor]:
        chunks = flat.split([args.batch * d for d in dims])
        return [c.view(args.batch, d) for c, d in zip(chunks, dims, strict=True)]

    ways = {
        "cat_index_select": lambda f: select_columns_by_index(torch.cat(split(f), 1), columns),
        "permute_parts": lambda f: permute_parts(split(f), columns),
        "permute_received": lambda f: permute_received(f, args.batch, dims, columns),
        "permute_received_torch": lambda f: permute_received(f, args.batch, dims, columns),
    }
    for name in args.dtypes.split(","):
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[name]
        # the all-to-all's output, [batch, dim] per source rank back to back, as in training
        received = torch.randn(args.batch * sum(dims), dtype=dtype, requires_grad=True)
        grad = torch.randn(args.batch, args.tables * args.dim, dtype=dtype)
        times: dict[str, list[float]] = {k: [] for k in ways}
        for i in range(args.repeats + 2):
            for way, fn in ways.items():
                received.grad = None
                torch_only = way.endswith("_torch") or not _native_lib.available()
                with _native_lib.torch_path_only() if torch_only else contextlib.nullcontext():
                    begin = time.perf_counter()
                    fn(received).backward(grad)
                if i >= 2:  # warm-up
                    times[way].append((time.perf_counter() - begin) * 1e3)
        print(json.dumps({
            "bench": "columns", "dtype": name, "tables": args.tables, "dim": args.dim,
            "batch": args.batch, "ranks": args.ranks, "threads": torch.get_num_threads(),
            "cpu": cpu_name(), "c_helper": _native_lib.available(),
            **{
                f"{way}_ms": {
                    "median": round(statistics.median(t), 2),
                    "min": round(min(t), 2), "max": round(max(t), 2),
                }
                for way, t in times.items()
            },
        }))


if __name__ == "__main__":
    main()
