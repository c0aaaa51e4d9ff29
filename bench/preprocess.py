"""Criteo preprocessing throughput against the parse limit and a plain-Python parser.

Writes a seeded random Criteo-format TSV (``--rows`` rows, some missing fields) and its .gz
into a temp dir, then prints one JSON line per (input, impl, encoding):

  ours          dlrm_app.data.criteo.preprocess_criteo (parse + transform + Parquet shards),
                once per ``--workers`` count (``rows_per_s_per_worker`` is rows_per_s /
                workers; ``threads``: tasks at a time per process, two in one process where
                two CPUs are usable, one for gzip input) and encoding: ``hash``
                (num_embeddings_per_feature=1000) and ``vocabulary`` (the default: a counting
                pass over the train split, then tables sized from it; ``ratio_to_hash``
                compares the two, ``table_rows`` is the rows it made)
  pyarrow_bare  pyarrow.csv.read_csv of the same file, no transforms (the parse limit)
  plain_python  line.split('\\t') + int()/log1p/int(h, 16) per field (reference DLRM style)

``ratio_to_pyarrow`` is ours / pyarrow_bare in rows/s (target >= 0.6). Output shards hold
``--rows-per-shard`` rows (default 100,000: several shards per split, as real datasets have;
workers write whole shards of plain input in parallel, so one huge shard would be serial).
``--ids uniform`` (default) draws every categorical id uniformly from 32 bits: nearly every id
is distinct, the worst case for the vocabulary; ``--ids skewed`` draws Zipf-distributed ids
(a few ids in most rows, a long tail), closer to the real data.
``--repeat R`` runs every (workers, encoding) R times, interleaved (1, 2, 1, 2, ...: a shared
machine's load hits every count alike), and then prints one ``"stat": "median"`` line per
(input, workers, encoding) with the median seconds over the R runs; ``--inputs`` and
``--encodings`` pick what to run.
Usage: python bench/preprocess.py [--rows 1000000] [--workers 1 2] [--rows-per-shard N]
[--ids uniform|skewed] [--skip-python] [--repeat R] [--inputs plain gzip]
[--encodings hash vocabulary]
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
from dlrm_app.data.criteo.workers import task_threads
from dlrm_app.data.schema import DatasetSpec
from dlrm_app.data.tables import table_summary


def write_tsv(path: Path, rows: int, seed: int, ids: str = "uniform") -> None:
    """A Criteo-shaped TSV: 0/1 labels, small skewed ints, 8-hex-digit ids, ~5% missing."""
    rng = np.random.default_rng(seed)
    # skewed: feature k's ids are Zipf ranks (exponent 1.05 .. 2.3) scattered over 32 bits
    alpha = 1.05 + 0.05 * np.arange(26)
    with open(path, "w") as f:
        for start in range(0, rows, 100_000):
            n = min(100_000, rows - start)
            label = rng.integers(0, 2, n).astype(str)
            dense = rng.geometric(0.01, (n, 13)).astype(str)
            dense[rng.random((n, 13)) < 0.05] = ""
            if ids == "uniform":
                raw = rng.integers(0, 2**32, (n, 26), dtype=np.uint64)
            else:
                raw = (rng.zipf(alpha, (n, 26)).astype(np.uint64) * np.uint64(2654435761)
                       + np.arange(26, dtype=np.uint64)) % np.uint64(2**32)
            cats = np.char.mod("%08x", raw)
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


def _line(path: Path, name: str, rows: int, seconds: float, mb: float) -> dict:
    return {"bench": "preprocess_criteo", "input": path.name, "impl": name, "rows": rows,
            "seconds": round(seconds, 3), "rows_per_s": round(rows / seconds),
            "mb_per_s": round(mb / seconds, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2],
                        help="worker process counts to run ours with")
    parser.add_argument("--rows-per-shard", type=int, default=100_000)
    parser.add_argument("--ids", choices=("uniform", "skewed"), default="uniform",
                        help="categorical ids: uniform over 32 bits or Zipf-skewed")
    parser.add_argument("--skip-python", action="store_true", help="skip the slow baseline")
    parser.add_argument("--repeat", type=int, default=1,
                        help="runs of each (workers, encoding), interleaved; medians at the end")
    parser.add_argument("--inputs", nargs="+", choices=("plain", "gzip"),
                        default=["plain", "gzip"])
    parser.add_argument("--encodings", nargs="+", choices=("hash", "vocabulary"),
                        default=["hash", "vocabulary"])
    args = parser.parse_args()
    table_summary([])  # its one-time import is not preprocessing time (no torch since issue 30)
    sizing = {"hash": {"num_embeddings_per_feature": 1000}, "vocabulary": {}}
    with tempfile.TemporaryDirectory() as tmp:
        tsv = Path(tmp) / "day_0.tsv"
        write_tsv(tsv, args.rows, args.seed, args.ids)
        mb = tsv.stat().st_size / 1e6
        paths = [tsv] if "plain" in args.inputs else []
        if "gzip" in args.inputs:
            gz = Path(tmp) / "day_0.tsv.gz"
            gz.write_bytes(gzip.compress(tsv.read_bytes(), compresslevel=6))
            paths.append(gz)
        for path in paths:
            impls: dict[tuple[str, int | None, str | None], Callable[[], DatasetSpec | int]] = {
                ("pyarrow_bare", None, None): lambda p=path: bare_pyarrow(p)}
            for w in dict.fromkeys(args.workers):
                for encoding in args.encodings:
                    impls[("ours", w, encoding)] = lambda p=path, w=w, e=encoding: \
                        preprocess_criteo([p], Path(tmp) / f"out-{p.suffix}-{w}-{e}",
                                          rows_per_shard=args.rows_per_shard, workers=w,
                                          **sizing[e])
            if not args.skip_python:
                impls[("plain_python", None, None)] = lambda p=path: plain_python(p, 1000)
            times: dict[tuple[str, int | None, str | None], list[float]] = {}
            rows_of: dict[tuple[str, int | None, str | None], int] = {}
            for run in range(args.repeat):
                for key, fn in impls.items():
                    if key[0] == "plain_python" and run:
                        continue  # the slow baseline once
                    start = time.perf_counter()
                    result = fn()
                    seconds = time.perf_counter() - start
                    spec = result if isinstance(result, DatasetSpec) else None
                    rows = result if spec is None else sum(s.rows for s in spec.splits)
                    times.setdefault(key, []).append(seconds)
                    rows_of[key] = rows
                    line = {**_line(path, key[0], rows, seconds, mb), "run": run}
                    if spec is not None:
                        line |= {"workers": key[1], "threads": task_threads([path], key[1]),
                                 "encoding": key[2],
                                 "table_rows": (spec.tables or {})["total_rows"]}
                    print(json.dumps(line), flush=True)
            _print_medians(path, times, rows_of, mb, args)


def _print_medians(path: Path, times: dict, rows_of: dict, mb: float,
                   args: argparse.Namespace) -> None:
    """One line per impl: median seconds, compared with the bare parse (and hashing)."""
    median = {k: float(np.median(v)) for k, v in times.items()}
    bare = rows_of[("pyarrow_bare", None, None)] / median[("pyarrow_bare", None, None)]
    for (name, workers, encoding), seconds in median.items():
        rows = rows_of[(name, workers, encoding)]
        line = {**_line(path, name, rows, seconds, mb), "stat": "median",
                "runs": len(times[(name, workers, encoding)])}
        if name != "pyarrow_bare":
            line["ratio_to_pyarrow"] = round(rows / seconds / bare, 3)
        if workers is not None:
            line |= {"encoding": encoding, "rows_per_shard": args.rows_per_shard,
                     "workers": workers, "rows_per_s_per_worker": round(rows / seconds / workers),
                     "ids": args.ids}
            one = median.get((name, args.workers[0], encoding))
            if workers != args.workers[0] and one is not None:
                line[f"speedup_over_{args.workers[0]}"] = round(one / seconds, 3)
            hashed = median.get((name, workers, "hash"))
            if encoding == "vocabulary" and hashed is not None:
                line["ratio_to_hash"] = round(hashed / seconds, 3)
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
