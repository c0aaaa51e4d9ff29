"""Atomic Parquet shards: row groups of a fixed size, temp name + rename, done-markers.

Every preprocessor writes its shards through this module, so that a file under its final name
is always complete (a killed run leaves only hidden ``.<file>.tmp`` files) and a rerun can keep
the shards a previous run finished:

* :class:`ShardWriter` writes one shard in row groups of exactly ``row_group_size`` rows (the
  last may be shorter) to ``.<file>.tmp`` and renames it on ``close``. The bytes depend only on
  the rows, not on how ``add`` calls cut them.
* :func:`finish_shard` records a renamed shard's checksum (and whatever the caller needs to
  resume) in a small done-marker ``.<file>.done``; :func:`read_marker` reads it back if it was
  written by the same configuration (``fingerprint``).
* :func:`write_split_shards` cuts a table held in memory into a split's shards.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dlrm_app.data.schema import ShardFile, sha256_file


class ShardWriter:
    """One Parquet shard in row groups of exactly ``row_group_size`` rows (the last may be
    shorter), written to a hidden temp name and renamed by ``close``. With ``label``, the sum
    of that column over the rows written is kept in ``label_sum``.

    With ``background=True`` the row groups are encoded and written by a thread (pyarrow
    releases the GIL), at most ``IN_FLIGHT`` of them at a time, while the caller makes the next
    rows: the same bytes, in the same order; an error of a write is raised by a later ``add``
    or by ``close``."""

    IN_FLIGHT = 2

    def __init__(self, directory: Path, file: str, schema: pa.Schema, row_group_size: int,
                 label: str | None = None, *, background: bool = False) -> None:
        self.directory, self.file, self.row_group_size = directory, file, row_group_size
        self.label = label
        self.tmp = directory / f".{file}.tmp"
        self.writer: pq.ParquetWriter | None = pq.ParquetWriter(self.tmp, schema)
        self.pending: list[pa.Table] = []
        self.pending_rows = self.rows = self.label_sum = 0
        self.thread = ThreadPoolExecutor(1, "shard-writer") if background else None
        self.writing: deque[Future] = deque()

    def add(self, table: pa.Table) -> None:
        self.rows += len(table)
        if self.label is not None:
            self.label_sum += int(pc.sum(table[self.label]).as_py() or 0)
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
        if self.thread is None:
            self.writer.write_table(table.slice(0, n), row_group_size=n)
        else:
            while len(self.writing) >= self.IN_FLIGHT:
                self.writing.popleft().result()
            self.writing.append(self.thread.submit(self.writer.write_table, table.slice(0, n),
                                                   row_group_size=n))
        rest = table.slice(n)
        self.pending = ([rest] if len(rest) else []) + self.pending[used:]
        self.pending_rows -= n

    def _wait(self) -> None:
        """Wait for the writes in flight; the first error is raised once all have ended."""
        error = None
        while self.writing:
            try:
                self.writing.popleft().result()
            except BaseException as e:  # raised below, once the others have ended
                error = error or e
        if self.thread is not None:
            self.thread.shutdown()
        if error is not None:
            raise error

    def close(self) -> None:
        if self.pending_rows:
            self._flush(self.pending_rows)
        self._wait()
        assert self.writer is not None
        self.writer.close()
        self.writer = None
        os.replace(self.tmp, self.directory / self.file)

    def abort(self) -> None:
        """Drop the temp file (a failed run leaves no finished-looking file)."""
        if self.writer is not None:
            with contextlib.suppress(BaseException):
                self._wait()  # the caller's error is the one to report
            self.writer.close()
            self.writer = None
            self.tmp.unlink(missing_ok=True)


def finish_shard(out: Path, file: str, rows: int, fingerprint: str,
                 extra: dict | None = None) -> str:
    """Record a renamed, complete shard in its done-marker; returns its sha256."""
    sha = sha256_file(out / file)
    marker = out / f".{file}.done"
    tmp = out / f".{file}.done.tmp"
    tmp.write_text(json.dumps({"sha256": sha, "rows": rows, "config": fingerprint,
                               **(extra or {})}))
    os.replace(tmp, marker)
    return sha


def read_marker(directory: Path, file: str, fingerprint: str) -> dict | None:
    """The done-marker of ``file`` if it belongs to this configuration, else None."""
    marker = directory / f".{file}.done"
    if not marker.exists():
        return None
    done = json.loads(marker.read_text())
    return done if done.get("config") == fingerprint else None


def write_split_shards(out: Path, split: str, table: pa.Table, rows_per_shard: int,
                       row_group_size: int) -> tuple[ShardFile, ...]:
    """``table`` as ``<split>-00000.parquet``, ... of ``rows_per_shard`` rows each (none for
    an empty table), each written atomically."""
    shards = []
    for k, start in enumerate(range(0, table.num_rows, rows_per_shard)):
        w = ShardWriter(out, f"{split}-{k:05d}.parquet", table.schema, row_group_size)
        try:
            w.add(table.slice(start, rows_per_shard))
            w.close()
        finally:
            w.abort()
        shards.append(ShardFile(file=w.file, rows=w.rows, sha256=sha256_file(out / w.file),
                                row_group_size=row_group_size))
    return tuple(shards)
