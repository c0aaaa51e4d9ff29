"""A table-batched kernel whose tables live in a slower tier behind a cache of row slots.

Each cached table keeps all of its rows (weights and per-row optimizer state, together) in a
*backing store*: a memory-mapped file on local disk on CPU (TorchRec's SSD tier), pinned host
memory on CUDA. A fast-tier *cache* of ``slots`` rows (RAM on CPU, device memory on CUDA) is an
ordinary uncached kernel (FBGEMM's or the torch one) whose "table" has ``slots`` rows. Before a
batch is looked up, every row it needs is made resident: missing rows are loaded into free slots
or into the slots of evicted rows (LRU or LFU), evicted rows that were trained are written back,
and the batch's ids are renamed to slots. The inner kernel's fused optimizer updates only the
rows it looked up, one row at a time, so training through the cache gives exactly the weights
and optimizer state of the uncached kernel, at any cache size that holds one batch's rows.

Rows of a batch stay *locked* from the moment they are made resident (by ``forward`` or by
``prefetch``) until that batch's backward has updated them (or right after a forward that
builds no graph), so a prefetch of the next batch never evicts rows the in-flight batch still
needs. ``prefetch(indices, offsets)`` does the bookkeeping at once and the copies in a worker
thread; the ``forward`` that later receives the same ids waits for them.

The backing store is authoritative only after :meth:`flush` (write back every trained resident
row); ``split_embedding_weights`` / ``split_optimizer_states`` return views of the store, and
the collections flush before exporting state and :meth:`invalidate` after importing it.

The backing files (``offload_store.py``) have their space reserved when they are made, and
every row read back from them is checked against a checksum recorded when it was last written
(:class:`OffloadCorruptionError` on a mismatch; the flush before an export checks every row).
A move that fails leaves the cache inconsistent: its error is raised again by every later
lookup, prefetch and flush, and :meth:`drop_prefetched` does not raise it a second time.

Tables without a cache in the same kernel are held by the inner kernel as usual.

On CPU, misses and write-backs move rows with ``pread`` / ``pwrite`` through the package's
small C helper (``_rowio.c``, built at install when a C compiler is there), which maps nothing
into the process; without it they go through the files' memory mappings, in blocks whose pages
are dropped again (same results; measured 1.8x slower on the bench's 2-core machine, see
``bench/offload.py``).
"""

from __future__ import annotations

import errno
import math
import os
import tempfile
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import nn

from recsys_core.kernels.config import FusedOptimizerConfig
from recsys_core.kernels.offload_store import (
    ROWIO,
    BackingStore,
    OffloadCorruptionError,
    OffloadSpaceError,
    free_bytes,
    row_io_available,
)
from recsys_core.kernels.torch_tbe import feature_bounds

__all__ = [
    "CacheStats",
    "CacheTooSmallError",
    "CachedTableBatchedEmbedding",
    "OffloadCorruptionError",
    "OffloadSpaceError",
    "TableCache",
    "cache_slots",
    "row_io_available",
]

CACHE_ALGORITHMS = ("lru", "lfu")
# Fast-tier bookkeeping: per table row an int32 row -> slot map, an int32 LFU count and the
# int32 checksum of the row in its backing file; per slot an int64 row id, an int64 last-use
# tick, an int16 lock count, a dirty flag and (LRU) up to 1.25 int32 entries of the recency
# queue (see ``_LruQueue``): 24 bytes.
BOOKKEEPING_BYTES_PER_ROW = 12
BOOKKEEPING_BYTES_PER_SLOT = 24
_NEVER = torch.iinfo(torch.int64).max
# A slot is locked once per batch that holds it: the unreleased batches must stay below this.
_MAX_LOCKS = torch.iinfo(torch.int16).max
# The recency queue is compacted when it holds more than this many entries beyond one per
# filled slot (or a quarter of the filled slots, whichever is more); compacted chunks are
# merged up to this many entries.
_QUEUE_SLACK = 65536


class CacheTooSmallError(RuntimeError):
    """A batch needs more distinct rows of a table than its cache has unlocked slots."""


@dataclass(frozen=True, kw_only=True)
class TableCache:
    """The cache of one table: ``slots`` rows in the fast tier, evicting by ``algorithm``."""

    slots: int
    algorithm: str = "lru"

    def __post_init__(self) -> None:
        if self.slots < 1:
            raise ValueError(f"TableCache: slots must be >= 1, got {self.slots}")
        if self.algorithm not in CACHE_ALGORITHMS:
            raise ValueError(
                f"TableCache: algorithm {self.algorithm!r} is not one of {CACHE_ALGORITHMS}"
            )


def cache_slots(rows: int, load_factor: float) -> int:
    """Slots of a cache holding ``load_factor`` of ``rows`` rows (at least 1, at most rows)."""
    return max(1, min(int(rows), math.ceil(int(rows) * float(load_factor))))


@dataclass
class _Batch:
    """Rows one batch made resident: per cached table, its distinct slots (locked)."""

    slots: dict[int, torch.Tensor]
    source: torch.Tensor  # the ids as given (a prefetched batch is matched by identity)
    indices: torch.Tensor  # the ids renamed to slots, fed to the inner kernel
    moved: Future | None = None
    released: bool = False
    deferred: bool = False  # a prefetch that did not fit: its forward looks it up


@dataclass
class CacheStats:
    """Counters since construction (or :meth:`CachedTableBatchedEmbedding.reset_stats`)."""

    lookups: int = 0  # distinct rows per batch, summed
    misses: int = 0  # of those, rows loaded from the backing store
    ids: int = 0  # ids looked up (every occurrence)
    id_hits: int = 0  # of those, ids whose row was resident before the batch
    evictions: int = 0  # resident rows dropped to make room
    writebacks: int = 0  # evicted or flushed rows written to the backing store
    bytes_read: int = 0  # from the backing store
    bytes_written: int = 0  # to the backing store
    prefetched: int = 0  # batches whose rows a prefetch brought in before their forward

    @property
    def hit_rate(self) -> float:
        """Share of each batch's distinct rows that were resident (FBGEMM's unique hit rate)."""
        return 1.0 - self.misses / self.lookups if self.lookups else 1.0

    @property
    def id_hit_rate(self) -> float:
        """Share of looked-up ids whose row was resident."""
        return self.id_hits / self.ids if self.ids else 1.0


class _LruQueue:
    """The filled slots of a cache in the order they were last used, so that the least recently
    used unlocked ones are found in time proportional to the victims, not to the cache.

    Every lookup appends its slots as one chunk ``(tick, tick, slots)``. A slot used again
    leaves a stale entry behind: an entry of chunk ``(lo, hi, slots)`` is current while the
    slot's last-use tick is within ``[lo, hi]`` (chunks cover disjoint, increasing tick ranges
    and a chunk never holds a slot twice, so a slot has exactly one current entry). Victims are
    taken from the front, skipping stale entries and setting locked ones aside (they keep their
    place). When the queue holds more than a quarter of the filled slots (at least
    ``_QUEUE_SLACK``) in stale entries, it is compacted: stale entries dropped, small chunks
    merged; each compaction follows at least that many appended entries, so its cost is a
    constant per lookup.

    Worked example (ticks in brackets, ``*`` stale)::

        lookups: t1 slots [0 1 2], t2 slots [3 1], t3 slots [0]
        queue:   (1,1)[0* 1* 2]  (2,2)[3 1]  (3,3)[0]
        3 victims, none locked -> 2, 3, 1 (the front chunk's current entries, then the next's)
    """

    def __init__(self) -> None:
        self.chunks: deque[tuple[int, int, torch.Tensor]] = deque()
        self.entries = 0

    def clear(self) -> None:
        self.chunks.clear()
        self.entries = 0

    def append(self, tick: int, slots: torch.Tensor, last_used: torch.Tensor, filled: int) -> None:
        self.chunks.append((tick, tick, slots.to(torch.int32)))
        self.entries += slots.numel()
        if self.entries > filled + max(filled // 4, _QUEUE_SLACK):
            self._compact(last_used)

    def _current(self, lo: int, hi: int, slots: torch.Tensor, last_used: torch.Tensor) -> torch.Tensor:
        used = last_used[slots]
        return slots[(used >= lo) & (used <= hi)]

    def _compact(self, last_used: torch.Tensor) -> None:
        old, self.chunks, self.entries = self.chunks, deque(), 0
        group: list[torch.Tensor] = []
        group_lo = group_hi = group_n = 0
        while old:
            lo, hi, slots = old.popleft()
            slots = self._current(lo, hi, slots, last_used)
            if not slots.numel():
                continue
            if not group:
                group_lo = lo
            group.append(slots)
            group_hi, group_n = hi, group_n + slots.numel()
            if group_n >= _QUEUE_SLACK:
                self._push_merged(group_lo, group_hi, group)
                group, group_n = [], 0
        if group:
            self._push_merged(group_lo, group_hi, group)

    def _push_merged(self, lo: int, hi: int, parts: list[torch.Tensor]) -> None:
        merged = torch.cat(parts) if len(parts) > 1 else parts[0]
        self.chunks.append((lo, hi, merged))
        self.entries += merged.numel()

    def take(self, needed: int, last_used: torch.Tensor, locks: torch.Tensor) -> torch.Tensor:
        """The ``needed`` least recently used unlocked slots (there are that many), removed
        from the queue; the caller gives them a new tick and appends them again."""
        taken: list[torch.Tensor] = []
        aside: list[tuple[int, int, torch.Tensor]] = []  # locked current entries, in order
        while needed > 0:
            if not self.chunks:
                raise RuntimeError("cache bookkeeping: fewer unlocked slots than counted")
            lo, hi, slots = self.chunks.popleft()
            self.entries -= slots.numel()
            slots = self._current(lo, hi, slots, last_used)
            free = locks[slots] == 0
            n_free = int(free.sum())
            if n_free > needed:
                take = free & (free.cumsum(0) <= needed)
                taken.append(slots[take])
                rest = slots[~take]
                self.chunks.appendleft((lo, hi, rest))
                self.entries += rest.numel()
                needed = 0
            else:
                taken.append(slots[free])
                needed -= n_free
                if n_free < slots.numel():
                    aside.append((lo, hi, slots[~free]))
        for lo, hi, slots in reversed(aside):
            self.chunks.appendleft((lo, hi, slots))
            self.entries += slots.numel()
        return (torch.cat(taken) if len(taken) > 1 else taken[0]).long()


class _TableState:
    """Bookkeeping of one cached table (on the host). Slots ``[filled, slots)`` have never held
    a row since the cache was made or invalidated (slots are filled in order and only
    :meth:`CachedTableBatchedEmbedding.invalidate` empties them); ``locked`` counts the slots
    whose lock count is not 0."""

    def __init__(self, rows: int, cache: TableCache, store: BackingStore, row_bytes: int) -> None:
        self.rows, self.cache, self.store, self.row_bytes = rows, cache, store, row_bytes
        self.slot_of_row = torch.full((rows,), -1, dtype=torch.int32)
        self.freq = torch.zeros(rows, dtype=torch.int32) if cache.algorithm == "lfu" else None
        self.row_of_slot = torch.full((cache.slots,), -1, dtype=torch.int64)
        self.last_used = torch.zeros(cache.slots, dtype=torch.int64)
        self.locks = torch.zeros(cache.slots, dtype=torch.int16)
        self.dirty = torch.zeros(cache.slots, dtype=torch.bool)
        self.filled = 0
        self.locked = 0
        self.queue = _LruQueue() if cache.algorithm == "lru" else None

    def lock(self, slots: torch.Tensor) -> None:
        """One more lock on each of ``slots`` (distinct)."""
        self.locked += int((self.locks[slots] == 0).sum())
        self.locks[slots] += 1

    def unlock(self, slots: torch.Tensor) -> None:
        self.locks[slots] -= 1
        self.locked -= int((self.locks[slots] == 0).sum())

    def forget(self) -> None:
        """Every slot empty (nothing locked)."""
        self.slot_of_row.fill_(-1)
        self.row_of_slot.fill_(-1)
        self.dirty.fill_(False)
        self.last_used.zero_()
        self.filled = 0
        if self.queue is not None:
            self.queue.clear()


def _make_stores(
    row_bytes: dict[int, int], rows: list[int], dims: list[int], states: dict[str, bool],
    device: torch.device, directory: str | None, names: list[str],
) -> dict[int, BackingStore]:
    """The backing stores of the cached tables (``row_bytes``: their bytes per row), their
    files' space reserved: all or none (:class:`OffloadSpaceError` naming the directory, the
    bytes needed and free)."""
    if device.type != "cpu" or not row_bytes:
        return {t: BackingStore(rows[t], dims[t], states, device, directory, names[t])
                for t in row_bytes}
    where = directory or tempfile.gettempdir()
    needed = sum(rows[t] * b for t, b in row_bytes.items())
    if needed > (free := free_bytes(where)):
        raise OffloadSpaceError(where, needed, free)
    stores: dict[int, BackingStore] = {}
    try:
        for t in row_bytes:
            stores[t] = BackingStore(rows[t], dims[t], states, device, directory, names[t])
    except OSError as e:
        for store in stores.values():
            store.close()
        if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise OffloadSpaceError(where, needed, free_bytes(where), e.strerror) from None
        raise
    return stores


def _same_ids(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a is b or (a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b)))


class CachedTableBatchedEmbedding(nn.Module):
    """``forward(indices, offsets, per_sample_weights)`` like the uncached kernels, with the
    tables named in ``caches`` held in a backing store behind a cache (see the module doc).

    ``inner_factory(rows)`` builds the fast-tier kernel for the given per-table row counts (the
    caller's FBGEMM-or-torch choice); ``offload_dir`` is where backing files go on CPU (None:
    the system's temporary directory); their space is reserved there at once
    (:class:`OffloadSpaceError` when the disk has too little). ``table_names`` name the tables
    in the files' names and in errors. Rows move to and from the backing files in blocks of
    ``move_block_rows`` (see ``_move``), checked against per-row checksums
    (:class:`OffloadCorruptionError`, see ``offload_store.py``).
    """

    def __init__(
        self,
        *,
        rows: Sequence[int],
        dims: Sequence[int],
        feature_table_map: Sequence[int],
        optimizer: FusedOptimizerConfig,
        caches: Sequence[TableCache | None],
        device: torch.device,
        inner_factory,
        offload_dir: str | None = None,
        move_block_rows: int = 256,
        table_names: Sequence[str] | None = None,
    ) -> None:
        super().__init__()
        if len(caches) != len(rows):
            raise ValueError(f"CachedTableBatchedEmbedding: {len(caches)} caches for {len(rows)} tables")
        self.rows, self.dims = list(rows), list(dims)
        self.feature_table_map = list(feature_table_map)
        self.optimizer = optimizer
        self.caches = [
            # an empty table (a shard with no rows) has nothing to cache
            None if c is None or r == 0 else TableCache(slots=min(c.slots, r), algorithm=c.algorithm)
            for c, r in zip(caches, self.rows, strict=True)
        ]
        inner_rows = [r if c is None else c.slots for r, c in zip(self.rows, self.caches, strict=True)]
        self.inner = inner_factory(inner_rows)
        opt = optimizer.optimizer
        states = {name: opt.state_is_rowwise(name) for name in opt.state_names}
        names = list(table_names) if table_names is not None else [
            f"table_{t}" for t in range(len(self.rows))]
        row_bytes = {t: 4 * (self.dims[t] + sum(1 if rw else self.dims[t] for rw in states.values()))
                     for t, c in enumerate(self.caches) if c is not None}
        self._tables: dict[int, _TableState] = {}
        for t, store in _make_stores(row_bytes, self.rows, self.dims, states, device, offload_dir,
                                     names).items():
            self._tables[t] = _TableState(self.rows[t], self.caches[t], store, row_bytes[t])
        self._features_of = {
            t: [f for f, ft in enumerate(self.feature_table_map) if ft == t] for t in self._tables
        }
        self._tick = 0
        self._pending: deque[_Batch] = deque()  # resident and locked, forward not yet run
        self._in_flight: list[_Batch] = []  # forward run, backward not yet
        self._mover = ThreadPoolExecutor(max_workers=1, thread_name_prefix="embedding-cache")
        # the tables of one batch's move run side by side (each table's rows in order)
        self._table_movers = ThreadPoolExecutor(
            max_workers=max(1, min(len(self._tables), os.cpu_count() or 1)),
            thread_name_prefix="embedding-cache-table")
        self.move_block_rows = int(move_block_rows)
        # rows move with pread / pwrite (the C helper) on CPU; False: through the mappings
        self.row_io = ROWIO is not None and device.type == "cpu"
        self.stats = CacheStats()
        # the error that left the cache inconsistent (a failed or corrupt move): raised again
        # by every later lookup, prefetch or flush
        self._failure: BaseException | None = None

    # ---- the uncached kernel's interface -------------------------------------------------------
    @property
    def iter(self) -> torch.Tensor:
        return self.inner.iter

    def set_learning_rate(self, lr: float) -> None:
        self.inner.set_learning_rate(lr)

    def get_learning_rate(self) -> float:
        return self.inner.get_learning_rate()

    def split_embedding_weights(self) -> list[torch.Tensor]:
        """Per table: the backing store's ``[rows, dim]`` for a cached table (current after
        :meth:`flush`), the inner kernel's view otherwise. A caller may write the stores' views
        (a checkpoint load, in place) and then :meth:`invalidate`."""
        self._hand_out_stores()
        inner = self.inner.split_embedding_weights()
        return [self._tables[t].store.weight if t in self._tables else w for t, w in enumerate(inner)]

    def split_optimizer_states(self) -> list[dict[str, torch.Tensor]]:
        self._hand_out_stores()
        inner = self.inner.split_optimizer_states()
        return [dict(self._tables[t].store.states) if t in self._tables else s
                for t, s in enumerate(inner)]

    def _hand_out_stores(self) -> None:
        # DCP's load writes a checkpoint through these views before the load hook's flush: that
        # flush must not check the files against checksums of what the cache last wrote
        for ts in self._tables.values():
            ts.store.hand_out()

    def resident_rows(self, table: int) -> list[int]:
        """The rows of cached table ``table`` now in the cache, sorted."""
        rows = self._tables[table].row_of_slot
        return sorted(rows[rows >= 0].tolist())

    # ---- cache control -------------------------------------------------------------------------
    @torch.no_grad()
    def flush(self, verify: bool = True) -> None:
        """Write every trained resident row (weights and state) back to the backing store, then
        (``verify``) check every row of the backing files against its checksum: the store's
        views are about to be exported (a checkpoint), and no corrupt row may go with them."""
        self._wait_moves()
        weights = self.inner.split_embedding_weights()
        states = self.inner.split_optimizer_states()
        for t, ts in self._tables.items():
            slots = torch.nonzero(ts.dirty[: ts.filled]).flatten()
            if slots.numel():
                self._store_rows(ts, weights[t], states[t], slots, ts.row_of_slot[slots])
                ts.dirty[slots] = False
            if verify:
                ts.store.verify()
        self.release_memory()

    @torch.no_grad()
    def invalidate(self) -> None:
        """Forget every resident row: the next lookups read the backing store again (after it
        was written from outside, e.g. by a checkpoint load). Trained rows not yet flushed are
        written back first, so nothing is lost."""
        if any(not b.released for b in self._in_flight) or self._pending:
            raise RuntimeError(
                "CachedTableBatchedEmbedding.invalidate: a batch is in flight (forward run, "
                "backward not yet, or prefetched); finish it first"
            )
        self.flush(verify=False)
        for ts in self._tables.values():
            ts.store.sealed = False  # the files were written from outside: sealed anew, lazily
            ts.forget()

    def set_row_verification(self, enabled: bool) -> None:
        """Check rows read from the backing files against their checksums (the default; off:
        for measuring what the checks cost)."""
        for ts in self._tables.values():
            if enabled and not ts.store.check:
                ts.store.sealed = False  # checksums were not kept meanwhile: record them anew
            ts.store.check = enabled

    def record_filled(self, t: int, first: int, last: int) -> None:
        """Table ``t``'s rows ``first:last`` were just written through
        :meth:`split_embedding_weights` (filled block by block as the table is built): their
        checksums are recorded from memory, so the first move needs no scan of the files once
        every row was filled in order (:meth:`BackingStore.record_written`). Nothing for a
        table kept in memory."""
        if t in self._tables:
            self._tables[t].store.record_written(first, last)

    def release_memory(self) -> None:
        """Drop the backing files' pages from this process's resident memory."""
        for ts in self._tables.values():
            ts.store.release()

    def occupancy(self) -> float:
        """Share of the cache slots holding a row (all cached tables together)."""
        total = sum(ts.cache.slots for ts in self._tables.values())
        used = sum(ts.filled for ts in self._tables.values())
        return used / total if total else 1.0

    def reset_stats(self) -> None:
        self.stats = CacheStats()

    # ---- lookups -------------------------------------------------------------------------------
    def prefetch(self, indices: torch.Tensor, offsets: torch.Tensor) -> None:
        """Make the rows of a future batch resident (copies run in a worker thread); the forward
        that receives the same ids uses them (prefetched batches are consumed in order; a
        forward of other ids is looked up on its own and leaves them waiting). Rows of batches
        in flight are never evicted."""
        self._raise_failure()
        batch = self._resolve(indices, offsets, asynchronous=True)
        # None: no room beside the batches in flight; its forward looks it up then instead.
        self._pending.append(batch or _Batch(slots={}, source=indices, indices=indices, deferred=True))

    def forward(
        self,
        indices: torch.Tensor,
        offsets: torch.Tensor,
        per_sample_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        self._raise_failure()
        self._retire()
        batch = None
        if self._pending and _same_ids(self._pending[0].source, indices):
            batch = self._pending.popleft()
            self.stats.prefetched += not batch.deferred
        if batch is None or batch.deferred:
            batch = self._resolve(indices, offsets, asynchronous=False)
        assert batch is not None
        if batch.moved is not None:
            batch.moved.result()
        out = self.inner(batch.indices, offsets, per_sample_weights)
        if out.requires_grad and out.grad_fn is not None:
            self._in_flight.append(batch)
            out.grad_fn.register_hook(lambda *_: self._release(batch, trained=True))
        else:
            self._release(batch, trained=False)
        return out

    def _retire(self) -> None:
        self._in_flight = [b for b in self._in_flight if not b.released]

    def drop_prefetched(self) -> None:
        """Prefetched batches that no forward consumed (the loop changed course): unlock them."""
        while self._pending:
            batch = self._pending.popleft()
            if batch.moved is not None:
                try:
                    batch.moved.result()
                except BaseException:
                    # recorded in _failure: the next lookup, prefetch or flush raises it. Not
                    # here: this cleanup runs while the loop unwinds from that very error.
                    if self._failure is None:
                        raise
            self._release(batch, trained=False)

    def _release(self, batch: _Batch, trained: bool) -> None:
        if batch.released:
            return
        batch.released = True
        for t, slots in batch.slots.items():
            ts = self._tables[t]
            ts.unlock(slots)
            if trained:
                ts.dirty[slots] = True

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure

    def _wait_moves(self) -> None:
        self._raise_failure()
        for b in self._pending:
            if b.moved is not None:
                b.moved.result()
        for b in self._in_flight:
            if b.moved is not None:
                b.moved.result()

    @torch.no_grad()
    def _resolve(
        self, indices: torch.Tensor, offsets: torch.Tensor, asynchronous: bool
    ) -> _Batch | None:
        """Bookkeeping for one batch: pick slots, lock them, rename the ids; returns the batch
        with the copies to do (run now, or in the worker when ``asynchronous``). A prefetch
        (``asynchronous``) that does not fit beside the batches in flight returns None and
        changes nothing; a forward that does not fit raises :class:`CacheTooSmallError`."""
        unreleased = len(self._pending) + sum(not b.released for b in self._in_flight)
        if unreleased >= _MAX_LOCKS:
            raise RuntimeError(
                f"CachedTableBatchedEmbedding: {unreleased} batches hold cache rows (prefetched "
                "or forward run without backward); run their forwards and backwards, or "
                "drop_prefetched(), before looking up more"
            )
        _, bounds = feature_bounds(offsets, len(self.feature_table_map))
        host_ids = indices if indices.device.type == "cpu" else indices.cpu()
        # Pass 1, read-only: the distinct rows of each table, and whether they fit.
        plans = []
        for t, ts in self._tables.items():
            segments = [(bounds[f], bounds[f + 1]) for f in self._features_of[t]]
            parts = [host_ids[lo:hi] for lo, hi in segments if hi > lo]
            if not parts:
                continue
            ids = torch.cat(parts).long() if len(parts) > 1 else parts[0].long()
            lo_id, hi_id = torch.aminmax(ids)
            if int(lo_id) < 0 or int(hi_id) >= ts.rows:
                raise IndexError(
                    f"embedding id out of range for a cached table of {ts.rows} rows "
                    f"(ids between {int(lo_id)} and {int(hi_id)})"
                )
            uniq, inverse, counts = torch.unique(ids, return_inverse=True, return_counts=True)
            slots = ts.slot_of_row[uniq].long()
            missing = slots < 0
            n_miss = int(missing.sum())
            if n_miss:
                # unlocked slots (empty ones included) less the hits this batch will lock
                hits_unlocked = int((ts.locks[slots[~missing]] == 0).sum())
                available = ts.cache.slots - ts.locked - hits_unlocked
                if available < n_miss:
                    if asynchronous:
                        return None
                    raise CacheTooSmallError(
                        f"the cache of table {t} has {ts.cache.slots} slots; a batch needs "
                        f"{uniq.numel()} distinct rows of it, {n_miss} not resident, but only "
                        f"{available} slots are free (the others hold this batch's resident "
                        "rows and rows of batches in flight whose backward has not run). Raise "
                        "the cache's load_factor (CacheParams), shrink the batch, or run forwards "
                        "without backward under torch.no_grad()"
                    )
            plans.append((t, ts, segments, uniq, inverse, counts, slots, missing))
        # Pass 2: lock, evict, rename.
        self._tick += 1
        renamed = indices.clone() if plans else indices
        slots_by_table: dict[int, torch.Tensor] = {}
        moves: list[tuple[_TableState, int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        for t, ts, segments, uniq, inverse, counts, slots, missing in plans:
            miss_rows = uniq[missing]
            ts.lock(slots[~missing])
            if miss_rows.numel():
                victims = self._victims(ts, miss_rows.numel())
                old_rows = ts.row_of_slot[victims]
                occupied = old_rows >= 0
                write = occupied & ts.dirty[victims]
                ts.slot_of_row[old_rows[occupied]] = -1
                ts.slot_of_row[miss_rows] = victims.to(torch.int32)
                ts.row_of_slot[victims] = miss_rows
                ts.dirty[victims] = False
                ts.lock(victims)
                slots[missing] = victims
                moves.append((ts, t, victims[write], old_rows[write], victims, miss_rows))
                self.stats.misses += miss_rows.numel()
                self.stats.evictions += int(occupied.sum())
                self.stats.writebacks += int(write.sum())
                self.stats.bytes_read += miss_rows.numel() * ts.row_bytes
                self.stats.bytes_written += int(write.sum()) * ts.row_bytes
            self.stats.lookups += uniq.numel()
            self.stats.ids += int(counts.sum())
            self.stats.id_hits += int(counts[~missing].sum())
            ts.last_used[slots] = self._tick
            if ts.queue is not None:
                ts.queue.append(self._tick, slots, ts.last_used, ts.filled)
            if ts.freq is not None:
                ts.freq.index_add_(0, uniq, counts.to(torch.int32))
            slots_by_table[t] = slots
            per_id = slots[inverse].to(device=indices.device, dtype=indices.dtype)
            start = 0
            for lo, hi in segments:
                renamed[lo:hi] = per_id[start : start + hi - lo]
                start += hi - lo
        batch = _Batch(slots=slots_by_table, source=indices, indices=renamed)
        if moves:
            # Always through the one worker, in order: a row evicted by an earlier prefetch is
            # written back before any later batch reads it again.
            batch.moved = self._mover.submit(self._move, moves)
            if not asynchronous:
                batch.moved.result()
        return batch

    def _victims(self, ts: _TableState, needed: int) -> torch.Tensor:
        """``needed`` unlocked slots (pass 1 checked there are enough): empty ones first, then
        least recently (LRU) or least frequently (LFU, ties to the least recent) used. Empty
        slots cost no search; LRU victims come off the recency queue (time proportional to
        the victims); LFU searches the filled slots."""
        fresh = min(needed, ts.cache.slots - ts.filled)
        parts = []
        if fresh:
            parts.append(torch.arange(ts.filled, ts.filled + fresh))
        evict = needed - fresh
        if evict:
            filled = ts.filled
            if ts.queue is not None:
                parts.append(ts.queue.take(evict, ts.last_used, ts.locks))
            else:
                rows = ts.row_of_slot[:filled]
                assert ts.freq is not None
                key = ts.freq[rows].long() * (self._tick + 1) + ts.last_used[:filled]
                key[ts.locks[:filled] != 0] = _NEVER
                parts.append(torch.topk(key, evict, largest=False, sorted=False).indices)
        ts.filled += fresh
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    @torch.no_grad()
    def _move(self, moves) -> None:
        """Write evicted trained rows back, then load the missing rows, the tables side by side
        in worker threads (see :meth:`_store_rows` and :meth:`_load_rows`)."""
        try:
            self._raise_failure()  # moves queued behind a failed one do not run
            weights = self.inner.split_embedding_weights()
            states = self.inner.split_optimizer_states()
            if len(moves) == 1:
                self._move_table(weights, states, *moves[0])
                return
            futures = [self._table_movers.submit(self._move_table, weights, states, *m)
                       for m in moves]
            errors = [f.exception() for f in futures]  # every table's move ends first
            for error in errors:
                if error is not None:
                    raise error
        except BaseException as e:
            # the cache now maps rows to slots whose contents did not arrive (or rows whose
            # write-back failed): nothing may be looked up or exported from it any more
            if self._failure is None:
                self._failure = e
            raise

    def _move_table(self, weights, states, ts, t, write_slots, write_rows, load_slots,
                    load_rows) -> None:
        """One table's part of :meth:`_move`."""
        if not ts.store.sealed:
            ts.store.seal()  # the first move since the table was filled: checksum every row
        self._store_rows(ts, weights[t], states[t], write_slots, write_rows)
        self._load_rows(ts, weights[t], states[t], load_slots, load_rows)

    def _blocks(self, slots: torch.Tensor, rows: torch.Tensor):
        """(slots, rows) in row order, in blocks of ``move_block_rows`` rows (through the C
        helper, which maps no pages, blocks of 65536 rows: they bound the copies a flush of a
        large cache makes)."""
        rows, order = torch.sort(rows)
        slots = slots[order]
        step = 65536 if self.row_io else self.move_block_rows
        for lo in range(0, rows.numel(), max(step, 1)):
            yield slots[lo : lo + step], rows[lo : lo + step]

    def _store_rows(self, ts: _TableState, weight: torch.Tensor, states: dict[str, torch.Tensor],
                    slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Write the cache's ``slots`` (weights and states) over backing ``rows``. Through the
        memory mappings (no C helper, or pinned host memory on CUDA), each block's pages are
        dropped once written: a fault maps up to 16 neighbouring pages of the file that are in
        the page cache, so a block of 1024 rows mapped ~64 MB, and the blocks walk the file in
        row order so that each drop covers a small part of it (measured alone, 2M rows of 64
        floats: 2.0 us per row against 4.5 us dropping the whole range after each block)."""
        dev = weight.device
        for block_slots, block_rows in self._blocks(slots, rows):
            on = block_slots.to(dev)
            values = weight[on].cpu()
            state_values = {name: cached[on].cpu() for name, cached in states.items()}
            ts.store.write_rows(block_rows, values, state_values, io=self.row_io)
            if not (self.row_io and ts.store.files):
                ts.store.release(block_rows)

    def _load_rows(self, ts: _TableState, weight: torch.Tensor, states: dict[str, torch.Tensor],
                   slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Read backing ``rows`` into the cache's ``slots`` (as :meth:`_store_rows`, reversed).
        Through ``.data``: these slots belong to no batch in flight, and the in-flight batch's
        autograd (FBGEMM saves the weights for its backward) must not see the whole tensor as
        modified."""
        dev = weight.device
        for block_slots, block_rows in self._blocks(slots, rows):
            on = block_slots.to(dev)
            # checked against the rows' checksums before anything reaches the cache
            values, state_values = ts.store.read_rows(block_rows, io=self.row_io)
            weight.data[on] = values.to(dev, non_blocking=True)
            for name, cached in states.items():
                cached.data[on] = state_values[name].to(dev, non_blocking=True)
            if not (self.row_io and ts.store.files):
                ts.store.release(block_rows)

    def __deepcopy__(self, memo):
        raise TypeError(
            "a cached embedding kernel cannot be deep-copied (its tables live in backing files); "
            "save a checkpoint and load it into a new module instead"
        )

    def __del__(self) -> None:
        # No join here: a finalizer may run from the garbage collector inside any thread, even
        # one being started while threading's shutdown lock is held, and joining a worker then
        # needs that lock (a full test run hung so: the main thread in Thread.start, the new
        # thread in this join). Nothing is left to wait for: a queued move holds a bound
        # method of this kernel, so while one is pending the kernel is not garbage. The idle
        # workers exit on their own.
        for name in ("_mover", "_table_movers"):
            mover = getattr(self, name, None)
            if mover is not None:
                mover.shutdown(wait=False)
