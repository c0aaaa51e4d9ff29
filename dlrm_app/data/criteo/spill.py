"""Parse once: the rows the vocabulary's counting pass parsed, kept on disk for the main pass.

The default vocabulary reads the train split twice: a counting pass (ids counted per line
range, in the workers), then the main pass that encodes and writes every row. Both parsed the
same text. Now each counting task also writes the rows it parsed to a binary file in
``.staging`` (``parsed-<input>-<first line>.rows``, one per task), and the main pass reads
those instead of parsing the text again (only plain inputs with bad rows as errors, the path
whose workers read their own line ranges; validation and test lines are read as text).

A file holds, per parsed block: a header (rows, and which arrays were narrowed), the labels,
the dense ints ``[n, 13]`` and the categorical ids ``[26, n]``, each in the ``.npy`` format.
Ints are narrowed where the block's values fit (ids to uint32: Criteo ids have 8 hex digits;
dense to int32) and read back as they are: the rows read are the rows parsed, value for value,
and the encoder writes the same bytes from either width. About 160 bytes a row (a Criteo row has about
260 bytes of text); reading it back costs a fraction of parsing.

Disk: the files of the whole train split exist when the main pass starts; each is deleted
once the shards that read it are written, and any left when preprocessing ends (or fails)
then. Spilling is skipped up front when the disk of ``--out`` has less than twice their
estimated size free, and a task whose file hits a full disk deletes its file and leaves that
range to be parsed again: a full disk while spilling is no error of its own, and the output is
the same either way.
"""

from __future__ import annotations

import dataclasses
import errno
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from dlrm_app.data.criteo.format import NUM_SPARSE
from dlrm_app.data.criteo.parse import Rows

SPILL_GLOB = "parsed-*.rows"
ROW_BYTES_ESTIMATE = 160
"""Spilled bytes a row: float32 label, 13 int32 dense, 26 uint32 ids."""
_FULL_DISK = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def spill_file(staging: Path, input_no: int, line: int) -> Path:
    """The file of the counting task over input ``input_no``'s lines from ``line`` (0-based)."""
    return staging / f"parsed-{input_no:05d}-{line:012d}.rows"


def should_spill(staging: Path, train_lines: int) -> bool:
    """Whether the disk of ``staging`` has room for the spill twice over (the shards that the
    main pass writes beside it need room too)."""
    return shutil.disk_usage(staging).free >= 2 * ROW_BYTES_ESTIMATE * train_lines


def remove_spills(staging: Path) -> None:
    for f in staging.glob(SPILL_GLOB):
        f.unlink(missing_ok=True)


def _narrow(a: np.ndarray, to: type) -> tuple[np.ndarray, bool]:
    """``a`` as ``to`` when every value fits and ``a`` is int64 (else as it is)."""
    info = np.iinfo(to)
    if a.dtype == np.int64 and a.size and info.min <= a.min() and a.max() <= info.max:
        return a.astype(to), True
    return a, False


class SpillWriter:
    """Writes one counting task's parsed blocks; ``ok`` turns False (and the file is deleted)
    if the disk is full."""

    def __init__(self, path: Path) -> None:
        self.path, self.ok = path, True
        self.file = open(path, "wb")  # noqa: SIM115 (closed by close)

    def add(self, rows: Rows) -> None:
        if not self.ok:
            return
        dense, dense_narrow = _narrow(rows.dense, np.int32)
        cats, cats_narrow = _narrow(np.asarray(rows.cats), np.uint32)
        header = np.array([len(rows.label), dense_narrow, cats_narrow], np.int64)
        try:
            for a in (header, rows.label, dense, cats):
                np.lib.format.write_array(self.file, np.ascontiguousarray(a),
                                          allow_pickle=False)
        except OSError as e:
            if e.errno not in _FULL_DISK:
                raise
            self._drop()

    def close(self) -> bool:
        """Finish the file; whether it holds every block added."""
        if self.ok:
            try:
                self.file.close()
            except OSError as e:
                if e.errno not in _FULL_DISK:
                    raise
                self._drop()
        return self.ok

    def abort(self) -> None:
        if not self.file.closed:
            self.file.close()
        if self.ok:
            self.path.unlink(missing_ok=True)

    def _drop(self) -> None:
        self.ok = False
        try:
            self.file.close()
        except OSError:
            pass  # the unflushed rest of a file being deleted
        self.path.unlink(missing_ok=True)


def read_spill(path: Path) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(labels, dense ``[n, 13]``, ids ``[26, n]``) per block of a spill file: the values
    parsed, in the narrow ints they were stored in (the encoder's results do not depend on the
    width: it takes ``log1p`` of the dense values in float64 and looks the ids up as int64)."""
    with open(path, "rb") as f:
        while True:
            try:
                header = np.lib.format.read_array(f, allow_pickle=False)
            except ValueError:  # no more arrays (the header's magic string is missing)
                return
            label = np.lib.format.read_array(f, allow_pickle=False)
            dense = np.lib.format.read_array(f, allow_pickle=False)
            cats = np.lib.format.read_array(f, allow_pickle=False)
            if header[0] != len(label) or cats.shape != (NUM_SPARSE, len(label)):
                raise RuntimeError(f"{path}: damaged spill of parsed rows; rerun")
            yield label, dense, cats


@dataclasses.dataclass(frozen=True, slots=True)
class SpillPlan:
    """Which line ranges of which inputs were spilled: per input path, ``(first line, lines,
    file)`` in line order. Ranges not listed are read from the text."""

    ranges: dict[str, tuple[tuple[int, int, str], ...]]

    def cover(self, path: Path, line: int, n: int
              ) -> Iterator[tuple[int, int, tuple[int, int, str] | None]]:
        """``[line, line + n)`` as consecutive ``(first, lines, spilled range or None)``."""
        end = line + n
        for spilled in self.ranges.get(str(path), ()):
            first, lines, _ = spilled
            if first + lines <= line or first >= end:
                continue
            if first > line:
                yield line, first - line, None
                line = first
            stop = min(first + lines, end)
            yield line, stop - line, spilled
            line = stop
        if line < end:
            yield line, end - line, None


def spilled_rows(spilled: tuple[int, int, str], line: int, n: int, row_group_size: int,
                 done: int) -> Iterator[Rows]:
    """Rows of the 0-based lines ``[line, line + n)`` from a ``spilled`` range (first line,
    lines, file), cut so that each piece ends a row group of a shard that already has
    ``done`` rows (the shard writer then writes it without a copy)."""
    first, _, file = spilled
    want = row_group_size - done % row_group_size
    held: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    held_rows, pos, start, end = 0, first, line, line + n
    for label, dense, cats in read_spill(Path(file)):
        a, b = max(start - pos, 0), min(end - pos, len(label))
        pos += len(label)
        if a >= b:
            if pos >= end:
                break
            continue
        label, dense, cats = label[a:b], dense[a:b], cats[:, a:b]
        while len(label):
            take = min(want - held_rows, len(label))
            held.append((label[:take], dense[:take], cats[:, :take]))
            held_rows += take
            label, dense, cats = label[take:], dense[take:], cats[:, take:]
            if held_rows == want:
                yield _joined(held, line)
                line += held_rows
                held, held_rows, want = [], 0, row_group_size
        if pos >= end:
            break
    if held:
        yield _joined(held, line)


def _joined(parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]], line: int) -> Rows:
    if len(parts) == 1:
        label, dense, cats = parts[0]
    else:
        label = np.concatenate([p[0] for p in parts])
        dense = np.concatenate([p[1] for p in parts])
        cats = np.concatenate([p[2] for p in parts], axis=1)
    return Rows(label, dense, list(cats), np.arange(line + 1, line + 1 + len(label)))
