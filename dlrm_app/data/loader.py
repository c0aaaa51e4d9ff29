"""Parquet -> ``Batch(dense, sparse KJT, labels)`` with the split's rows dealt to ranks.

Each epoch the loader lists every row group of the split (the shards listed in
``dataset.json``) in shard order, shuffles that list with ``(seed, epoch)`` when ``shuffle`` is
on, and reads it as one stream of ``N`` rows. Rank ``r`` of ``W`` takes the contiguous rows
``[floor(r*N/W), floor((r+1)*N/W))`` of that stream, so shares differ by at most one row and a
rank reads only the row groups that overlap its range (a row group cut by a boundary is read by
both neighbours, each keeping its part). Example: two shards of 3 and 2 row groups, ``W=3``, no
shuffle::

    row group   g0=(shard0,rg0) g1=(shard0,rg1) g2=(shard0,rg2) g3=(shard1,rg0) g4=(shard1,rg1)
    rows        1000            1000            500             1000            701
    stream      [0, 1000)       [1000, 2000)    [2000, 2500)    [2500, 3500)    [3500, 4201)
    rank 0      [0, 1400)     g0, g1[0:400]                 -> 1400 rows
    rank 1      [1400, 2800)  g1[400:1000], g2, g3[0:300]   -> 1400 rows
    rank 2      [2800, 4201)  g3[300:1000], g4              -> 1401 rows

A split with one row group thus trains on any number of ranks; one with fewer rows than ranks
is refused. Every rank computes every rank's row count from the Parquet metadata alone, so all
ranks agree without communicating on the number of batches per epoch:

    drop_last=True   num_batches = min over ranks of floor(rows_r / batch_size)
    pad_last=True    num_batches = max over ranks of ceil(rows_r / batch_size); every batch
                     has exactly batch_size rows, the missing ones are padding rows (dense 0,
                     empty bags, label 0) at the end, counted out by ``Batch.valid_rows``.
                     Every row of the split is yielded exactly once: use it for evaluation
                     (sharded modules need the same batch size on every rank).
    drop_last=False  num_batches = min over ranks of ceil(rows_r / batch_size); a rank's last
                     batch may then be shorter than ``batch_size`` (and differ between ranks)

With ``batch_size=512`` above: every rank has floor(1400/512) = 2 batches, and the remaining
376 (377 on rank 2) rows of each share are dropped this epoch. Equal batch counts matter because
every batch triggers collectives (KJT all-to-all, gradient all-reduce): a rank with one extra
batch would hang the others.

Shuffling (``shuffle=True``) is two-level. The row-group order above changes with
``(seed, epoch)``, so each epoch a rank gets different row groups; then the rank cuts its share
into windows of ``shuffle_window`` rows (the last may be shorter) and deals each window's rows
to batches in a random order drawn from ``(seed, epoch, rank, window index)``. A window spans
several row groups (4 of the default 65,536 rows), so rows move across row groups, and memory
stays bounded by the decoded row groups of one window (whole row groups: at most two more than
its rows need). Rows are gathered from the decoded row groups, not copied into a window first;
inside a batch the rows of one window are listed in window order (the order inside a batch
does not change the loss, and ascending indices make the gather cache-friendly). Gathering
costs more than slicing: ``bench/loader.py`` reports both, and a smaller window is faster (it
stays in cache) but mixes fewer row groups. Example with ``shuffle_window=4``,
``batch_size=2``, a share of rows r0..r5 and a window permutation (2, 0, 3, 1)::

    windows      [r0 r1 r2 r3] [r4 r5]
    dealt        r2 r0 | r3 r1 | r5 r4        (second window permuted (1, 0))
    batches      (r0, r2) (r1, r3) (r4, r5)

Same ``(seed, epoch)``: same order; ``shuffle=False``: file order.

Resuming (``load_state_dict``) skips, unread, every row group before the resume point (with
shuffling: before the window that holds it, which is read whole to redraw its order).

Days: ``ParquetLoader(dir, days=range(3, 5), ...)`` reads the rows of days 3 and 4 of a
dataset that records its days (:mod:`dlrm_app.data.days`) instead of a split: their pieces of
shards, in day order, form the stream above (a row group cut by a day's edge counts only its
rows of the day), dealt and shuffled the same way.

Example::

    loader = ParquetLoader("data/synth", "train", batch_size=4096, rank=rank,
                           world_size=world_size, shuffle=True, seed=0)
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for batch in loader:
            batch = batch.to(device, non_blocking=True)
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import os
import queue
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from dlrm_app.data.days import read_days, select_days, shard_files
from dlrm_app.data.integrity import read_footer, verify_checksums
from dlrm_app.data.schema import DENSE_COLUMN, SPLIT_NAMES, DatasetSpec
from recsys_core.sparse.keyed_jagged_tensor import KeyedJaggedTensor

DEFAULT_SHUFFLE_WINDOW = 262_144
"""Rows permuted together when shuffling: 4 row groups of the preprocessors' default 65,536."""
_PUT_POLL_S = 0.1
"""How often a blocked producer re-checks whether the consumer went away."""


@dataclasses.dataclass(frozen=True)
class Batch:
    """One training batch of ``B`` rows."""

    dense: torch.Tensor
    """``[B, n_dense]`` float32, columns in ``dense_features`` order."""
    sparse: KeyedJaggedTensor
    """Keys are the sparse feature names in dataset.json order; int64 values, int32 lengths."""
    labels: torch.Tensor
    """``[B]`` float32."""
    valid_rows: int | None = None
    """A padded batch (``pad_last``): only the first ``valid_rows`` rows are real. None: all."""

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        """A copy with every tensor on ``device``."""
        return Batch(
            dense=self.dense.to(device, non_blocking=non_blocking),
            sparse=self.sparse.to(device, non_blocking=non_blocking),
            labels=self.labels.to(device, non_blocking=non_blocking),
            valid_rows=self.valid_rows,
        )

    def pin_memory(self) -> Batch:
        """A copy in page-locked host memory, so ``to(cuda, non_blocking=True)`` overlaps."""
        return Batch(dense=self.dense.pin_memory(), sparse=self.sparse.pin_memory(),
                     labels=self.labels.pin_memory(), valid_rows=self.valid_rows)


@dataclasses.dataclass(frozen=True)
class _RowGroup:
    shard: int
    """Index into the split's shard list."""
    index: int
    """Row group index inside that shard."""
    rows: int
    """Rows of the row group this loader reads (all of it, unless it is cut by a day)."""
    first_row: int = 0
    """The row group's first row in its shard (for messages naming a row)."""
    skip: int = 0
    """Rows of the row group before the ones read (a day that starts inside it)."""


@dataclasses.dataclass(frozen=True)
class _Part:
    """Some rows of a batch in the batch's layout; ``_make_batch`` concatenates parts."""

    dense: np.ndarray  # [m, n_dense] float32
    labels: np.ndarray  # [m] float32
    lengths: np.ndarray  # [n_features, m] int32
    values: list[np.ndarray]  # per feature, the ids of the m rows in order, int64


@dataclasses.dataclass(frozen=True)
class _Decoded:
    """One row group as numpy arrays: the fast path, built from Arrow buffers, no row loops."""

    dense: np.ndarray  # [n, n_dense] float32
    labels: np.ndarray  # [n] float32
    lengths: np.ndarray  # [n_features, n] int32: row-slicing then ravel() is key-major
    offsets: list[np.ndarray]  # per feature, [n + 1] int64 into values
    values: list[np.ndarray]  # per feature, int64

    @property
    def rows(self) -> int:
        return int(self.labels.shape[0])

    @functools.cached_property
    def one_hot(self) -> list[bool]:
        """Per feature: exactly one id in every row (then row i's id is at offsets[0] + i)."""
        return (self.lengths == 1).all(axis=1).tolist()

    def parts(self, rows: slice) -> list[_Part]:
        """Contiguous rows, as views."""
        a, b = rows.start, rows.stop
        return [_Part(dense=self.dense[a:b], labels=self.labels[a:b],
                      lengths=self.lengths[:, a:b],
                      values=[v[off[a]:off[b]] for v, off in zip(self.values, self.offsets,
                                                                  strict=True)])]

    def gather(self, rows: np.ndarray) -> _Part:
        """The rows at indices ``rows``, in that order (copies; ``take`` is numpy's fastest
        gather)."""
        lengths = np.ones((len(self.values), rows.shape[0]), np.int32)
        values = []
        for k, (v, off) in enumerate(zip(self.values, self.offsets, strict=True)):
            if self.one_hot[k]:
                values.append(v[off[0]:].take(rows))
                continue
            starts = off.take(rows)
            bag = off[1:].take(rows) - starts
            lengths[k] = bag
            # each output id's position in v: its bag's start plus its index inside the bag
            shift = starts - (np.cumsum(bag) - bag)
            values.append(v.take(np.repeat(shift, bag) + np.arange(int(bag.sum()))))
        return _Part(dense=self.dense.take(rows, axis=0), labels=self.labels.take(rows),
                     lengths=lengths, values=values)


@dataclasses.dataclass(frozen=True)
class _Window:
    """The rows of one shuffle window: slices of decoded row groups, in stream order. Not a
    copy: batches gather their rows straight from the row groups."""

    chunks: list[tuple[_Decoded, slice]]

    @functools.cached_property
    def _starts(self) -> np.ndarray:
        """Window row at which each chunk starts, then the window's size."""
        return np.cumsum([0] + [s.stop - s.start for _, s in self.chunks])

    def parts(self, rows: np.ndarray) -> list[_Part]:
        """The rows at window indices ``rows``, in ascending order: the order of rows inside
        a batch does not change its loss, and ascending indices are one cache-friendly gather
        per row group."""
        rows = np.sort(rows)
        bounds = np.searchsorted(rows, self._starts)
        return [d.gather(rows[lo:hi] - start + s.start)
                for (d, s), start, lo, hi in zip(self.chunks, self._starts, bounds, bounds[1:],
                                                 strict=False) if lo < hi]


class _RowStream:
    """Rows from an iterator of row-group slices, taken ``n`` at a time."""

    def __init__(self, chunks: Iterator[tuple[_Decoded, slice]]) -> None:
        self._chunks = chunks
        self._carry: tuple[_Decoded, slice] | None = None  # a row group cut by the last take

    def take(self, n: int) -> list[tuple[_Decoded, slice]]:
        parts: list[tuple[_Decoded, slice]] = []
        while n > 0:
            decoded, rows = self._carry if self._carry is not None else next(self._chunks)
            cut = min(rows.start + n, rows.stop)
            parts.append((decoded, slice(rows.start, cut)))
            self._carry = (decoded, slice(cut, rows.stop)) if cut < rows.stop else None
            n -= cut - rows.start
        return parts


_Piece = tuple[_Decoded, slice] | tuple[_Window, np.ndarray]
"""Rows of one source: a slice of a row group (file order) or indices into a window."""


def _num_rows(rows: slice | np.ndarray) -> int:
    return rows.stop - rows.start if isinstance(rows, slice) else int(rows.shape[0])


def _sub_rows(rows: slice | np.ndarray, start: int, stop: int) -> slice | np.ndarray:
    if isinstance(rows, slice):
        return slice(rows.start + start, rows.start + stop)
    return rows[start:stop]


class _Failure:
    """Carries an exception from the prefetch thread to the consumer."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


_END = object()


class ParquetLoader:
    """Iterable of :class:`Batch` over one split, this rank's contiguous share of its rows.

    See the module docstring for the row assignment, the shuffle and the batch count.
    Iterating runs a background thread that keeps up to ``prefetch`` batches ready (0: no
    thread); an error in the thread is raised in the consumer, and abandoning the iterator
    stops the thread.

    ``shuffle_window`` is the number of rows permuted together when ``shuffle`` is on; memory
    grows with it. Order is a pure function of ``(seed, epoch, rank, world_size,
    shuffle_window)`` and the batch size; ``state_dict()`` records the epoch and how many batches the consumer received, and
    ``load_state_dict()`` makes the next iteration resume right after them.
    """

    def __init__(
        self,
        dataset_dir: str | os.PathLike[str],
        split: str | None = None,
        *,
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = True,
        pad_last: bool = False,
        prefetch: int = 2,
        epoch: int = 0,
        shuffle_window: int = DEFAULT_SHUFFLE_WINDOW,
        days: int | range | Sequence[int] | None = None,
    ) -> None:
        if days is not None and split is not None:
            raise ValueError(f"pass a split or days, not both (got split={split!r}, "
                             f"days={days!r})")
        if days is None and split not in SPLIT_NAMES:
            raise ValueError(f"unknown split {split!r}; choose one of {SPLIT_NAMES}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside the world: need 0 <= rank < world_size "
                             f"({world_size})")
        if prefetch < 0:
            raise ValueError(f"prefetch must be >= 0 batches (0 = no thread), got {prefetch}")
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        if shuffle_window < 1:
            raise ValueError(f"shuffle_window must be >= 1 row, got {shuffle_window}")
        self.dataset_dir = Path(dataset_dir)
        self.spec = DatasetSpec.load(self.dataset_dir)
        self.split = split
        self.days: tuple[int, ...] | None = None
        """The day indices read (``days=``), None when reading a split."""
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.shuffle = shuffle
        self.seed = seed
        if pad_last and drop_last:
            raise ValueError("pad_last=True pads the last batches instead of dropping them: "
                             "pass drop_last=False with it")
        self.drop_last = drop_last
        self.pad_last = pad_last
        self.prefetch = prefetch
        self.shuffle_window = shuffle_window
        self.keys = [f.name for f in self.spec.sparse_features]
        self._rows = {f.name: f.num_embeddings for f in self.spec.sparse_features}
        self._columns = [self.spec.label, DENSE_COLUMN, *self.keys]
        self._n_dense = len(self.spec.dense_features)
        if days is None:
            assert split is not None  # checked against SPLIT_NAMES above
            shards = self.spec.split(split).shards
            self._sources = [(s, 0, s.rows) for s in shards]
            self._what = str(split)
        else:
            all_days = read_days(self.spec)
            chosen = select_days(all_days, days)
            self.days = tuple(d.index for d in chosen)
            files = shard_files(self.spec, all_days)
            self._sources = [(files[p.file], p.first_row, p.rows)
                             for d in chosen for p in d.pieces]
            self._what = f"days {list(self.days)}" if len(chosen) > 1 else \
                f"day {self.days[0]}"
            shards = tuple({s.file: s for s, _, _ in self._sources}.values())
        self._paths = [self.dataset_dir / s.file for s, _, _ in self._sources]
        self._row_groups = self._scan_metadata()
        verify_checksums(self.dataset_dir, shards, self._what, rank, world_size)
        total = sum(g.rows for g in self._row_groups)
        if total < world_size:
            raise ValueError(
                f"{'split ' if days is None else ''}'{self._what}' of {self.dataset_dir} has "
                f"{total} rows, fewer than "
                f"world_size={world_size}: every rank needs at least one row. Use at most "
                f"{max(total, 1)} ranks or a dataset with more rows in this split")
        # rank r's rows of the epoch's stream: [bounds[r], bounds[r + 1])
        self._bounds = [r * total // world_size for r in range(world_size + 1)]
        per_rank = [b - a for a, b in itertools.pairwise(self._bounds)]
        if pad_last:
            self._count = max(math.ceil(rows / batch_size) for rows in per_rank)
        elif drop_last:
            self._count = min(rows // batch_size for rows in per_rank)
        else:
            self._count = min(math.ceil(rows / batch_size) for rows in per_rank)
        self._epoch = epoch
        self._resume_from = 0  # batches to skip at the start of the next iteration
        self._yielded = 0  # batches handed to the consumer in the current epoch

    # -- metadata and assignment ----------------------------------------------------------

    def _scan_metadata(self) -> list[_RowGroup]:
        """The row groups of the sources (a day's rows may cut a row group: only the rows
        inside the source's range count)."""
        groups = []
        for source, (path, (shard, lo, n)) in enumerate(zip(self._paths, self._sources,
                                                            strict=True)):
            meta = read_footer(path, shard, self._what)
            names = set(meta.schema.to_arrow_schema().names)  # parquet names are leaves
            missing = [c for c in self._columns if c not in names]
            if missing:
                raise ValueError(f"{path}: missing columns {missing} that dataset.json "
                                 f"declares; regenerate the dataset")
            first = 0
            for i in range(meta.num_row_groups):
                rows = meta.row_group(i).num_rows
                a, b = max(lo, first), min(lo + n, first + rows)
                if a < b:
                    groups.append(_RowGroup(source, i, b - a, first, a - first))
                first += rows
        return groups

    def _epoch_order(self, epoch: int) -> list[_RowGroup]:
        if not self.shuffle:
            return list(self._row_groups)
        perm = np.random.default_rng([self.seed, epoch]).permutation(len(self._row_groups))
        return [self._row_groups[i] for i in perm]

    def __len__(self) -> int:
        """Batches per epoch (the same on every rank and in every epoch)."""
        return self._count

    # -- epoch and resume state -----------------------------------------------------------

    @property
    def epoch(self) -> int:
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order the next iteration follows; starts it from the top."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        self._epoch = epoch
        self._resume_from = 0
        self._yielded = 0

    def state_dict(self) -> dict[str, int]:
        """``{"epoch", "batches_yielded"}``: what the consumer has received so far."""
        return {"epoch": self._epoch, "batches_yielded": self._yielded}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make the next iteration continue ``state``'s epoch after its yielded batches."""
        unknown = set(state) - {"epoch", "batches_yielded"}
        if unknown or "epoch" not in state or "batches_yielded" not in state:
            raise ValueError(f"loader state must have exactly the keys 'epoch' and "
                             f"'batches_yielded', got {sorted(state)}")
        epoch, done = int(state["epoch"]), int(state["batches_yielded"])
        if epoch < 0 or done < 0:
            raise ValueError(f"loader state has negative values: {dict(state)}")
        if done > self._count:
            raise ValueError(f"loader state says {done} batches were yielded in epoch {epoch}, "
                             f"but this loader has only {self._count} per epoch (different dataset, "
                             f"batch_size or world_size?)")
        self._epoch = epoch
        self._resume_from = done
        self._yielded = done

    # -- reading --------------------------------------------------------------------------

    def _decode(self, table: pa.Table, path: Path, first_row: int = 0) -> _Decoded:
        n = table.num_rows
        labels = table.column(self.spec.label).combine_chunks()
        if labels.null_count:
            raise ValueError(f"{path}: label column '{self.spec.label}' has nulls")
        dense_arr = table.column(DENSE_COLUMN).combine_chunks()
        # flatten() honours a slice offset, unlike .values; zero-copy for a fresh read
        dense = dense_arr.flatten().to_numpy(zero_copy_only=False)
        if dense.size != n * self._n_dense:
            raise ValueError(f"{path}: column '{DENSE_COLUMN}' has {dense.size} values for "
                             f"{n} rows x {self._n_dense} dense features")
        lengths = np.empty((len(self.keys), n), dtype=np.int32)
        offsets, values = [], []
        for k, key in enumerate(self.keys):
            arr = table.column(key).combine_chunks()
            if arr.null_count or arr.values.null_count:
                raise ValueError(f"{path}: sparse feature '{key}' has null lists or ids")
            off = arr.offsets.to_numpy().astype(np.int64, copy=False)
            # .values ignores a slice; offsets still index into it, so keep both consistent
            values.append(arr.values.to_numpy())
            offsets.append(off)
            np.subtract(off[1:], off[:-1], out=lengths[k], casting="unsafe")
        decoded = _Decoded(dense=dense.reshape(n, self._n_dense),
                           labels=labels.to_numpy(zero_copy_only=False).astype(np.float32),
                           lengths=lengths, offsets=offsets, values=values)
        self._check_contents(decoded, path, first_row)
        return decoded

    def _check_contents(self, d: _Decoded, path: Path, first_row: int) -> None:
        """Labels 0 or 1, finite dense values, ids inside their tables: one vectorized pass per
        row group, so that a bad shard stops the run naming its file and row instead of
        training on it."""
        fix = "the shards and dataset.json disagree: run the preprocessing again"
        bad = (d.labels != 0) & (d.labels != 1)
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"{path}: row {first_row + i:,}: label {float(d.labels[i])} is not 0 or 1 "
                             f"(a click/no-click label); {fix}")
        finite = np.isfinite(d.dense)
        if not finite.all():
            i, j = (int(x) for x in np.argwhere(~finite)[0])
            raise ValueError(f"{path}: row {first_row + i:,}: dense feature "
                             f"'{self.spec.dense_features[j]}' is {float(d.dense[i, j])}, not a finite "
                             f"number; {fix}")
        for k, key in enumerate(self.keys):
            ids = d.values[k][d.offsets[k][0]:d.offsets[k][-1]]
            if ids.size == 0:
                continue
            rows = self._rows[key]
            low, high = int(ids.min()), int(ids.max())
            if low < 0 or high >= rows:
                value = low if low < 0 else high
                where = int(np.argmax(ids == value)) + int(d.offsets[k][0])
                row = int(np.searchsorted(d.offsets[k], where, side="right")) - 1
                raise ValueError(f"{path}: row {first_row + row:,}: id {value} of sparse feature "
                                 f"'{key}' is outside [0, {rows:,}) (its num_embeddings in "
                                 f"dataset.json); {fix}")

    def _chunks(self, epoch: int, start: int, stop: int) -> Iterator[tuple[_Decoded, slice]]:
        """Rows ``[start, stop)`` of ``epoch``'s stream, one row group (or part of one) at a
        time; row groups outside the range are not read."""
        files: dict[int, pq.ParquetFile] = {}
        first = 0  # stream position of g's first row
        for g in self._epoch_order(epoch):
            lo, hi = max(start - first, 0), min(stop - first, g.rows)
            first += g.rows
            if lo >= hi:
                if first >= stop:
                    return
                continue
            path = self._paths[g.shard]
            try:
                if g.shard not in files:
                    files[g.shard] = pq.ParquetFile(path)
                table = files[g.shard].read_row_group(g.index, columns=self._columns)
            except (OSError, pa.ArrowException) as e:
                raise ValueError(f"{path}: cannot read row group {g.index} (rows "
                                 f"{g.first_row:,}-{g.first_row + g.rows - 1:,}): "
                                 f"{' '.join(str(e).split())}; the file "
                                 f"is damaged: run the preprocessing again") from None
            yield self._decode(table, path, g.first_row), slice(g.skip + lo, g.skip + hi)

    def _pieces(self, epoch: int, skip: int) -> Iterator[_Piece]:
        """This rank's rows of ``epoch`` in yield order, after its first ``skip`` rows."""
        begin, end = self._bounds[self.rank], self._bounds[self.rank + 1]
        if not self.shuffle:
            yield from self._chunks(epoch, min(begin + skip, end), end)
            return
        size = self.shuffle_window
        window = skip // size  # the windows before it were consumed whole: not read
        skip -= window * size
        stream = _RowStream(self._chunks(epoch, min(begin + window * size, end), end))
        while begin + window * size < end:
            want = min(size, end - begin - window * size)
            # rank and window are shifted by one: numpy seeds [a, b] and [a, b, 0] collide
            rng = np.random.default_rng([self.seed, epoch, self.rank + 1, window + 1])
            # no name here keeps the window or its row groups once the consumer drops them
            yield _Window(stream.take(want)), rng.permutation(want)[skip:]
            skip = 0
            window += 1

    def _make_batch(self, parts: list[_Part], pad: bool = False) -> Batch:
        """``parts`` concatenated (copies: batches own memory); with ``pad``, padding rows up
        to ``batch_size``."""
        valid = sum(p.labels.shape[0] for p in parts)
        padding = self.batch_size - valid if pad else 0
        n_sparse = len(self.keys)
        dense = np.concatenate([p.dense for p in parts]
                               + [np.zeros((padding, self._n_dense), np.float32)])
        labels = np.concatenate([p.labels for p in parts] + [np.zeros(padding, np.float32)])
        lengths = np.concatenate([p.lengths for p in parts]
                                 + [np.zeros((n_sparse, padding), np.int32)], axis=1)
        values = np.concatenate([p.values[k] for k in range(n_sparse) for p in parts]
                                + [np.zeros(0, np.int64)])
        sparse = KeyedJaggedTensor(
            keys=self.keys, values=torch.from_numpy(values),
            lengths=torch.from_numpy(lengths.ravel()), stride=labels.shape[0],
            length_per_key=lengths.sum(axis=1).tolist())
        return Batch(dense=torch.from_numpy(dense), sparse=sparse,
                     labels=torch.from_numpy(labels), valid_rows=valid if pad else None)

    def _generate(self, epoch: int, skip_batches: int) -> Iterator[Batch]:
        """This rank's batches of ``epoch`` from batch ``skip_batches`` on (no thread)."""
        remaining = self._count - skip_batches
        # every batch before the last is full, so the skipped batches held exactly these rows
        pieces = self._pieces(epoch, skip_batches * self.batch_size)
        pending: list[_Part] = []
        pending_rows = 0
        for source, rows in pieces if remaining > 0 else ():
            start, n = 0, _num_rows(rows)
            while start < n and remaining > 0:
                take = min(self.batch_size - pending_rows, n - start)
                pending += source.parts(_sub_rows(rows, start, start + take))
                pending_rows += take
                start += take
                if pending_rows == self.batch_size:
                    yield self._make_batch(pending)
                    remaining -= 1
                    pending, pending_rows = [], 0
            if remaining == 0:
                break  # drop_last: the rest of the share is not read
            del source  # free this window before the next one is built
        if remaining > 0 and pending_rows:  # drop_last=False: the short final batch
            yield self._make_batch(pending, pad=self.pad_last)
            remaining -= 1
        while self.pad_last and remaining > 0:  # this rank ran out before the others
            yield self._make_batch([], pad=True)
            remaining -= 1

    def __iter__(self) -> Iterator[Batch]:
        epoch, skip = self._epoch, self._resume_from
        self._resume_from = 0
        self._yielded = skip
        source = self._generate(epoch, skip)
        if self.prefetch == 0:
            for batch in source:
                self._yielded += 1
                yield batch
            return
        q: queue.Queue[object] = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()

        def put(item: object) -> bool:
            # a timed put so that a producer blocked on a full queue notices `stop`
            while not stop.is_set():
                try:
                    q.put(item, timeout=_PUT_POLL_S)
                    return True
                except queue.Full:
                    continue
            return False

        def produce() -> None:
            try:
                for batch in source:
                    if not put(batch):
                        return
            except BaseException as e:  # re-raised in the consumer, not lost in the thread
                put(_Failure(e))
                return
            put(_END)

        thread = threading.Thread(target=produce, name="ParquetLoader-prefetch", daemon=True)
        thread.start()
        try:
            while True:
                item = q.get()
                if item is _END:
                    return
                if isinstance(item, _Failure):
                    raise item.exc
                self._yielded += 1
                yield cast(Batch, item)  # the producer puts source's batches, _END and _Failure
        finally:
            # reached on exhaustion, on error, and when an abandoned iterator is closed or
            # garbage collected (GeneratorExit): stop the producer and wait for it
            stop.set()
            while thread.is_alive():
                try:
                    q.get(timeout=_PUT_POLL_S)
                except queue.Empty:
                    pass
            thread.join()
