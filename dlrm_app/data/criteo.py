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
transform is vectorized. ``workers=N > 1`` runs that work in N processes (a fork server: no
state of the parent is inherited). Every path writes the same rows in the same order through
one shard writer, so the bytes are the same for every N and path. Shards are written to
``.staging/stage-*.parquet`` and renamed (or cut, below) to their final names at the end, so a
failed run leaves nothing finished-looking. Three paths:

* Bad rows are errors and every input is plain: rows are lines. A newline count over byte
  ranges (in the workers, about 1/10 of the parse time) gives each input's line count and an
  index of where its lines are, so every shard's lines are known; each worker reads, parses,
  encodes and writes whole shards. Nothing passes through the parent.
* Bad rows are errors, some input is gzip, ``workers > 1``: the parent decompresses (once) and
  cuts the lines into shards, spilling each shard's lines to ``.staging`` (the page cache, in
  practice); a worker parses, encodes and writes the shard as above.
* Otherwise (skipping bad rows, or gzip in one process): one streaming pass. The parent reads
  (and decompresses) blocks in a reader thread, the workers (or this process) parse and encode
  them, and the parent writes the rows in input order.

Where the split starts are known up front (plain inputs: counted; the terabyte validation
starts with the last day; a kaggle vocabulary needs the counts anyway), the staging shards
restart there and every one of them is a final shard. Where not (gzip: decompressed once, so
the splits are found at the end), a staging shard holding exactly a final shard's rows is
renamed and the rest (kaggle: about ``rows_per_shard + N / 7`` rows) is rewritten from staging
shards, in the workers.

Memory does not grow with the input (a 1TB day is streamed). A process that writes whole
shards (one process, or each worker) peaks at about 0.25 GB + 3 x ``block_bytes``, a gzip
parent that only cuts lines at about 0.1 GB + 3 x ``block_bytes``, plus the spilled lines of
at most ``2 * workers`` shards on disk. Streaming: one process about 0.2 GB + 10 x
``block_bytes``; with workers, each about 0.2 GB + 6 x ``block_bytes`` and the parent (up to
``2 * workers`` blocks and their encoded rows in flight) about 0.2 GB + (3 + 4 x workers) x
``block_bytes``. Measured with 32 MB blocks, in total: plain 0.4 GB (one process) / 0.8 GB
(two workers), gzip 0.5 / 0.9 GB. Add the vocabulary counts (one entry per distinct raw id)
and the line numbers of skipped bad rows (8 bytes each).

Resumption: each shard is written to a hidden temp name and renamed when complete, then a
small done-marker records its checksum; a rerun keeps every finished shard and redoes only
the others, and a killed run plus a rerun gives the same bytes as one uninterrupted run.
Finished shards are not re-parsed: shard tasks are skipped (a gzip input is still
decompressed to find the others), and a streaming staging shard's marker records the block
its last row came from, where a rerun resumes reading (a plain input seeks to it, gzip
decompresses up to it without parsing). ``dataset.json`` is written last.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import functools
import gzip
import hashlib
import importlib.metadata
import io
import json
import math
import multiprocessing
import os
import queue
import shutil
import signal
import sys
import threading
import zlib
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from tqdm import tqdm

from dlrm_app.data.criteo_parse import (
    _SCHEMA,
    DEFAULT_NUM_EMBEDDINGS,
    DENSE_NAMES,
    LABEL,
    NUM_SPARSE,
    RARE_ID,
    SPARSE_NAMES,
    VOCABULARY_FILE,
    _Encoder,
    count_lines,
    parse_block,
    read_blocks,
)
from dlrm_app.data.schema import (
    SPLIT_NAMES,
    DatasetKind,
    DatasetSpec,
    ShardFile,
    SparseFeature,
    SplitSpec,
    sha256_file,
)


def _finish_shard(out: Path, file: str, rows: int, fingerprint: str,
                  extra: dict | None = None) -> str:
    """Record a renamed, complete shard in its done-marker (a test hook wraps this)."""
    sha = sha256_file(out / file)
    marker = out / f".{file}.done"
    tmp = out / f".{file}.done.tmp"
    tmp.write_text(json.dumps({"sha256": sha, "rows": rows, "config": fingerprint,
                               **(extra or {})}))
    os.replace(tmp, marker)
    return sha


def _read_marker(directory: Path, file: str, fingerprint: str) -> dict | None:
    """The done-marker of ``file`` if it belongs to this configuration, else None."""
    marker = directory / f".{file}.done"
    if not marker.exists():
        return None
    done = json.loads(marker.read_text())
    return done if done.get("config") == fingerprint else None


class _ShardWriter:
    """One Parquet shard in row groups of exactly ``row_group_size`` rows (the last may be
    shorter), written to a hidden temp name and renamed by ``close``. The bytes depend only on
    the rows, not on how ``add`` calls cut them."""

    def __init__(self, directory: Path, file: str, row_group_size: int) -> None:
        self.directory, self.file, self.row_group_size = directory, file, row_group_size
        self.tmp = directory / f".{file}.tmp"
        self.writer: pq.ParquetWriter | None = pq.ParquetWriter(self.tmp, _SCHEMA)
        self.pending: list[pa.Table] = []
        self.pending_rows = self.rows = self.label_sum = 0

    def add(self, table: pa.Table) -> None:
        self.rows += len(table)
        self.label_sum += int(pc.sum(table[LABEL]).as_py() or 0)
        self.pending.append(table)
        self.pending_rows += len(table)
        while self.pending_rows >= self.row_group_size:
            self._flush(self.row_group_size)

    def _flush(self, n: int) -> None:
        # Copy only a row group that spans several added tables into one chunk (the writer is
        # given one chunk per column either way, so the bytes do not depend on the cutting).
        used, rows = 0, 0
        while rows < n:
            rows += len(self.pending[used])
            used += 1
        table = self.pending[0]
        if used > 1 or any(c.num_chunks != 1 for c in table.columns):
            table = pa.concat_tables(self.pending[:used]).combine_chunks()
        assert self.writer is not None
        self.writer.write_table(table.slice(0, n), row_group_size=n)
        rest = table.slice(n)
        self.pending = ([rest] if len(rest) else []) + self.pending[used:]
        self.pending_rows -= n

    def close(self) -> None:
        if self.pending_rows:
            self._flush(self.pending_rows)
        assert self.writer is not None
        self.writer.close()
        self.writer = None
        os.replace(self.tmp, self.directory / self.file)

    def abort(self) -> None:
        """Drop the temp file (a failed run leaves no finished-looking file)."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None
            self.tmp.unlink(missing_ok=True)


# ---- workers -----------------------------------------------------------------------------------

class _Runner(Protocol):
    """Runs tasks in order: in this process or in worker processes."""

    def map(self, fn: Callable[..., Any], tasks: Iterable[tuple]) -> Iterator[Any]:
        """``fn(*task)`` for each task, results in task order."""
        ...


class _InProcess:
    def map(self, fn: Callable[..., Any], tasks: Iterable[tuple]) -> Iterator[Any]:
        return (fn(*t) for t in tasks)


def _init_worker(threads: int) -> None:
    # The parent handles Ctrl-C (it cancels queued tasks and waits for running ones); pyarrow's
    # CSV reader gets an equal share of the cores instead of a full pool per worker.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    pa.set_cpu_count(threads)


class _Processes:
    """``workers`` processes started by a fork server (a clean process: no threads or torch
    state of the parent are inherited; it imports this module once, so workers start in about
    0.1 s); at most ``2 * workers`` tasks (blocks) in flight, so the input is read only as fast
    as it is consumed."""

    def __init__(self, workers: int) -> None:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["__main__", __name__])  # once the server starts
        threads = max(1, (os.cpu_count() or 1) // workers)
        self.pool = ProcessPoolExecutor(workers, mp_context=context, initializer=_init_worker,
                                        initargs=(threads,))
        self.depth = 2 * workers

    def map(self, fn: Callable[..., Any], tasks: Iterable[tuple]) -> Iterator[Any]:
        window: deque[Future] = deque()
        try:
            for t in tasks:
                window.append(self.pool.submit(fn, *t))
                if len(window) >= self.depth:
                    yield window.popleft().result()
            while window:
                yield window.popleft().result()
        except BrokenProcessPool as e:
            raise RuntimeError(f"a preprocessing worker process died ({e}); if it ran out of "
                               f"memory, pass fewer workers or a smaller block_bytes") from e


@contextlib.contextmanager
def _runner(workers: int) -> Iterator[_Runner]:
    if workers == 1:
        try:
            yield _InProcess()
        finally:
            _encoder.cache_clear()
        return
    runner = _Processes(workers)
    try:
        yield runner
    finally:
        # an error or interrupt: queued tasks are dropped, running ones finish (a block each)
        runner.pool.shutdown(wait=True, cancel_futures=True)


# ---- line counts and where the splits start ----------------------------------------------------

_INDEX_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True, slots=True)
class _LineIndex:
    """Newline counts of a plain input per range of ``step`` bytes: any line is found by
    reading one range."""

    step: int
    newlines: np.ndarray

    def locate(self, path: Path, line: int) -> int:
        """Byte offset where 0-based ``line`` starts (the file size past the last line)."""
        if line == 0:
            return 0
        before = np.cumsum(self.newlines)
        if line > before[-1]:  # after an unterminated last line
            return path.stat().st_size
        j = int(np.searchsorted(before, line))  # the range holding newline number ``line``
        k = line - (int(before[j - 1]) if j else 0)
        with open(path, "rb") as f:
            f.seek(j * self.step)
            chunk = f.read(self.step)
        return j * self.step + _nth_newline(chunk, k) + 1


def _nth_newline(data: bytes, n: int) -> int:
    """Index of the ``n``-th (1-based) newline of ``data``."""
    return int(np.flatnonzero(np.frombuffer(data, np.uint8) == 10)[n - 1])


def _count_part(path: Path, start: int, stop: int, step: int) -> list[int]:
    """Worker task: ``[lines]`` of a gzip input (the whole file), or the newlines of a plain
    one in each ``step`` bytes of [start, stop)."""
    if path.suffix == ".gz":
        return [count_lines(path)]
    with open(path, "rb") as f:
        f.seek(start)
        return [f.read(min(step, stop - a)).count(b"\n") for a in range(start, stop, step)]


def _line_counts(run: _Runner, paths: list[Path], which: list[bool], part: int,
                 step: int = _INDEX_BYTES) -> tuple[list[int | None], list[_LineIndex | None]]:
    """Line counts of the inputs marked in ``which`` (None for the others; a last line without
    newline counts) and, for plain ones, their newline counts per ``step`` bytes (one task
    per ``part`` bytes, rounded to whole steps)."""
    part = max(part // step, 1) * step
    tasks, owners = [], []  # owners[j]: the input of task j
    for i, (p, w) in enumerate(zip(paths, which, strict=True)):
        size = p.stat().st_size if w else 0
        length = max(size, 1) if p.suffix == ".gz" else part
        tasks += [(p, a, min(a + length, size), step) for a in range(0, size, length)]
        owners += [i] * (len(tasks) - len(owners))
    parts: list[list[int]] = [[] for _ in paths]
    for i, n in zip(owners, run.map(_count_part, tasks), strict=True):
        parts[i] += n
    counts: list[int | None] = []
    indexes: list[_LineIndex | None] = []
    for p, w, n in zip(paths, which, parts, strict=True):
        plain = w and p.suffix != ".gz"
        if plain:
            with open(p, "rb") as f:
                f.seek(-1, os.SEEK_END)
                n = [*n, f.read(1) != b"\n"]  # the unterminated last line
        counts.append(sum(n) if w else None)
        indexes.append(_LineIndex(step, np.asarray(n[:-1], np.int64)) if plain else None)
    return counts, indexes


def _split_starts(fmt: str, counts: list[int | None]) -> list[list[int]]:
    """Per input, the 0-based lines where validation and test start, where known without
    reading the data: kaggle needs every count, terabyte's validation starts the last day."""
    starts: list[list[int]] = [[] for _ in counts]
    if fmt == "terabyte":
        half = counts[-1]
        starts[-1] = [0] if half is None else [0, half // 2]
    elif None not in counts:
        total = sum(counts)
        train = total * 6 // 7
        offset = 0
        for i, n in enumerate(counts):
            starts[i] = [c - offset for c in (train, train + (total - train) // 2)
                         if offset <= c < offset + n]
            offset += n
    return starts


def _split_rows(fmt: str, input_lines: list[int], skipped: list[int]) -> list[int]:
    """Row edges [0, train end, validation end, rows] of the contiguous splits (see the module
    doc: the rule counts lines, bad rows included)."""
    total = sum(input_lines)
    if fmt == "kaggle":
        train = total * 6 // 7
        val = train + (total - train) // 2
    else:
        train = total - input_lines[-1]
        val = train + input_lines[-1] // 2
    bad = np.sort(np.asarray(skipped, np.int64))
    return [0, *(int(x - np.searchsorted(bad, x)) for x in (train, val, total))]


# ---- staging shards; the streaming pass: blocks -> (workers) parse + encode -> the parent ---

STAGING_DIR = ".staging"
"""Subfolder of the output for the single pass's shards (removed when the run finishes)."""


def _stage_file(k: int) -> str:
    return f"stage-{k:05d}.parquet"


@dataclasses.dataclass(frozen=True, slots=True)
class _Block:
    """Whole lines of one input: its index, the byte offset and 1-based line of the first."""

    input: int
    offset: int
    line: int
    lines: int
    data: bytes


@dataclasses.dataclass(frozen=True, slots=True)
class _Encoded:
    """A block's encoded rows and the 1-based lines of its skipped bad rows (sorted)."""

    input: int
    offset: int
    line: int
    lines: int
    table: pa.Table
    skipped: np.ndarray


@dataclasses.dataclass(frozen=True, slots=True)
class _EncodeSpec:
    """What a worker needs to build the encoder (a vocabulary is loaded once per process)."""

    num_embeddings: tuple[int, ...]
    vocabulary: str | None = None
    vocabulary_sha256: str | None = None


@functools.lru_cache(maxsize=1)
def _encoder(spec: _EncodeSpec) -> _Encoder:
    vocab = None if spec.vocabulary is None else load_vocabulary(Path(spec.vocabulary).parent)
    return _Encoder(list(spec.num_embeddings), vocab)


def _blocks(paths: Sequence[Path], block_bytes: int, start: tuple[int, int, int] = (0, 0, 1),
            max_lines: Sequence[float] | None = None) -> Iterator[_Block]:
    """Blocks of all inputs in order from ``start`` = (input, byte offset, line); with
    ``max_lines``, input i is read only until its first ``max_lines[i]`` lines are covered."""
    first, offset, line = start
    for i in range(first, len(paths)):
        if i > first:
            offset, line = 0, 1
        if max_lines is not None and max_lines[i] < line:
            continue
        for data in read_blocks(paths[i], block_bytes, offset):
            n = data.count(b"\n")
            yield _Block(i, offset, line, n, data)
            offset += len(data)
            line += n
            if max_lines is not None and max_lines[i] < line:
                break


_T = TypeVar("_T")


def _prefetch(items: Iterator[_T], depth: int = 1) -> Iterator[_T]:
    """``items``, produced up to ``depth`` ahead by a thread: reading and gzip decompression
    release the GIL, so they overlap with parsing (one process) or writing (the parent)."""
    slots: queue.Queue = queue.Queue(depth)
    stop = threading.Event()

    def produce() -> None:
        try:
            for item in items:
                slots.put((True, item))
                if stop.is_set():
                    return
            slots.put((False, None))
        except BaseException as e:  # handed to the consumer, raised there
            slots.put((False, e))
        finally:
            items.close()

    thread = threading.Thread(target=produce, name="criteo-reader", daemon=True)
    thread.start()
    try:
        while True:
            more, item = slots.get()
            if not more:
                if item is not None:
                    raise item
                return
            yield item
    finally:
        stop.set()
        while thread.is_alive():  # unblock a waiting put until the thread sees ``stop``
            with contextlib.suppress(queue.Empty):
                slots.get(timeout=0.01)
        thread.join()


def _encode_block(path: Path, block: _Block, on_bad_row: str, spec: _EncodeSpec) -> _Encoded:
    """Worker task of the main pass."""
    rows, skipped = parse_block(block.data, block.line, path, on_bad_row, block.lines)
    bad = np.zeros(0, np.int64)
    if skipped:
        bad = np.setdiff1d(np.arange(block.line, block.line + block.lines), rows.lines)
    table = _encoder(spec).encode(rows, slice(None))
    return _Encoded(block.input, block.offset, block.line, block.lines, table, bad)


def _count_ids(path: Path, block: _Block, on_bad_row: str,
               train_lines: float) -> list[tuple[np.ndarray, np.ndarray]]:
    """Worker task of the vocabulary pass: per feature, the distinct raw ids of the block's
    train rows (its lines up to ``train_lines`` of the input) and their counts."""
    rows, _ = parse_block(block.data, block.line, path, on_bad_row, block.lines)
    n_train = int(np.searchsorted(rows.lines, train_lines, side="right"))
    return [np.unique(c[:n_train], return_counts=True) for c in rows.cats]


class _StagingWriter:
    """The single pass's output: every kept row in input order, cut into shards of
    ``rows_per_shard`` rows (``.staging/stage-00000.parquet``, ...) that restart at every known
    split start, so that where the splits are known up front every shard is final. Each
    shard's done-marker holds its first row and where to resume reading (the block its last
    row came from, and the bookkeeping up to it): a rerun neither rewrites nor re-parses
    finished shards."""

    def __init__(self, staging: Path, rows_per_shard: int, row_group_size: int,
                 fingerprint: str, done: list[dict]) -> None:
        self.staging, self.fingerprint = staging, fingerprint
        self.rows_per_shard, self.row_group_size = rows_per_shard, row_group_size
        self.shards = done
        resume = done[-1]["resume"] if done else {
            "input": 0, "offset": 0, "line": 1, "row": 0, "input_lines": [], "skipped": []}
        self.start = (resume["input"], resume["offset"], resume["line"])
        self.row = resume["row"]  # global index of the next block's first kept row
        # rows before this are staged already (the resume block is re-read from its start)
        self.keep_from = done[-1]["first_row"] + done[-1]["rows"] if done else 0
        self.input_lines: list[int] = list(resume["input_lines"])
        self.lines = resume["line"] - 1  # lines of the current input seen so far
        self.skipped: list[int] = [s for d in done for s in d["resume"]["skipped"]]
        self.pending: list[int] = []  # global 0-based lines of bad rows since the last marker
        self.writer: _ShardWriter | None = None
        self.first_row = 0
        self.position: dict = {}

    def add(self, enc: _Encoded, split_starts: Sequence[int]) -> None:
        """Append one block's rows (blocks in input order); ``split_starts`` are the 0-based
        lines of the input in this block where a split starts."""
        if enc.input != len(self.input_lines):
            assert enc.input == len(self.input_lines) + 1, "inputs are checked to be non-empty"
            self.input_lines.append(self.lines)
            self.lines = 0
        self.position = {"input": enc.input, "offset": enc.offset, "line": enc.line,
                         "row": self.row, "input_lines": list(self.input_lines)}
        # a split start at line c: the rows before it are the block's lines before c, less the
        # skipped ones
        cuts = [c - (enc.line - 1) - int(np.searchsorted(enc.skipped, c, side="right"))
                for c in split_starts]
        edges = [0, *cuts, len(enc.table)]
        for a, b, new_split in zip(edges[:-1], edges[1:], [False] + [True] * len(cuts),
                                   strict=True):
            if new_split and self.row + a >= self.keep_from and self.writer is not None:
                self._close()
            self._append(enc.table, max(a, self.keep_from - self.row), b)
        self.row += len(enc.table)
        bad = (sum(self.input_lines) + enc.skipped - 1).tolist()
        self.pending += bad
        self.skipped += bad
        self.lines = enc.line - 1 + enc.lines

    def _append(self, table: pa.Table, a: int, b: int) -> None:
        while a < b:
            if self.writer is None:
                self.first_row = self.row + a
                self.writer = _ShardWriter(self.staging, _stage_file(len(self.shards)),
                                           self.row_group_size)
            take = min(b - a, self.rows_per_shard - self.writer.rows)
            self.writer.add(table.slice(a, take))
            a += take
            if self.writer.rows == self.rows_per_shard:
                self._close()

    def _close(self) -> None:
        w = self.writer
        assert w is not None
        w.close()
        self.writer = None
        extra = {"first_row": self.first_row, "label_sum": w.label_sum,
                 "resume": {**self.position, "skipped": self.pending}}
        sha = _finish_shard(self.staging, w.file, w.rows, self.fingerprint, extra)
        self.shards.append({"sha256": sha, "rows": w.rows, **extra})
        self.pending = []

    def finish(self) -> None:
        """Close the last partial shard; ``input_lines`` is complete afterwards."""
        self.input_lines.append(self.lines)
        if self.writer is not None:
            self._close()

    def abort(self) -> None:
        if self.writer is not None:
            self.writer.abort()
            self.writer = None


def _done_stage_shard(out: Path, k: int, fingerprint: str) -> dict | None:
    """The marker of staging shard ``k`` if a previous run of this configuration finished it
    (the file is in ``.staging`` or, once renamed, at its final name, checksum intact)."""
    marker = _read_marker(out / STAGING_DIR, _stage_file(k), fingerprint)
    if marker is None:
        return None
    places = [out / STAGING_DIR / _stage_file(k)]
    if "renamed_to" in marker:
        places.append(out / marker["renamed_to"])
    return marker if any(p.exists() and sha256_file(p) == marker["sha256"] for p in places) \
        else None


def _stage(run: _Runner, paths: list[Path], out: Path, spec: _EncodeSpec,
           split_starts: list[list[int]], rows_per_shard: int, row_group_size: int,
           on_bad_row: str, block_bytes: int, fingerprint: str,
           total_lines: int | None) -> _StagingWriter:
    """The single pass over all inputs, resumed after the last finished staging shard."""
    staging = out / STAGING_DIR
    staging.mkdir(exist_ok=True)
    done: list[dict] = []  # the leading finished shards: the rest is redone
    while (marker := _done_stage_shard(out, len(done), fingerprint)) is not None:
        done.append(marker)
    stream = _StagingWriter(staging, rows_per_shard, row_group_size, fingerprint, done)
    progress = tqdm(total=total_lines, unit="rows", unit_scale=True, desc="criteo",
                    disable=not sys.stderr.isatty(), initial=stream.row)
    try:
        with contextlib.closing(_prefetch(_blocks(paths, block_bytes, stream.start))) as blocks:
            tasks = ((paths[b.input], b, on_bad_row, spec) for b in blocks)
            for enc in run.map(_encode_block, tasks):
                stream.add(enc, [c for c in split_starts[enc.input]
                                 if enc.line - 1 <= c < enc.line - 1 + enc.lines])
                progress.update(len(enc.table))
        stream.finish()
    finally:
        progress.close()
        stream.abort()
    return stream


# ---- bad rows are errors, so rows are lines: workers write whole shards -----------------------

def _write_stage_shard(staging: Path, k: int, first_row: int,
                       pieces: list[tuple[Path, int, int, _LineIndex | Path]],
                       spec: _EncodeSpec, block_bytes: int, row_group_size: int,
                       fingerprint: str) -> tuple[int, dict]:
    """Worker task: read, parse, encode and write staging shard ``k`` from ``pieces`` (input,
    first 0-based line, lines, where they are: the plain input's line index, or a file the
    lines were spilled to, deleted when done); returns ``k`` and its done-marker."""
    w = _ShardWriter(staging, _stage_file(k), row_group_size)
    try:
        for path, line, n, source in pieces:
            if isinstance(source, _LineIndex):
                end = source.locate(path, line + n)  # the next line's start (or the file's end)
                reader = read_blocks(path, block_bytes, source.locate(path, line), end)
            else:
                reader = read_blocks(source, block_bytes)
            with contextlib.closing(_prefetch(reader)) as blocks:
                for data in blocks:
                    lines = data.count(b"\n")
                    rows, _ = parse_block(data, line + 1, path, "error", lines)
                    w.add(_encoder(spec).encode(rows, slice(None)))
                    line += lines
        w.close()
    finally:
        w.abort()
    extra = {"first_row": first_row, "label_sum": w.label_sum}
    sha = _finish_shard(staging, w.file, w.rows, fingerprint, extra)
    for *_, source in pieces:
        if isinstance(source, Path):
            source.unlink()
    return k, {"sha256": sha, "rows": w.rows, **extra}


def _stage_shards(run: _Runner, paths: list[Path], out: Path, fmt: str, counts: list[int],
                  indexes: list[_LineIndex], rows_per_shard: int, spec: _EncodeSpec,
                  block_bytes: int, row_group_size: int, fingerprint: str) -> list[dict]:
    """Plain inputs: every final shard is one task (the splits are known from the line counts),
    written to ``.staging`` by the workers in any order; a rerun skips the finished ones."""
    edges = _split_rows(fmt, counts, [])
    starts = np.cumsum([0, *counts]).tolist()  # global line of each input's first line
    plan = []  # (first row = first global line, pieces)
    for a, b in zip(edges[:-1], edges[1:], strict=True):
        for first in range(a, b, rows_per_shard):
            last = min(first + rows_per_shard, b)
            plan.append((first, [(paths[i], max(first, s) - s, min(last, s + n) - max(first, s),
                                  indexes[i])
                                 for i, (s, n) in enumerate(zip(starts[:-1], counts, strict=True))
                                 if max(first, s) < min(last, s + n)]))
    shards = [_done_stage_shard(out, k, fingerprint) for k in range(len(plan))]
    tasks = ((k, first, pieces) for k, (first, pieces) in enumerate(plan) if shards[k] is None)
    return _run_shard_tasks(run, out, tasks, shards, spec, block_bytes, row_group_size,
                            fingerprint, total=edges[-1])


def _run_shard_tasks(run: _Runner, out: Path, tasks: Iterable[tuple[int, int, list]],
                     shards: list[dict | None], spec: _EncodeSpec, block_bytes: int,
                     row_group_size: int, fingerprint: str, total: int | None) -> list[dict]:
    """Run (k, first row, pieces) shard tasks; ``shards`` gets each one's marker."""
    staging = out / STAGING_DIR
    staging.mkdir(exist_ok=True)
    progress = tqdm(total=total, unit="rows", unit_scale=True, desc="criteo",
                    disable=not sys.stderr.isatty())
    try:
        for k, marker in run.map(_write_stage_shard, (
                (staging, k, first, pieces, spec, block_bytes, row_group_size, fingerprint)
                for k, first, pieces in tasks)):
            shards[k] = marker
            progress.update(marker["rows"])
    finally:
        progress.close()
    return shards  # type: ignore[return-value]


class _Spiller:
    """gzip input, workers: this process only decompresses (once) and cuts the lines into
    staging shards of ``rows_per_shard`` lines that restart at every known split start,
    spilling each shard's lines to ``.staging/stage-k.<piece>.tsv`` (the page cache, in
    practice: at most ``2 * workers`` shards are in flight) for a worker to parse, encode and
    write. A rerun still decompresses all, but neither spills nor parses finished shards."""

    def __init__(self, paths: list[Path], out: Path, split_starts: list[list[int]],
                 rows_per_shard: int, fingerprint: str) -> None:
        self.paths, self.out, self.split_starts = paths, out, split_starts
        self.rows_per_shard, self.fingerprint = rows_per_shard, fingerprint
        self.input_lines: list[int] = []
        self.lines = 0  # lines of the current input so far
        self.shards: list[dict | None] = []  # done-markers; None: written by a task
        self.first_row = self.rows = 0  # the open shard's first row (= global line) and rows
        self.pieces: list[tuple[Path, int, int, Path]] = []  # one per input in the shard
        self.piece_input = -1
        self.file: io.BufferedWriter | None = None

    def tasks(self, blocks: Iterable[_Block]) -> Iterator[tuple[int, int, list]]:
        """(k, first row, pieces) for every shard to write, as its lines are spilled."""
        try:
            yield from self._tasks(blocks)
        finally:  # stopped early (an error): the open spill file
            if self.file is not None:
                self.file.close()

    def _tasks(self, blocks: Iterable[_Block]) -> Iterator[tuple[int, int, list]]:
        for b in blocks:
            if b.input != len(self.input_lines):  # the previous input ended
                self.input_lines.append(self.lines)
            self.lines = b.line - 1 + b.lines
            cuts = [c - (b.line - 1) for c in self.split_starts[b.input]
                    if b.line - 1 <= c < b.line - 1 + b.lines]
            newlines = None if not cuts and b.lines <= self.rows_per_shard - self.rows \
                else np.flatnonzero(np.frombuffer(b.data, np.uint8) == 10)
            pos = 0
            while pos < b.lines:
                if cuts and cuts[0] == pos:
                    cuts.pop(0)
                    if (task := self._close()) is not None:
                        yield task
                    continue
                take = min(b.lines - pos, self.rows_per_shard - self.rows,
                           cuts[0] - pos if cuts else b.lines)
                self._spill(b, pos, take, newlines)
                pos += take
                if self.rows == self.rows_per_shard and (task := self._close()) is not None:
                    yield task
        self.input_lines.append(self.lines)
        if (task := self._close()) is not None:
            yield task

    def _spill(self, b: _Block, pos: int, take: int, newlines: np.ndarray | None) -> None:
        if self.rows == 0:  # a new shard
            self.shards.append(_done_stage_shard(self.out, len(self.shards), self.fingerprint))
        k = len(self.shards) - 1
        if self.shards[k] is None:  # not finished by an earlier run
            if not self.pieces or self.piece_input != b.input:
                spill = self.out / STAGING_DIR / f"stage-{k:05d}.{len(self.pieces)}.tsv"
                if self.file is not None:
                    self.file.close()
                self.file = open(spill, "wb")  # closed with the piece or the shard
                self.pieces.append((self.paths[b.input], b.line - 1 + pos, 0, spill))
                self.piece_input = b.input
            start = 0 if pos == 0 else int(newlines[pos - 1]) + 1
            end = len(b.data) if newlines is None else int(newlines[pos + take - 1]) + 1
            self.file.write(memoryview(b.data)[start:end])
            path, line, n, spill = self.pieces[-1]
            self.pieces[-1] = (path, line, n + take, spill)
        self.rows += take

    def _close(self) -> tuple[int, int, list] | None:
        """End the open shard; its task unless an earlier run finished it."""
        if self.rows == 0:
            return None
        if self.file is not None:
            self.file.close()
            self.file = None
        k, first, pieces = len(self.shards) - 1, self.first_row, self.pieces
        self.first_row += self.rows
        self.rows, self.pieces = 0, []
        return (k, first, pieces) if self.shards[k] is None else None


# ---- once the line counts are known: staging shards -> train / validation / test shards -----

def _rewrite_shard(out: Path, file: str, pieces: list[tuple[str, int, int]],
                   row_group_size: int, fingerprint: str) -> tuple[str, int]:
    """Worker task: write final shard ``file`` from row ranges (stage file, first row, rows) of
    staging shards, one row group at a time; returns its checksum and label sum."""
    w = _ShardWriter(out, file, row_group_size)
    try:
        for stage, first, n in pieces:
            with pq.ParquetFile(out / STAGING_DIR / stage) as pf:
                row = 0
                for g in range(pf.num_row_groups):
                    size = pf.metadata.row_group(g).num_rows
                    lo, hi = max(first, row), min(first + n, row + size)
                    if lo < hi:
                        part = pf.read_row_group(g).slice(lo - row, hi - lo)
                        w.add(pa.Table.from_arrays(part.columns, schema=_SCHEMA))
                    row += size
        w.close()
    finally:
        w.abort()
    sha = _finish_shard(out, file, w.rows, fingerprint, {"label_sum": w.label_sum})
    return sha, w.label_sum


def _finalize(run: _Runner, out: Path, stage: list[dict], edges: list[int],
              rows_per_shard: int, row_group_size: int, fingerprint: str) -> tuple[SplitSpec, ...]:
    """Cut rows [edges[s], edges[s + 1]) into split s's shards. A shard with exactly the rows of
    a staging shard is that file renamed (every shard where the split starts were known up
    front, else every train shard but the last); the rest are rewritten from staging shards,
    in the workers."""
    staging = out / STAGING_DIR
    if sum(m["rows"] for m in stage) != edges[-1]:
        raise RuntimeError(f"{staging}: staged rows do not add up to the input's; delete "
                           f"{out} and rerun")
    by_rows = {(m["first_row"], m["rows"]): k for k, m in enumerate(stage)}
    firsts = [m["first_row"] for m in stage]
    plan: list[tuple[str, str, int, int]] = []  # (split, file, first row, rows)
    for split, a, b in zip(SPLIT_NAMES, edges[:-1], edges[1:], strict=True):
        plan += [(split, f"{split}-{j:05d}.parquet", s, min(s + rows_per_shard, b) - s)
                 for j, s in enumerate(range(a, b, rows_per_shard))]
    results: dict[str, tuple[str, int]] = {}  # file -> (sha256, label sum)
    tasks = []
    for _, file, first, n in plan:
        k = by_rows.get((first, n))
        if k is not None:
            if stage[k].get("renamed_to") != file:  # recorded first: a kill may fall between
                stage[k]["renamed_to"] = file
                marker = staging / f".{_stage_file(k)}.done"
                marker.write_text(json.dumps({**stage[k], "config": fingerprint}))
            if (staging / _stage_file(k)).exists():
                os.replace(staging / _stage_file(k), out / file)
            results[file] = (stage[k]["sha256"], stage[k]["label_sum"])
            continue
        done = _read_marker(out, file, fingerprint)
        if done is not None and (out / file).exists() and \
                sha256_file(out / file) == done["sha256"]:
            results[file] = (done["sha256"], done["label_sum"])
            continue
        pieces = []
        k = bisect.bisect_right(firsts, first) - 1
        while n:
            offset = first - stage[k]["first_row"]
            take = min(n, stage[k]["rows"] - offset)
            pieces.append((_stage_file(k), offset, take))
            first, n, k = first + take, n - take, k + 1
        tasks.append((out, file, pieces, row_group_size, fingerprint))
    for task, result in zip(tasks, run.map(_rewrite_shard, tasks), strict=True):
        results[task[1]] = result
    splits = []
    for split, a, b in zip(SPLIT_NAMES, edges[:-1], edges[1:], strict=True):
        shards = tuple(ShardFile(file=f, rows=n, sha256=results[f][0],
                                 row_group_size=row_group_size)
                       for s, f, _, n in plan if s == split)
        label_sum = sum(results[f][1] for s, f, _, _ in plan if s == split)
        splits.append(SplitSpec(name=split, label_rate=label_sum / (b - a) if b > a else 0.0,
                                shards=shards))
    return tuple(splits)


# ---- encodings -------------------------------------------------------------------------------

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


def _build_vocabulary(run: _Runner, paths: list[Path], fmt: str, counts: list[int | None],
                      threshold: int, block_bytes: int, on_bad_row: str) -> list[np.ndarray]:
    """Sorted raw ids seen at least ``threshold`` times in the train split, per feature. Only
    the train lines are read (kaggle: ``counts`` has every input's line count)."""
    if fmt == "kaggle":
        assert None not in counts
        train = sum(counts) * 6 // 7
        starts = np.cumsum([0, *counts[:-1]])
        train_lines: list[float] = [min(max(train - s, 0), n) for s, n in zip(
            starts.tolist(), counts, strict=True)]
    else:
        train_lines = [math.inf] * (len(paths) - 1) + [0]
    uniq = [np.zeros(0, np.int64)] * NUM_SPARSE
    counts_ = [np.zeros(0, np.int64)] * NUM_SPARSE
    with contextlib.closing(_prefetch(_blocks(paths, block_bytes, max_lines=train_lines))) \
            as blocks:
        tasks = ((paths[b.input], b, on_bad_row, train_lines[b.input]) for b in blocks)
        for per_feature in run.map(_count_ids, tasks):
            for k, (u, c) in enumerate(per_feature):
                merged, inv = np.unique(np.concatenate([uniq[k], u]), return_inverse=True)
                counts_[k] = np.bincount(inv, np.concatenate([counts_[k], c]),
                                         minlength=len(merged)).astype(np.int64)
                uniq[k] = merged
    return [u[c >= threshold] for u, c in zip(uniq, counts_, strict=True)]


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


def _choose_encoding(run: _Runner, paths: list[Path], out: Path, fmt: str,
                     counts: list[int | None],
                     num_embeddings_per_feature: int | Sequence[int] | None,
                     frequency_threshold: int | None, like: str | os.PathLike[str] | None,
                     block_bytes: int, on_bad_row: str) -> dict:
    """The ``encoding`` record of dataset.json; a vocabulary is built or copied into ``out``."""
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
        encoding["like"] = str(like)
        return encoding
    if frequency_threshold is not None:
        if num_embeddings_per_feature is not None:
            raise ValueError("pass num_embeddings_per_feature or frequency_threshold, not both")
        if frequency_threshold < 1:
            raise ValueError(f"frequency_threshold must be >= 1, got {frequency_threshold}")
        vocab = _build_vocabulary(run, paths, fmt, counts, frequency_threshold, block_bytes,
                                  on_bad_row)
        return {"mode": "vocabulary", "frequency_threshold": frequency_threshold,
                "rare_id": RARE_ID, "vocabulary_sha256": _save_vocabulary(out, vocab),
                "num_embeddings": [len(v) + 1 for v in vocab]}
    n = DEFAULT_NUM_EMBEDDINGS if num_embeddings_per_feature is None \
        else num_embeddings_per_feature
    sizes = [int(n)] * NUM_SPARSE if isinstance(n, int) else [int(x) for x in n]
    if len(sizes) != NUM_SPARSE or min(sizes) < 1:
        raise ValueError(f"num_embeddings_per_feature must be one positive int or "
                         f"{NUM_SPARSE}, got {n}")
    return {"mode": "hash", "num_embeddings": sizes}


def _many_shards(paths: list[Path], rows_per_shard: int, workers: int) -> bool:
    """Whether the inputs likely hold 2 shards per worker (gzip Criteo holds about 10 rows per
    KB; a plain file fewer, so this errs high): only then do whole-shard tasks beat streaming
    (a shard's worker starts when its last line is read)."""
    return sum(p.stat().st_size for p in paths) // 1024 * 8 >= 2 * workers * rows_per_shard


def _preprocess(paths: list[Path], out: Path, fmt: str,
                num_embeddings_per_feature: int | Sequence[int] | None,
                frequency_threshold: int | None, rows_per_shard: int, row_group_size: int,
                on_bad_row: str, like: str | os.PathLike[str] | None, block_bytes: int,
                workers: int) -> tuple[tuple[SplitSpec, ...], list[int], dict, list[int], list]:
    """preprocess_criteo's work, with its workers: the splits, table sizes, encoding record,
    input line counts and skipped lines."""
    with _runner(workers) as run:
        # Line counts up front where cheap (plain files: a newline count over byte ranges, in
        # the workers) or needed anyway (a kaggle vocabulary); a gzip input is decompressed
        # once. With bad rows as errors, rows are lines and the workers write whole shards:
        # plain inputs are read by the workers, gzip is cut into shards here (see the doc).
        plain = [p.suffix != ".gz" for p in paths]
        direct = all(plain) and on_bad_row == "error"
        spill = not direct and on_bad_row == "error" and workers > 1 and \
            _many_shards(paths, rows_per_shard, workers)
        if direct:
            which = [True] * len(paths)
        elif fmt == "terabyte":
            which = [False] * (len(paths) - 1) + plain[-1:]
        else:
            which = [all(plain) or frequency_threshold is not None] * len(paths)
        counts, indexes = _line_counts(run, paths, which, block_bytes)
        encoding = _choose_encoding(run, paths, out, fmt, counts, num_embeddings_per_feature,
                                    frequency_threshold, like, block_bytes, on_bad_row)
        num_embeddings = list(encoding["num_embeddings"])
        spec = _EncodeSpec(tuple(num_embeddings))
        if encoding["mode"] == "vocabulary":
            spec = _EncodeSpec(tuple(num_embeddings), str(out / VOCABULARY_FILE),
                               encoding["vocabulary_sha256"])
        # block_bytes and workers are left out: they do not change a byte of the output
        config = {"inputs": [[str(p), p.stat().st_size, p.stat().st_mtime_ns] for p in paths],
                  "fmt": fmt, "encoding": encoding, "rows_per_shard": rows_per_shard,
                  "row_group_size": row_group_size, "on_bad_row": on_bad_row}
        fingerprint = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()
        shard_args = (spec, block_bytes, row_group_size, fingerprint)
        if direct:
            staged = _stage_shards(run, paths, out, fmt, counts, indexes, rows_per_shard,
                                   *shard_args)
            input_lines, skipped = counts, []
        elif spill:
            spiller = _Spiller(paths, out, _split_starts(fmt, counts), rows_per_shard,
                               fingerprint)
            with contextlib.closing(_prefetch(_blocks(paths, block_bytes))) as blocks:
                staged = _run_shard_tasks(run, out, spiller.tasks(blocks), spiller.shards,
                                          *shard_args, total=None)
            input_lines, skipped = spiller.input_lines, []
        else:
            stream = _stage(run, paths, out, spec, _split_starts(fmt, counts), rows_per_shard,
                            row_group_size, on_bad_row, block_bytes, fingerprint,
                            None if None in counts else sum(counts))
            staged, input_lines, skipped = stream.shards, stream.input_lines, stream.skipped
        for p, n, m in zip(paths, counts, input_lines, strict=True):
            if n is not None and n != m:
                raise ValueError(f"{p}: {n} lines when counted, {m} when read; the file "
                                 f"changed during the run, rerun when it is complete")
        edges = _split_rows(fmt, input_lines, skipped)
        splits = _finalize(run, out, staged, edges, rows_per_shard, row_group_size, fingerprint)
    return splits, num_embeddings, encoding, input_lines, skipped


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
    workers: int = 1,
) -> DatasetSpec:
    """Preprocess Criteo TSV files into ``out_dir`` (shards + dataset.json); see the module doc.

    Encoding: modulo hashing into ``num_embeddings_per_feature`` (one int or 26; default
    40,000,000) or, with ``frequency_threshold=K``, a train-split vocabulary; ``like`` reuses
    an existing dataset's encoding instead (its vocabulary is copied). Bad rows raise
    ValueError with file and line, or with ``on_bad_row="skip"`` are dropped and counted in
    ``parameters["skipped_rows"]``. Empty or truncated (gzip) inputs always raise.
    ``workers > 1`` runs the parsing, encoding and (plain input) shard writing in that many
    processes; the output is byte-identical for every ``workers``. As with any
    multiprocessing, a script that passes ``workers > 1`` needs the
    ``if __name__ == "__main__":`` guard.
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
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be a positive int, got {workers!r}")
    for p in paths:
        if not p.is_file():
            raise ValueError(f"{p}: input file not found")
        _check_not_empty(p)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "dataset.json").unlink(missing_ok=True)  # a run in progress is not finished
    try:
        splits, num_embeddings, encoding, input_lines, skipped = _preprocess(
            paths, out, fmt, num_embeddings_per_feature, frequency_threshold, rows_per_shard,
            row_group_size, on_bad_row, like, block_bytes, workers)
    finally:  # after the workers stopped: spilled lines of shards not written (after an error)
        for spilled in (out / STAGING_DIR).glob("*.tsv"):
            spilled.unlink()
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
            "input_lines": input_lines,
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
            "skipped_rows": len(skipped),
        },
        created_by=f"dlrm_app {importlib.metadata.version('recsys-dlrm')}",
    )
    spec.save(out)
    shutil.rmtree(out / STAGING_DIR)
    return spec
