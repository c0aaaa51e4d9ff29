"""The train-split vocabulary: table rows for the ids the training data has, sized from it.

Per feature, the raw ids seen at least ``frequency_threshold`` times in the *train* split
qualify; if more than ``max_embeddings - 1`` qualify, the most frequent keep rows (ties: the
smaller raw id). The kept ids get rows ``1..V`` in raw-id order; every other raw id (rarer,
cut by the cap, or never seen in train) shares the out-of-vocabulary row ``0``. So a table has
``V + 1 <= max_embeddings`` rows. The kept ids are saved as ``vocabulary.parquet`` (rows
``(feature, raw_id)``) beside the shards; training and export read it from there.

Counting is exact: per feature, the sorted distinct raw ids of the train split and their
counts (16 bytes per distinct id), merged in this process from per-block counts made in the
workers (a block's distinct ids by the C helper's hash count, then sorted) (plain inputs: each worker reads its own line ranges of about ``block_bytes``, found
with the line index; gzip: this process reads the blocks and hands them out). Its memory is
bounded by ``memory_bytes`` (default 4 GiB): the held counts (merged, and per-block ones
waiting to be merged) plus the temporaries of the merge in progress (about 40 bytes per id
merged). Estimates from the published per-feature counts of the whole sets:

* Criteo Kaggle: at most 33.8 M distinct ids over the 26 features, 10.1 M in the largest:
  0.5 GB of merged counts, at most about 1.9 GB while merging (measured on 1 M synthetic rows
  of 21 M distinct ids: 0.32 GB of counts, 0.54 GB peak for the whole counting pass);
* Criteo 1TB: about 880 M distinct ids (293 M in the largest feature), some 14 GB of counts
  plus 20 GB or more to merge them: more than a machine's memory should hold. The pass stops
  as soon as the bound is reached (for 1TB, within its first few train days) with an error
  naming the hashing option: ``num_embeddings_per_feature`` (e.g. 40,000,000 per feature as
  the reference does; ``--num-embeddings-per-feature``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections import deque
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dlrm_app.data.criteo import fastparse
from dlrm_app.data.criteo.format import NUM_SPARSE, SPARSE_NAMES, SplitRule
from dlrm_app.data.criteo.lines import Block, LineIndex, blocks, prefetch
from dlrm_app.data.criteo.parse import no_valid_rows_error, parse_block, read_blocks
from dlrm_app.data.criteo.spill import SpillPlan, SpillWriter, spill_file
from dlrm_app.data.criteo.workers import Runner
from dlrm_app.data.integrity import verify_file
from dlrm_app.data.schema import sha256_file
from dlrm_app.inputs import DATASET_JSON

VOCABULARY_FILE = "vocabulary.parquet"
RARE_ID = 0
"""The out-of-vocabulary row: every raw id without a row of its own maps here."""
DEFAULT_VOCABULARY_MEMORY_BYTES = 4 << 30
"""Memory the exact count of distinct train ids may use (roughly 100-200 M distinct ids,
depending on how they spread over the features)."""

_ENTRY_BYTES = 16  # a held (raw id, count) pair: two int64
_MERGE_BYTES = 40  # per id merged: concatenated ids and counts, the sort order, the results


@dataclasses.dataclass(frozen=True, slots=True)
class Vocabulary:
    """Per feature, the kept raw ids (sorted) and what the train split had."""

    ids: list[np.ndarray]
    """Kept raw ids per feature, sorted; id ``ids[k][i]`` is row ``i + 1`` of table ``k``."""
    distinct: list[int]
    """Distinct raw ids per feature in the train split."""
    qualified: list[int]
    """Of those, the ids seen at least ``frequency_threshold`` times (before the cap)."""
    coverage: list[float]
    """Fraction of the train rows whose id has a row of its own, per feature."""
    spill: SpillPlan | None = None
    """Where the counting pass kept the train rows it parsed (None: it kept none)."""

    @property
    def num_embeddings(self) -> list[int]:
        return [len(v) + 1 for v in self.ids]


class IdCounts:
    """Exact counts of raw ids per feature, merged from per-block counts.

    Block counts wait in ``pending`` until they hold as many ids as the merged counts, then all
    are merged at once: a merge costs at most about twice the ids that waited for it, and the
    waiting ids at most double the memory of the merged ones. Raises ValueError once the
    counts and a merge's temporaries would need more than ``memory_bytes``.
    """

    def __init__(self, memory_bytes: int, where: str) -> None:
        self.memory_bytes, self.where = memory_bytes, where
        self.ids = [np.zeros(0, np.int64) for _ in range(NUM_SPARSE)]
        self.counts = [np.zeros(0, np.int64) for _ in range(NUM_SPARSE)]
        self.pending: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in range(NUM_SPARSE)]
        self.pending_ids = [0] * NUM_SPARSE
        self.rows = 0  # train rows counted

    def held(self) -> int:
        return sum(len(i) for i in self.ids) + sum(self.pending_ids)

    def add(self, per_feature: Sequence[tuple[np.ndarray, np.ndarray]], rows: int,
            lines_read: str) -> None:
        """Add one block's (distinct ids, counts) per feature, of ``rows`` train rows."""
        self.rows += rows
        for k, (ids, counts) in enumerate(per_feature):
            if len(ids):
                self.pending[k].append((ids, counts))
                self.pending_ids[k] += len(ids)
        self._check(0, lines_read)
        for k in range(NUM_SPARSE):
            if self.pending_ids[k] >= max(len(self.ids[k]), 1 << 14):
                self._merge(k, lines_read)

    def _check(self, merging: int, lines_read: str) -> None:
        need = _ENTRY_BYTES * self.held() + _MERGE_BYTES * merging
        if need > self.memory_bytes:
            big = max(range(NUM_SPARSE), key=lambda k: len(self.ids[k]) + self.pending_ids[k])
            raise ValueError(
                f"{self.where}: counting the train ids for the vocabulary needs more than "
                f"{_size(self.memory_bytes)} (vocabulary_memory_bytes): "
                f"{self.held():,} distinct ids so far ({SPARSE_NAMES[big]}: "
                f"{len(self.ids[big]) + self.pending_ids[big]:,}) after {lines_read}. Hash the "
                f"ids instead with num_embeddings_per_feature (--num-embeddings-per-feature, "
                f"e.g. 40000000 as the reference does for Criteo 1TB; no counting pass), or "
                f"allow more memory if this machine has it")

    def _merge(self, k: int, lines_read: str) -> None:
        parts = [(self.ids[k], self.counts[k]), *self.pending[k]]
        self._check(sum(len(i) for i, _ in parts), lines_read)
        self.ids[k], self.counts[k] = merge_counts(parts)
        self.pending[k], self.pending_ids[k] = [], 0

    def finish(self, lines_read: str) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """(sorted distinct ids, their counts) per feature."""
        for k in range(NUM_SPARSE):
            if self.pending[k]:
                self._merge(k, lines_read)
        return self.ids, self.counts


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def merge_counts(parts: Sequence[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """One (sorted distinct ids, counts) as int64 from several, each sorted (of any int
    dtype)."""
    parts = [p for p in parts if len(p[0])]
    if len(parts) <= 1:
        ids, counts = parts[0] if parts else (np.zeros(0, np.int64), np.zeros(0, np.int64))
        return ids.astype(np.int64, copy=False), counts.astype(np.int64, copy=False)
    ids = np.concatenate([i for i, _ in parts]).astype(np.int64, copy=False)
    counts = np.concatenate([c for _, c in parts]).astype(np.int64, copy=False)
    order = np.argsort(ids, kind="stable")  # sorted runs: a merge, not a full sort
    ids, counts = ids[order], counts[order]
    del order
    first = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1]])
    return ids[first], np.add.reduceat(counts, first)


def select(ids: np.ndarray, counts: np.ndarray, threshold: int,
           max_embeddings: int) -> np.ndarray:
    """Indices into ``ids`` (sorted, so the ids they pick are sorted) of the ids that keep
    rows: ``counts >= threshold``, the ``max_embeddings - 1`` most frequent of those (ties:
    the smaller raw id)."""
    ok = np.flatnonzero(counts >= threshold)
    keep = max_embeddings - 1
    if len(ok) <= keep:
        return ok
    order = np.lexsort((ids[ok], -counts[ok]))[:keep]  # by count descending, then raw id
    return np.sort(ok[order])


def _compact(ids: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A task's (ids, counts) as uint32, half the bytes to send back: raw ids have at most 8
    hex digits, and a task counts far fewer than 2**32 rows."""
    return ids.astype(np.uint32), counts.astype(np.uint32)


def distinct_counts(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(ids, return_counts=True)``: by the C helper's hash count where it is built
    (3x faster on a block of Criteo ids), else numpy's sort."""
    fast = fastparse.count_ids(ids)
    return fast if fast is not None else np.unique(ids, return_counts=True)


def count_ids(path: Path, block: Block, on_bad_row: str, train_lines: float
              ) -> tuple[list[tuple[np.ndarray, np.ndarray]], int]:
    """Worker task of the vocabulary pass: per feature, the distinct raw ids of the block's
    train rows (its lines up to ``train_lines`` of the input) and their counts; and the number
    of those rows."""
    rows, _ = parse_block(block.data, block.line, path, on_bad_row, block.lines)
    n_train = int(np.searchsorted(rows.lines, train_lines, side="right"))
    return [_compact(*distinct_counts(c[:n_train])) for c in rows.cats], n_train


def count_lines_of(path: Path, line: int, lines: int, index: LineIndex, block_bytes: int,
                   on_bad_row: str, spill: Path | None = None
                   ) -> tuple[list[tuple[np.ndarray, np.ndarray]], int, bool]:
    """Worker task of the vocabulary pass over a plain input: reads the input's 0-based lines
    ``[line, line + lines)`` itself (found with its line ``index``; all of them train lines)
    and returns, per feature, their distinct raw ids and counts, the rows counted, and whether
    the parsed rows were all written to ``spill`` (for the main pass,
    :mod:`~dlrm_app.data.criteo.spill`; False without one)."""
    start, end = index.locate(path, line), index.locate(path, line + lines)
    parts: list[list[tuple[np.ndarray, np.ndarray]]] = []
    n_rows = 0
    writer = None if spill is None else SpillWriter(spill)
    try:
        with contextlib.closing(prefetch(read_blocks(path, block_bytes, start, end))) as datas:
            for data in datas:
                n = fastparse.count_newlines(data)
                rows, _ = parse_block(data, line + 1, path, on_bad_row, n)
                parts.append([distinct_counts(c) for c in rows.cats])
                if writer is not None:
                    writer.add(rows)
                n_rows += len(rows.label)
                line += n
        spilled = writer is not None and writer.close()
    finally:
        if writer is not None and not writer.file.closed:
            writer.abort()
    per_feature = [_compact(*merge_counts([p[k] for p in parts])) for k in range(NUM_SPARSE)]
    return per_feature, n_rows, spilled


def _line_tasks(paths: list[Path], counts: list[int | None], indexes: list[LineIndex | None],
                train_lines: list[float], block_bytes: int, on_bad_row: str,
                positions: deque[tuple[str, int, tuple | None]],
                spill_to: Path | None) -> Iterator[tuple]:
    """count_lines_of tasks of about ``block_bytes`` each over the train lines of indexed
    (plain) inputs: nothing but line numbers goes to the workers."""
    for i, (path, n, index, train) in enumerate(
            zip(paths, counts, indexes, train_lines, strict=True)):
        assert n is not None and index is not None
        train = int(min(train, n))
        step = max(1, block_bytes * n // max(path.stat().st_size, 1))  # lines per task
        for line in range(0, train, step):
            lines = min(step, train - line)
            spill = None if spill_to is None else spill_file(spill_to, i, line)
            positions.append((f"line {line + lines:,} of {path}", lines,
                              None if spill is None else (str(path), line, lines, str(spill))))
            yield path, line, lines, index, block_bytes, on_bad_row, spill


def count_train_ids(run: Runner, paths: list[Path], rule: SplitRule,
                    counts: list[int | None], indexes: list[LineIndex | None], block_bytes: int,
                    on_bad_row: str, memory_bytes: int, spill_to: Path | None = None
                    ) -> tuple[list[np.ndarray], list[np.ndarray], int, SpillPlan | None]:
    """Per feature, the sorted distinct raw ids of the train split and their counts, the train
    rows counted, and where the parsed rows were kept (see :func:`build_vocabulary`)."""
    train_lines = rule.train_lines(counts)
    where = ", ".join(map(str, paths)) if len(paths) <= 3 else f"{paths[0]} ... {paths[-1]}"
    counter = IdCounts(memory_bytes, where)
    # per task in flight, in task order: where it ends, its train lines, and its spill range
    positions: deque[tuple[str, int, tuple | None]] = deque()

    def block_tasks(stream: Iterator[Block]) -> Iterator[tuple]:
        for b in stream:
            lines = int(min(b.lines, train_lines[b.input] - (b.line - 1)))
            positions.append((f"line {b.line - 1 + b.lines:,} of {paths[b.input]}", lines, None))
            yield paths[b.input], b, on_bad_row, train_lines[b.input]

    read, lines_read = "nothing", 0
    spilled: dict[str, list[tuple[int, int, str]]] = {}
    indexed = None not in indexes
    with contextlib.ExitStack() as stack:
        if indexed:
            results = run.map(count_lines_of, _line_tasks(
                paths, counts, indexes, train_lines, block_bytes, on_bad_row, positions,
                spill_to))
        else:
            stream = stack.enter_context(contextlib.closing(
                prefetch(blocks(paths, block_bytes, max_lines=train_lines))))
            results = run.map(count_ids, block_tasks(stream))
        for per_feature, n_train, *kept in results:
            read, lines, spill = positions.popleft()
            if spill is not None and kept[0]:
                spilled.setdefault(spill[0], []).append(spill[1:])
            lines_read += lines
            counter.add(per_feature, n_train, read)
    if lines_read and not counter.rows:  # stop before a second pass over the wrong files
        raise no_valid_rows_error(paths, rule.fmt, lines_read)
    ids, id_counts = counter.finish(read)
    spill = None if spill_to is None or not indexed else \
        SpillPlan({p: tuple(r) for p, r in spilled.items()})
    return ids, id_counts, counter.rows, spill


def build_vocabulary(run: Runner, paths: list[Path], rule: SplitRule,
                     counts: list[int | None], indexes: list[LineIndex | None], threshold: int,
                     max_embeddings: Sequence[int], block_bytes: int, on_bad_row: str,
                     memory_bytes: int, spill_to: Path | None = None) -> Vocabulary:
    """The vocabulary of the train split; only the train lines are read (kaggle: ``counts``
    has every input's line count). Inputs that all have a line index (plain ones) are read by
    the workers, each its own line ranges, and with ``spill_to`` (a folder) keep the rows they
    parsed there for the main pass (the vocabulary's ``spill``); otherwise (gzip) this process
    reads the blocks and hands them out."""
    ids, id_counts, n_rows, spill = count_train_ids(
        run, paths, rule, counts, indexes, block_bytes, on_bad_row, memory_bytes, spill_to)
    kept, coverage = [], []
    for k in range(NUM_SPARSE):
        rows = select(ids[k], id_counts[k], threshold, max_embeddings[k])
        kept.append(ids[k][rows])
        coverage.append(float(id_counts[k][rows].sum() / n_rows) if n_rows else 0.0)
    qualified = [int((c >= threshold).sum()) for c in id_counts]
    return Vocabulary(kept, [len(i) for i in ids], qualified, coverage, spill)


def save_vocabulary(out: Path, vocab: list[np.ndarray]) -> str:
    """Write ``vocabulary.parquet`` atomically; returns its sha256."""
    feature = np.concatenate([np.full(len(v), k, np.int32) for k, v in enumerate(vocab)])
    table = pa.table({"feature": feature, "raw_id": np.concatenate(vocab)})
    tmp = out / f".{VOCABULARY_FILE}.tmp"
    pq.write_table(table, tmp)
    os.replace(tmp, out / VOCABULARY_FILE)
    return sha256_file(out / VOCABULARY_FILE)


def load_vocabulary(directory: str | os.PathLike[str]) -> list[np.ndarray]:
    """The per-feature sorted raw ids that have rows (id ``i`` of the list is row ``i + 1``).

    A vocabulary grown by added days (its ids' rows are not in raw-id order) raises
    ValueError: read it with :func:`load_vocabulary_rows`."""
    grown = _grown_record(Path(directory))
    if grown is not None:
        raise ValueError(
            f"{directory}: its vocabulary grew when days were added (preprocess criteo "
            f"--add-day; {grown['file']}): the ids' rows are not in raw-id order, so this "
            f"reader (id i -> row i + 1) does not apply; read it with "
            f"dlrm_app.data.criteo.vocabulary.load_vocabulary_rows")
    return load_vocabulary_rows(directory)[0]


GROWN_VOCABULARY = "grown_vocabulary"
"""Key of the ``encoding`` record naming a vocabulary grown by added days: ``{"file", "sha256",
"day"}`` (the file holds ``row`` beside ``feature`` and ``raw_id``)."""


def grown_vocabulary_file(day: int) -> str:
    return f"vocabulary-day-{day:05d}.parquet"


def _grown_record(directory: Path) -> dict | None:
    """The dataset's grown vocabulary record, if its dataset.json has one."""
    try:
        data = json.loads((directory / DATASET_JSON).read_text())
    except (OSError, ValueError):
        return None
    encoding = data.get("parameters", {}).get("encoding", {}) if isinstance(data, dict) else {}
    return encoding.get(GROWN_VOCABULARY) if isinstance(encoding, dict) else None


def load_vocabulary_rows(directory: str | os.PathLike[str], file: str | None = None
                         ) -> tuple[list[np.ndarray], list[np.ndarray] | None]:
    """Per feature, the sorted raw ids that have rows and their rows (None: id ``i`` is row
    ``i + 1``), from ``file`` (None: the grown vocabulary dataset.json names, else
    ``vocabulary.parquet``)."""
    if file is None:
        grown = _grown_record(Path(directory))
        file = VOCABULARY_FILE if grown is None else grown["file"]
    table = pq.read_table(Path(directory) / file)
    feature = table["feature"].to_numpy()
    raw = table["raw_id"].to_numpy()
    edges = np.searchsorted(feature, np.arange(NUM_SPARSE + 1))  # rows are by feature
    ids = [raw[a:b] for a, b in zip(edges[:-1], edges[1:], strict=True)]
    if "row" not in table.column_names:
        return ids, None
    row = table["row"].to_numpy()
    return ids, [row[a:b] for a, b in zip(edges[:-1], edges[1:], strict=True)]


@dataclasses.dataclass(frozen=True, slots=True)
class ServedVocabulary:
    """A dataset's id -> row map as a model with given table sizes reads it
    (:func:`vocabulary_for_tables`)."""

    ids: list[np.ndarray]
    """Per feature, the sorted raw ids that read a row of their own."""
    rows: list[np.ndarray] | None
    """Their rows; None when id ``ids[k][i]`` reads row ``i + 1`` (a vocabulary that never
    grew, or whose grown ids lie past the model's tables)."""
    file: str
    """The vocabulary file it was read from."""
    past_tables: list[int]
    """Per feature, the vocabulary's ids whose row lies at or past the model's table: left out
    (they read row 0, as in training)."""


def vocabulary_for_tables(directory: str | os.PathLike[str], num_embeddings: Sequence[int],
                          encoding: dict) -> ServedVocabulary:
    """The id -> row map of the dataset in ``directory`` (its ``encoding`` record: the grown
    vocabulary it names, else ``vocabulary.parquet``; checked against the recorded sha256) for
    a model whose tables have ``num_embeddings`` rows. A ``--follow`` run keeps the tables of
    its start while ``--add-day`` grows the vocabulary: its training reads row 0 for ids whose
    row is at or past its tables, as for ids without a row, so those ids are left out."""
    directory = Path(directory)
    grown = encoding.get(GROWN_VOCABULARY)
    file, sha256 = (VOCABULARY_FILE, encoding.get("vocabulary_sha256")) if grown is None \
        else (grown["file"], grown["sha256"])
    verify_file(directory / file, sha256)
    ids, rows = load_vocabulary_rows(directory, file)
    if rows is None:
        rows = [np.arange(1, len(v) + 1, dtype=np.int64) for v in ids]
    kept_ids, kept_rows, past = [], [], []
    for k, (v, r) in enumerate(zip(ids, rows, strict=True)):
        keep = r < int(num_embeddings[k])
        kept_ids.append(v[keep])
        kept_rows.append(r[keep])
        past.append(int((~keep).sum()))
    in_order = all(np.array_equal(r, np.arange(1, len(r) + 1)) for r in kept_rows)
    return ServedVocabulary(kept_ids, None if in_order else kept_rows, file, past)


def save_grown_vocabulary(out: Path, file: str, ids: list[np.ndarray],
                          rows: list[np.ndarray]) -> str:
    """Write a grown vocabulary (per feature sorted raw ids and their rows) atomically as
    ``file``; returns its sha256."""
    feature = np.concatenate([np.full(len(v), k, np.int32) for k, v in enumerate(ids)])
    table = pa.table({"feature": feature, "raw_id": np.concatenate(ids).astype(np.int64),
                      "row": np.concatenate(rows).astype(np.int64)})
    tmp = out / f".{file}.tmp"
    pq.write_table(table, tmp)
    os.replace(tmp, out / file)
    return sha256_file(out / file)


@dataclasses.dataclass(frozen=True, slots=True)
class Grown:
    """A vocabulary after a day's new ids got rows."""

    ids: list[np.ndarray]
    """Per feature, every kept raw id, sorted."""
    rows: list[np.ndarray]
    """Their rows: the old ids keep theirs, the new ones follow the table's last row."""
    num_embeddings: list[int]
    """Table sizes after the day."""
    added: list[int]
    """New ids that got a row, per feature."""
    refused: list[int]
    """New ids (seen ``threshold`` times) left in the out-of-vocabulary row: past the budget."""


def grow(vocab: list[np.ndarray], rows: list[np.ndarray] | None, num_embeddings: Sequence[int],
         day_ids: list[np.ndarray], day_counts: list[np.ndarray], threshold: int,
         budget: Sequence[int]) -> Grown:
    """Rows for a new day's ids: per feature, the ids not in the vocabulary seen at least
    ``threshold`` times in the day qualify; while the table has fewer than ``budget`` rows
    they get the next rows (if more qualify than fit, the most frequent, ties the smaller raw
    id), in raw-id order; every other id stays in ``RARE_ID``."""
    ids_out, rows_out, sizes, added, refused = [], [], [], [], []
    for k in range(NUM_SPARSE):
        old = np.asarray(vocab[k], np.int64)
        old_rows = np.arange(1, len(old) + 1, dtype=np.int64) if rows is None \
            else np.asarray(rows[k], np.int64)
        fresh = ~np.isin(day_ids[k], old)
        cand, cand_counts = day_ids[k][fresh], day_counts[k][fresh]
        room = max(0, int(budget[k]) - int(num_embeddings[k]))
        pick = cand[select(cand, cand_counts, threshold, room + 1)].astype(np.int64)
        new_rows = int(num_embeddings[k]) + np.arange(len(pick), dtype=np.int64)
        merged = np.concatenate([old, pick])
        order = np.argsort(merged, kind="stable")
        ids_out.append(merged[order])
        rows_out.append(np.concatenate([old_rows, new_rows])[order])
        sizes.append(int(num_embeddings[k]) + len(pick))
        added.append(len(pick))
        refused.append(int((cand_counts >= threshold).sum()) - len(pick))
    return Grown(ids_out, rows_out, sizes, added, refused)
