"""TorchRec's planner value types: :class:`Storage` (bytes per memory tier), :class:`Perf` (ms of
one shard, by phase), :class:`Shard` (one placed piece of a table) and :class:`DeviceHardware`
(one rank's capacity).

:class:`Tier` names the tiers (in ``Storage``'s field order, so it indexes the planner's per-tier
arrays). ``Storage`` adds and subtracts per tier and orders like TorchRec's (a dataclass compared field
by field: hbm, then ddr, then ssd); :meth:`Storage.fits_in` is the per-tier comparison a
planner needs::

    Storage(hbm=2, ddr=5) + Storage(hbm=1, ddr=1) == Storage(hbm=3, ddr=6, ssd=0)
    Storage(hbm=1, ddr=9).fits_in(Storage(hbm=2, ddr=8)) is False   # ddr 9 > 8
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum, unique


@unique
class Tier(IntEnum):
    """A memory tier, numbered in :class:`Storage`'s field order (hbm, ddr, ssd)."""

    HBM = 0
    """Device (GPU) memory."""
    DDR = 1
    """Host memory (RAM)."""
    SSD = 2
    """Local disk: the backing files of cached tables on CPU."""

    @property
    def label(self) -> str:
        """How plans and messages name it: "HBM", "DDR", "disk"."""
        return ("HBM", "DDR", "disk")[self]


@dataclass(order=True)
class Storage:
    """Bytes in each memory tier."""

    hbm: int
    """Device (GPU) memory."""
    ddr: int
    """Host memory."""
    ssd: int = 0
    """Local disk (TorchRec's SSD tier): the backing files of FUSED_UVM_CACHING tables on CPU."""

    def __add__(self, other: Storage) -> Storage:
        return Storage(self.hbm + other.hbm, self.ddr + other.ddr, self.ssd + other.ssd)

    def __sub__(self, other: Storage) -> Storage:
        return Storage(self.hbm - other.hbm, self.ddr - other.ddr, self.ssd - other.ssd)

    def __hash__(self) -> int:
        return hash((self.hbm, self.ddr, self.ssd))

    def fits_in(self, other: Storage) -> bool:
        """Every tier at most ``other``'s."""
        return self.hbm <= other.hbm and self.ddr <= other.ddr and self.ssd <= other.ssd


@dataclass
class Perf:
    """Estimated ms of one shard per training step, by phase."""

    fwd_compute: float
    fwd_comms: float
    bwd_compute: float
    bwd_comms: float
    input_dist_comms: float = 0.0
    """Part of ``fwd_comms`` spent sending ids (informational, not added again in total)."""
    prefetch_compute: float = 0.0

    @property
    def total(self) -> float:
        return (
            self.fwd_compute + self.bwd_compute + self.fwd_comms + self.bwd_comms
            + self.prefetch_compute
        )

    def __add__(self, other: Perf) -> Perf:
        return Perf(
            fwd_compute=self.fwd_compute + other.fwd_compute,
            fwd_comms=self.fwd_comms + other.fwd_comms,
            bwd_compute=self.bwd_compute + other.bwd_compute,
            bwd_comms=self.bwd_comms + other.bwd_comms,
            input_dist_comms=self.input_dist_comms + other.input_dist_comms,
            prefetch_compute=self.prefetch_compute + other.prefetch_compute,
        )

    def __hash__(self) -> int:
        return hash((self.fwd_compute, self.fwd_comms, self.bwd_compute, self.bwd_comms,
                     self.input_dist_comms, self.prefetch_compute))


@dataclass
class Shard:
    """One piece of a table: ``size`` [rows, cols] at ``offset`` [row, col], with its estimated
    storage and perf and, once partitioned, its rank."""

    size: list[int]
    offset: list[int]
    storage: Storage | None = None
    perf: Perf | None = None
    rank: int | None = None

    def __hash__(self) -> int:
        return hash((tuple(self.size), tuple(self.offset), self.storage, self.perf, self.rank))

    def __str__(self) -> str:
        return (f"Shard size: {tuple(self.size)}, offset: {tuple(self.offset)}, storage: "
                f"{self.storage}, perf: {self.perf}, rank: {self.rank}")


@dataclass
class DeviceHardware:
    """One rank's memory (``storage``) and the load placed on it so far (``perf``)."""

    rank: int
    storage: Storage
    perf: Perf
