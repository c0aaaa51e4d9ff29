"""What a user tells the planner about one table: :class:`ParameterConstraints`, and the UVM cache
settings it may carry (:class:`CacheParams`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum, unique
from typing import Any

from recsys_core.modules.embedding_configs import DataType
from recsys_core.plan.types import EmbeddingComputeKernel, ShardingType


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


def _coerce(enum: type[Enum], value: Any, what: str) -> Any:
    if isinstance(value, enum):
        return value
    raw = getattr(value, "value", value)
    try:
        return enum(raw)
    except ValueError:
        valid = ", ".join(repr(m.value) for m in enum)  # type: ignore[attr-defined]
        raise ValueError(f"{what}: {value!r} is not a {enum.__name__}; use one of {valid}") from None
