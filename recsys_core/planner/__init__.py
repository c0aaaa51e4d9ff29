"""Sharding planner: (tables, Topology, constraints) -> ShardingPlan, with per-rank estimates."""

from recsys_core.planner.planner import EmbeddingShardingPlanner, plan_for_env
from recsys_core.planner.stats import PlanStats, RankStats
from recsys_core.planner.types import (
    CacheAlgorithm,
    CacheParams,
    ParameterConstraints,
    PlannerError,
    Topology,
)

__all__ = [
    "CacheAlgorithm",
    "CacheParams",
    "EmbeddingShardingPlanner",
    "ParameterConstraints",
    "PlanStats",
    "PlannerError",
    "RankStats",
    "Topology",
    "plan_for_env",
]
