"""Bad rows are errors, so rows are lines: every staging shard is one task for the workers.

* Plain inputs: the line counts (and line index) give every final shard's lines up front; a
  worker reads, parses, encodes and writes the whole shard. Nothing passes through the parent.
* gzip inputs with workers: the parent decompresses (once) and cuts the lines into shards,
  spilling each shard's lines to ``.staging`` (the page cache, in practice); a worker parses,
  encodes and writes the shard as above.

A rerun skips the shards a previous run finished (their done-markers).
"""

from __future__ import annotations

import contextlib
import io
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np
from tqdm import tqdm

from dlrm_app.data import shard_writer
from dlrm_app.data.criteo import fastparse
from dlrm_app.data.criteo.encoding import EncodeSpec, encoder
from dlrm_app.data.criteo.format import LABEL, OUTPUT_SCHEMA, SplitRule
from dlrm_app.data.criteo.lines import Block, LineIndex, prefetch
from dlrm_app.data.criteo.parse import parse_block, read_blocks
from dlrm_app.data.criteo.spill import SpillPlan, spilled_rows
from dlrm_app.data.criteo.staging import STAGING_DIR, done_stage_shard, stage_file
from dlrm_app.data.criteo.workers import Runner
from dlrm_app.data.shard_writer import ShardWriter


def write_stage_shard(staging: Path, k: int, first_row: int,
                      pieces: list[tuple[Path, int, int, LineIndex | Path]],
                      spec: EncodeSpec, block_bytes: int, row_group_size: int,
                      fingerprint: str, spill: SpillPlan | None = None) -> tuple[int, dict]:
    """Worker task: read, parse, encode and write staging shard ``k`` from ``pieces`` (input,
    first 0-based line, lines, where they are: the plain input's line index, or a file the
    lines were spilled to, deleted when done); returns ``k`` and its done-marker. Lines that
    the counting pass kept parsed (``spill``) are read from there instead of parsed again."""
    # the row groups are written by a thread while the next block is parsed and encoded
    w = ShardWriter(staging, stage_file(k), OUTPUT_SCHEMA, row_group_size, LABEL,
                    background=True)
    try:
        for path, line, n, source in pieces:
            parts = [(line, n, None)] if spill is None or not isinstance(source, LineIndex) \
                else spill.cover(path, line, n)
            for first, lines, spilled in parts:
                if spilled is not None:
                    for rows in spilled_rows(spilled, first, lines, row_group_size, w.rows):
                        w.add(encoder(spec).encode(rows, slice(None)))
                else:
                    _write_text(w, spec, path, first, lines, source, block_bytes)
        w.close()
    finally:
        w.abort()
    extra = {"first_row": first_row, "label_sum": w.label_sum}
    sha = shard_writer.finish_shard(staging, w.file, w.rows, fingerprint, extra)
    for *_, source in pieces:
        if isinstance(source, Path):
            source.unlink()
    return k, {"sha256": sha, "rows": w.rows, **extra}


def _write_text(w: ShardWriter, spec: EncodeSpec, path: Path, line: int, n: int,
                source: LineIndex | Path, block_bytes: int) -> None:
    """Parse, encode and add the ``n`` lines from 0-based ``line`` of ``path`` (found with its
    line index), or all lines of the spilled text file ``source``."""
    if isinstance(source, LineIndex):
        end = source.locate(path, line + n)  # the next line's start (or the file's end)
        reader = read_blocks(path, block_bytes, source.locate(path, line), end)
    else:
        reader = read_blocks(source, block_bytes)
    with contextlib.closing(prefetch(reader)) as datas:
        for data in datas:
            lines = fastparse.count_newlines(data)
            rows, _ = parse_block(data, line + 1, path, "error", lines)
            w.add(encoder(spec).encode(rows, slice(None)))
            line += lines


def stage_shards(run: Runner, paths: list[Path], out: Path, rule: SplitRule, counts: list[int],
                 indexes: list[LineIndex], rows_per_shard: int, spec: EncodeSpec,
                 block_bytes: int, row_group_size: int, fingerprint: str,
                 spill: SpillPlan | None = None) -> list[dict]:
    """Plain inputs: every final shard is one task (the splits are known from the line counts),
    written to ``.staging`` by the workers in any order; a rerun skips the finished ones. The
    lines in ``spill`` are read from the rows the counting pass parsed."""
    edges = rule.row_edges(counts, [])
    starts = np.cumsum([0, *counts]).tolist()  # global line of each input's first line
    plan = []  # (first row = first global line, pieces)
    for a, b in zip(edges[:-1], edges[1:], strict=True):
        for first in range(a, b, rows_per_shard):
            last = min(first + rows_per_shard, b)
            plan.append((first, [(paths[i], max(first, s) - s, min(last, s + n) - max(first, s),
                                  indexes[i])
                                 for i, (s, n) in enumerate(zip(starts[:-1], counts, strict=True))
                                 if max(first, s) < min(last, s + n)]))
    shards = [done_stage_shard(out, k, fingerprint) for k in range(len(plan))]
    tasks = ((k, first, pieces) for k, (first, pieces) in enumerate(plan) if shards[k] is None)
    release = None if spill is None else \
        _spill_release(spill, [[] if shards[k] else pieces for k, (_, pieces) in enumerate(plan)])
    return run_shard_tasks(run, out, tasks, shards, spec, block_bytes, row_group_size,
                           fingerprint, total=edges[-1], spill=spill, written=release)


def _spill_release(spill: SpillPlan, pieces: list[list]) -> Callable[[int], None]:
    """A callback for each staging shard written: deletes the spill files that no shard still
    to be written reads (the disk the spill holds shrinks as the main pass goes; files that
    only finished shards read go now)."""
    readers: dict[str, set[int]] = {f: set() for r in spill.ranges.values() for *_, f in r}
    for k, shard in enumerate(pieces):
        for path, line, n, _ in shard:
            for *_, spilled in spill.cover(path, line, n):
                if spilled is not None:
                    readers[spilled[2]].add(k)
    for f in [f for f, ks in readers.items() if not ks]:
        Path(f).unlink(missing_ok=True)

    def written(k: int) -> None:
        for f in [f for f, ks in readers.items() if k in ks]:
            readers[f].discard(k)
            if not readers[f]:
                Path(f).unlink(missing_ok=True)
    return written


def run_shard_tasks(run: Runner, out: Path, tasks: Iterable[tuple[int, int, list]],
                    shards: list[dict | None], spec: EncodeSpec, block_bytes: int,
                    row_group_size: int, fingerprint: str, total: int | None,
                    spill: SpillPlan | None = None,
                    written: Callable[[int], None] | None = None) -> list[dict]:
    """Run (k, first row, pieces) shard tasks; ``shards`` gets each one's marker (and
    ``written`` is called with each ``k`` once its shard is written)."""
    staging = out / STAGING_DIR
    staging.mkdir(exist_ok=True)
    progress = tqdm(total=total, unit="rows", unit_scale=True, desc="criteo",
                    disable=not sys.stderr.isatty())
    try:
        for k, marker in run.map(write_stage_shard, (
                (staging, k, first, pieces, spec, block_bytes, row_group_size, fingerprint,
                 spill) for k, first, pieces in tasks)):
            shards[k] = marker
            progress.update(marker["rows"])
            if written is not None:
                written(k)
    finally:
        progress.close()
    written_all = [s for s in shards if s is not None]
    assert len(written_all) == len(shards), "run.map yields a marker per task, or raises"
    return written_all


class Spiller:
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

    def tasks(self, blocks: Iterable[Block]) -> Iterator[tuple[int, int, list]]:
        """(k, first row, pieces) for every shard to write, as its lines are spilled."""
        try:
            yield from self._tasks(blocks)
        finally:  # stopped early (an error): the open spill file
            if self.file is not None:
                self.file.close()

    def _tasks(self, blocks: Iterable[Block]) -> Iterator[tuple[int, int, list]]:
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

    def _spill(self, b: Block, pos: int, take: int, newlines: np.ndarray | None) -> None:
        if self.rows == 0:  # a new shard
            self.shards.append(done_stage_shard(self.out, len(self.shards), self.fingerprint))
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
