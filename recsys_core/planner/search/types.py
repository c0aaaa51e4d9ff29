"""The values this library's search passes along: :class:`TableSpec` (one table as the search
sees it), :class:`Placement` (which ranks a layout's shards may use) and :class:`Candidate`
(one candidate layout of a table with its estimated per-shard storage and cost; TorchRec's
``ShardingOption`` view of it is in ``planner/sharding_option.py``).

Units, as TorchRec's: bytes for memory, bytes per ms for bandwidths, ms for estimated cost.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, unique

import numpy as np

from recsys_core.kernels.config import EmbOptimType
from recsys_core.modules.embedding_configs import BaseEmbeddingConfig
from recsys_core.plan.types import EmbeddingComputeKernel, ShardingType
from recsys_core.planner.constraints import ParameterConstraints
from recsys_core.planner.storage import Tier

__all__ = ["Candidate", "Placement", "TableSpec", "cache_slots"]


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

    Arrays have one entry per shard. A FUSED_UVM_CACHING shard keeps all its rows in a slow
    tier (``backing_tier``: host memory on CUDA, local disk on CPU) and a cache of
    ``cache_slots(rows, lf)`` rows in a fast tier (``cache_tier``: HBM on CUDA, host memory on
    CPU); ``hbm``, ``ddr`` and ``ssd`` leave the cache slots out (:meth:`memory` adds them), and
    its cost at load factor ``lf`` is ``cost + (1 - lf) * miss_cost``.
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
    """Host-memory bytes of each shard (without cache slots)."""
    ssd: np.ndarray
    """Local-disk bytes of each shard (the backing files of a cached table on CPU, else 0)."""
    cost: np.ndarray
    """Estimated ms per training step of each shard (all cache hits for caching)."""
    perf: np.ndarray = field(default_factory=lambda: np.zeros((4, 0)))
    """``cost`` by phase, shape [4, shards]: fwd compute, fwd comms, bwd compute, bwd comms
    (computed on request only: empty otherwise)."""
    cache_tier: Tier = Tier.HBM
    """Where the cache slots live: HBM on CUDA, DDR on CPU (caching only)."""
    backing_tier: Tier = Tier.DDR
    """Where every row lives (weights and optimizer state): DDR on CUDA, SSD on CPU (caching
    only)."""
    slot_bytes: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """Bytes of one cache slot of each shard in ``cache_tier``, bookkeeping included (caching
    only)."""
    miss_rows: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """Distinct rows each shard's lookups touch per step: the rows that miss when nothing is
    cached (caching only; the expected misses at load factor lf are ``(1 - lf) *`` these)."""
    row_bytes: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """Bytes one missed row moves from ``backing_tier`` into the cache (caching only)."""
    miss_cost: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """Extra ms of each shard when every lookup misses the cache (caching only)."""
    miss_fwd: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """The forward's part of ``miss_cost`` (caching only)."""
    load_factor: float | None = None
    """A load factor fixed by the table's constraints (caching only)."""
    _fixed: np.ndarray = field(init=False, repr=False)
    """``hbm``, ``ddr``, ``ssd`` stacked once, read-only (set in ``__post_init__``)."""

    def __post_init__(self) -> None:
        # The per-tier bytes, stacked once: the partitioner asks for them at every placement.
        fixed = np.array((self.hbm, self.ddr, self.ssd), dtype=np.float64)
        fixed.flags.writeable = False
        object.__setattr__(self, "_fixed", fixed)

    @property
    def num_shards(self) -> int:
        return len(self.cost)

    @property
    def is_caching(self) -> bool:
        return self.compute_kernel is EmbeddingComputeKernel.FUSED_UVM_CACHING

    def total_cost(self, load_factor: float = 1.0) -> float:
        extra = float(self.miss_cost.sum()) * (1.0 - load_factor) if self.is_caching else 0.0
        return float(self.cost.sum()) + extra

    def cache_bytes(self, load_factor: float) -> np.ndarray:
        """Bytes of each shard's cache at ``load_factor`` (in ``cache_tier``; 0 if not caching)."""
        if not self.is_caching:
            return np.zeros(self.num_shards)
        return cache_slots(self.shard_rows, load_factor) * self.slot_bytes

    def memory(self, load_factor: float | None = None) -> np.ndarray:
        """Bytes of each shard per tier, shape [3, shards] (rows in :class:`Tier` order), the
        cache at ``load_factor`` included (None: without cache slots). Read-only."""
        fixed = self._fixed
        if load_factor is None or not self.is_caching:
            return fixed
        mem = fixed.copy()
        mem[self.cache_tier] += self.cache_bytes(load_factor)
        mem.flags.writeable = False
        return mem

    def expected_miss_rows(self, load_factor: float) -> np.ndarray:
        """Rows per step each shard is expected to read from ``backing_tier`` (hit rate = load
        factor, as if ids were uniform)."""
        return (1.0 - load_factor) * self.miss_rows if self.is_caching else np.zeros(self.num_shards)


def cache_slots(rows: np.ndarray | int, load_factor: float) -> np.ndarray:
    """Slots of each shard's cache at ``load_factor``, counted as the cached kernel counts them
    (``recsys_core.kernels.cached_tbe.cache_slots``): ``ceil(load_factor * rows)``, at least 1
    and at most ``rows``; 0 for an empty shard."""
    rows = np.asarray(rows, dtype=np.float64)
    slots = np.minimum(rows, np.maximum(1.0, np.ceil(rows * float(load_factor))))
    return np.where(rows > 0, slots, 0.0)
