"""Criteo preprocessing throughput against the parse limit and a plain-Python parser.

Writes a seeded random Criteo-format TSV (``--rows`` rows, some missing fields) and its .gz
into a temp dir, then prints one JSON line per (input, impl):

  ours          dlrm_app.data.criteo.preprocess_criteo (parse + transform + Parquet shards),
                once per ``--workers`` count (``rows_per_s_per_worker`` is rows_per_s / workers)
  pyarrow_bare  pyarrow.csv.read_csv of the same file, no transforms (the parse limit)
  plain_python  line.split('\\t') + int()/log1p/int(h, 16) per field (reference DLRM style)

``ratio_to_pyarrow`` is ours / pyarrow_bare in rows/s (target >= 0.6). Output shards hold
``--rows-per-shard`` rows (default 100,000: several shards per split, as real datasets have;
workers write whole shards of plain input in parallel, so one huge shard would be serial).
Usage: python bench/preprocess.py [--rows 1000000] [--workers 1 2] [--rows-per-shard N]
[--skip-python]
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow.csv as pacsv

from dlrm_app.data.criteo import preprocess_criteo


def write_tsv(path: Path, rows: int, seed: int) -> None:
    """A Criteo-shaped TSV: 0/1 labels, small skewed ints, 8-hex-digit ids, ~5% missing."""
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for start in range(0, rows, 100_000):
            n = min(100_000, rows - start)
            label = rng.integers(0, 2, n).astype(str)
            dense = rng.geometric(0.01, (n, 13)).astype(str)
            dense[rng.random((n, 13)) < 0.05] = ""
            cats = np.char.mod("%08x", rng.integers(0, 2**32, (n, 26), dtype=np.uint64))
            cats[rng.random((n, 26)) < 0.05] = ""
            table = np.concatenate([label[:, None], dense, cats], axis=1)
            f.write("\n".join("\t".join(r) for r in table.tolist()) + "\n")


def plain_python(path: Path, n_emb: int) -> int:
    rows = 0
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        for line in f:
            x = line.rstrip("\n").split("\t")
            x += [""] * (40 - len(x))
            _ = (int(x[0]), [math.log1p(max(int(v), 0)) if v else 0.0 for v in x[1:14]],
                 [int(h, 16) % n_emb if h else 0 for h in x[14:]])
            rows += 1
    return rows


def bare_pyarrow(path: Path) -> int:
    opts = pacsv.ParseOptions(delimiter="\t", quote_char=False)
    read = pacsv.ReadOptions(column_names=[f"c{i}" for i in range(40)])
    return pacsv.read_csv(path, read, opts).num_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2],
                        help="worker process counts to run ours with")
    parser.add_argument("--rows-per-shard", type=int, default=100_000)
    parser.add_argument("--skip-python", action="store_true", help="skip the slow baseline")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tsv = Path(tmp) / "day_0.tsv"
        write_tsv(tsv, args.rows, args.seed)
        gz = Path(tmp) / "day_0.tsv.gz"
        gz.write_bytes(gzip.compress(tsv.read_bytes(), compresslevel=6))
        mb = tsv.stat().st_size / 1e6
        for path in (tsv, gz):
            impls: dict[tuple[str, int | None], Callable[[], int]] = {
                ("pyarrow_bare", None): lambda p=path: bare_pyarrow(p)}
            for w in args.workers:
                impls[("ours", w)] = lambda p=path, w=w: sum(s.rows for s in preprocess_criteo(
                    [p], Path(tmp) / f"out-{p.suffix}-{w}", num_embeddings_per_feature=1000,
                    rows_per_shard=args.rows_per_shard, workers=w).splits)
            if not args.skip_python:
                impls[("plain_python", None)] = lambda p=path: plain_python(p, 1000)
            bare = 0.0
            for (name, workers), fn in impls.items():
                start = time.perf_counter()
                rows = fn()
                seconds = time.perf_counter() - start
                line = {"bench": "preprocess_criteo", "input": path.name, "impl": name,
                        "rows": rows, "seconds": round(seconds, 3),
                        "rows_per_s": round(rows / seconds),
                        "mb_per_s": round(mb / seconds, 1)}
                if name == "pyarrow_bare":
                    bare = rows / seconds
                else:
                    line["ratio_to_pyarrow"] = round(rows / seconds / bare, 3)
                if workers is not None:
                    line["rows_per_shard"] = args.rows_per_shard
                    line["workers"] = workers
                    line["rows_per_s_per_worker"] = round(rows / seconds / workers)
                print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
