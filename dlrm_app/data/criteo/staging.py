"""The single streaming pass: blocks -> (workers) parse + encode -> staging shards here.

Used where rows are not lines (bad rows skipped) or a gzip input is read in one process. The
parent reads (and decompresses) blocks in a reader thread, the workers (or this process) parse
and encode them, and this process writes every kept row in input order into staging shards
``.staging/stage-00000.parquet``, ... of ``rows_per_shard`` rows that restart at every known
split start. Each shard's done-marker holds its first row and where to resume reading (the
block its last row came from, and the bookkeeping up to it): a rerun neither rewrites nor
re-parses finished shards (a plain input seeks to the block, gzip decompresses up to it
without parsing).
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
from tqdm import tqdm

from dlrm_app.data import shard_writer
from dlrm_app.data.criteo.encoding import EncodeSpec, encoder
from dlrm_app.data.criteo.format import LABEL, OUTPUT_SCHEMA
from dlrm_app.data.criteo.lines import Block, blocks, prefetch
from dlrm_app.data.criteo.parse import parse_block
from dlrm_app.data.criteo.workers import Runner
from dlrm_app.data.schema import sha256_file
from dlrm_app.data.shard_writer import ShardWriter, read_marker

STAGING_DIR = ".staging"
"""Subfolder of the output for shards not yet at their final name (removed when the run
finishes)."""


def stage_file(k: int) -> str:
    return f"stage-{k:05d}.parquet"


def done_stage_shard(out: Path, k: int, fingerprint: str) -> dict | None:
    """The marker of staging shard ``k`` if a previous run of this configuration finished it
    (the file is in ``.staging`` or, once renamed, at its final name, checksum intact)."""
    marker = read_marker(out / STAGING_DIR, stage_file(k), fingerprint)
    if marker is None:
        return None
    places = [out / STAGING_DIR / stage_file(k)]
    if "renamed_to" in marker:
        places.append(out / marker["renamed_to"])
    return marker if any(p.exists() and sha256_file(p) == marker["sha256"] for p in places) \
        else None


@dataclasses.dataclass(frozen=True, slots=True)
class Encoded:
    """A block's encoded rows and the 1-based lines of its skipped bad rows (sorted)."""

    input: int
    offset: int
    line: int
    lines: int
    table: pa.Table
    skipped: np.ndarray


def encode_block(path: Path, block: Block, on_bad_row: str, spec: EncodeSpec) -> Encoded:
    """Worker task of the main pass."""
    rows, skipped = parse_block(block.data, block.line, path, on_bad_row, block.lines)
    bad = np.zeros(0, np.int64)
    if skipped:
        bad = np.setdiff1d(np.arange(block.line, block.line + block.lines), rows.lines)
    table = encoder(spec).encode(rows, slice(None))
    return Encoded(block.input, block.offset, block.line, block.lines, table, bad)


class StagingWriter:
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
        self.writer: ShardWriter | None = None
        self.first_row = 0
        self.position: dict = {}

    def add(self, enc: Encoded, split_starts: Sequence[int]) -> None:
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
                self.writer = ShardWriter(self.staging, stage_file(len(self.shards)),
                                          OUTPUT_SCHEMA, self.row_group_size, LABEL,
                                          background=True)
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
        sha = shard_writer.finish_shard(self.staging, w.file, w.rows, self.fingerprint, extra)
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


def stage(run: Runner, paths: list[Path], out: Path, spec: EncodeSpec,
          split_starts: list[list[int]], rows_per_shard: int, row_group_size: int,
          on_bad_row: str, block_bytes: int, fingerprint: str,
          total_lines: int | None) -> StagingWriter:
    """The single pass over all inputs, resumed after the last finished staging shard."""
    staging = out / STAGING_DIR
    staging.mkdir(exist_ok=True)
    done: list[dict] = []  # the leading finished shards: the rest is redone
    while (marker := done_stage_shard(out, len(done), fingerprint)) is not None:
        done.append(marker)
    stream = StagingWriter(staging, rows_per_shard, row_group_size, fingerprint, done)
    progress = tqdm(total=total_lines, unit="rows", unit_scale=True, desc="criteo",
                    disable=not sys.stderr.isatty(), initial=stream.row)
    try:
        with contextlib.closing(prefetch(blocks(paths, block_bytes, stream.start))) as read:
            tasks = ((paths[b.input], b, on_bad_row, spec) for b in read)
            for enc in run.map(encode_block, tasks):
                stream.add(enc, [c for c in split_starts[enc.input]
                                 if enc.line - 1 <= c < enc.line - 1 + enc.lines])
                progress.update(len(enc.table))
        stream.finish()
    finally:
        progress.close()
        stream.abort()
    return stream
