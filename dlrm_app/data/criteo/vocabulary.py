"""The frequency-threshold vocabulary: raw ids seen at least ``K`` times in the train split.

Raw ids of the vocabulary get ids ``1..V`` (in raw-id order); every other raw id maps to the
shared rare id ``0``. The vocabulary is saved as ``vocabulary.parquet`` (rows ``(feature,
raw_id)``) beside the shards; training and export read it from there.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dlrm_app.data.criteo.format import NUM_SPARSE, SplitRule
from dlrm_app.data.criteo.lines import Block, blocks, prefetch
from dlrm_app.data.criteo.parse import parse_block
from dlrm_app.data.criteo.workers import Runner
from dlrm_app.data.schema import sha256_file

VOCABULARY_FILE = "vocabulary.parquet"
RARE_ID = 0
"""With a frequency threshold, every raw id seen fewer than K times in train maps here."""


def count_ids(path: Path, block: Block, on_bad_row: str,
              train_lines: float) -> list[tuple[np.ndarray, np.ndarray]]:
    """Worker task of the vocabulary pass: per feature, the distinct raw ids of the block's
    train rows (its lines up to ``train_lines`` of the input) and their counts."""
    rows, _ = parse_block(block.data, block.line, path, on_bad_row, block.lines)
    n_train = int(np.searchsorted(rows.lines, train_lines, side="right"))
    return [np.unique(c[:n_train], return_counts=True) for c in rows.cats]


def build_vocabulary(run: Runner, paths: list[Path], rule: SplitRule,
                     counts: list[int | None], threshold: int, block_bytes: int,
                     on_bad_row: str) -> list[np.ndarray]:
    """Sorted raw ids seen at least ``threshold`` times in the train split, per feature. Only
    the train lines are read (kaggle: ``counts`` has every input's line count)."""
    train_lines = rule.train_lines(counts)
    uniq = [np.zeros(0, np.int64)] * NUM_SPARSE
    counts_ = [np.zeros(0, np.int64)] * NUM_SPARSE
    with contextlib.closing(prefetch(blocks(paths, block_bytes, max_lines=train_lines))) \
            as stream:
        tasks = ((paths[b.input], b, on_bad_row, train_lines[b.input]) for b in stream)
        for per_feature in run.map(count_ids, tasks):
            for k, (u, c) in enumerate(per_feature):
                merged, inv = np.unique(np.concatenate([uniq[k], u]), return_inverse=True)
                counts_[k] = np.bincount(inv, np.concatenate([counts_[k], c]),
                                         minlength=len(merged)).astype(np.int64)
                uniq[k] = merged
    return [u[c >= threshold] for u, c in zip(uniq, counts_, strict=True)]


def save_vocabulary(out: Path, vocab: list[np.ndarray]) -> str:
    """Write ``vocabulary.parquet`` atomically; returns its sha256."""
    feature = np.concatenate([np.full(len(v), k, np.int32) for k, v in enumerate(vocab)])
    table = pa.table({"feature": feature, "raw_id": np.concatenate(vocab)})
    tmp = out / f".{VOCABULARY_FILE}.tmp"
    pq.write_table(table, tmp)
    os.replace(tmp, out / VOCABULARY_FILE)
    return sha256_file(out / VOCABULARY_FILE)


def load_vocabulary(directory: str | os.PathLike[str]) -> list[np.ndarray]:
    """The per-feature sorted raw ids saved by a frequency-threshold run."""
    table = pq.read_table(Path(directory) / VOCABULARY_FILE)
    feature = table["feature"].to_numpy()
    raw = table["raw_id"].to_numpy()
    return [raw[feature == k] for k in range(NUM_SPARSE)]
