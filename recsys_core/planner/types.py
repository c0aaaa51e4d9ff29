"""What the planner's enumerator, estimator and partitioner pass along, and the inputs a user
writes (re-exported here from their own modules).

Inputs: :class:`Topology` (``topology.py``), :class:`ParameterConstraints` and
:class:`CacheParams` (``constraints.py``), :class:`PlannerError` (``errors.py``); TorchRec's
value types :class:`Storage`, :class:`Perf`, :class:`Shard` (``storage.py``). Internal values:
:class:`TableSpec` (one table as the planner sees it) and :class:`Candidate` (one candidate
layout of a table with its estimated per-shard storage and cost; TorchRec's ``ShardingOption``
view of it is in ``sharding_option.py``).

Units, as TorchRec's: bytes for memory, bytes per ms for bandwidths, ms for estimated cost.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, unique

import numpy as np

from recsys_core.kernels.config import EmbOptimType
from recsys_core.modules.embedding_configs import BaseEmbeddingConfig
from recsys_core.plan.sharder import Sharder
from recsys_core.plan.types import EmbeddingComputeKernel, ShardingType
from recsys_core.planner.constraints import CacheAlgorithm, CacheParams, ParameterConstraints
from recsys_core.planner.errors import PlannerError, PlannerErrorType
from recsys_core.planner.storage import DeviceHardware, Perf, Shard, Storage
from recsys_core.planner.topology import (
    DEFAULT_DDR_CAP,
    DEFAULT_HBM_CAP,
    GB,
    GIB,
    Topology,
)

__all__ = [
    "DeviceHardware",
    "Perf",
    "PlannerErrorType",
    "Shard",
    "Storage",
    "DEFAULT_DDR_CAP",
    "DEFAULT_HBM_CAP",
    "GB",
    "GIB",
    "CacheAlgorithm",
    "CacheParams",
    "ParameterConstraints",
    "Placement",
    "PlannerError",
    "Sharder",
    "Candidate",
    "TableSpec",
    "Topology",
]


@dataclass(frozen=True, kw_only=True)
class TableSpec:
    """One table as the planner sees it: its config, where it lives, what traffic it gets."""

    path: str
    """Module path of its collection (``""`` for a top-level collection)."""
    config: BaseEmbeddingConfig
    """The table config (rows, dim, name, data type, features)."""
    pooled: bool
    """True for an EmbeddingBagCollection table (one output row per bag)."""
    optimizer: EmbOptimType
    """The fused optimizer, which sets the optimizer-state bytes per row."""
    constraints: ParameterConstraints
    """The table's constraints (defaults when the user gave none)."""
    ids_per_batch: float
    """Ids one rank's batch sends to this table per step, summed over its features
    (batch size x poolings x pooling factor)."""
    bags_per_batch: float
    """Bags one rank's batch produces in this table per step (batch size x poolings)."""
    is_weighted: bool
    """Ids carry weights."""
    output_bytes: float = 4.0
    """Bytes per element of the table's output embeddings (4: FP32; ``output_dtype``)."""

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def key(self) -> tuple[str, str]:
        return (self.path, self.config.name)


@unique
class Placement(Enum):
    """Which ranks an option's shards land on; the partitioner chooses where it is free to."""

    ANY_RANKS = "any_ranks"  # table-wise, column-wise: each shard on a rank of its choice
    ANY_HOST = "any_host"  # table-row/column-wise: shard i on local rank i of a host it picks
    ALL_RANKS = "all_ranks"  # row-wise, data-parallel: shard i on rank i


@dataclass(frozen=True, kw_only=True, eq=False)
class Candidate:
    """One candidate layout of a table with a kernel, and its per-shard estimates.

    Arrays have one entry per shard. For FUSED_UVM_CACHING the HBM footprint and cost depend on
    the cache load factor ``lf``: ``hbm + lf * cache_hbm`` bytes and ``cost + (1 - lf) * miss_cost``.
    """

    table: TableSpec
    """The table."""
    sharding_type: ShardingType
    """The split."""
    compute_kernel: EmbeddingComputeKernel
    """The kernel holding each shard."""
    placement: Placement
    """Which ranks the shards may use."""
    shard_rows: np.ndarray
    """Rows of each shard."""
    shard_cols: np.ndarray
    """Columns of each shard."""
    hbm: np.ndarray
    """HBM bytes of each shard (without cache slots)."""
    ddr: np.ndarray
    """Host-memory bytes of each shard."""
    cost: np.ndarray
    """Estimated ms per training step of each shard (all cache hits for caching)."""
    perf: np.ndarray = field(default_factory=lambda: np.zeros((4, 0)))
    """``cost`` by phase, shape [4, shards]: fwd compute, fwd comms, bwd compute, bwd comms
    (computed on request only: empty otherwise)."""
    cache_hbm: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """HBM bytes of each shard's cache at load factor 1 (caching only)."""
    miss_cost: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """Extra ms of each shard when every lookup misses the cache (caching only)."""
    miss_fwd: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """The forward's part of ``miss_cost`` (caching only)."""
    load_factor: float | None = None
    """A load factor fixed by the table's constraints (caching only)."""

    @property
    def num_shards(self) -> int:
        return len(self.cost)

    @property
    def is_caching(self) -> bool:
        return self.compute_kernel is EmbeddingComputeKernel.FUSED_UVM_CACHING

    def total_cost(self, load_factor: float = 1.0) -> float:
        extra = float(self.miss_cost.sum()) * (1.0 - load_factor) if self.is_caching else 0.0
        return float(self.cost.sum()) + extra
