"""What the planner is told (topology, per-table constraints, cache settings) and what it weighs.

Inputs a user writes: :class:`Topology` (ranks, memory, bandwidths), :class:`ParameterConstraints`
(per table: allowed sharding types and kernels, pooling factors...), :class:`CacheParams` (UVM
cache settings). Internal values the enumerator, estimator and partitioner pass along:
:class:`TableSpec` (one table as the planner sees it) and :class:`ShardingOption` (one candidate
layout of a table with its estimated per-shard storage and cost).

Units: bytes for memory, bytes per second for bandwidths, milliseconds for estimated cost.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field
from enum import Enum, unique
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from torch import nn

from recsys_core.distributed.types import EmbeddingComputeKernel, ShardingType
from recsys_core.kernels.config import EmbOptimType
from recsys_core.modules.embedding_configs import BaseEmbeddingConfig, DataType

if TYPE_CHECKING:
    from recsys_core.planner.shortfall import MemoryShortfall

GIB = 1024**3
GB = 1000**3


class PlannerError(ValueError):
    """The planner cannot produce a plan: nothing fits, or the constraints exclude every layout
    (a ValueError: the inputs, not the program, are what must change).

    ``shortfall`` says, as data, what did not fit where memory ran out (None for other errors),
    so an application can word its own remedies."""

    def __init__(self, message: str, shortfall: MemoryShortfall | None = None) -> None:
        super().__init__(message)
        self.shortfall = shortfall

    def __reduce__(self) -> tuple[Any, ...]:  # keep the shortfall across processes
        return (type(self), (str(self), self.shortfall))


@unique
class CacheAlgorithm(Enum):
    """Eviction policy of the UVM cache (FBGEMM's ``CacheAlgorithm``)."""

    LRU = "lru"
    LFU = "lfu"


@dataclass(frozen=True, kw_only=True)
class CacheParams:
    """Settings of a FUSED_UVM_CACHING table: the HBM cache in front of rows kept in host memory.

    ``to_dict()`` is what a plan stores in ``ParameterSharding.cache_params`` (plain JSON).
    """

    algorithm: CacheAlgorithm = CacheAlgorithm.LRU
    """Which rows the cache evicts first."""
    load_factor: float | None = None
    """Cache slots as a fraction of the table's rows, in (0, 1]. None: the planner sizes it to
    the free HBM. Given in a constraint, the planner uses exactly this value."""
    reserved_memory: float | None = None
    """GiB of HBM the cache leaves unused on its rank (FBGEMM's ``cache_reserved_memory``)."""
    precision: DataType | None = None
    """Precision of cached rows (FP32 or FP16); None: the table's data type."""
    prefetch_pipeline: bool | None = None
    """Whether the training pipeline prefetches the next batch's rows into the cache."""

    def __post_init__(self) -> None:
        if not isinstance(self.algorithm, CacheAlgorithm):
            object.__setattr__(self, "algorithm", _coerce(CacheAlgorithm, self.algorithm, "algorithm"))
        if self.load_factor is not None and not 0.0 < self.load_factor <= 1.0:
            raise ValueError(
                f"CacheParams: load_factor {self.load_factor} must be in (0, 1] (cache slots as a "
                "fraction of the table's rows); leave it None to size it to the free HBM"
            )
        if self.reserved_memory is not None and self.reserved_memory < 0:
            raise ValueError(f"CacheParams: reserved_memory {self.reserved_memory} GiB must be >= 0")
        if self.precision is not None:
            precision = _coerce(DataType, self.precision, "precision")
            if precision not in (DataType.FP32, DataType.FP16):
                raise ValueError(
                    f"CacheParams: precision {precision} is not a cache precision; use "
                    "DataType.FP32 or DataType.FP16"
                )
            object.__setattr__(self, "precision", precision)

    def to_dict(self) -> dict[str, Any]:
        return {
            "algorithm": self.algorithm.value,
            "load_factor": self.load_factor,
            "reserved_memory": self.reserved_memory,
            "precision": None if self.precision is None else self.precision.value,
            "prefetch_pipeline": self.prefetch_pipeline,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CacheParams:
        unknown = set(data) - {
            "algorithm", "load_factor", "reserved_memory", "precision", "prefetch_pipeline"
        }
        if unknown:
            raise ValueError(f"CacheParams.from_dict: unknown keys {sorted(unknown)}")
        return cls(
            algorithm=CacheAlgorithm(data.get("algorithm", CacheAlgorithm.LRU.value)),
            load_factor=data.get("load_factor"),
            reserved_memory=data.get("reserved_memory"),
            precision=None if data.get("precision") is None else DataType(data["precision"]),
            prefetch_pipeline=data.get("prefetch_pipeline"),
        )


@dataclass(frozen=True, kw_only=True)
class ParameterConstraints:
    """What the planner may do with one table, and what it should assume about its traffic.

    Keyed by table name in ``EmbeddingShardingPlanner(constraints={...})``. Lists may be given
    as lists of enums or of their string values; they are stored as tuples of enums.
    """

    sharding_types: Sequence[ShardingType | str] | None = None
    """Allowed sharding types (None: every type the sharder supports)."""
    compute_kernels: Sequence[EmbeddingComputeKernel | str] | None = None
    """Allowed kernels (None: FUSED on CPU; FUSED, FUSED_UVM_CACHING, FUSED_UVM on CUDA)."""
    min_partition: int | None = None
    """Narrowest column-wise shard, in columns (None: the planner's default, 32)."""
    pooling_factors: Sequence[float] = (1.0,)
    """Mean ids per bag, one per feature of the table (or one value for all features)."""
    num_poolings: Sequence[float] | None = None
    """Bags per sample, per feature (None: 1)."""
    batch_sizes: Sequence[int] | None = None
    """Samples per rank per step, per feature (None: the planner's batch_size)."""
    cache_params: CacheParams | None = None
    """UVM cache settings; its load_factor, if set, is used exactly."""
    enforce_hbm: bool | None = None
    """True: keep this table in HBM (FUSED only, never UVM) on a CUDA topology."""
    is_weighted: bool = False
    """Ids carry weights (adds 4 bytes per id to the input all-to-all)."""

    def __post_init__(self) -> None:
        if self.sharding_types is not None:
            types = tuple(_coerce(ShardingType, t, "sharding_types") for t in self.sharding_types)
            if not types:
                raise ValueError("ParameterConstraints: sharding_types is empty; allow at least one")
            object.__setattr__(self, "sharding_types", types)
        if self.compute_kernels is not None:
            kernels = tuple(
                _coerce(EmbeddingComputeKernel, k, "compute_kernels") for k in self.compute_kernels
            )
            if not kernels:
                raise ValueError("ParameterConstraints: compute_kernels is empty; allow at least one")
            object.__setattr__(self, "compute_kernels", kernels)
        if self.min_partition is not None and (
            isinstance(self.min_partition, bool) or int(self.min_partition) != self.min_partition
            or self.min_partition < 1
        ):
            raise ValueError(f"ParameterConstraints: min_partition {self.min_partition} must be an int >= 1")
        for name in ("pooling_factors", "num_poolings", "batch_sizes"):
            values = getattr(self, name)
            if values is None:
                continue
            if isinstance(values, int | float):
                raise ValueError(f"ParameterConstraints: {name} is a list (one value per feature), got {values!r}")
            values = tuple(values)
            if not values or any(not v > 0 for v in values):
                raise ValueError(f"ParameterConstraints: {name} {list(values)} must be non-empty and > 0")
            object.__setattr__(self, name, values)
        if self.cache_params is not None and not isinstance(self.cache_params, CacheParams):
            raise ValueError(
                f"ParameterConstraints: cache_params must be a CacheParams, got {self.cache_params!r}"
            )


# Defaults of a Topology (per rank unless said otherwise). Sources: TorchRec's planner constants
# (torchrec/distributed/planner/constants.py) and vendor data sheets, rounded.
DEFAULT_HBM_CAP = 80 * GIB  # H100 / A100-80GB
DEFAULT_DDR_CAP = 128 * GIB  # per HOST; each rank gets ddr_cap / local_world_size
DEFAULT_HBM_MEM_BW = 897 * GB  # TorchRec's HBM_MEM_BW: effective for random row gathers
# TorchRec's DDR_MEM_BW: host-memory row reads by a CPU kernel or over UVM. With
# NS_PER_UPDATED_ROW it matches FBGEMM-CPU step times within ~30% on the development VM
# (bench/planner.py).
DEFAULT_DDR_MEM_BW = 51 * GB
DEFAULT_CUDA_INTRA_HOST_BW = 600 * GB  # TorchRec's INTRA_NODE_BANDWIDTH (NVLink)
# gloo over loopback TCP between the processes of one host: 0.97 GB/s per rank measured for a
# 64 MiB all-to-all between 2 ranks on the 2-vCPU development VM (bigger hosts do better).
DEFAULT_CPU_INTRA_HOST_BW = 1 * GB
DEFAULT_INTER_HOST_BW = 12.5 * GB  # TorchRec's CROSS_NODE_BANDWIDTH (a 100 Gb/s NIC per rank)


@dataclass(frozen=True)
class Topology:
    """The ranks a model is planned for: how many, what memory each has, how fast links are.

    ``Topology(world_size=8, compute_device="cuda")`` is 8 GPUs of 80 GiB on one host. On a CPU
    topology memory is DDR: each rank gets ``ddr_cap / local_world_size`` and ``hbm_cap`` is 0.
    The defaults are TorchRec's constants, not this machine's memory:
    ``recsys_core.planner.detect_topology`` reads what this machine has free.
    """

    world_size: int
    """Number of ranks."""
    compute_device: str = "cuda"
    """Where lookups run, "cuda" or "cpu" (this also decides which kernels exist)."""
    _: KW_ONLY
    local_world_size: int | None = None
    """Ranks per host (None: all ranks on one host). Must divide world_size."""
    hbm_cap: int | None = None
    """HBM bytes per rank (None: 80 GiB on CUDA, 0 on CPU)."""
    ddr_cap: int | None = None
    """Host memory bytes per HOST, shared by its ranks (None: 128 GiB)."""
    hbm_mem_bw: float = DEFAULT_HBM_MEM_BW
    """Bytes/s a rank's lookups read from HBM."""
    ddr_mem_bw: float = DEFAULT_DDR_MEM_BW
    """Bytes/s a rank's lookups read from host memory (CPU kernels and UVM)."""
    intra_host_bw: float | None = None
    """Bytes/s a rank sends to ranks of its host (None: 600 GB/s NVLink on CUDA, 1 GB/s on CPU)."""
    inter_host_bw: float = DEFAULT_INTER_HOST_BW
    """Bytes/s a rank sends to other hosts."""
    memory_source: str | None = field(default=None, compare=False)
    """Where hbm_cap and ddr_cap come from, for messages (``detect_topology`` fills it in;
    None: given to this constructor, or its TorchRec defaults)."""

    def __post_init__(self) -> None:
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"Topology: world_size must be an int >= 1, got {self.world_size!r}")
        device = getattr(self.compute_device, "type", self.compute_device)
        if device not in ("cuda", "cpu"):
            raise ValueError(f"Topology: compute_device must be 'cuda' or 'cpu', got {self.compute_device!r}")
        object.__setattr__(self, "compute_device", device)
        local = self.world_size if self.local_world_size is None else self.local_world_size
        if isinstance(local, bool) or not isinstance(local, int) or local < 1 or self.world_size % local:
            raise ValueError(
                f"Topology: local_world_size {self.local_world_size!r} must be an int >= 1 that "
                f"divides world_size {self.world_size}; pass the number of ranks per host"
            )
        object.__setattr__(self, "local_world_size", local)
        if device == "cpu" and self.hbm_cap:
            raise ValueError(
                f"Topology: hbm_cap {self.hbm_cap} on a CPU topology; CPU ranks have no HBM, "
                "so size their memory with ddr_cap (bytes per host)"
            )
        hbm = (DEFAULT_HBM_CAP if device == "cuda" else 0) if self.hbm_cap is None else self.hbm_cap
        ddr = DEFAULT_DDR_CAP if self.ddr_cap is None else self.ddr_cap
        for name, value in (("hbm_cap", hbm), ("ddr_cap", ddr)):
            if not value >= 0:
                raise ValueError(f"Topology: {name} must be >= 0 bytes, got {value!r}")
        object.__setattr__(self, "hbm_cap", int(hbm))
        object.__setattr__(self, "ddr_cap", int(ddr))
        if self.intra_host_bw is None:
            default = DEFAULT_CUDA_INTRA_HOST_BW if device == "cuda" else DEFAULT_CPU_INTRA_HOST_BW
            object.__setattr__(self, "intra_host_bw", default)
        for name in ("hbm_mem_bw", "ddr_mem_bw", "intra_host_bw", "inter_host_bw"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Topology: {name} must be > 0 bytes/s, got {getattr(self, name)!r}")

    @property
    def local_size(self) -> int:
        assert self.local_world_size is not None  # resolved in __post_init__
        return self.local_world_size

    @property
    def num_hosts(self) -> int:
        return self.world_size // self.local_size

    @property
    def is_cuda(self) -> bool:
        return self.compute_device == "cuda"

    @property
    def hbm_per_rank(self) -> int:
        return int(self.hbm_cap or 0)

    @property
    def ddr_per_rank(self) -> int:
        return int(self.ddr_cap or 0) // self.local_size

    @classmethod
    def default(cls, world_size: int, compute_device: str | None = None) -> Topology:
        """As TorchRec when no topology is given: ranks per host from ``LOCAL_WORLD_SIZE``
        (torchrun sets it), CUDA when available."""
        import torch  # local: only this convenience needs to probe the machine

        local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        if local < 1 or world_size % local:
            local = world_size
        device = compute_device or ("cuda" if torch.cuda.is_available() else "cpu")
        return cls(world_size=world_size, compute_device=device, local_world_size=local)


class Sharder(Protocol):
    """What the planner asks a sharder (EmbeddingBagCollectionSharder matches this)."""

    @property
    def module_type(self) -> type[nn.Module]: ...

    def sharding_types(self, compute_device_type: str) -> list[str]: ...

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]: ...


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
class ShardingOption:
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
    cache_hbm: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """HBM bytes of each shard's cache at load factor 1 (caching only)."""
    miss_cost: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """Extra ms of each shard when every lookup misses the cache (caching only)."""
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


def _coerce(enum: type[Enum], value: Any, what: str) -> Any:
    if isinstance(value, enum):
        return value
    raw = getattr(value, "value", value)
    try:
        return enum(raw)
    except ValueError:
        valid = ", ".join(repr(m.value) for m in enum)  # type: ignore[attr-defined]
        raise ValueError(f"{what}: {value!r} is not a {enum.__name__}; use one of {valid}") from None
