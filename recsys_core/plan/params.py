"""Per-table kernel parameters a plan carries (TorchRec's ``torchrec.distributed.types`` names):
UVM cache settings (:class:`CacheParams`), id bounds checking (:class:`BoundsCheckMode`, FBGEMM's
values) and key-value store settings (:class:`KeyValueParams`)."""

from __future__ import annotations

import abc
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum, unique
from typing import Any, NamedTuple

from recsys_core.modules.embedding_configs import DataType
from recsys_core.types import enum_member


@unique
class BoundsCheckMode(Enum):
    """What a kernel does with an id outside its table (FBGEMM's ``BoundsCheckMode`` values)."""

    FATAL = 0  # raise
    WARNING = 1  # warn and use row 0
    IGNORE = 2  # use row 0 silently
    NONE = 3  # no check
    V2_IGNORE = 4
    V2_WARNING = 5
    V2_FATAL = 6


@dataclass(frozen=True)
class KeyValueParams:
    """Settings of a key-value (SSD or parameter-server) backed table. No kernel of this library
    stores tables that way: the planner refuses constraints that set these."""

    ssd_storage_directory: str | None = None
    ssd_rocksdb_write_buffer_size: int | None = None
    ssd_rocksdb_shards: int | None = None
    l2_cache_size: int | None = None
    ps_hosts: tuple[tuple[str, int], ...] | None = None


@unique
class CacheAlgorithm(Enum):
    """Eviction policy of the UVM cache (FBGEMM's ``CacheAlgorithm``)."""

    LRU = "lru"
    LFU = "lfu"


class CacheStatistics(abc.ABC):
    """Statistics of a cached table's ids (TorchRec's interface): the planner's offload
    scale-up proposer reads them to size each cache."""

    @property
    @abc.abstractmethod
    def expected_lookups(self) -> float:
        """Distinct ids a global training batch looks up."""

    @abc.abstractmethod
    def expected_miss_rate(self, clf: float) -> float:
        """Miss rate of a cache holding ``clf`` of the rows (1.0 at 0, 0.0 at 1)."""

    @property
    @abc.abstractmethod
    def cacheability(self) -> float:
        """How hard the ids are to cache whatever the cache size: 0 easy, 1 hard."""


class MultiPassPrefetchConfig(NamedTuple):
    """FBGEMM's multi-pass cache prefetch (TorchRec's ``distributed.types`` name): a prefetch
    splits its ids into up to ``num_passes`` passes (tensors shorter than
    ``min_splitable_pass_size`` are not split), so its extra memory shrinks with the passes. The
    planner's storage estimate reads ``num_passes``; this library's caches prefetch in one pass."""

    num_passes: int = 12
    min_splitable_pass_size: int = 6 * 1024 * 1024


@dataclass(unsafe_hash=True)
class CacheParams:
    """Settings of a FUSED_UVM_CACHING table: the HBM cache in front of rows kept in host memory.

    Fields in TorchRec's order (``CacheParams(CacheAlgorithm.LFU, 0.5)`` works positionally).
    Mutable and hashable as TorchRec's (a planner proposer sets ``load_factor`` and ``stats`` on
    a sharding option's copy); the hash leaves ``stats`` out, and values are checked when built.

    ``to_dict()`` is what a plan stores in ``ParameterSharding.cache_params`` (plain JSON).
    """

    algorithm: CacheAlgorithm = CacheAlgorithm.LRU
    """Which rows the cache evicts first."""
    load_factor: float | None = None
    """Cache slots as a fraction of the table's rows, in [0, 1] (the cache keeps at least one
    slot, so 0 means a one-row cache; TorchRec accepts 0 here and its planner check refuses it).
    None: the planner sizes it to the free HBM. Given in a constraint, the planner uses exactly
    this value."""
    reserved_memory: float | None = None
    """GiB of HBM the cache leaves unused on its rank (FBGEMM's ``cache_reserved_memory``)."""
    precision: DataType | None = None
    """Precision of cached rows (FP32 or FP16); None: the table's data type."""
    prefetch_pipeline: bool | None = None
    """Whether the training pipeline prefetches the next batch's rows into the cache."""
    stats: CacheStatistics | None = field(default=None, compare=False)
    """Statistics of the table's ids for the planner (not stored in a plan; TorchRec leaves
    them out of the hash too)."""
    multipass_prefetch_config: MultiPassPrefetchConfig | None = None
    """Multi-pass prefetch settings; the planner sizes the prefetch memory with ``num_passes``
    (not stored in a plan)."""

    def __post_init__(self) -> None:
        if not isinstance(self.algorithm, CacheAlgorithm):
            object.__setattr__(self, "algorithm", coerce_enum(CacheAlgorithm, self.algorithm, "algorithm"))
        if self.load_factor is not None and not 0.0 <= self.load_factor <= 1.0:
            raise ValueError(
                f"CacheParams: load_factor {self.load_factor} must be in [0, 1] (cache slots as a "
                "fraction of the table's rows); leave it None to size it to the free HBM"
            )
        if self.reserved_memory is not None and self.reserved_memory < 0:
            raise ValueError(f"CacheParams: reserved_memory {self.reserved_memory} GiB must be >= 0")
        if self.precision is not None:
            precision = coerce_enum(DataType, self.precision, "precision")
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


def coerce_enum(enum: type[Enum], value: Any, what: str) -> Any:
    member = enum_member(enum, value)
    if member is None:
        valid = ", ".join(repr(m.value) for m in enum)
        raise ValueError(f"{what}: {value!r} is not a {enum.__name__}; use one of {valid}")
    return member
