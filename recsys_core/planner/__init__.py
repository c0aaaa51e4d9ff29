"""Sharding planner: (tables, Topology, constraints) -> ShardingPlan, with per-rank estimates."""

from recsys_core.planner.constraints import (
    BoundsCheckMode,
    CacheAlgorithm,
    CacheParams,
    KeyValueParams,
    ParameterConstraints,
)
from recsys_core.planner.enumerators import EmbeddingEnumerator
from recsys_core.planner.errors import MemoryShortfall, PlannerError, PlannerErrorType, TableMemory
from recsys_core.planner.machine import (
    MemoryReading,
    detect_topology,
    device_memory,
    disk_space,
    host_memory,
    smallest_over_ranks,
)
from recsys_core.planner.planners import EmbeddingShardingPlanner, plan_for_env
from recsys_core.planner.search.stats import CachedTableStats, PlanStats, RankStats
from recsys_core.planner.sharding_option import ShardingOption
from recsys_core.planner.storage import DeviceHardware, Perf, Shard, Storage, Tier
from recsys_core.planner.storage_reservations import (
    HeuristicalStorageReservation,
    StorageReservation,
)
from recsys_core.planner.topology import Topology

__all__ = [
    "EmbeddingEnumerator",
    "ShardingOption",
    "HeuristicalStorageReservation",
    "StorageReservation",
    "BoundsCheckMode",
    "KeyValueParams",
    "DeviceHardware",
    "Perf",
    "PlannerErrorType",
    "Shard",
    "Storage",
    "CacheAlgorithm",
    "CacheParams",
    "CachedTableStats",
    "EmbeddingShardingPlanner",
    "MemoryReading",
    "MemoryShortfall",
    "ParameterConstraints",
    "PlanStats",
    "PlannerError",
    "RankStats",
    "TableMemory",
    "Tier",
    "Topology",
    "detect_topology",
    "device_memory",
    "disk_space",
    "host_memory",
    "plan_for_env",
    "smallest_over_ranks",
]
