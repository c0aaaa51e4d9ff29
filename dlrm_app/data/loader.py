"""Parquet -> ``Batch(dense, sparse KJT, labels)`` with row groups split across ranks.

The unit of work is one Parquet row group of the split's shards (listed in ``dataset.json``).
Each epoch the loader lists every row group of the split in shard order, shuffles that list
with ``(seed, epoch)`` when ``shuffle`` is on, and deals it round-robin to the ranks. Example:
two shards of 3 and 2 row groups, ``world_size=2``, no shuffle::

    row group    g0=(shard0,rg0) g1=(shard0,rg1) g2=(shard0,rg2) g3=(shard1,rg0) g4=(shard1,rg1)
    rows         1000            1000            500             1000            700
    rank 0       g0, g2, g4  -> 2200 rows
    rank 1       g1, g3      -> 2000 rows

Each rank reads its row groups in that order as one stream of rows and cuts it into batches of
``batch_size`` (a batch can span two row groups: the leftover rows are carried over). Every rank
computes every rank's row count from the Parquet metadata alone, so all ranks agree without
communicating on the number of batches per epoch:

    drop_last=True   num_batches = min over ranks of floor(rows_r / batch_size)
    pad_last=True    num_batches = max over ranks of ceil(rows_r / batch_size); every batch
                     has exactly batch_size rows, the missing ones are padding rows (dense 0,
                     empty bags, label 0) at the end, counted out by ``Batch.valid_rows``.
                     Every row of the split is yielded exactly once: use it for evaluation
                     (sharded modules need the same batch size on every rank).
    drop_last=False  num_batches = min over ranks of ceil(rows_r / batch_size); a rank's last
                     batch may then be shorter than ``batch_size`` (and differ between ranks)

With ``batch_size=512`` above: rank 0 has floor(2200/512)=4, rank 1 floor(2000/512)=3, so both
ranks yield 3 batches and the remaining rows of the epoch (2200-1536 and 2000-1536) are dropped.
Equal batch counts matter because every batch triggers collectives (KJT all-to-all, gradient
all-reduce): a rank with one extra batch would hang the others.

Shuffling is at row-group granularity (rows inside a row group keep their file order); the
preprocessors write rows already shuffled, so this is enough to vary the order per epoch
without a random-access read per row.

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
import math
import os
import queue
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from dlrm_app.data.schema import DENSE_COLUMN, SPLIT_NAMES, DatasetSpec
from recsys_core.sparse.keyed_jagged_tensor import KeyedJaggedTensor

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


class _Failure:
    """Carries an exception from the prefetch thread to the consumer."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


_END = object()


class ParquetLoader:
    """Iterable of :class:`Batch` over one split, this rank's share of its row groups.

    See the module docstring for the row-group assignment and the batch count. Iterating runs
    a background thread that keeps up to ``prefetch`` batches ready (0: no thread); an error in
    the thread is raised in the consumer, and abandoning the iterator stops the thread.

    Order is a pure function of ``(seed, epoch)``; ``state_dict()`` records the epoch and how
    many batches the consumer received, and ``load_state_dict()`` makes the next iteration
    resume right after them (whole row groups before that point are skipped unread).
    """

    def __init__(
        self,
        dataset_dir: str | os.PathLike[str],
        split: str,
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
    ) -> None:
        if split not in SPLIT_NAMES:
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
        self.dataset_dir = Path(dataset_dir)
        self.spec = DatasetSpec.load(self.dataset_dir)
        self.split = split
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
        self.keys = [f.name for f in self.spec.sparse_features]
        self._columns = [self.spec.label, DENSE_COLUMN, *self.keys]
        self._n_dense = len(self.spec.dense_features)
        self._paths = [self.dataset_dir / s.file for s in self.spec.split(split).shards]
        self._row_groups = self._scan_metadata()
        if len(self._row_groups) < world_size:
            raise ValueError(
                f"split '{split}' of {self.dataset_dir} has {len(self._row_groups)} row groups, "
                f"fewer than world_size={world_size}; some ranks would get no data. Regenerate "
                f"the dataset with a smaller row_group_size or use fewer ranks")
        self._epoch = epoch
        self._resume_from = 0  # batches to skip at the start of the next iteration
        self._yielded = 0  # batches handed to the consumer in the current epoch

    # -- metadata and assignment ----------------------------------------------------------

    def _scan_metadata(self) -> list[_RowGroup]:
        groups = []
        for shard, path in enumerate(self._paths):
            if not path.is_file():
                raise FileNotFoundError(
                    f"{path}: shard of split '{self.split}' listed in {self.dataset_dir}/"
                    f"dataset.json is missing; regenerate the dataset")
            meta = pq.ParquetFile(path).metadata
            names = set(meta.schema.to_arrow_schema().names)  # parquet names are leaves
            missing = [c for c in self._columns if c not in names]
            if missing:
                raise ValueError(f"{path}: missing columns {missing} that dataset.json "
                                 f"declares; regenerate the dataset")
            groups += [_RowGroup(shard, i, meta.row_group(i).num_rows)
                       for i in range(meta.num_row_groups)]
        return groups

    def _epoch_order(self, epoch: int) -> list[_RowGroup]:
        if not self.shuffle:
            return list(self._row_groups)
        perm = np.random.default_rng([self.seed, epoch]).permutation(len(self._row_groups))
        return [self._row_groups[i] for i in perm]

    def _assignment(self, epoch: int) -> tuple[list[_RowGroup], int]:
        """This rank's row groups for ``epoch`` and the batch count shared by all ranks."""
        order = self._epoch_order(epoch)
        per_rank = [sum(g.rows for g in order[r::self.world_size])
                    for r in range(self.world_size)]
        if self.pad_last:
            count = max(math.ceil(rows / self.batch_size) for rows in per_rank)
        elif self.drop_last:
            count = min(rows // self.batch_size for rows in per_rank)
        else:
            count = min(math.ceil(rows / self.batch_size) for rows in per_rank)
        return order[self.rank::self.world_size], count

    def __len__(self) -> int:
        """Batches per epoch for the current epoch (the same on every rank)."""
        return self._assignment(self._epoch)[1]

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
        total = self._assignment(epoch)[1]
        if done > total:
            raise ValueError(f"loader state says {done} batches were yielded in epoch {epoch}, "
                             f"but this loader has only {total} per epoch (different dataset, "
                             f"batch_size or world_size?)")
        self._epoch = epoch
        self._resume_from = done
        self._yielded = done

    # -- reading --------------------------------------------------------------------------

    def _decode(self, table: pa.Table, path: Path) -> _Decoded:
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
        return _Decoded(dense=dense.reshape(n, self._n_dense),
                        labels=labels.to_numpy(zero_copy_only=False).astype(np.float32),
                        lengths=lengths, offsets=offsets, values=values)

    def _make_batch(self, pieces: list[tuple[_Decoded, int, int]], pad: bool = False) -> Batch:
        """Rows ``[a, b)`` of each decoded row group, concatenated (copies: batches own memory);
        with ``pad``, padding rows up to ``batch_size``."""
        valid = sum(b - a for _, a, b in pieces)
        padding = self.batch_size - valid if pad else 0
        n_sparse = len(self.keys)
        dense = np.concatenate([d.dense[a:b] for d, a, b in pieces]
                               + [np.zeros((padding, self._n_dense), np.float32)])
        labels = np.concatenate([d.labels[a:b] for d, a, b in pieces]
                                + [np.zeros(padding, np.float32)])
        lengths = np.concatenate([d.lengths[:, a:b] for d, a, b in pieces]
                                 + [np.zeros((n_sparse, padding), np.int32)], axis=1)
        values = np.concatenate([
            d.values[k][d.offsets[k][a]:d.offsets[k][b]]
            for k in range(n_sparse) for d, a, b in pieces] + [np.zeros(0, np.int64)])
        sparse = KeyedJaggedTensor(
            keys=self.keys, values=torch.from_numpy(values),
            lengths=torch.from_numpy(lengths.ravel()), stride=labels.shape[0],
            length_per_key=lengths.sum(axis=1).tolist())
        return Batch(dense=torch.from_numpy(dense), sparse=sparse,
                     labels=torch.from_numpy(labels), valid_rows=valid if pad else None)

    def _generate(self, epoch: int, skip_batches: int) -> Iterator[Batch]:
        """This rank's batches of ``epoch`` from batch ``skip_batches`` on (no thread)."""
        groups, count = self._assignment(epoch)
        remaining = count - skip_batches
        skip_rows = skip_batches * self.batch_size  # every batch before the last is full
        files: dict[int, pq.ParquetFile] = {}
        pending: list[tuple[_Decoded, int, int]] = []
        pending_rows = 0
        for g in groups:
            if remaining <= 0:
                break
            if skip_rows >= g.rows:  # resume: the whole row group was consumed, do not read
                skip_rows -= g.rows
                continue
            if g.shard not in files:
                files[g.shard] = pq.ParquetFile(self._paths[g.shard])
            table = files[g.shard].read_row_group(g.index, columns=self._columns)
            decoded = self._decode(table, self._paths[g.shard])
            start, skip_rows = skip_rows, 0
            while start < decoded.rows and remaining > 0:
                take = min(self.batch_size - pending_rows, decoded.rows - start)
                pending.append((decoded, start, start + take))
                pending_rows += take
                start += take
                if pending_rows == self.batch_size:
                    yield self._make_batch(pending)
                    remaining -= 1
                    pending, pending_rows = [], 0
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
                yield item  # type: ignore[misc]
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
