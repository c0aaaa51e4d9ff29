"""How much of each rank's memory the planner leaves to what is not an embedding table.

TorchRec's ``StorageReservation`` interface: ``reserve(topology, batch_size, module, sharders,
constraints)`` returns the topology the tables must fit in. :class:`HeuristicalStorageReservation`
keeps a fixed fraction of every rank's HBM and host memory free: 15% of 80 GiB of HBM leaves
68 GiB for tables. Disk (``ssd_cap``) holds only offloaded tables, so none of it is reserved.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from torch import nn

from recsys_core.plan.sharder import Sharder
from recsys_core.planner.constraints import ParameterConstraints
from recsys_core.planner.topology import Topology

DEFAULT_STORAGE_RESERVATION = 0.15  # of each rank's memory: dense parameters, activations


class StorageReservation(Protocol):
    """Reserves memory for the parts of a model the planner does not place."""

    def reserve(
        self,
        topology: Topology,
        batch_size: int,
        module: nn.Module,
        sharders: Sequence[Sharder],
        constraints: Mapping[str, ParameterConstraints] | None = None,
    ) -> Topology: ...

    @property
    def last_reserved_topology(self) -> Topology | None: ...


class HeuristicalStorageReservation:
    """Keeps ``percentage`` of every rank's HBM and host memory free.

    TorchRec's version also subtracts its own estimates of the dense parameters' and the input
    KJTs' memory; here the percentage is meant to cover them (dense parameters, activations,
    allocator slack)."""

    def __init__(self, percentage: float = DEFAULT_STORAGE_RESERVATION) -> None:
        if isinstance(percentage, bool) or not 0.0 <= percentage < 1.0:
            raise ValueError(
                f"HeuristicalStorageReservation: percentage {percentage!r} must be in [0, 1) (the "
                "fraction of memory kept for dense parameters and activations)"
            )
        self.percentage = float(percentage)
        self._last: Topology | None = None

    def reserve(
        self,
        topology: Topology,
        batch_size: int,
        module: nn.Module,
        sharders: Sequence[Sharder],
        constraints: Mapping[str, ParameterConstraints] | None = None,
    ) -> Topology:
        """``topology`` with ``1 - percentage`` of its HBM and host memory."""
        keep = 1.0 - self.percentage
        self._last = dataclasses.replace(
            topology, hbm_cap=int(topology.hbm_per_rank * keep),
            ddr_cap=int(topology.ddr_per_rank * keep),
        )
        return self._last

    @property
    def last_reserved_topology(self) -> Topology | None:
        return self._last


def _reserved(topology: Topology, hbm_left: Callable[[int], int]) -> Topology:
    """``topology`` with each rank's HBM replaced by ``hbm_left(its HBM)`` (host memory and
    disk unchanged), in its caps and its per-rank ``devices``."""
    reserved = dataclasses.replace(topology, hbm_cap=hbm_left(topology.hbm_per_rank))
    for device, original in zip(reserved.devices, topology.devices, strict=True):
        device.storage.hbm = hbm_left(original.storage.hbm)
    return reserved


class FixedPercentageStorageReservation:
    """Keeps ``percentage`` of every rank's HBM free (TorchRec's: host memory untouched)."""

    def __init__(self, percentage: float) -> None:
        if isinstance(percentage, bool) or not 0.0 <= percentage <= 1.0:
            raise ValueError(
                f"FixedPercentageStorageReservation: percentage {percentage!r} must be in [0, 1]"
            )
        self._percentage = float(percentage)
        self._last_reserved_topology: Topology | None = None

    def reserve(
        self,
        topology: Topology,
        batch_size: int,
        module: nn.Module,
        sharders: Sequence[Sharder],
        constraints: Mapping[str, ParameterConstraints] | None = None,
    ) -> Topology:
        self._last_reserved_topology = _reserved(
            topology, lambda hbm: int((1 - self._percentage) * hbm))
        return self._last_reserved_topology

    @property
    def last_reserved_topology(self) -> Topology | None:
        return copy.deepcopy(self._last_reserved_topology)


class FixedAbsoluteStorageReservation(FixedPercentageStorageReservation):
    """Keeps ``hbm_reserved_bytes`` of every rank's HBM free (at most all of it)."""

    def __init__(self, hbm_reserved_bytes: int) -> None:
        if isinstance(hbm_reserved_bytes, bool) or not hbm_reserved_bytes >= 0:
            raise ValueError(
                f"FixedAbsoluteStorageReservation: hbm_reserved_bytes {hbm_reserved_bytes!r} "
                "must be >= 0"
            )
        super().__init__(percentage=0.0)
        self._hbm_reserved_bytes = int(hbm_reserved_bytes)

    @classmethod
    def from_gb(cls, hbm_reserved_gb: float) -> FixedAbsoluteStorageReservation:
        return cls(hbm_reserved_bytes=int(hbm_reserved_gb * 1024**3))

    def reserve(
        self,
        topology: Topology,
        batch_size: int,
        module: nn.Module,
        sharders: Sequence[Sharder],
        constraints: Mapping[str, ParameterConstraints] | None = None,
    ) -> Topology:
        self._last_reserved_topology = _reserved(
            topology, lambda hbm: max(0, hbm - self._hbm_reserved_bytes))
        return self._last_reserved_topology
