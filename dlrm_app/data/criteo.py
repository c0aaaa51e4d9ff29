"""Criteo (Kaggle display-ads and 1TB click logs) TSV -> Parquet shards + ``dataset.json``.

Input rows: ``label \\t I1..I13 \\t C1..C26``; integers in decimal, categoricals as hex (8 digits
in the real data, 1-8 accepted); empty fields are missing; files are plain or ``.gz``. Rows with
missing trailing fields (fewer than 40 fields) are padded with missing values.

Transforms (the reference DLRM's defaults):

* dense: missing -> 0, negatives clamped to 0, then ``log(x + 1)``, stored as float32;
* categorical: hex -> integer, missing -> 0 *before* encoding (so a missing value shares the
  id of the hex value ``0``, as in the reference), then either modulo hashing
  ``id % num_embeddings`` (default 40,000,000 per feature, the reference's ``max-ind-range``)
  or a frequency-threshold vocabulary: raw ids seen at least ``K`` times in the *train* split
  get ids ``1..V`` (in raw-id order), every other raw id maps to the shared rare id ``0``.
  The vocabulary is saved as ``vocabulary.parquet`` beside the shards.

Splits (contiguous, by input row order, bad rows included in the counting):

* kaggle: of the ``N`` lines of all inputs concatenated, the first ``N * 6 // 7`` are train,
  of the rest the first half (rounded down) is validation and the remainder test;
* terabyte: every input is one day; all but the last are train, the last day's first half of
  lines (rounded down) is validation and the rest test.

Engineering: input is read in blocks of ``block_bytes`` of whole lines; each block is padded
(numpy finds short rows) and parsed by ``pyarrow.csv`` with an explicit schema, and every
transform is vectorized. Memory is bounded by about ``6 * block_bytes`` plus one Parquet row
group and the vocabulary counts (one entry per distinct raw id), independent of input size.
Each shard is written to a hidden temp name and renamed when complete, then a small done-marker
records its checksum; a rerun re-reads the input but skips writing shards whose file matches
its marker, so a killed run plus a rerun gives the same bytes as one uninterrupted run.
``dataset.json`` is written last.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.metadata
import io
import json
import os
import re
import shutil
import sys
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
from tqdm import tqdm

from dlrm_app.data.schema import (
    DENSE_COLUMN,
    DatasetKind,
    DatasetSpec,
    ShardFile,
    SparseFeature,
    SplitSpec,
    sha256_file,
)

NUM_DENSE = 13
NUM_SPARSE = 26
NUM_FIELDS = 1 + NUM_DENSE + NUM_SPARSE
LABEL = "label"
DENSE_NAMES = tuple(f"int_{i}" for i in range(NUM_DENSE))
SPARSE_NAMES = tuple(f"cat_{i}" for i in range(NUM_SPARSE))
DEFAULT_NUM_EMBEDDINGS = 40_000_000
VOCABULARY_FILE = "vocabulary.parquet"
RARE_ID = 0
"""With a frequency threshold, every raw id seen fewer than K times in train maps here."""

_COLUMNS = (LABEL, *DENSE_NAMES, *SPARSE_NAMES)
_HEX_LUT = np.full(256, 255, dtype=np.uint8)
for _i, _c in enumerate(b"0123456789abcdef"):
    _HEX_LUT[_c] = _i
for _i, _c in enumerate(b"ABCDEF"):
    _HEX_LUT[_c] = 10 + _i
_SCHEMA = pa.schema([(LABEL, pa.float32()), (DENSE_COLUMN, pa.list_(pa.float32(), NUM_DENSE))]
                    + [(n, pa.list_(pa.int64())) for n in SPARSE_NAMES])
_PARSE = pacsv.ParseOptions(delimiter="\t", quote_char=False, ignore_empty_lines=False)
_TYPED = pacsv.ConvertOptions(column_types={LABEL: pa.int64(), **dict.fromkeys(
    DENSE_NAMES, pa.int64()), **dict.fromkeys(SPARSE_NAMES, pa.string())})
_STRINGS = pacsv.ConvertOptions(column_types=dict.fromkeys(_COLUMNS, pa.string()),
                                strings_can_be_null=False)


def _bad_row_error(path: Path, line: int, problem: str) -> ValueError:
    return ValueError(f"{path}:{line}: {problem}; fix or delete the line, or pass "
                      f"on_bad_row='skip' (--on-bad-row skip) to drop bad rows")


def row_problem(text: str) -> str:
    """Why one raw line (without newline) is not a valid Criteo row (pure Python, slow)."""
    fields = text.split("\t")
    if len(fields) > NUM_FIELDS:
        return (f"{len(fields)} tab-separated fields, expected at most {NUM_FIELDS} "
                f"(label, {NUM_DENSE} integer, {NUM_SPARSE} categorical)")
    fields += [""] * (NUM_FIELDS - len(fields))
    if fields[0] not in ("0", "1"):
        return f"label {fields[0]!r} is not 0 or 1"
    for name, f in zip(DENSE_NAMES, fields[1:1 + NUM_DENSE], strict=True):
        if f and not re.fullmatch(r"-?[0-9]+", f):
            return f"integer feature {name} = {f!r} is not a decimal integer"
    for name, f in zip(SPARSE_NAMES, fields[1 + NUM_DENSE:], strict=True):
        if f and not re.fullmatch(r"[0-9a-fA-F]{1,8}", f):
            return f"categorical feature {name} = {f!r} is not 1-8 hex digits"
    return "value out of range"


def read_blocks(path: Path, block_bytes: int) -> Iterator[bytes]:
    """Whole lines of ``path`` (plain or .gz) in blocks of about ``block_bytes``, each ending
    in a newline. A truncated or corrupt gzip raises ValueError naming the file."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            rest = b""
            while chunk := f.read(block_bytes):
                data = rest + chunk
                cut = data.rfind(b"\n") + 1
                rest = data[cut:]
                if cut:
                    yield data[:cut]
            if rest:
                yield rest + b"\n"
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:
        raise ValueError(f"{path}: truncated or corrupt gzip file ({e}); re-download or "
                         f"re-compress it") from None


def count_lines(path: Path, block_bytes: int = 16 << 20) -> int:
    """Number of lines of ``path`` (a last line without newline counts); an empty file raises
    ValueError. A bare ``bytes.count`` over large binary reads (no line splitting)."""
    opener = gzip.open if path.suffix == ".gz" else open
    n, last = 0, b"\n"
    try:
        with opener(path, "rb") as f:
            while chunk := f.read(max(block_bytes, 1 << 20)):
                n += chunk.count(b"\n")
                last = chunk[-1:]
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:
        raise ValueError(f"{path}: truncated or corrupt gzip file ({e}); re-download or "
                         f"re-compress it") from None
    n += last != b"\n"
    if n == 0:
        raise ValueError(f"{path}: empty file (no rows); remove it from the inputs")
    return n


_ONES = np.uint64(0x0101010101010101)
_HIGH = np.uint64(0x8080808080808080)


_SWAR_CHUNK = 1 << 15  # values per step: the temporaries stay in the CPU cache


def _swar_hex(x: np.ndarray) -> tuple[np.ndarray, bool]:
    """Values of uint64s of 8 hex characters each (first character in the lowest byte),
    decoded eight characters at a time (SIMD within a register), and whether all were valid
    hex digits (values of invalid ones are garbage)."""
    out = np.empty(len(x), np.uint64)
    c = {k: _ONES * np.uint64(k) for k in (0x7F, 0x20, 15, 0x80 - 0x30, 0x7F - 0x39,
                                           0x80 - 0x61, 0x7F - 0x66)}
    m4, m8, m16 = (np.uint64(0x000F000F000F000F), np.uint64(0x000000FF000000FF),
                   np.uint64(0xFFFF))
    s4, s6, s8, s16, s32 = (np.uint64(k) for k in (4, 6, 8, 16, 32))
    ok = True
    for i in range(0, len(x), _SWAR_CHUNK):
        v = x[i:i + _SWAR_CHUNK]
        # validity: with bytes < 0x80, (b + 0x80 - lo) has its high bit set iff b >= lo and
        # (b + 0x7F - hi) has it clear iff b <= hi; no carry crosses a byte
        low7 = v & c[0x7F]
        hi = low7 + c[0x7F - 0x39]
        ok_bits = low7 + c[0x80 - 0x30]
        ok_bits &= ~hi
        low7 |= c[0x20]
        hi = low7 + c[0x7F - 0x66]
        low7 += c[0x80 - 0x61]
        low7 &= ~hi
        ok_bits |= low7
        ok_bits &= ~v
        ok = ok and bool(np.all((ok_bits & _HIGH) == _HIGH))
        # value: digit = (b & 15) + 9 * bit 6, then pack nibble pairs, bytes, 16-bit halves
        d = v >> s6
        d &= _ONES
        d *= np.uint64(9)
        d += v & c[15]
        t = (d >> s8) & m4
        d &= m4
        d <<= s4
        d |= t
        t = (d >> s16) & m8
        d &= m8
        d <<= s8
        d |= t
        t = (d >> s32) & m16
        d &= m16
        d <<= s16
        d |= t
        out[i:i + _SWAR_CHUNK] = d
    return out.view(np.int64), ok


def _parse_hex(col: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """Raw int64 ids of a string column of hex values ("" -> 0) and a bad-value mask."""
    n = len(col)
    offsets = np.frombuffer(col.buffers()[1], np.int32)[col.offset:col.offset + n + 1]
    data_buf = col.buffers()[2]
    data = np.frombuffer(data_buf, np.uint8) if data_buf is not None else np.zeros(0, np.uint8)
    data = data[offsets[0]:offsets[-1]]
    lengths = np.diff(offsets)
    out = np.zeros(n, np.int64)
    if np.all((lengths == 8) | (lengths == 0)):
        # Fast path (the real data): non-empty values are back-to-back 8-byte runs, decoded
        # eight characters at a time as one little-endian uint64 (SIMD within a register).
        full = lengths == 8
        bad = np.zeros(n, bool)
        values, ok = _swar_hex(np.frombuffer(data.tobytes(), "<u8"))
        out[full] = values
        if not ok:
            bad[full] = (_HEX_LUT[data.reshape(-1, 8)] == 255).any(axis=1)
        return out, bad
    # General path: right-align every value in an 8-wide window, leading positions are zeros.
    ends = offsets[1:] - offsets[0] + 8
    padded = np.concatenate([np.full(8, ord("0"), np.uint8), data])
    window = padded[ends[:, None] - 8 + np.arange(8)]
    used = np.arange(8) >= 8 - np.minimum(lengths, 8)[:, None]
    digits = np.where(used, _HEX_LUT[window], 0)
    bad = (lengths > 8) | (digits == 255).any(axis=1)
    for k in range(8):
        out = (out << 4) | (digits[:, k] & 15)
    return out, bad


class _Rows:
    """Parsed, validated rows of one block: labels, raw dense ints, raw categorical ids."""

    def __init__(self, label: np.ndarray, dense: np.ndarray, cats: list[np.ndarray],
                 lines: np.ndarray) -> None:
        self.label, self.dense, self.cats, self.lines = label, dense, cats, lines


def _parse_slow(buf: bytes, lines: np.ndarray, path: Path, on_bad_row: str,
                read: pacsv.ReadOptions) -> tuple:
    """parse_block's general path: drop/raise on rows with too many fields, pad short rows,
    and re-read as strings when a numeric field does not parse."""
    arr = np.frombuffer(buf, np.uint8)
    nl = np.flatnonzero(arr == 10)
    starts = np.concatenate([[0], nl[:-1] + 1])
    fields = np.diff(np.searchsorted(np.flatnonzero(arr == 9), nl), prepend=0) + 1

    skipped = 0
    too_many = fields > NUM_FIELDS
    if too_many.any():
        first = int(np.argmax(too_many))
        if on_bad_row == "error":
            raise _bad_row_error(path, int(lines[first]), row_problem(
                buf[starts[first]:nl[first]].decode("utf-8", "replace")))
        keep = ~too_many
        skipped += int(too_many.sum())
        buf = b"".join(buf[s:e + 1] for s, e in zip(starts[keep], nl[keep], strict=True))
        lines, fields = lines[keep], fields[keep]
        arr = np.frombuffer(buf, np.uint8)
        nl = np.flatnonzero(arr == 10)
        starts = np.concatenate([[0], nl[:-1] + 1])
    if len(nl) == 0:
        return None, None, None, None, lines, buf, skipped
    short = np.flatnonzero(fields < NUM_FIELDS)
    padded = buf
    if len(short):
        # pyarrow's reader rejects short rows, so insert the missing tabs (a loop over the
        # short rows only; the common all-40-fields block is passed through untouched).
        pieces, prev = [], 0
        for i in short:
            pieces += [buf[prev:nl[i]], b"\t" * int(NUM_FIELDS - fields[i])]
            prev = nl[i]
        pieces.append(buf[prev:])
        padded = b"".join(pieces)
    try:
        table = pacsv.read_csv(io.BytesIO(padded), read, _PARSE, _TYPED)
        label = table[LABEL].combine_chunks()
        bad = ~np.asarray(pc.fill_null(pc.is_in(label, pa.array([0, 1])), False))
        dense_cols = [pc.fill_null(table[n], 0).combine_chunks() for n in DENSE_NAMES]
    except pa.ArrowInvalid:
        # A non-numeric field: re-read as strings and find every bad row vectorized.
        table = pacsv.read_csv(io.BytesIO(padded), read, _PARSE, _STRINGS)
        bad = ~np.asarray(pc.is_in(table[LABEL], pa.array(["0", "1"])))
        for n in DENSE_NAMES:
            bad |= ~np.asarray(pc.match_substring_regex(table[n], r"^-?[0-9]*$"))
        label = None
        dense_cols = None
    return table, label, bad, dense_cols, lines, buf, skipped


def parse_block(buf: bytes, first_line: int, path: Path, on_bad_row: str) -> tuple[_Rows, int]:
    """Parse whole lines ``buf`` (line ``first_line`` is the first) into validated rows.

    Returns the rows and the number of bad rows skipped; with ``on_bad_row="error"`` the
    first bad row raises ValueError with file and line.
    """
    n_lines = buf.count(b"\n")
    lines = np.arange(first_line, first_line + n_lines)
    skipped = 0
    read = pacsv.ReadOptions(column_names=list(_COLUMNS))

    def line_text(i: int) -> str:
        # only on the error path: the i-th line of the (possibly filtered) current buf
        ends = np.flatnonzero(np.frombuffer(buf, np.uint8) == 10)
        start = int(ends[i - 1]) + 1 if i else 0
        return buf[start:int(ends[i])].decode("utf-8", "replace")

    table = None
    try:
        # Fast path (the real data): every row has exactly 40 numeric/hex fields, so the
        # block parses as is and the per-line field counting below is not needed.
        table = pacsv.read_csv(io.BytesIO(buf), read, _PARSE, _TYPED)
        if len(table) != n_lines:
            table = None
    except pa.ArrowInvalid:
        table = None
    if table is not None:
        label = table[LABEL].combine_chunks()
        bad = ~np.asarray(pc.fill_null(pc.is_in(label, pa.array([0, 1])), False))
        dense_cols = [pc.fill_null(table[n], 0).combine_chunks() for n in DENSE_NAMES]
    else:
        table, label, bad, dense_cols, lines, buf, skipped = _parse_slow(
            buf, lines, path, on_bad_row, read)
        if table is None:
            return _Rows(np.zeros(0, np.float32), np.zeros((0, NUM_DENSE), np.int64),
                         [np.zeros(0, np.int64)] * NUM_SPARSE, lines), skipped
    cats, cat_bad = [], np.zeros(len(table), bool)
    for n in SPARSE_NAMES:
        ids, b = _parse_hex(table[n].combine_chunks())
        cats.append(ids)
        cat_bad |= b
    bad |= cat_bad
    if bad.any():
        first = int(np.argmax(bad))
        if on_bad_row == "error":
            raise _bad_row_error(path, int(lines[first]), row_problem(line_text(first)))
        skipped += int(bad.sum())
    keep = ~bad
    if dense_cols is None:
        # Fallback path: the surviving strings are valid integers or empty.
        good = table.filter(pa.array(keep))
        label = pc.cast(good[LABEL], pa.int64()).combine_chunks()
        dense_cols = [pc.cast(pc.replace_substring_regex(good[n], "^$", "0"), pa.int64())
                      .combine_chunks() for n in DENSE_NAMES]
    else:
        label = label.filter(pa.array(keep))
        dense_cols = [c.filter(pa.array(keep)) for c in dense_cols]
    dense = np.stack([c.to_numpy(zero_copy_only=False) for c in dense_cols], axis=1)
    labels = label.to_numpy(zero_copy_only=False).astype(np.float32)
    return _Rows(labels, dense, [c[keep] for c in cats], lines[keep]), skipped


class _Encoder:
    """Raw rows -> the Parquet table of the dataset.json contract."""

    def __init__(self, num_embeddings: list[int], vocab: list[np.ndarray] | None) -> None:
        self.num_embeddings, self.vocab = num_embeddings, vocab

    def encode(self, rows: _Rows, sl: slice) -> pa.Table:
        n = len(rows.label[sl])
        dense = np.log1p(np.maximum(rows.dense[sl], 0).astype(np.float64)).astype(np.float32)
        offsets = pa.array(np.arange(n + 1, dtype=np.int32))
        cols = []
        for k, raw in enumerate(rows.cats):
            raw = raw[sl]
            if self.vocab is None:
                ids = raw % self.num_embeddings[k]
            else:
                v = self.vocab[k]
                pos = np.searchsorted(v, raw)
                hit = v[np.minimum(pos, len(v) - 1)] == raw if len(v) else np.zeros(n, bool)
                ids = np.where(hit, pos + 1, RARE_ID).astype(np.int64)
            cols.append(pa.ListArray.from_arrays(offsets, pa.array(ids)))
        dense_col = pa.FixedSizeListArray.from_arrays(pa.array(dense.reshape(-1)), NUM_DENSE)
        return pa.Table.from_arrays([pa.array(rows.label[sl]), dense_col, *cols],
                                    schema=_SCHEMA)


def _finish_shard(out: Path, file: str, rows: int, fingerprint: str) -> str:
    """Record a renamed, complete shard in its done-marker (a test hook wraps this)."""
    sha = sha256_file(out / file)
    marker = out / f".{file}.done"
    tmp = out / f".{file}.done.tmp"
    tmp.write_text(json.dumps({"sha256": sha, "rows": rows, "config": fingerprint}))
    os.replace(tmp, marker)
    return sha


class _SplitWriter:
    """Cuts one split's rows into shards and row groups; skips shards already done."""

    def __init__(self, out: Path, split: str, rows_per_shard: int, row_group_size: int,
                 fingerprint: str) -> None:
        self.out, self.split, self.fingerprint = out, split, fingerprint
        self.rows_per_shard, self.row_group_size = rows_per_shard, row_group_size
        self.shards: list[ShardFile] = []
        self.rows = self.label_sum = 0
        self.shard_rows = 0
        self.pending: list[pa.Table] = []
        self.pending_rows = 0
        self.writer: pq.ParquetWriter | None = None
        self.done_sha: str | None = None

    def _file(self) -> str:
        return f"{self.split}-{len(self.shards):05d}.parquet"

    def _open(self) -> None:
        file = self._file()
        marker = self.out / f".{file}.done"
        self.done_sha = None
        if marker.exists() and (self.out / file).exists():
            done = json.loads(marker.read_text())
            if done.get("config") == self.fingerprint and \
                    sha256_file(self.out / file) == done.get("sha256"):
                self.done_sha = done["sha256"]
                return
        self.writer = pq.ParquetWriter(self.out / f".{file}.tmp", _SCHEMA)

    def _flush(self, n: int) -> None:
        table = pa.concat_tables(self.pending).combine_chunks()
        assert self.writer is not None
        self.writer.write_table(table.slice(0, n), row_group_size=n)
        rest = table.slice(n)
        self.pending, self.pending_rows = ([rest] if len(rest) else []), len(rest)

    def _close(self) -> None:
        file = self._file()
        if self.done_sha is None:
            if self.pending_rows:
                self._flush(self.pending_rows)
            assert self.writer is not None
            self.writer.close()
            self.writer = None
            os.replace(self.out / f".{file}.tmp", self.out / file)
            sha = _finish_shard(self.out, file, self.shard_rows, self.fingerprint)
        else:
            sha = self.done_sha
        self.shards.append(ShardFile(file=file, rows=self.shard_rows, sha256=sha,
                                     row_group_size=self.row_group_size))
        self.shard_rows = 0

    def add(self, table: pa.Table) -> None:
        """Append encoded rows (in order)."""
        self.rows += len(table)
        self.label_sum += int(pc.sum(table[LABEL]).as_py() or 0)
        start = 0
        while start < len(table):
            if self.shard_rows == 0:
                self._open()
            take = min(len(table) - start, self.rows_per_shard - self.shard_rows)
            if self.done_sha is None:
                self.pending.append(table.slice(start, take))
                self.pending_rows += take
                while self.pending_rows >= self.row_group_size:
                    self._flush(self.row_group_size)
            self.shard_rows += take
            start += take
            if self.shard_rows == self.rows_per_shard:
                self._close()

    def finish(self) -> SplitSpec:
        """Close the last partial shard and describe the split."""
        if self.shard_rows:
            self._close()
        rate = self.label_sum / self.rows if self.rows else 0.0
        return SplitSpec(name=self.split, label_rate=rate, shards=tuple(self.shards))

    def abort(self) -> None:
        """Drop the unfinished shard's temp file (a failed run leaves no finished-looking file)."""
        if self.writer is not None:
            self.writer.close()
            (self.out / f".{self._file()}.tmp").unlink(missing_ok=True)
            self.writer = None


def _iter_rows(inputs: list[Path], block_bytes: int, on_bad_row: str, counter: list[int],
               line_counts: list[int] | None = None) -> Iterator[tuple[int, _Rows]]:
    """(input index, parsed rows) per block; counter[0] accumulates skipped rows and
    ``line_counts`` (if given) receives each input's number of lines once it is read."""
    for i, path in enumerate(inputs):
        line = 1
        for buf in read_blocks(path, block_bytes):
            rows, skipped = parse_block(buf, line, path, on_bad_row)
            counter[0] += skipped
            line += buf.count(b"\n")
            yield i, rows
        if line == 1:
            raise ValueError(f"{path}: empty file (no rows); remove it from the inputs")
        if line_counts is not None:
            line_counts.append(line - 1)


def _check_not_empty(path: Path) -> None:
    """Raise ValueError early for an empty input (or an unreadable gzip header)."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            empty = not f.read(1)
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:
        raise ValueError(f"{path}: truncated or corrupt gzip file ({e}); re-download or "
                         f"re-compress it") from None
    if empty:
        raise ValueError(f"{path}: empty file (no rows); remove it from the inputs")


def _split_bounds(fmt: str, inputs: list[Path],
                  line_counts: list[int | None]) -> list[np.ndarray]:
    """Per input, the 0-based line indices where validation and test start (sorted); a
    terabyte split needs only the last input's count."""
    if fmt == "kaggle":
        total = sum(line_counts)
        train = total * 6 // 7
        val = train + (total - train) // 2
        bounds, offset = [], 0
        for n in line_counts:
            assert n is not None
            bounds.append(np.array([train - offset, val - offset]))
            offset += n
        return bounds
    big = np.iinfo(np.int64).max
    assert line_counts[-1] is not None
    half = line_counts[-1] // 2
    return [np.array([big, big])] * (len(inputs) - 1) + [np.array([0, half])]


def _build_vocabulary(inputs: list[Path], bounds: list[np.ndarray], threshold: int,
                      block_bytes: int, on_bad_row: str) -> list[np.ndarray]:
    """Sorted raw ids seen at least ``threshold`` times in the train split, per feature."""
    uniq = [np.zeros(0, np.int64)] * NUM_SPARSE
    counts = [np.zeros(0, np.int64)] * NUM_SPARSE
    for i, rows in _iter_rows(inputs, block_bytes, on_bad_row, [0]):
        n_train = int(np.searchsorted(rows.lines - 1, bounds[i][0]))
        for k in range(NUM_SPARSE):
            u, c = np.unique(rows.cats[k][:n_train], return_counts=True)
            merged, inv = np.unique(np.concatenate([uniq[k], u]), return_inverse=True)
            counts[k] = np.bincount(inv, np.concatenate([counts[k], c]),
                                    minlength=len(merged)).astype(np.int64)
            uniq[k] = merged
    return [u[c >= threshold] for u, c in zip(uniq, counts, strict=True)]


def _save_vocabulary(out: Path, vocab: list[np.ndarray]) -> str:
    feature = np.concatenate([np.full(len(v), k, np.int32) for k, v in enumerate(vocab)])
    table = pa.table({"feature": feature, "raw_id": np.concatenate(vocab)})
    tmp = out / f".{VOCABULARY_FILE}.tmp"
    pq.write_table(table, tmp)
    os.replace(tmp, out / VOCABULARY_FILE)
    return sha256_file(out / VOCABULARY_FILE)


def load_vocabulary(directory: Path) -> list[np.ndarray]:
    """The per-feature sorted raw ids saved by a frequency-threshold run."""
    table = pq.read_table(Path(directory) / VOCABULARY_FILE)
    feature = table["feature"].to_numpy()
    raw = table["raw_id"].to_numpy()
    return [raw[feature == k] for k in range(NUM_SPARSE)]


def preprocess_criteo(
    inputs: Sequence[str | os.PathLike[str]],
    out_dir: str | os.PathLike[str],
    *,
    fmt: Literal["kaggle", "terabyte"] = "kaggle",
    num_embeddings_per_feature: int | Sequence[int] | None = None,
    frequency_threshold: int | None = None,
    rows_per_shard: int = 1_000_000,
    row_group_size: int = 65_536,
    on_bad_row: Literal["error", "skip"] = "error",
    like: str | os.PathLike[str] | None = None,
    block_bytes: int = 32 << 20,
) -> DatasetSpec:
    """Preprocess Criteo TSV files into ``out_dir`` (shards + dataset.json); see the module doc.

    Encoding: modulo hashing into ``num_embeddings_per_feature`` (one int or 26; default
    40,000,000) or, with ``frequency_threshold=K``, a train-split vocabulary; ``like`` reuses
    an existing dataset's encoding instead (its vocabulary is copied). Bad rows raise
    ValueError with file and line, or with ``on_bad_row="skip"`` are dropped and counted in
    ``parameters["skipped_rows"]``. Empty or truncated (gzip) inputs always raise.
    """
    paths = [Path(p) for p in inputs]
    if not paths:
        raise ValueError("no input files; pass at least one Criteo TSV (plain or .gz)")
    if fmt not in ("kaggle", "terabyte"):
        raise ValueError(f"fmt must be 'kaggle' or 'terabyte', got {fmt!r}")
    if fmt == "terabyte" and len(paths) < 2:
        raise ValueError("terabyte format needs at least 2 day files (train days + the last "
                         "day for validation/test); pass the day files in order")
    if on_bad_row not in ("error", "skip"):
        raise ValueError(f"on_bad_row must be 'error' or 'skip', got {on_bad_row!r}")
    if rows_per_shard < 1 or row_group_size < 1 or block_bytes < 1:
        raise ValueError("rows_per_shard, row_group_size and block_bytes must be positive")
    for p in paths:
        if not p.is_file():
            raise ValueError(f"{p}: input file not found")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "dataset.json").unlink(missing_ok=True)  # a run in progress is not finished

    # The split needs line counts before the main pass: kaggle the total, terabyte only the
    # last day's (the other days are all train); the main pass counts every input again.
    if fmt == "kaggle":
        known: list[int | None] = [count_lines(p) for p in paths]
    else:
        for p in paths[:-1]:
            _check_not_empty(p)
        known = [None] * (len(paths) - 1) + [count_lines(paths[-1])]
    bounds = _split_bounds(fmt, paths, known)
    vocab: list[np.ndarray] | None = None
    if like is not None:
        if num_embeddings_per_feature is not None or frequency_threshold is not None:
            raise ValueError("pass either like= or an encoding (num_embeddings_per_feature / "
                             "frequency_threshold), not both")
        encoding = dict(DatasetSpec.load(like).parameters["encoding"])
        if encoding["mode"] == "vocabulary":
            src = Path(like) / VOCABULARY_FILE
            if sha256_file(src) != encoding["vocabulary_sha256"]:
                raise ValueError(f"{src}: checksum differs from {like}/dataset.json; "
                                 f"re-run the preprocessing of {like}")
            shutil.copyfile(src, out / f".{VOCABULARY_FILE}.tmp")
            os.replace(out / f".{VOCABULARY_FILE}.tmp", out / VOCABULARY_FILE)
            vocab = load_vocabulary(out)
        encoding["like"] = str(like)
    elif frequency_threshold is not None:
        if num_embeddings_per_feature is not None:
            raise ValueError("pass num_embeddings_per_feature or frequency_threshold, not both")
        if frequency_threshold < 1:
            raise ValueError(f"frequency_threshold must be >= 1, got {frequency_threshold}")
        vocab = _build_vocabulary(paths, bounds, frequency_threshold, block_bytes, on_bad_row)
        encoding = {"mode": "vocabulary", "frequency_threshold": frequency_threshold,
                    "rare_id": RARE_ID, "vocabulary_sha256": _save_vocabulary(out, vocab),
                    "num_embeddings": [len(v) + 1 for v in vocab]}
    else:
        n = DEFAULT_NUM_EMBEDDINGS if num_embeddings_per_feature is None \
            else num_embeddings_per_feature
        sizes = [int(n)] * NUM_SPARSE if isinstance(n, int) else [int(x) for x in n]
        if len(sizes) != NUM_SPARSE or min(sizes) < 1:
            raise ValueError(f"num_embeddings_per_feature must be one positive int or "
                             f"{NUM_SPARSE}, got {n}")
        encoding = {"mode": "hash", "num_embeddings": sizes}
    num_embeddings = list(encoding["num_embeddings"])
    encoder = _Encoder(num_embeddings, vocab)

    config = {"inputs": [[str(p), p.stat().st_size, p.stat().st_mtime_ns] for p in paths],
              "fmt": fmt, "encoding": encoding, "rows_per_shard": rows_per_shard,
              "row_group_size": row_group_size, "on_bad_row": on_bad_row,
              "block_bytes": block_bytes}
    fingerprint = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()
    writers = [_SplitWriter(out, s, rows_per_shard, row_group_size, fingerprint)
               for s in ("train", "validation", "test")]
    skipped = [0]
    line_counts: list[int] = []
    progress = tqdm(total=sum(known) if None not in known else None, unit="rows", unit_scale=True,
                    disable=not sys.stderr.isatty(), desc="criteo")
    try:
        for i, rows in _iter_rows(paths, block_bytes, on_bad_row, skipped, line_counts):
            cuts = np.searchsorted(rows.lines - 1, bounds[i])
            edges = [0, int(cuts[0]), int(cuts[1]), len(rows.label)]
            for w, a, b in zip(writers, edges[:-1], edges[1:], strict=True):
                if b > a:
                    w.add(encoder.encode(rows, slice(a, b)))
            progress.update(len(rows.label))
        splits = tuple(w.finish() for w in writers)
    finally:
        progress.close()
        for w in writers:
            w.abort()
    spec = DatasetSpec(
        name=f"criteo-{fmt}",
        kind=DatasetKind.CRITEO,
        dense_features=DENSE_NAMES,
        sparse_features=tuple(SparseFeature(name=n, num_embeddings=e, multi_hot=False)
                              for n, e in zip(SPARSE_NAMES, num_embeddings, strict=True)),
        label=LABEL,
        label_dtype="float32",
        splits=splits,
        parameters={
            "preprocessor": "dlrm_app.data.criteo",
            "format": fmt,
            "inputs": [str(p) for p in paths],
            "input_lines": line_counts,
            "split_rule": ("kaggle: first N*6//7 lines train, then half validation, rest test"
                           if fmt == "kaggle" else
                           "terabyte: all but the last day train, last day halves "
                           "validation/test"),
            "dense_transform": "missing->0, clamp negatives to 0, log(x+1)",
            "categorical_transform": "hex->int, missing->0, then encoding",
            "encoding": encoding,
            "rows_per_shard": rows_per_shard,
            "row_group_size": row_group_size,
            "on_bad_row": on_bad_row,
            "skipped_rows": skipped[0],
        },
        created_by=f"dlrm_app {importlib.metadata.version('recsys-dlrm')}",
    )
    spec.save(out)
    return spec
