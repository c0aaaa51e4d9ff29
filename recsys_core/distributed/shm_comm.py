"""Collectives through shared memory for a gloo process group whose ranks all live on one host
(what NCCL does within a node): gloo moves every byte over TCP loopback, spending the very cores
the ranks compute on; here a rank copies what its peers need into one ``/dev/shm`` segment and
each peer copies its part out, two memcpy per byte.

One segment per group, made by the group's rank 0 at the group's first collective, its name
passed over gloo; every rank maps it, then rank 0 unlinks the name at once (the mappings keep
the memory), so no name outlives the setup, whatever happens to the ranks later::

    [ header: magic, world, abort word, pids ]
    [ descriptors: per writer, K slots of (seq, dtype, per reader: byte offset, bytes) ]
    [ acks: per (writer, reader), K words: the seq the reader finished ]
    [ data: per writer, a region it alone writes; allocated first-fit, pages reserved lazily ]

A collective takes the group's next sequence number ``s`` (every rank issues collectives in the
same order, as gloo requires). The writer copies each peer's part into its region, fills slot
``s % K`` and publishes ``s`` (a release store after a store fence); ``wait()`` waits for each
peer's slot to show ``s`` (acquire), checks the sizes and dtype against its own call, copies
its part out and acks ``s``; the writer reuses the bytes and the slot once every peer acked.
Starting never waits for a peer (only, in the rare case of K collectives or a region's worth of
bytes outstanding, for acks), so an in-flight collective overlaps compute as gloo's does.

A failure is never a hang: a mismatched call (sizes, dtype) raises on the rank that sees it and
sets the abort word, which makes every waiting peer raise; a dead peer (its pid gone) and a
deadline (the process group's timeout; ``RECSYS_SHM_COMM_TIMEOUT_S`` overrides it) raise too,
worded as gloo's errors for the same events ("timed out", "connection closed by peer").

``RECSYS_SHM_COMM=0`` turns the transport off (everything goes through gloo).
"""

from __future__ import annotations

import atexit
import mmap
import os
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist

try:
    from recsys_core.distributed import _shm_sync
except ImportError:  # built without a C compiler: the collectives stay on gloo
    _shm_sync = None

if TYPE_CHECKING:
    from concurrent.futures import ThreadPoolExecutor

ENV_SWITCH = "RECSYS_SHM_COMM"
ENV_TIMEOUT = "RECSYS_SHM_COMM_TIMEOUT_S"
MAGIC = 0x5245_4353_4853_4D31  # "RECSHSM1"
SLOTS = 512  # collectives a writer may have unacknowledged
MAX_WORLD = 64
REGION_BYTES = 1 << 32  # per writer, virtual: pages are reserved as the high-water mark grows
RESERVE_STEP = 1 << 24
ALIGN = 64
_SLICE_S = 0.1  # how long one C wait runs before liveness and the deadline are checked
_DTYPES = {dt: i + 1 for i, dt in enumerate((
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool))}


class ShmCommError(RuntimeError):
    """A shared-memory collective failed (mismatched call, dead peer, timeout, no space)."""


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


class ShmWork:
    """One collective in flight; ``wait()`` finishes it (as ``dist.Work.wait``)."""

    def __init__(self, finish: Callable[[], None]) -> None:
        self._finish: Callable[[], None] | None = finish
        self._error: BaseException | None = None
        self._lock = threading.Lock()

    def wait(self, timeout: object = None) -> bool:
        with self._lock:
            if self._finish is not None:
                finish, self._finish = self._finish, None
                try:
                    finish()
                except BaseException as e:
                    self._error = e
            if self._error is not None:
                raise self._error
        return True


class ShmGroup:
    """The shared-memory transport of one process group (made by :func:`for_group`).

    Besides the collectives, its building blocks compose collectives of a caller's own (as
    ``comm.pooled_all_to_all_assembled`` does): :meth:`next_seq` numbers one (every rank in
    the same order), :meth:`post` / :meth:`post_filled` publish this rank's parts,
    :meth:`receive` / :meth:`read_part` take a peer's part, :meth:`peers` lists the others."""

    def __init__(self, group: dist.ProcessGroup, path: str, fd: int, world: int,
                 rank: int) -> None:
        self.world, self.rank = world, rank
        self._timeout_s = _timeout_s(group)
        header = _round_up(8 + world, 8)
        self._slot_words = _round_up(4 + 2 * world, 8)
        self._desc0 = header
        self._ack0 = header + world * SLOTS * self._slot_words
        ctrl_bytes = _round_up((self._ack0 + world * world * SLOTS) * 8, mmap.PAGESIZE)
        self._data0 = ctrl_bytes
        self._fd, self._path = fd, path
        self._mm = mmap.mmap(fd, ctrl_bytes + world * REGION_BYTES)
        self._bytes = torch.frombuffer(self._mm, dtype=torch.uint8)
        self._words = np.frombuffer(self._mm, dtype=np.int64, count=ctrl_bytes // 8)
        self._base = self._bytes.data_ptr()
        self._abort_addr = self._base + 2 * 8
        self._seq = 0
        self._lock = threading.Lock()  # allocation and slots (a DDP hook may post from a thread)
        self._live: list[tuple[int, int, int]] = []  # (offset, end, seq) of my unacked data
        self._unposted: set[int] = set()  # reserved numbers not yet posted
        self._reserved = 0
        self._executor: ThreadPoolExecutor | None = None
        self._closed = self._closing = False
        self._failure: str | None = None  # this rank's first failure (any of its threads)

    # ---- words ---------------------------------------------------------------------------
    def _addr(self, word: int) -> int:
        return self._base + 8 * word

    def _desc(self, writer: int, seq: int) -> int:
        return self._desc0 + (writer * SLOTS + seq % SLOTS) * self._slot_words

    def _ack(self, writer: int, reader: int, seq: int) -> int:
        return self._ack0 + (writer * self.world + reader) * SLOTS + seq % SLOTS

    def _fail(self, message: str) -> None:
        if self._words[2] == 0:
            self._words[2] = self.rank + 1
        if self._failure is None:
            self._failure = message
        raise ShmCommError(message)

    def _wait_word(self, word: int, target: int, what: str) -> None:
        deadline = time.monotonic() + self._timeout_s
        addr = self._addr(word)
        while True:
            if _shm_sync.wait_ge(addr, target, _SLICE_S, self._abort_addr) >= target:
                return
            # worded as gloo's errors for the same events, which callers already recognise
            culprit = int(self._words[2])
            if culprit == self.rank + 1 and self._failure is not None:
                # this rank's other thread (the DDP hook's) failed first: its reason, not a
                # peer's, is why this wait cannot finish
                raise ShmCommError(self._failure)
            if culprit:
                raise ShmCommError(
                    f"shm collective: connection closed by peer: rank {culprit - 1} of the group "
                    f"failed a collective (see its error) while rank {self.rank} waited for {what}")
            for peer in range(self.world):
                if peer != self.rank and not _alive(int(self._words[8 + peer])):
                    raise ShmCommError(
                        f"shm collective: connection closed by peer: rank {peer} (pid "
                        f"{self._words[8 + peer]}) exited while rank {self.rank} waited for {what}")
            if time.monotonic() > deadline:
                self._fail(f"shm collective: timed out after {self._timeout_s:.0f} s: rank "
                           f"{self.rank} waited for {what}; a rank stalled, or issued collectives "
                           f"in another order (the process group's timeout sets the limit, "
                           f"{ENV_TIMEOUT} overrides it; {ENV_SWITCH}=0 uses gloo)")

    # ---- posting -------------------------------------------------------------------------
    def _reclaim(self) -> None:
        """Drop my data that every peer has read."""
        self._live = [(off, end, seq) for off, end, seq in self._live
                      if self._unread_by(seq) is not None]

    def _unread_by(self, seq: int) -> int | None:
        """A peer that has not acked my collective ``seq`` yet (None: all have)."""
        for peer in self.peers():
            if _shm_sync.load_acquire(self._addr(self._ack(self.rank, peer, seq))) < seq:
                return peer
        return None

    def _try_allocate(self, nbytes: int, seq: int) -> int | tuple[int, int | None]:
        """My region's byte offset for ``nbytes`` of collective ``seq``, or (collective,
        peer) to wait for: the slot's previous user, or the oldest data when full (peer
        None: every peer has read it since the reclaim above)."""
        self._reclaim()
        reuse = seq - SLOTS  # the previous collective in this slot must be read (or posted)
        if any(p <= reuse for p in self._unposted):
            return min(self._unposted), self.rank
        for _, _, old in self._live:
            if old <= reuse:
                return old, self._unread_by(old)
        start = 0
        for off, end, _ in sorted(self._live):
            if off - start >= nbytes:
                break
            start = max(start, end)
        if start + nbytes > REGION_BYTES:
            oldest = min(old for _, _, old in self._live)
            return oldest, self._unread_by(oldest)
        end = start + nbytes
        if end > self._reserved:
            grow = min(_round_up(end, RESERVE_STEP), REGION_BYTES) - self._reserved
            try:
                os.posix_fallocate(self._fd, self._data0 + self.rank * REGION_BYTES
                                   + self._reserved, grow)
            except OSError as e:
                self._fail(f"shm collective: cannot reserve {grow} bytes in /dev/shm "
                           f"({e.strerror}); enlarge /dev/shm or set {ENV_SWITCH}=0 to use gloo")
            self._reserved += grow
        self._live.append((start, end, seq))
        return self._data0 + self.rank * REGION_BYTES + start

    def post(self, seq: int, parts: Sequence[torch.Tensor | None], dtype: torch.dtype) -> None:
        """Publish collective ``seq``: ``parts[r]`` (a contiguous tensor) is what reader r
        gets; parts that are the same tensor object are written once."""
        unique: dict[int, tuple[torch.Tensor, int]] = {}
        total = 0
        for r, part in enumerate(parts):
            if r != self.rank and part is not None and id(part) not in unique:
                unique[id(part)] = (part, total)
                total += _round_up(part.numel() * part.element_size(), ALIGN)
        at = self._allocate(seq, total)
        for part, off in unique.values():
            n = part.numel() * part.element_size()
            self._bytes[at + off : at + off + n].copy_(part.reshape(-1).view(torch.uint8))
        spans = [(0, 0) if r == self.rank or part is None or not part.numel()
                 else (at + unique[id(part)][1], part.numel() * part.element_size())
                 for r, part in enumerate(parts)]
        self._publish(seq, dtype, spans)

    def post_filled(self, seq: int, counts: Sequence[int], dtype: torch.dtype,
                    fill: Callable[[int, torch.Tensor], None]) -> None:
        """Publish collective ``seq`` whose part for reader r is ``counts[r]`` elements of
        ``dtype``, written by ``fill(r, part)`` straight into the segment (``part``: a 1-D
        tensor over the shared bytes, valid only during the call; no staging copy). This
        rank's own count is ignored."""
        size = dtype.itemsize
        offsets, total = [], 0
        for r, count in enumerate(counts):
            offsets.append(total)
            if r != self.rank:
                total += _round_up(count * size, ALIGN)
        at = self._allocate(seq, total)
        spans = []
        for r, count in enumerate(counts):
            if r == self.rank or not count:
                spans.append((0, 0))
                continue
            start = at + offsets[r]
            fill(r, self._bytes[start : start + count * size].view(dtype))
            spans.append((start, count * size))
        self._publish(seq, dtype, spans)

    def _allocate(self, seq: int, total: int) -> int:
        """Bytes of this rank's region for collective ``seq`` (waiting for peers' acks when
        the slot or the region is still in use)."""
        self._check_open()
        if total > REGION_BYTES:
            self._fail(f"shm collective: {total} bytes to send exceed the {REGION_BYTES}-byte "
                       f"region of a rank; set {ENV_SWITCH}=0 to use gloo")
        deadline = time.monotonic() + self._timeout_s
        while True:
            with self._lock:
                at = self._try_allocate(max(total, ALIGN), seq)
                if isinstance(at, int):
                    self._unposted.discard(seq)
                    return at
            # waited outside the lock: a DDP hook's thread may need it to post what we wait for
            old, peer = at
            if peer is None:  # read meanwhile
                continue
            if peer == self.rank:
                if time.monotonic() > deadline:
                    self._fail(f"shm collective #{seq}: collective #{old} was never posted")
                time.sleep(1e-4)
            else:
                self._wait_word(self._ack(self.rank, peer, old), old,
                                f"rank {peer} to read collective #{old} (#{seq} needs its space)")

    def _publish(self, seq: int, dtype: torch.dtype, spans: Sequence[tuple[int, int]]) -> None:
        """Fill ``seq``'s slot (reader r's part: ``spans[r]``, byte offset and bytes) and
        release it to the readers."""
        desc = self._desc(self.rank, seq)
        self._words[desc + 1] = _DTYPES[dtype]
        for r, (off, n) in enumerate(spans):
            if r != self.rank:
                self._words[desc + 4 + 2 * r], self._words[desc + 5 + 2 * r] = off, n
        _shm_sync.store_release(self._addr(desc), seq)

    def read_part(self, seq: int, peer: int, count: int, dtype: torch.dtype, what: str,
                  use: Callable[[torch.Tensor], None]) -> None:
        """Wait for ``peer``'s part of collective ``seq``, check that it is ``count``
        elements of ``dtype``, call ``use(part)`` on it in place (a 1-D tensor over the
        shared bytes, valid only during the call; not called for an empty part) and
        acknowledge it."""
        self._check_open()
        desc = self._desc(peer, seq)
        self._wait_word(desc, seq, f"rank {peer}'s part of {what} (collective #{seq})")
        got = int(_shm_sync.load_acquire(self._addr(desc)))
        if got != seq:
            self._fail(f"shm collective: rank {peer}'s slot holds collective #{got}, rank "
                       f"{self.rank} expected #{seq} ({what}); the ranks' calls are out of step")
        off, n = int(self._words[desc + 4 + 2 * self.rank]), int(self._words[desc + 5 + 2 * self.rank])
        want = count * dtype.itemsize
        code = int(self._words[desc + 1])
        if n != want or (n and code != _DTYPES[dtype]):
            sent = next((str(k).removeprefix("torch.") for k, v in _DTYPES.items() if v == code), "?")
            mine = str(dtype).removeprefix("torch.")
            self._fail(f"shm collective {what}: rank {peer} sends rank {self.rank} {n} bytes of "
                       f"{sent}, rank {self.rank} expects {want} bytes of {mine}; the ranks' "
                       f"splits or dtypes disagree")
        if n:
            use(self._bytes[off : off + n].view(dtype))
        _shm_sync.store_release(self._addr(self._ack(peer, self.rank, seq)), seq)

    def receive(self, seq: int, peer: int, out: torch.Tensor | None, what: str,
                 add: bool = False) -> None:
        """Copy ``peer``'s part of collective ``seq`` into ``out`` (None: expect nothing), or
        with ``add`` add it to ``out`` (read in place: no copy)."""
        if out is None:
            self.read_part(seq, peer, 0, torch.uint8, what, lambda part: None)
            return
        flat = out.view(-1) if add else out.reshape(-1)
        if add:
            self.read_part(seq, peer, out.numel(), out.dtype, what, flat.add_)
        else:
            self.read_part(seq, peer, out.numel(), out.dtype, what, flat.copy_)

    def _check_open(self) -> None:
        if self._closed:
            raise ShmCommError("shm collective on a closed group (shm_comm.release or exit "
                               "closed it while the collective was not finished)")

    def next_seq(self, later: int = 0) -> int:
        """The next collective's number; ``later`` more are reserved for posts made later
        (an all-reduce's gather, posted once its reduce is in)."""
        self._check_open()
        with self._lock:
            seq = self._seq + 1
            self._seq += 1 + later
            self._unposted.update(range(seq + 1, seq + 1 + later))
            return seq

    def peers(self) -> list[int]:
        return [(self.rank + i) % self.world for i in range(1, self.world)]

    # ---- collectives ---------------------------------------------------------------------
    def all_to_all_single(self, out: torch.Tensor, x: torch.Tensor, out_splits: Sequence[int],
                          in_splits: Sequence[int]) -> ShmWork:
        """``x[in_splits[r]]``-sized parts of 1-D ``x`` go to rank r; ``out`` receives
        ``out_splits[p]`` elements from rank p, in rank order (``dist.all_to_all_single``)."""
        if len(out_splits) != self.world or len(in_splits) != self.world:
            raise ValueError(f"all_to_all: {len(in_splits)} in-splits and {len(out_splits)} "
                             f"out-splits for {self.world} ranks")
        if x.dtype != out.dtype:
            raise ValueError(f"all_to_all: input {x.dtype} and output {out.dtype} differ")
        x, seq = x.contiguous().view(-1), self.next_seq()
        sends = list(x.split(list(in_splits)))
        recvs = list(out.view(-1).split(list(out_splits)))
        recvs[self.rank].copy_(sends[self.rank])
        self.post(seq, sends, x.dtype)

        def finish() -> None:
            for peer in self.peers():
                self.receive(seq, peer, recvs[peer], "all_to_all")

        return ShmWork(finish)

    def all_gather(self, out: torch.Tensor, x: torch.Tensor) -> ShmWork:
        """``out`` (``[world * n]`` elements) gets every rank's ``x``, rank order."""
        x, seq = x.contiguous().view(-1), self.next_seq()
        recvs = list(out.view(-1).split(x.numel()))
        recvs[self.rank].copy_(x)
        self.post(seq, [x] * self.world, x.dtype)

        def finish() -> None:
            for peer in self.peers():
                self.receive(seq, peer, recvs[peer], "all_gather")

        return ShmWork(finish)

    def reduce_scatter(self, out: torch.Tensor, x: torch.Tensor) -> ShmWork:
        """``out`` = the sum over ranks of this rank's chunk of ``x`` (``world`` equal chunks
        of the flat tensor), summed as ``stack(chunks in rank order).sum(0)``."""
        n = out.numel()
        stacked = out.new_empty(self.world * n)
        work = self.all_to_all_single(stacked, x.reshape(-1), [n] * self.world, [n] * self.world)

        def finish() -> None:
            work.wait()
            torch.sum(stacked.view(self.world, *out.shape), dim=0, out=out)

        return ShmWork(finish)

    def all_reduce(self, x: torch.Tensor) -> ShmWork:
        """In-place sum of ``x`` over the ranks; every rank gets the same bits. 2 ranks: one
        round, each adds its peer's whole tensor to its own (a + b == b + a, bit for bit).
        More: chunk r is summed by rank r (rank order, as :meth:`reduce_scatter`), then
        gathered."""
        if not x.is_contiguous():
            raise ValueError("all_reduce: the tensor must be contiguous")
        flat = x.view(-1)
        if self.world == 2:
            seq = self.next_seq()
            self.post(seq, [flat, flat], x.dtype)
            peer = 1 - self.rank

            def add_peer() -> None:
                self.receive(seq, peer, flat, "all_reduce", add=True)

            return ShmWork(add_peer)
        q, extra = divmod(flat.numel(), self.world)
        sizes = [q + (r < extra) for r in range(self.world)]
        seq = self.next_seq(later=1)
        chunks = list(flat.split(sizes))
        mine = sizes[self.rank]
        stacked = flat.new_empty(self.world * mine).view(self.world, mine)
        self.post(seq, chunks, x.dtype)

        def finish() -> None:
            stacked[self.rank].copy_(chunks[self.rank])
            for peer in self.peers():
                self.receive(seq, peer, stacked[peer], "all_reduce (reduce)")
            torch.sum(stacked, dim=0, out=chunks[self.rank])
            self.post(seq + 1, [chunks[self.rank]] * self.world, x.dtype)
            for peer in self.peers():
                self.receive(seq + 1, peer, chunks[peer], "all_reduce (gather)")

        return ShmWork(finish)

    def all_reduce_future(self, x: torch.Tensor) -> torch.futures.Future:
        """:meth:`all_reduce` finished on a helper thread: a future of ``x`` (for DDP hooks)."""
        from concurrent.futures import ThreadPoolExecutor

        work = self.all_reduce(x)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="shm_comm")
        executor = self._executor
        fut: torch.futures.Future = torch.futures.Future()

        def run() -> None:
            try:
                work.wait()
                fut.set_result(x)
            except BaseException as e:  # noqa: BLE001  the waiter re-raises it
                fut.set_exception(e)

        executor.submit(run)
        return fut

    def close(self) -> None:
        """Release the mapping (the segment's name is long gone). A DDP hook's all-reduce
        still in flight on the helper thread finishes first (or fails: a dead peer, the
        deadline): the thread reads and writes the mapping through raw addresses, and
        ``torch.frombuffer`` views do not pin it, so unmapping under it would let a later
        allocation there be overwritten. Work not yet waited for raises afterwards (the
        group counts as closed only once the thread is done: marked before, a hook that had
        not yet started its wait raised instead of finishing)."""
        if self._closed or self._closing:
            return
        self._closing = True
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        self._closed = True
        with self._lock:
            del self._bytes, self._words
            try:
                self._mm.close()
            except BufferError:  # a numpy view still exports it: unmapped with the last one
                pass
            os.close(self._fd)


def _timeout_s(group: dist.ProcessGroup) -> float:
    """``RECSYS_SHM_COMM_TIMEOUT_S``, else the group's own timeout (``init_process_group``'s
    ``timeout``, e.g. ``dlrm-app train --timeout``), else gloo's default."""
    if os.environ.get(ENV_TIMEOUT):
        return float(os.environ[ENV_TIMEOUT])
    try:
        return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    except (AttributeError, RuntimeError):  # torch without per-backend options
        return dist.distributed_c10d.default_pg_timeout.total_seconds()


def _alive(pid: int) -> bool:
    if pid <= 0:
        return True  # unknown (another pid namespace): the deadline still applies
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")


# ---- per-group setup -----------------------------------------------------------------------
# Weak: a group must die with the program's last reference to it (destroy_process_group and
# the program's own objects), never live on here. A gloo group alive at interpreter exit keeps
# its worker threads, and one freeing a finished collective's tensors then aborts the process.
_GROUPS: dict[int, tuple[weakref.ref[dist.ProcessGroup], ShmGroup | None]] = {}


_PAUSED = False


def enabled() -> bool:
    """The env switch: ``RECSYS_SHM_COMM=0`` (or false/off/no) turns the transport off."""
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "off", "no")


def pause(paused: bool) -> None:
    """While paused, new collectives go through gloo (those in flight finish where they
    started). Every rank must pause and resume at the same point of its collectives, e.g.
    after a barrier: for A/B measurements of the two transports in one job."""
    global _PAUSED
    _PAUSED = paused


def for_group(group: dist.ProcessGroup | None, device: torch.device) -> ShmGroup | None:
    """The transport of ``group`` for tensors on ``device``, or None: use gloo. Collective on
    the group's first call (every rank calls it at the same collective, as they issue the
    collective itself); later calls are a dict lookup."""
    if device.type != "cpu" or _shm_sync is None or _PAUSED:
        return None
    group = group if group is not None else dist.group.WORLD
    entry = _GROUPS.get(id(group))
    if entry is not None and entry[0]() is group:
        return entry[1]
    shm = None
    if dist.get_backend(group) == "gloo" and 1 < dist.get_world_size(group) <= MAX_WORLD:
        shm = _setup(group)
    _GROUPS[id(group)] = (weakref.ref(group), shm)
    return shm


def _setup(group: dist.ProcessGroup) -> ShmGroup | None:
    """Rank 0 makes the segment; every rank maps it; rank 0 unlinks the name. None on every
    rank when the switch is off on any rank or any rank cannot map it (another host)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    src = dist.get_global_rank(group, 0)
    probe = None
    if rank == 0 and enabled():
        try:
            probe = SegmentProbe(world)
        except OSError:  # no /dev/shm here: every rank learns it from the broadcast below
            probe = None
    names: list[object] = [probe.path if probe is not None else None]
    dist.broadcast_object_list(names, src=src, group=group)
    path, fd = names[0], -1
    if isinstance(path, str) and enabled():
        try:
            fd = probe.fd if probe is not None else os.open(path, os.O_RDWR)
        except OSError:
            fd = -1
    pids = [0] * world
    dist.all_gather_object(pids, os.getpid() if fd >= 0 else -1, group=group)
    if probe is not None:
        probe.unlink()  # every rank has opened it (or given up): the name is no longer needed
    if any(p < 0 for p in pids):
        if fd >= 0:
            os.close(fd)
        return None
    shm = ShmGroup(group, path, fd, world, rank)
    if rank == 0:
        shm._words[0], shm._words[1] = MAGIC, world
    shm._words[8 + rank] = os.getpid()
    dist.barrier(group=group)
    if int(shm._words[0]) != MAGIC:
        raise ShmCommError(f"shm collective setup: {path} does not hold rank 0's header")
    atexit.register(shm.close)
    return shm


class SegmentProbe:
    """The segment rank 0 makes: a fresh /dev/shm file sized for ``world`` ranks (sparse)."""

    def __init__(self, world: int) -> None:
        self.path = f"/dev/shm/recsys_shm_comm_{os.getpid()}_{uuid.uuid4().hex[:12]}"
        header = _round_up(8 + world, 8)
        slot_words = _round_up(4 + 2 * world, 8)
        ctrl = (header + world * SLOTS * slot_words + world * world * SLOTS) * 8
        size = _round_up(ctrl, mmap.PAGESIZE) + world * REGION_BYTES
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(self.fd, size)
        except OSError:
            self.unlink()
            os.close(self.fd)
            raise

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def release(group: dist.ProcessGroup | None = None) -> None:
    """Close the transport of ``group`` (None: every group), e.g. before destroying it."""
    for key, (pg, shm) in list(_GROUPS.items()):
        if group is None or pg() is group:
            if shm is not None:
                shm.close()
            del _GROUPS[key]
