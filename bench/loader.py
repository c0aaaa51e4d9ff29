"""ParquetLoader throughput against a naive per-row Python reader, in the same run.

Data: ``dlrm_app.data.synthetic.generate`` with Criteo's shape (13 dense, 26 sparse features;
``--multi-hot`` makes the last 13 multi-hot with mean pooling factor 10), written to a temp dir
unless ``--data DIR`` points at an existing dataset (generated there if it has no dataset.json).

Implementations (one JSON line each: batches/s and rows/s over the train split):

  parquet_loader      ParquetLoader, prefetch thread on (the training path)
  parquet_loader_sync ParquetLoader, prefetch=0 (conversion cost alone, no overlap)
  parquet_loader_shuffle  ParquetLoader, prefetch on, shuffle=True (row groups shuffled, rows
                      permuted within the default shuffle window: batches gather rows)
  naive_pylist        pyarrow reads each row group, ``to_pylist()``, then per-row Python loops
                      build lengths/values lists and ``torch.tensor`` them (what a first
                      version usually does); timed on ``--naive-batches`` batches only

Usage: python bench/loader.py [--rows 1000000] [--batch-size 4096] [--multi-hot] [--data DIR]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq
import torch

from dlrm_app.data.loader import ParquetLoader
from dlrm_app.data.schema import DATASET_JSON, DENSE_COLUMN, DatasetSpec
from dlrm_app.data.synthetic import generate
from recsys_core.sparse.keyed_jagged_tensor import KeyedJaggedTensor

NUM_SPARSE = 26
NUM_DENSE = 13


def _ensure_data(directory: Path, rows: int, multi_hot: bool) -> DatasetSpec:
    if (directory / DATASET_JSON).is_file():
        return DatasetSpec.load(directory)
    pooling = [1.0] * NUM_SPARSE
    if multi_hot:
        pooling[NUM_SPARSE // 2:] = [10.0] * (NUM_SPARSE - NUM_SPARSE // 2)
    # train gets (nearly) all rows: the benchmark reads only the train split
    return generate(directory, rows=rows, num_dense=NUM_DENSE,
                    cardinalities=[100_000] * NUM_SPARSE, pooling_factors=pooling,
                    splits=(0.98, 0.01, 0.01), seed=0)


def _time_loader(directory: Path, batch_size: int, prefetch: int,
                 shuffle: bool = False) -> tuple[int, int, float]:
    loader = ParquetLoader(directory, "train", batch_size=batch_size, prefetch=prefetch,
                           shuffle=shuffle)
    start = time.perf_counter()
    batches = rows = 0
    for batch in loader:
        batches += 1
        rows += batch.labels.shape[0]
    return batches, rows, time.perf_counter() - start


def _time_naive(directory: Path, spec: DatasetSpec, batch_size: int,
                max_batches: int) -> tuple[int, int, float]:
    keys = [f.name for f in spec.sparse_features]
    start = time.perf_counter()
    batches = rows = 0
    buffer: list[dict] = []
    for shard in spec.split("train").shards:
        f = pq.ParquetFile(directory / shard.file)
        for g in range(f.num_row_groups):
            buffer += f.read_row_group(g).to_pylist()
            while len(buffer) >= batch_size and batches < max_batches:
                part, buffer = buffer[:batch_size], buffer[batch_size:]
                lengths = [len(r[k]) for k in keys for r in part]
                values = [i for k in keys for r in part for i in r[k]]
                torch.tensor([r[DENSE_COLUMN] for r in part], dtype=torch.float32)
                torch.tensor([r[spec.label] for r in part], dtype=torch.float32)
                KeyedJaggedTensor(keys=keys, values=torch.tensor(values, dtype=torch.int64),
                                  lengths=torch.tensor(lengths, dtype=torch.int32),
                                  stride=batch_size)
                batches += 1
                rows += batch_size
            if batches >= max_batches:
                return batches, rows, time.perf_counter() - start
    return batches, rows, time.perf_counter() - start


def _report(impl: str, batch_size: int, multi_hot: bool, result: tuple[int, int, float]) -> None:
    batches, rows, seconds = result
    print(json.dumps({
        "bench": "loader", "impl": impl, "batch_size": batch_size, "multi_hot": multi_hot,
        "batches": batches, "rows": rows, "seconds": round(seconds, 3),
        "batches_per_s": round(batches / seconds, 1), "rows_per_s": round(rows / seconds),
        "threads": torch.get_num_threads(),
    }), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--batch-size", type=int, default=4096)
    parser.add_argument("--multi-hot", action="store_true")
    parser.add_argument("--naive-batches", type=int, default=20)
    parser.add_argument("--data", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        directory = args.data if args.data is not None else Path(tmp)
        spec = _ensure_data(directory, args.rows, args.multi_hot)
        multi_hot = any(f.multi_hot for f in spec.sparse_features)
        _time_loader(directory, args.batch_size, 2)  # warm the page cache and allocator
        _report("parquet_loader", args.batch_size, multi_hot,
                _time_loader(directory, args.batch_size, 2))
        _report("parquet_loader_sync", args.batch_size, multi_hot,
                _time_loader(directory, args.batch_size, 0))
        _report("parquet_loader_shuffle", args.batch_size, multi_hot,
                _time_loader(directory, args.batch_size, 2, shuffle=True))
        _report("naive_pylist", args.batch_size, multi_hot,
                _time_naive(directory, spec, args.batch_size, args.naive_batches))


if __name__ == "__main__":
    main()
