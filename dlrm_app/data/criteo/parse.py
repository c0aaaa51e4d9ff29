"""Criteo TSV parsing: raw blocks of whole lines -> validated typed columns.

The row format is :mod:`dlrm_app.data.criteo.format`. A block of rows in the strict format
(all 40 fields, valid values) goes through the optional C parser
(:mod:`~dlrm_app.data.criteo.fastparse`: one pass, every field straight to its number);
anything else, or every block without the helper, takes the vectorized path: pyarrow's CSV
reader with an explicit schema, a word-at-a-time hex decode, and a per-line fallback only for
bad or short rows. Both give the same rows.
"""

from __future__ import annotations

import gzip
import io
import math
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

from dlrm_app.data.criteo import fastparse
from dlrm_app.data.criteo.format import (
    COLUMNS,
    DENSE_NAMES,
    HEX_LUT,
    LABEL,
    MAX_DENSE_DIGITS,
    MAX_LINE_BYTES,
    NUM_DENSE,
    NUM_FIELDS,
    NUM_SPARSE,
    SPARSE_NAMES,
    bad_row_error,
    row_problem,
)

_PARSE = pacsv.ParseOptions(delimiter="\t", quote_char=False, ignore_empty_lines=False)
_TYPED = pacsv.ConvertOptions(column_types={LABEL: pa.int64(), **dict.fromkeys(
    DENSE_NAMES, pa.int64()), **dict.fromkeys(SPARSE_NAMES, pa.string())})
_STRINGS = pacsv.ConvertOptions(column_types=dict.fromkeys(COLUMNS, pa.string()),
                                strings_can_be_null=False)


def _gzip_error(path: Path, e: Exception) -> ValueError:
    return ValueError(f"{path}: truncated or corrupt gzip file ({e}); re-download or "
                      f"re-compress it")


def check_not_empty(path: Path) -> None:
    """Raise ValueError early for an empty input (or an unreadable gzip header)."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            empty = not f.read(1)
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:
        raise _gzip_error(path, e) from None
    if empty:
        raise ValueError(f"{path}: empty file (no rows); remove it from the inputs")


def no_valid_rows_error(paths: list[Path], fmt: str, lines: int) -> ValueError:
    """The error for inputs whose every row read (``lines`` of them) was a bad row, skipped:
    most likely not Criteo files at all. Shows why their first line is not a row."""
    opener = gzip.open if paths[0].suffix == ".gz" else open
    with opener(paths[0], "rb") as f:
        text = f.read(1 << 16).split(b"\n", 1)[0].rstrip(b"\r").decode("utf-8", "replace")
    shown = text if len(text) <= 60 else text[:60] + "..."
    names = ", ".join(map(str, paths)) if len(paths) <= 3 else \
        f"{paths[0]} ... {paths[-1]} ({len(paths)} files)"
    return ValueError(
        f"{names}: all {lines:,} rows read are bad rows (skipped with --on-bad-row skip), "
        f"e.g. {paths[0]}:1 {shown!r}: {row_problem(text)}. These are not Criteo {fmt} rows "
        f"(label, {NUM_DENSE} integer and {NUM_SPARSE} hex categorical fields, "
        f"tab-separated): check that these are the files you meant (not another dataset, a "
        f"comma-separated export or a file with only a header)")


def read_blocks(path: Path, block_bytes: int, offset: int = 0,
                end: int | None = None) -> Iterator[bytes]:
    """Whole lines of ``path`` (plain or .gz) from byte ``offset`` (of the decompressed data; a
    line start) up to ``end`` (a line start; default the end of the file) in blocks of about
    ``block_bytes``, each ending in a newline. A truncated or corrupt gzip raises ValueError
    naming the file."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            f.seek(offset)  # gzip: decompresses up to offset (no parsing)
            left = math.inf if end is None else end - offset
            rest = b""  # a line's start without its newline yet
            while left > 0 and (chunk := f.read(int(min(block_bytes, left)))):
                left -= len(chunk)
                cut = chunk.rfind(b"\n") + 1
                if not cut:
                    rest += chunk
                    continue
                # one copy of the block (none when it ends a chunk exactly)
                yield chunk if not rest and cut == len(chunk) else \
                    b"".join((rest, memoryview(chunk)[:cut]))
                rest = chunk[cut:]
            if rest:
                yield rest + b"\n"
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:
        raise _gzip_error(path, e) from None


def count_lines(path: Path, block_bytes: int = 16 << 20) -> int:
    """Number of lines of ``path`` (a last line without newline counts); an empty file raises
    ValueError. A bare ``bytes.count`` over large binary reads (no line splitting)."""
    opener = gzip.open if path.suffix == ".gz" else open
    n, last = 0, b"\n"
    try:
        with opener(path, "rb") as f:
            while chunk := f.read(max(block_bytes, 1 << 20)):
                n += fastparse.count_newlines(chunk)
                last = chunk[-1:]
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:
        raise _gzip_error(path, e) from None
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


def parse_hex(col: pa.Array) -> tuple[np.ndarray, np.ndarray]:
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
            bad[full] = (HEX_LUT[data.reshape(-1, 8)] == 255).any(axis=1)
        return out, bad
    # General path: right-align every value in an 8-wide window, leading positions are zeros.
    ends = offsets[1:] - offsets[0] + 8
    padded = np.concatenate([np.full(8, ord("0"), np.uint8), data])
    window = padded[ends[:, None] - 8 + np.arange(8)]
    used = np.arange(8) >= 8 - np.minimum(lengths, 8)[:, None]
    digits = np.where(used, HEX_LUT[window], 0)
    bad = (lengths > 8) | (digits == 255).any(axis=1)
    for k in range(8):
        out = (out << 4) | (digits[:, k] & 15)
    return out, bad


class Rows:
    """Parsed, validated rows of one block: labels, raw dense ints, raw categorical ids."""

    def __init__(self, label: np.ndarray, dense: np.ndarray, cats: list[np.ndarray],
                 lines: np.ndarray) -> None:
        self.label, self.dense, self.cats, self.lines = label, dense, cats, lines


def _has_long_line(buf: bytes) -> bool:
    """Whether some line may be longer than MAX_LINE_BYTES: a window of half that size without
    a newline (a few ``find`` calls per block, each stopping at the window's first newline)."""
    step = MAX_LINE_BYTES // 2
    return any(buf.find(b"\n", i, i + step) < 0 for i in range(0, len(buf) - step, step))


def _drop_unparsable(buf: bytes, lines: np.ndarray, path: Path,
                     on_bad_row: str) -> tuple[bytes, np.ndarray, int]:
    """Lines the CSV parser must never see: longer than MAX_LINE_BYTES, not UTF-8, or with a
    carriage return inside. Raise naming the first (file:line), or drop them (counted)."""
    arr = np.frombuffer(buf, np.uint8)
    nl = np.flatnonzero(arr == 10)
    starts = np.concatenate([[0], nl[:-1] + 1]).astype(np.int64)
    problems: dict[int, str] = {}
    for i in np.flatnonzero(nl - starts > MAX_LINE_BYTES):
        problems[int(i)] = (f"a line of {int(nl[i] - starts[i]):,} bytes, longer than "
                            f"{MAX_LINE_BYTES:,} (not a Criteo row)")
    cr = np.flatnonzero(arr == 13)
    stray = cr[arr[np.minimum(cr + 1, len(arr) - 1)] != 10] if len(cr) else cr
    for i in np.unique(np.searchsorted(nl, stray)):
        problems.setdefault(int(i), "a carriage return inside the row (binary data?)")
    try:
        buf.decode("utf-8")
    except UnicodeDecodeError:
        for i in range(len(nl)):
            if i not in problems:
                try:
                    buf[starts[i]:nl[i]].decode("utf-8")
                except UnicodeDecodeError as e:
                    problems[i] = f"bytes that are not UTF-8 text at column {e.start + 1}"
    if not problems:
        return buf, lines, 0
    if on_bad_row == "error":
        first = min(problems)
        raise bad_row_error(path, int(lines[first]), problems[first])
    keep = np.ones(len(nl), bool)
    keep[list(problems)] = False
    kept = b"".join(buf[s:e + 1] for s, e in zip(starts[keep], nl[keep], strict=True))
    return kept, lines[keep], len(problems)


def _parse_slow(buf: bytes, lines: np.ndarray, path: Path, on_bad_row: str,
                read: pacsv.ReadOptions) -> tuple:
    """parse_block's general path: drop/raise on rows with too many fields, pad short rows,
    and re-read as strings when a numeric field does not parse."""
    buf, lines, skipped = _drop_unparsable(buf, lines, path, on_bad_row)
    arr = np.frombuffer(buf, np.uint8)
    nl = np.flatnonzero(arr == 10)
    starts = np.concatenate([[0], nl[:-1] + 1])
    fields = np.diff(np.searchsorted(np.flatnonzero(arr == 9), nl), prepend=0) + 1

    too_many = fields > NUM_FIELDS
    if too_many.any():
        first = int(np.argmax(too_many))
        if on_bad_row == "error":
            raise bad_row_error(path, int(lines[first]), row_problem(
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
            end = int(nl[i]) - (nl[i] > starts[i] and buf[nl[i] - 1] == 13)  # before a CRLF's CR
            pieces += [buf[prev:end], b"\t" * int(NUM_FIELDS - fields[i])]
            prev = end
        pieces.append(buf[prev:])
        padded = b"".join(pieces)
    try:
        table = pacsv.read_csv(io.BytesIO(padded), read, _PARSE, _TYPED)
        label = table[LABEL].combine_chunks()
        bad = ~np.asarray(pc.fill_null(pc.is_in(label, pa.array([0, 1])), False))
        dense_cols = [pc.fill_null(table[n], 0).combine_chunks() for n in DENSE_NAMES]
    except pa.ArrowInvalid:
        # A non-numeric field: re-read as strings and find every bad row vectorized.
        try:
            table = pacsv.read_csv(io.BytesIO(padded), read, _PARSE, _STRINGS)
        except pa.ArrowException as e:  # the lines it could fail on were dropped above
            raise ValueError(f"{path}:{int(lines[0])}-{int(lines[-1])}: these lines could not "
                             f"be parsed ({str(e)[:100]}); check the file for binary "
                             f"data") from None
        bad = ~np.asarray(pc.is_in(table[LABEL], pa.array(["0", "1"])))
        for n in DENSE_NAMES:
            bad |= ~np.asarray(pc.match_substring_regex(
                table[n], rf"^(-?[0-9]{{1,{MAX_DENSE_DIGITS}}})?$"))
        label = None
        dense_cols = None
    return table, label, bad, dense_cols, lines, buf, skipped


def parse_block(buf: bytes, first_line: int, path: Path, on_bad_row: str,
                n_lines: int | None = None) -> tuple[Rows, int]:
    """Parse whole lines ``buf`` (line ``first_line`` is the first; ``n_lines`` lines if the
    caller counted them) into validated rows.

    Returns the rows and the number of bad rows skipped; with ``on_bad_row="error"`` the
    first bad row raises ValueError with file and line.
    """
    if n_lines is None:
        n_lines = fastparse.count_newlines(buf)
    lines = np.arange(first_line, first_line + n_lines)
    if (fast := fastparse.parse_rows(buf, n_lines)) is not None:
        label_values, dense_values, cat_values = fast  # every row valid (the strict format)
        return Rows(label_values, dense_values, list(cat_values), lines), 0
    skipped = 0
    read = pacsv.ReadOptions(column_names=list(COLUMNS))

    def line_text(i: int) -> str:
        # only on the error path: the i-th line of the (possibly filtered) current buf
        ends = np.flatnonzero(np.frombuffer(buf, np.uint8) == 10)
        start = int(ends[i - 1]) + 1 if i else 0
        return buf[start:int(ends[i])].decode("utf-8", "replace")

    table = None
    try:
        # Fast path (the real data): every row has exactly 40 numeric/hex fields, so the
        # block parses as is and the per-line field counting below is not needed.
        if not _has_long_line(buf):
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
            return Rows(np.zeros(0, np.float32), np.zeros((0, NUM_DENSE), np.int64),
                         [np.zeros(0, np.int64)] * NUM_SPARSE, lines), skipped
    cats, cat_bad = [], np.zeros(len(table), bool)
    for n in SPARSE_NAMES:
        ids, b = parse_hex(table[n].combine_chunks())
        cats.append(ids)
        cat_bad |= b
    bad |= cat_bad
    if bad.any():
        first = int(np.argmax(bad))
        if on_bad_row == "error":
            raise bad_row_error(path, int(lines[first]), row_problem(line_text(first)))
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
    return Rows(labels, dense, [c[keep] for c in cats], lines[keep]), skipped
