"""The backing store of a cached table: rows in files on local disk, reserved up front and
checksummed row by row.

A cached table (``cached_tbe.py``) keeps all its rows, weights and per-row optimizer state, in
a :class:`BackingStore`: one file per tensor under the offload directory on CPU (pinned host
memory on CUDA). Two things make the files safe to train from:

* **Space is reserved when they are made.** Each file gets its full size with
  ``posix_fallocate`` (writing zeros where the filesystem cannot), so a disk that fills later
  cannot fail a write-back, nor kill the process with SIGBUS on a page of a sparse file that
  has no block behind it. A directory without the room raises :class:`OffloadSpaceError` at
  once, naming the directory, the bytes needed and the bytes free.
* **Rows read back are what was written.** The store keeps, in memory, a 32-bit checksum of
  every row (its weights and state together): recorded for every row when the store is
  *sealed* (before the first row moves, and after state was written into the files from
  outside, see :meth:`BackingStore.seal`), updated with every row written back, checked for
  every row read. A row that does not match raises :class:`OffloadCorruptionError` naming the
  file and the row; nothing read from it reaches the cache.

The tensors over the files are handed out for exports and imports (:meth:`BackingStore.hand_out`),
and an import writes through them: DCP's load fills the very tensors the ``state_dict()`` before
it returned, so the files hold the checkpoint before the load hook flushes the cache and
invalidates it (which seals the store anew). The checksums cannot tell those writes from damage,
so a whole-store check finds nothing to do when every row was checked (or recorded) since the
store last wrote one and its tensors have been handed out since: what differs then was written
through them. Any row the store moves, or a seal, makes the next check whole again.

The checksum of a row of int32 words ``w_j`` (the float bits, weights then each state) is the
top half of ``sum_j w_j * k_j mod 2**64``, with fixed odd 64-bit ``k_j`` (a multilinear hash:
a changed row matches with probability about 2**-32). The C helper (``_rowio.c``) computes it
in the same loop as its ``pread`` / ``pwrite``; :func:`row_checksums` is the same function in
torch for the memory-mapped path. 4 bytes of memory per row; the time is measured in
``bench/offload.py``.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import re
import tempfile

import torch

from recsys_core.sparse._native_lib import load_c_helper

# Rows per block when the whole store is sealed or verified (bounds the memory mapped at once).
SCAN_BLOCK_ROWS = 65536
# The backing files' names begin with it (then the table's name and the tensor's).
FILE_PREFIX = "recsys_offload_"
# Bytes of zeros written per call where the filesystem has no fallocate.
_ZERO_CHUNK = 1 << 20


def _load_rowio() -> ctypes.CDLL | None:
    """The C helper's row functions, or None when the package was installed without it (no C
    compiler at install time)."""
    lib = load_c_helper("recsys_core.kernels._rowio")
    if lib is None:
        return None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    if not hasattr(lib, "recsys_hash_rows"):
        return None  # an older build of the helper: rebuild with `pip install -e .`
    for fn in (lib.recsys_read_rows, lib.recsys_write_rows):
        fn.restype, fn.argtypes = i64, [ctypes.c_int, p, i64, i64, p, p, p]
    lib.recsys_hash_rows.restype = None
    lib.recsys_hash_rows.argtypes = [p, i64, i64, p, p]
    return lib


ROWIO = _load_rowio()


def row_io_available() -> bool:
    """Whether cached tables on CPU move rows with pread/pwrite (the C helper was built)."""
    return ROWIO is not None


class OffloadSpaceError(OSError):
    """The offload directory's disk cannot hold the backing files (too little free space, or a
    quota / file size limit: ``reason``)."""

    def __init__(self, directory: str, needed: int, free: int, reason: str | None = None) -> None:
        self.directory, self.needed, self.free = directory, needed, free
        if reason is None or free < needed:
            what = f"but its disk has {format_bytes(free)} ({free} bytes) free"
        else:
            what = f"but reserving them failed ({reason}: a quota or file size limit)"
        super().__init__(
            errno.ENOSPC,
            f"offload directory {directory}: the tables kept there need {format_bytes(needed)} "
            f"({needed} bytes) {what}; free space there or give an offload directory on a disk "
            "with more room",
            directory,
        )

    def __str__(self) -> str:
        return self.strerror


class OffloadCorruptionError(RuntimeError):
    """A row read back from a table's backing files differs from the row last written there."""

    def __init__(self, paths: list[str], table: str, row: int, rows: int) -> None:
        self.paths, self.table, self.row, self.rows = paths, table, row, rows
        self.path = paths[0]
        others = f" (and {rows - 1} more of the rows read with it)" if rows > 1 else ""
        files = f"offload file {paths[0]}" + (
            f" (with its optimizer-state file{'s' if len(paths) > 2 else ''} "
            f"{', '.join(paths[1:])})" if len(paths) > 1 else "")
        super().__init__(
            f"{files} of table {table!r} is corrupt: row {row}{others} reads back with a "
            "different checksum than was written; training cannot go on from it: restore the "
            "model and optimizer state from the last checkpoint saved before (and check the disk)"
        )


def format_bytes(n: float) -> str:
    """``n`` bytes in the unit that fits (B, KiB, MiB, GiB, TiB)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def free_bytes(directory: str) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def _coefficients(words: int) -> torch.Tensor:
    """The hash's ``k_j`` for ``words`` words: splitmix64(j + 1) | 1, as int64 bit patterns."""
    mask = (1 << 64) - 1
    out = []
    for j in range(words):
        z = ((j + 1) * 0x9E3779B97F4A7C15) & mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        z = (z ^ (z >> 31)) | 1
        out.append(z - (1 << 64) if z >> 63 else z)
    return torch.tensor(out, dtype=torch.int64)


def row_checksums(parts: list[torch.Tensor], coef: torch.Tensor) -> torch.Tensor:
    """The checksums (int32) of rows given as float32 ``[n, width_i]`` parts (weights, then each
    state), with the words numbered across the parts; what the C helper computes."""
    acc = None
    start = 0
    for part in parts:
        words = part.contiguous().view(torch.int32).view(part.shape[0], -1)
        width = words.shape[1]
        # int64 products and sums wrap modulo 2**64, as the C helper's uint64 arithmetic does
        partial = (words.long() * coef[start : start + width]).sum(1)
        acc = partial if acc is None else acc + partial
        start += width
    assert acc is not None
    return (acc >> 32).to(torch.int32)


class BackingFile:
    """A float32 ``[rows, width]`` tensor in a memory-mapped file under ``directory``, its
    space reserved on disk.

    The file is unlinked as soon as it is mapped: its blocks are freed when the mapping goes,
    even if the process dies. ``release()`` drops the pages from this process's resident set
    (their contents stay in the file / page cache)."""

    def __init__(self, rows: int, width: int, directory: str | None, prefix: str) -> None:
        size = max(rows * width * 4, 4)
        fd, self.path = tempfile.mkstemp(prefix=prefix, suffix=".bin", dir=directory)
        try:
            reserve(fd, size, self.path)
            self._map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED,
                                  prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        finally:
            os.unlink(self.path)
        self._fd = fd  # for pread / pwrite of rows; closed with the object
        # Rows are read one by one at random: no read-ahead, and (on Linux) no mapping of the
        # neighbouring cached pages on each fault, which would pull far more than the rows
        # asked for into this process's resident memory.
        self._map.madvise(mmap.MADV_RANDOM)
        flat = torch.frombuffer(self._map, dtype=torch.float32, count=rows * width)
        self.tensor = flat.view(rows, width)
        self.row_bytes = width * 4

    def read_rows(self, rows: torch.Tensor, coef: torch.Tensor | None = None,
                  acc: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``rows`` (int64) as a new ``[len(rows), width]`` tensor, read with pread; with
        ``coef``, each row's hash terms are added to ``acc`` (int64, one per row)."""
        rows = rows.contiguous()
        out = torch.empty(rows.numel(), self.row_bytes // 4)
        self._check(ROWIO.recsys_read_rows(
            self._fd, rows.data_ptr(), rows.numel(), self.row_bytes, out.data_ptr(),
            *_hash_args(coef, acc)), "read")
        return out

    def write_rows(self, rows: torch.Tensor, values: torch.Tensor,
                   coef: torch.Tensor | None = None, acc: torch.Tensor | None = None) -> None:
        """Write ``values`` (``[len(rows), width]`` float32) over rows ``rows`` with pwrite (and
        hash them into ``acc`` as :meth:`read_rows` does)."""
        rows, values = rows.contiguous(), values.contiguous()
        assert values.dtype == torch.float32 and values.numel() * 4 == rows.numel() * self.row_bytes
        self._check(ROWIO.recsys_write_rows(
            self._fd, rows.data_ptr(), rows.numel(), self.row_bytes, values.data_ptr(),
            *_hash_args(coef, acc)), "write")

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise OSError(-rc, f"cached embedding kernel: cannot {what} rows of its backing "
                               f"file ({os.strerror(-rc)}); check the disk of the offload "
                               "directory", self.path)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        if getattr(self, "_fd", -1) >= 0:
            self.close()

    def release(self, first_row: int = 0, last_row: int | None = None) -> None:
        """Drop the pages of rows ``first_row..last_row`` (default: all). The cost of the call
        grows with the range (the kernel walks its page tables), not with the pages mapped."""
        if last_row is None:
            self._map.madvise(mmap.MADV_DONTNEED)
            return
        start = first_row * self.row_bytes // mmap.PAGESIZE * mmap.PAGESIZE
        end = min((last_row + 1) * self.row_bytes, len(self._map))
        if end > start:
            self._map.madvise(mmap.MADV_DONTNEED, start, end - start)


def _hash_args(coef: torch.Tensor | None, acc: torch.Tensor | None) -> tuple[int | None, ...]:
    if coef is None:
        return None, None
    assert acc is not None and acc.dtype == torch.int64 and acc.is_contiguous()
    return coef.data_ptr(), acc.data_ptr()


def reserve(fd: int, size: int, path: str) -> None:
    """Give the file ``size`` bytes of disk now: ``posix_fallocate``, or zeros written where the
    filesystem does not support it. A full disk raises ENOSPC (or EDQUOT / EFBIG) here."""
    try:
        os.posix_fallocate(fd, 0, size)
        return
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise OSError(e.errno, e.strerror, path) from None
    zeros = bytes(min(size, _ZERO_CHUNK))
    done = 0
    while done < size:
        try:
            done += os.pwrite(fd, zeros[: min(len(zeros), size - done)], done)
        except OSError as e:
            raise OSError(e.errno, e.strerror, path) from None


def _safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:64]


class BackingStore:
    """The backing rows of one cached table: weights ``[rows, dim]`` and each optimizer state
    (``[rows, dim]`` per element or ``[rows]`` per row), with a checksum per row (files only).

    Reads and writes go through :meth:`read_rows` / :meth:`write_rows`, with pread/pwrite
    (``io=True``, the C helper) or through the mappings. State written into :attr:`weight` /
    :attr:`states` from outside (initialization, a checkpoint load) must be followed by
    :meth:`seal`."""

    def __init__(
        self, rows: int, dim: int, states: dict[str, bool], device: torch.device,
        directory: str | None, name: str = "table",
    ) -> None:
        self.name = name
        self.files: list[BackingFile] = []  # weight, then each state (for pread / pwrite)
        try:
            self.weight = self._make(rows, dim, device, directory, "weight")
            self.states = {
                s: (self._make(rows, 1, device, directory, s).view(rows) if rowwise
                    else self._make(rows, dim, device, directory, s))
                for s, rowwise in states.items()
            }
        except BaseException:
            self.close()
            raise
        widths = [dim] + [1 if rowwise else dim for rowwise in states.values()]
        self._coef = _coefficients(sum(widths))
        # 4 bytes per row; valid once sealed. Verified only for files (a corrupted file is the
        # failure this guards against; pinned host memory on CUDA is not checked).
        self.checksums = torch.zeros(rows if self.files else 0, dtype=torch.int32)
        self.sealed = False
        self.check = True  # False: no checksums kept (to measure what they cost)
        # Every row matched (or got) its checksum in a whole-store scan and the store wrote no
        # row since; its tensors were handed out and it moved no row since (see the module doc).
        self._scanned = False
        self._handed_out = False
        self._recorded_to = -1  # rows 0:_recorded_to recorded by record_written, in order

    def _make(self, rows: int, width: int, device: torch.device, directory: str | None,
              what: str) -> torch.Tensor:
        if device.type == "cuda":
            return torch.zeros(rows, width, pin_memory=True)
        f = BackingFile(rows, width, directory, f"{FILE_PREFIX}{_safe_name(self.name)}_{what}_")
        self.files.append(f)
        return f.tensor

    @property
    def verified(self) -> bool:
        """Rows are checksummed: a store of files, with the checks on."""
        return bool(self.files) and self.check

    def close(self) -> None:
        for f in self.files:
            f.close()

    def _parts(self, rows: torch.Tensor) -> list[torch.Tensor]:
        return [self.weight[rows]] + [s[rows].view(rows.numel(), -1) for s in self.states.values()]

    def read_rows(self, rows: torch.Tensor, io: bool
                  ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Weights ``[n, dim]`` and states (``[n]`` row-wise, ``[n, dim]``) of ``rows``,
        checked against the rows' checksums (:class:`OffloadCorruptionError` on a mismatch)."""
        check = self.verified and self.sealed
        self._handed_out = False  # the rows are the store's again: checked when read
        if io and self.files:
            acc = torch.zeros(rows.numel(), dtype=torch.int64) if check else None
            coef = self._coef if check else None
            parts, start = [], 0
            for f in self.files:
                width = f.row_bytes // 4
                parts.append(f.read_rows(rows, None if coef is None else coef[start:], acc))
                start += width
            sums = None if acc is None else (acc >> 32).to(torch.int32)
        else:
            parts = self._parts(rows)
            sums = row_checksums(parts, self._coef) if check else None
        if sums is not None:
            self._compare(rows, sums)
        weight = parts[0]
        states = {name: p.view(-1, *s.shape[1:])
                  for (name, s), p in zip(self.states.items(), parts[1:], strict=True)}
        return weight, states

    def write_rows(self, rows: torch.Tensor, weight: torch.Tensor,
                   states: dict[str, torch.Tensor], io: bool) -> None:
        """Write rows (as :meth:`read_rows` returns them) and record their checksums."""
        parts = [weight] + [states[name].reshape(rows.numel(), -1) for name in self.states]
        record = self.verified and self.sealed
        self._scanned = self._handed_out = False
        if io and self.files:
            acc = torch.zeros(rows.numel(), dtype=torch.int64) if record else None
            start = 0
            for f, values in zip(self.files, parts, strict=True):
                f.write_rows(rows, values, self._coef[start:] if record else None, acc)
                start += f.row_bytes // 4
            if acc is not None:
                self.checksums[rows] = (acc >> 32).to(torch.int32)
            return
        self.weight[rows] = weight
        for name, values in states.items():
            self.states[name][rows] = values
        if record:
            self.checksums[rows] = row_checksums(parts, self._coef)

    def _compare(self, rows: torch.Tensor, sums: torch.Tensor) -> None:
        bad = sums != self.checksums[rows]
        if not bool(bad.any()):
            return
        first = int(rows[bad.nonzero()[0, 0]])
        raise OffloadCorruptionError([f.path for f in self.files], self.name, first,
                                     int(bad.sum()))

    def _block_sums(self, lo: int, hi: int) -> torch.Tensor:
        """The checksums of rows ``lo:hi`` as the mappings hold them."""
        parts = [f.tensor[lo:hi] for f in self.files]
        if ROWIO is None:
            return row_checksums(parts, self._coef)
        acc = torch.zeros(hi - lo, dtype=torch.int64)
        start = 0
        for p in parts:
            ROWIO.recsys_hash_rows(p.data_ptr(), hi - lo, p.shape[1] * 4,
                                   self._coef[start:].data_ptr(), acc.data_ptr())
            start += p.shape[1]
        return (acc >> 32).to(torch.int32)

    def _scan(self, record: bool) -> None:
        """Hash every row, block by block: record the checksums, or check them."""
        rows = self.checksums.numel()
        for lo in range(0, rows, SCAN_BLOCK_ROWS):
            hi = min(rows, lo + SCAN_BLOCK_ROWS)
            sums = self._block_sums(lo, hi)
            if record:
                self.checksums[lo:hi] = sums
            else:
                self._compare(torch.arange(lo, hi), sums)
            for f in self.files:
                f.release(lo, hi - 1)
        self._scanned, self._handed_out = True, False

    def record_written(self, lo: int, hi: int) -> None:
        """Rows ``lo:hi`` were just written through :attr:`weight` / :attr:`states` (a table
        filled block by block as it is built): record their checksums from the pages just
        written, still in memory. Once rows were recorded this way from the first to the last
        in order, the store is sealed without :meth:`seal`'s scan, which reads every file back
        (at Criteo 1TB's sizes 45 GB from the disk before the first step). On a sealed store
        the rows' checksums are kept current."""
        if self.verified and hi > lo:
            self.checksums[lo:hi] = self._block_sums(lo, hi)
        if self.sealed:
            return
        self._recorded_to = hi if lo in (0, self._recorded_to) else -1
        if self._recorded_to == self.weight.shape[0]:
            self.sealed = True

    def seal(self) -> None:
        """Record the checksum of every row as the files hold it now: before the first row
        moves (after the table was filled through :attr:`weight`), and after state was written
        into the files from outside."""
        if self.verified:
            self._scan(record=True)
        self.sealed = True

    def verify(self) -> None:
        """Check every row against its checksum (:class:`OffloadCorruptionError`), e.g. before
        the files' contents are exported to a checkpoint. Nothing to check when every row was
        checked since the store last wrote one and :meth:`hand_out` came after: rows that differ
        now were written through the tensors handed out (the checkpoint an import is loading,
        before its :meth:`seal`), see the module doc."""
        if self.verified and self.sealed and not (self._scanned and self._handed_out):
            self._scan(record=False)

    def hand_out(self) -> None:
        """:attr:`weight` and :attr:`states` are given to a caller that may write them (an
        import writes a checkpoint into them, then has the store sealed anew)."""
        self._handed_out = True

    def release(self, rows: torch.Tensor | None = None) -> None:
        """Drop the backing pages of ``rows`` (sorted; default: every row) from memory."""
        if rows is not None and rows.numel() == 0:
            return
        first, last = (0, None) if rows is None else (int(rows[0]), int(rows[-1]))
        for f in self.files:
            f.release(first, last)
