"""How much of each rank's memory the planner leaves to what is not an embedding table.

TorchRec's ``StorageReservation`` interface: ``reserve(topology, batch_size, module, sharders,
constraints)`` returns the topology the tables must fit in. :class:`HeuristicalStorageReservation`
keeps a fixed fraction of every rank's HBM and host memory free: 15% of 80 GiB of HBM leaves
68 GiB for tables. Disk (``ssd_cap``) holds only offloaded tables, so none of it is reserved.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import torch
from torch import nn

from recsys_core.plan.sharder import Sharder
from recsys_core.planner.constants import BIGINT_DTYPE, POOLING_FACTOR
from recsys_core.planner.constraints import ParameterConstraints
from recsys_core.planner.errors import PlannerError, PlannerErrorType
from recsys_core.planner.storage import Storage
from recsys_core.planner.topology import Topology
from recsys_core.planner.utils import shardable_parameters, sharder_name, storage_repr_in_gb

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
    """Keeps ``percentage`` of every rank's HBM and host memory free, then TorchRec's estimates
    of what the model needs besides its tables on the compute device (HBM on CUDA/MTIA, host
    memory on CPU):

    - dense tensors (``_dense_storage``): ``parameter_multiplier`` x the bytes of every
      parameter outside the sharded collections, plus their buffers (weights, gradients,
      optimizer state, activations: TorchRec's 6x); ``dense_tensor_estimate`` replaces it;
    - input KJTs (``_kjt_storage``): ``ceil(sum over features of batch x pooling factor x 8)
      x 20`` bytes.

    TorchRec's version keeps the percentage of HBM only; this one keeps it of host memory too
    (the host holds the loader, pinned buffers and the OS). A rank left with negative HBM is a
    ``PlannerError`` (INSUFFICIENT_STORAGE), as TorchRec; short host memory is reported by the
    planner's search, with each table's needs."""

    def __init__(self, percentage: float = DEFAULT_STORAGE_RESERVATION,
                 parameter_multiplier: float = 6.0,
                 dense_tensor_estimate: int | None = None) -> None:
        if isinstance(percentage, bool) or not 0.0 <= percentage <= 1.0:
            raise ValueError(
                f"HeuristicalStorageReservation: percentage {percentage!r} must be in [0, 1] (the "
                "fraction of memory kept for dense parameters and activations)"
            )
        self.percentage = float(percentage)
        self._percentage = self.percentage
        self._parameter_multiplier = float(parameter_multiplier)
        self._dense_tensor_estimate = dense_tensor_estimate
        self._dense_storage: Storage | None = None
        self._kjt_storage: Storage | None = None
        self._last: Topology | None = None

    def reserve(
        self,
        topology: Topology,
        batch_size: int,
        module: nn.Module,
        sharders: Sequence[Sharder],
        constraints: Mapping[str, ParameterConstraints] | None = None,
    ) -> Topology:
        """``topology`` with ``1 - percentage`` of its HBM and host memory, less the dense and
        KJT estimates on its compute device."""
        batch_inputs, shardable = _get_batch_inputs_and_shardable_parameters(
            module, sharders, batch_size, constraints)
        dense = (self._dense_tensor_estimate if self._dense_tensor_estimate
                 else _get_dense_tensor_size(module, shardable, self._parameter_multiplier))
        self._dense_storage = _on_compute_device(topology, dense)
        self._kjt_storage = _get_kjt_storage(topology, batch_inputs, BIGINT_DTYPE, 20)
        taken = self._dense_storage + self._kjt_storage
        keep = 1.0 - self.percentage
        reserved = dataclasses.replace(
            topology, hbm_cap=max(0, int(topology.hbm_per_rank * keep) - taken.hbm),
            ddr_cap=max(0, int(topology.ddr_per_rank * keep) - taken.ddr),
        )
        for device, original in zip(reserved.devices, topology.devices, strict=True):
            device.storage.hbm = int(original.storage.hbm * keep) - taken.hbm
            device.storage.ddr = int(original.storage.ddr * keep) - taken.ddr
        first = reserved.devices[0].storage
        if first.hbm < 0:  # TorchRec's check (host memory short: the planner's own report)
            raise PlannerError(
                f"HeuristicalStorageReservation: after keeping {self.percentage:.0%} of each "
                f"rank's memory ({storage_repr_in_gb(topology.devices[0].storage)} per rank), "
                f"the dense tensors ({storage_repr_in_gb(self._dense_storage)}, "
                f"{self._parameter_multiplier}x their parameters) and the input KJTs "
                f"({storage_repr_in_gb(self._kjt_storage)} at batch size {batch_size}) leave "
                f"{storage_repr_in_gb(first)}: no plan can fit. Lower the percentage or the "
                "batch size, pass dense_tensor_estimate if the dense estimate is too high "
                "(e.g. under FSDP), or use ranks with more memory",
                PlannerErrorType.INSUFFICIENT_STORAGE,
            )
        self._last = reserved
        return reserved

    @property
    def last_reserved_topology(self) -> Topology | None:
        return self._last


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _get_module_size(module: nn.Module, multiplier: float) -> int:
    """``multiplier`` x the bytes of ``module``'s parameters plus its buffers' bytes, rounded
    (meta tensors count by shape)."""
    params = sum(multiplier * _tensor_bytes(p) for p in module.parameters())
    return round(params + sum(_tensor_bytes(b) for b in module.buffers()))


def _get_dense_tensor_size(module: nn.Module, shardable_modules: set[nn.Module],
                           multiplier: float = 6.0) -> int:
    """:func:`_get_module_size` of ``module`` less that of its sharded collections."""
    return _get_module_size(module, multiplier) - sum(
        _get_module_size(m, multiplier) for m in shardable_modules)


def _on_compute_device(topology: Topology, size: int) -> Storage:
    accelerator = topology.compute_device in ("cuda", "mtia")
    return Storage(hbm=size if accelerator else 0,
                   ddr=size if topology.compute_device == "cpu" else 0, ssd=0)


def _get_kjt_storage(topology: Topology, batch_inputs: list[float], input_data_type_size: int,
                     multiplier: int) -> Storage:
    """TorchRec's input-KJT estimate on the compute device: ``ceil(sum(batch_inputs) x
    input_data_type_size) x multiplier`` bytes."""
    size = math.ceil(sum(batch_inputs) * float(input_data_type_size)) * multiplier
    return _on_compute_device(topology, size)


def _get_batch_inputs_and_shardable_parameters(
    module: nn.Module, sharders: Sequence[Sharder], batch_size: int,
    constraints: Mapping[str, ParameterConstraints] | None = None,
) -> tuple[list[float], set[nn.Module]]:
    """(ids per batch of each feature of every sharded table, the sharded modules).

    A module with a sharder is not descended into; per table, the constraint's
    ``pooling_factors`` (default one feature of 1.0) times its ``batch_sizes`` (default
    ``batch_size``)."""
    by_name = {sharder_name(s.module_type): s for s in sharders}
    lengths: list[float] = []
    batches: list[float] = []
    modules: set[nn.Module] = set()

    def visit(m: nn.Module) -> None:
        sharder = by_name.get(sharder_name(type(m)))
        if sharder is None:
            for child in m.children():
                visit(child)
            return
        modules.add(m)
        for name in shardable_parameters(sharder, m):
            c = (constraints or {}).get(name)
            factors = list(c.pooling_factors) if c is not None and c.pooling_factors else [
                POOLING_FACTOR]
            lengths.extend(factors)
            batches.extend(c.batch_sizes if c is not None and c.batch_sizes
                           else [batch_size] * len(factors))

    visit(module)
    return [x * b for x, b in zip(lengths, batches, strict=False)], modules


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
        self._kjt_storage: Storage | None = None

    def reserve(
        self,
        topology: Topology,
        batch_size: int,
        module: nn.Module,
        sharders: Sequence[Sharder],
        constraints: Mapping[str, ParameterConstraints] | None = None,
    ) -> Topology:
        self._last_reserved_topology = _reserved(topology, self._hbm_left)
        # Computed for stats (as TorchRec), not taken from the topology: the percentage covers it.
        batch_inputs, _ = _get_batch_inputs_and_shardable_parameters(
            module, sharders, batch_size, constraints)
        self._kjt_storage = _get_kjt_storage(topology, batch_inputs, BIGINT_DTYPE, 20)
        return self._last_reserved_topology

    def _hbm_left(self, hbm: int) -> int:
        """A rank's HBM once the reservation is taken from its ``hbm`` bytes."""
        return int((1 - self._percentage) * hbm)

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

    def _hbm_left(self, hbm: int) -> int:
        return max(0, hbm - self._hbm_reserved_bytes)
