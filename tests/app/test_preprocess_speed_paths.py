"""The default vocabulary's fast paths against independent references: the C helper's id
counter (a Counter), newline count (bytes.count) and vocabulary lookup (a dict of id -> row);
row groups written by a background thread (the same bytes as written in line, errors raised);
and a whole preprocess with and without the helper, 1 and 2 workers (the same bytes, the ids a
dict built from the train rows gives)."""

from __future__ import annotations

import hashlib
import os
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dlrm_app.data import shard_writer
from dlrm_app.data.criteo import fastparse, preprocess_criteo
from dlrm_app.data.criteo.encoding import VocabularyIndex, encoder, vocabulary_rows
from dlrm_app.data.criteo.vocabulary import distinct_counts

needs_helper = pytest.mark.skipif(
    not fastparse.available() and os.environ.get("CI") != "true",
    reason="the C helper was not built (no compiler); CI must build it")


def dict_rows(vocab: np.ndarray, raw: np.ndarray) -> list[int]:
    """The reference: row i + 1 for vocab[i], 0 for any other id."""
    rows = {int(v): i + 1 for i, v in enumerate(vocab)}
    return [rows.get(int(x), 0) for x in raw]


def vocabularies() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    spread = np.unique(rng.integers(0, 2**32, 50_000))
    return [
        np.zeros(0, np.int64),                      # no ids kept: every id is row 0
        np.array([0], np.int64),                    # the missing value's id only
        np.array([2**32 - 1], np.int64),            # the largest raw id
        np.arange(0, 3000, 3, dtype=np.int64),      # small ids: few high bits
        np.unique(rng.integers(0, 1 << 12, 700)),   # dense in a small range
        spread,                                     # spread over 32 bits (the real ids)
        np.concatenate([np.arange(100), [2**31 + 5, 2**32 - 2]]),  # skewed: one full bucket
    ]


@needs_helper
@pytest.mark.parametrize("vocab", vocabularies(), ids=lambda v: f"{len(v)}ids")
def test_vocabulary_lookup_matches_a_dict(vocab: np.ndarray) -> None:
    rng = np.random.default_rng(1)
    picked = vocab[rng.integers(0, len(vocab), 3000)] if len(vocab) else np.zeros(0, np.int64)
    raw = np.concatenate([
        picked, picked + 1, picked - 1,             # in, and next to the kept ids
        rng.integers(0, 2**32, 3000),               # anywhere
        [0, 1, 2**32 - 1, 2**32, 2**40, -1, -(2**63), 2**63 - 1],  # the edges of int64
    ]).astype(np.int64)
    want = dict_rows(vocab, raw)
    index = VocabularyIndex(vocab)
    assert index.rows(raw).tolist() == want
    assert vocabulary_rows(vocab, raw).tolist() == want  # the numpy path, without the helper
    assert index.rows(raw[:0]).tolist() == []


@needs_helper
def test_vocabulary_index_buckets_hold_few_ids() -> None:
    """Ids spread over 32 bits: 2-4 ids a bucket on average, an index of <= 4 bytes an id."""
    vocab = np.unique(np.random.default_rng(2).integers(0, 2**32, 100_000))
    index = VocabularyIndex(vocab)
    buckets = len(index.first) - 1
    assert 2 <= len(vocab) / buckets <= 4
    assert index.first.nbytes <= 4 * len(vocab) + 16
    assert index.first[0] == 0 and index.first[-1] == len(vocab)
    assert (np.diff(index.first) >= 0).all()


@needs_helper
@pytest.mark.parametrize("n, high", [(0, 10), (1, 10), (5000, 3), (5000, 2**32), (70_000, 900)])
def test_count_ids_matches_a_counter(n: int, high: int) -> None:
    ids = np.random.default_rng(n).integers(0, high, n).astype(np.int64)
    if n:
        ids[0] = high - 1  # the largest id each range allows (2^32 - 1 for the full one)
    got = fastparse.count_ids(ids)
    assert got is not None
    want = sorted(Counter(ids.tolist()).items())
    assert got[0].dtype == np.uint32 and got[1].dtype == np.uint32
    assert list(zip(got[0].tolist(), got[1].tolist(), strict=True)) == want
    ids_np, counts_np = distinct_counts(ids)
    assert ids_np.tolist() == [i for i, _ in want] and counts_np.tolist() == [c for _, c in want]


@needs_helper
@pytest.mark.parametrize("bad", [-1, 2**32, 2**62])
def test_count_ids_declines_ids_outside_32_bits(bad: int) -> None:
    ids = np.array([5, 7, bad, 5], np.int64)
    assert fastparse.count_ids(ids) is None
    got = distinct_counts(ids)  # the numpy path counts them
    assert got[0].tolist() == sorted({5, 7, bad}) and got[1].tolist() == [
        {5: 2, 7: 1, bad: 1}[i] for i in sorted({5, 7, bad})]


@needs_helper
def test_count_newlines_matches_bytes_count() -> None:
    rng = np.random.default_rng(3)
    for size in [0, 1, 254, 255, 256, 509, 510, 511, 4096, 100_003]:
        buf = rng.choice(np.frombuffer(b"\n\tab0", np.uint8), size).tobytes()
        assert fastparse.count_newlines(buf) == buf.count(b"\n")
    assert fastparse.count_newlines(b"\n" * 1000) == 1000  # more than a byte counter holds


SCHEMA = pa.schema([("label", pa.float32()), ("ids", pa.list_(pa.int64()))])


def table(start: int, n: int) -> pa.Table:
    offsets = pa.array(np.arange(n + 1, dtype=np.int32))
    ids = pa.ListArray.from_arrays(offsets, pa.array(np.arange(start, start + n) * 7919 % 1000))
    return pa.table([pa.array((np.arange(start, start + n) % 2).astype(np.float32)), ids],
                    schema=SCHEMA)


def write(directory: Path, name: str, cuts: list[int], background: bool) -> bytes:
    w = shard_writer.ShardWriter(directory, name, SCHEMA, 1000, "label", background=background)
    try:
        for a, b in zip(cuts[:-1], cuts[1:], strict=True):
            w.add(table(a, b - a))
        w.close()
    finally:
        w.abort()
    assert w.rows == cuts[-1] and w.label_sum == cuts[-1] // 2
    return (directory / name).read_bytes()


@pytest.mark.parametrize("cuts", [[0, 10_500], [0, 999, 1000, 3001, 7000, 10_500],
                                  [0, *range(333, 10_500, 333), 10_500]])
def test_background_writes_give_the_same_bytes(tmp_path: Path, cuts: list[int]) -> None:
    inline = write(tmp_path, "inline.parquet", cuts, background=False)
    threaded = write(tmp_path, "threaded.parquet", cuts, background=True)
    assert hashlib.sha256(inline).digest() == hashlib.sha256(threaded).digest()
    got = pq.read_table(tmp_path / "threaded.parquet")
    assert got.equals(table(0, cuts[-1]))
    assert [pq.ParquetFile(tmp_path / "threaded.parquet").metadata.row_group(g).num_rows
            for g in range(11)] == [1000] * 10 + [500]


def test_background_write_error_is_raised_and_leaves_no_file(tmp_path: Path) -> None:
    w = shard_writer.ShardWriter(tmp_path, "s.parquet", SCHEMA, 100, background=True)
    wrong = pa.table({"label": pa.array(np.zeros(100, np.float32)),
                      "ids": pa.array(np.zeros(100, np.int64))})  # not the file's schema
    with pytest.raises(ValueError, match="schema"):
        try:
            for _ in range(4):  # the failed write is found by a later add, or by close
                w.add(wrong)
            w.close()
        finally:
            w.abort()
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def strict_lines(rows: int, seed: int) -> list[str]:
    """Rows in the strict format (the C parser's): every field present, a tenth empty."""
    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(rows):
        dense = [str(v) if rng.random() > 0.1 else "" for v in rng.geometric(0.05, 13) - 1]
        cats = [f"{v:08x}" if rng.random() > 0.1 else "" for v in
                rng.integers(0, 600, 26) * 7_368_787 % 2**32]
        lines.append("\t".join([str(rng.integers(0, 2)), *dense, *cats]))
    return lines


def shards(out: Path) -> list[Path]:
    """The shards in row order: train, validation, test."""
    order = ["train", "validation", "test"]
    return sorted((p for p in out.glob("*-*.parquet")),
                  key=lambda p: (order.index(p.name.split("-")[0]), p))


def shard_digests(out: Path) -> list[str]:
    return [hashlib.sha256(p.read_bytes()).hexdigest() for p in shards(out)]


@pytest.mark.slow
def test_default_vocabulary_same_bytes_with_and_without_the_helper(tmp_path: Path) -> None:
    """One file of strict rows (the C parser, counter and lookup take every block) through the
    default vocabulary: the ids are those of a dict built from the train rows, and the bytes
    equal those of the numpy paths (helper switched off) and of 2 workers."""
    lines = strict_lines(1400, seed=4)
    path = tmp_path / "in.tsv"
    path.write_text("\n".join(lines) + "\n")
    outs = {}
    for name, workers, helper in [("fast", 1, True), ("numpy", 1, False), ("two", 2, True)]:
        fastparse.enabled = helper  # the workers' processes keep theirs on
        try:
            preprocess_criteo([path], tmp_path / name, workers=workers, block_bytes=8192,
                              rows_per_shard=500)
        finally:
            fastparse.enabled = True
            encoder.cache_clear()
        outs[name] = shard_digests(tmp_path / name)
    assert outs["fast"] == outs["numpy"] == outs["two"] and len(outs["fast"]) == 5
    raw = np.array([[int(h, 16) if h else 0 for h in line.split("\t")[14:]] for line in lines])
    train = raw[:1200]  # kaggle split: the first 6/7 of the lines
    got = pa.concat_tables([pq.read_table(p) for p in shards(tmp_path / "fast")])
    for k in range(26):
        vocab = np.unique(train[:, k])
        ids = got[f"cat_{k}"].combine_chunks().flatten().to_numpy()
        assert ids.tolist() == dict_rows(vocab, raw[:, k])
