"""TorchRec's pluggable planner interfaces: what a custom enumerator, estimator, proposer,
partitioner, perf model, stats logger or plan loader implements.

``EmbeddingShardingPlanner(enumerator=..., proposer=..., partitioner=..., performance_model=...,
stats=..., plan_loader=...)`` runs TorchRec's search with them (``planners.py``): enumerate
every :class:`ShardingOption`, ask each proposer for proposals, partition each on the reserved
topology, rate the partitioned plans and keep the best.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from recsys_core.plan.types import ShardingPlan
    from recsys_core.planner.constraints import ParameterConstraints
    from recsys_core.planner.sharding_option import ShardingOption
    from recsys_core.planner.topology import Topology


class PartitionByType(Enum):
    """How a partitioner places a sharding option's shards."""

    DEVICE = "device"  # each shard on a rank of the partitioner's choice
    HOST = "host"  # shards on the ranks of one host it picks
    UNIFORM = "uniform"  # shard i on rank i
    MULTI_HOST = "multi_host"  # shards over several whole hosts


@dataclass
class SharderData:
    """What estimators need of a sharder, as plain data (picklable)."""

    fused_params: dict[str, Any]
    qcomm_dtype_sizes: dict[str, tuple[float, float]]
    """Forward and backward bytes per element of each quantized CommOp (by name)."""
    storage_usage_type: Enum | None
    """TorchRec's ``StorageUsageType`` of the sharder's class (None: a sharder without one,
    counted as TorchRec's default)."""


SharderDataMap = dict[str, SharderData]


class ShardEstimator(abc.ABC):
    """Fills in each shard's ``storage`` or ``perf`` of fully specified sharding options."""

    @abc.abstractmethod
    def __init__(
        self, topology: Topology, constraints: dict[str, ParameterConstraints] | None = None
    ) -> None: ...

    @abc.abstractmethod
    def estimate(
        self, sharding_options: list[ShardingOption], sharder_data_map: SharderDataMap
    ) -> None: ...


class Enumerator(abc.ABC):
    """Lists every sharding option of a module's shardable tables, with estimates."""

    @abc.abstractmethod
    def __init__(
        self,
        topology: Topology,
        batch_size: int = 512,
        constraints: dict[str, ParameterConstraints] | None = None,
        estimator: ShardEstimator | list[ShardEstimator] | None = None,
    ) -> None: ...

    @abc.abstractmethod
    def enumerate(self, module: nn.Module, sharders: list[Any]) -> list[ShardingOption]: ...

    @abc.abstractmethod
    def populate_estimates(self, sharding_options: list[ShardingOption]) -> None: ...


class Proposer(abc.ABC):
    """Proposes complete lists of sharding options (one per table) to partition."""

    @abc.abstractmethod
    def load(
        self, search_space: list[ShardingOption], enumerator: Enumerator | None = None
    ) -> None: ...

    @abc.abstractmethod
    def feedback(
        self,
        partitionable: bool,
        plan: list[ShardingOption] | None = None,
        perf_rating: float | None = None,
        storage_constraint: Topology | None = None,
    ) -> None: ...

    @abc.abstractmethod
    def propose(self) -> list[ShardingOption] | None: ...


class Partitioner(abc.ABC):
    """Assigns a rank to every shard of a proposal (in place); raises PlannerError if it cannot."""

    @abc.abstractmethod
    def partition(
        self, proposal: list[ShardingOption], storage_constraint: Topology
    ) -> list[ShardingOption]: ...


class PerfModel(abc.ABC):
    """Rates a partitioned plan (lower is better)."""

    @abc.abstractmethod
    def rate(self, plan: list[ShardingOption]) -> float: ...


@dataclass
class PlanDebugStats:
    planner_type: str
    timeout_seconds: int | None


class Stats(abc.ABC):
    """Logs statistics of the chosen plan."""

    @abc.abstractmethod
    def log(
        self,
        sharding_plan: ShardingPlan,
        topology: Topology,
        batch_size: int,
        storage_reservation: Any,
        num_proposals: int,
        num_plans: int,
        run_time: float,
        best_plan: list[ShardingOption],
        constraints: dict[str, ParameterConstraints] | None = None,
        sharders: list[Any] | None = None,
        enumerator: Enumerator | None = None,
        debug: bool = False,
        debug_stats: PlanDebugStats | None = None,
    ) -> None: ...


class PlanLoader(abc.ABC):
    """Loads a stored plan: ``{ShardingOption.storage_hash(): ShardingOption}`` and the context
    hash it was planned for (``EmbeddingShardingPlanner.hash_planner_context_inputs_str()``)."""

    @abc.abstractmethod
    def load(self) -> dict[int, ShardingOption] | None: ...

    @abc.abstractmethod
    def plan_context_hash(self) -> str | None: ...

    def get_plan_id(self) -> str | None:
        return None
