"""Reading the inputs as blocks of whole lines, and counting and indexing their lines.

A plain input's line count comes from a newline count over byte ranges (in the workers); it
also gives an index of where its lines are, so that any line range is found by reading one
range. A gzip input is counted by decompressing it (:func:`count_lines`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import queue
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TypeVar

import numpy as np

from dlrm_app.data.criteo import fastparse
from dlrm_app.data.criteo.parse import count_lines, read_blocks
from dlrm_app.data.criteo.workers import Runner

INDEX_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True, slots=True)
class LineIndex:
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


def count_part(path: Path, start: int, stop: int, step: int) -> list[int]:
    """Worker task: ``[lines]`` of a gzip input (the whole file), or the newlines of a plain
    one in each ``step`` bytes of [start, stop)."""
    if path.suffix == ".gz":
        return [count_lines(path)]
    with open(path, "rb") as f:
        f.seek(start)
        return [fastparse.count_newlines(f.read(min(step, stop - a)))
                for a in range(start, stop, step)]


def line_counts(run: Runner, paths: list[Path], which: list[bool], part: int,
                step: int = INDEX_BYTES) -> tuple[list[int | None], list[LineIndex | None]]:
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
    for i, n in zip(owners, run.map(count_part, tasks), strict=True):
        parts[i] += n
    counts: list[int | None] = []
    indexes: list[LineIndex | None] = []
    for p, w, n in zip(paths, which, parts, strict=True):
        plain = w and p.suffix != ".gz"
        if plain:
            with open(p, "rb") as f:
                f.seek(-1, os.SEEK_END)
                n = [*n, f.read(1) != b"\n"]  # the unterminated last line
        counts.append(sum(n) if w else None)
        indexes.append(LineIndex(step, np.asarray(n[:-1], np.int64)) if plain else None)
    return counts, indexes


@dataclasses.dataclass(frozen=True, slots=True)
class Block:
    """Whole lines of one input: its index, the byte offset and 1-based line of the first."""

    input: int
    offset: int
    line: int
    lines: int
    data: bytes


def blocks(paths: Sequence[Path], block_bytes: int, start: tuple[int, int, int] = (0, 0, 1),
           max_lines: Sequence[float] | None = None) -> Iterator[Block]:
    """Blocks of all inputs in order from ``start`` = (input, byte offset, line); with
    ``max_lines``, input i is read only until its first ``max_lines[i]`` lines are covered."""
    first, offset, line = start
    for i in range(first, len(paths)):
        if i > first:
            offset, line = 0, 1
        if max_lines is not None and max_lines[i] < line:
            continue
        for data in read_blocks(paths[i], block_bytes, offset):
            n = fastparse.count_newlines(data)
            yield Block(i, offset, line, n, data)
            offset += len(data)
            line += n
            if max_lines is not None and max_lines[i] < line:
                break


_T = TypeVar("_T")


def prefetch(items: Iterator[_T], depth: int = 1) -> Iterator[_T]:
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
