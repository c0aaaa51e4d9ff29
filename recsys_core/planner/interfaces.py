"""TorchRec's pluggable planner interfaces: what a custom enumerator, estimator, proposer,
partitioner, perf model, stats logger or plan loader implements.

``EmbeddingShardingPlanner(enumerator=..., proposer=..., partitioner=..., performance_model=...,
stats=..., plan_loader=...)`` runs TorchRec's search with them (``planners.py``): enumerate
every :class:`ShardingOption`, ask each proposer for proposals, partition each on the reserved
topology, rate the partitioned plans and keep the best.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from recsys_core.plan.sharder import default_storage_usage
from recsys_core.planner.constants import CROSS_NODE_BANDWIDTH, INTRA_NODE_BANDWIDTH

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
    """TorchRec's ``StorageUsageType`` of the sharder (None: a sharder without one)."""
    storage_usage: Callable[[torch.Tensor, str, str], dict[str, int]] = field(
        default=default_storage_usage, compare=False, repr=False)
    """The sharder's ``storage_usage(tensor, compute_device_type, compute_kernel)`` (TorchRec
    1.8 asks the sharder itself); TorchRec's ``ModuleSharder`` rule by default."""


SharderDataMap = dict[str, SharderData]


class CollectiveType(Enum):
    ALL_TO_ALL = "all_to_all"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_GATHER = "all_gather"
    ALL_REDUCE = "all_reduce"


class GeneralizedCommsBandwidth(abc.ABC):
    """Bandwidth (bytes/ms) of a collective over ``world_size`` ranks, ``local_world_size`` per
    host."""

    @abc.abstractmethod
    def get_bw(
        self, local_world_size: int, world_size: int, collective_type: CollectiveType
    ) -> float: ...

    @property
    @abc.abstractmethod
    def intra_host_bw(self) -> float: ...

    @property
    @abc.abstractmethod
    def inter_host_bw(self) -> float: ...


class BasicCommsBandwidths(GeneralizedCommsBandwidth):
    """Intra-host links inside one host, the NICs across hosts; an all-reduce uses one NIC per
    local rank."""

    def __init__(
        self,
        inter_host_bw: float = CROSS_NODE_BANDWIDTH,
        intra_host_bw: float = INTRA_NODE_BANDWIDTH,
    ) -> None:
        self.name = "BasicCommsBandwidths"
        self._inter_host_bw = inter_host_bw
        self._intra_host_bw = intra_host_bw

    @property
    def inter_host_bw(self) -> float:
        return self._inter_host_bw

    @property
    def intra_host_bw(self) -> float:
        return self._intra_host_bw

    def get_bw(
        self, local_world_size: int, world_size: int, collective_type: CollectiveType
    ) -> float:
        if collective_type == CollectiveType.ALL_REDUCE:
            return self.inter_host_bw * local_world_size
        return self.intra_host_bw if world_size <= local_world_size else self.inter_host_bw

    def __str__(self) -> str:
        return f"{self.name}: inter_host_bw={self.inter_host_bw}, intra_host_bw={self.intra_host_bw}"

    def __hash__(self) -> int:
        return hash((self._inter_host_bw, self._intra_host_bw))

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, BasicCommsBandwidths)
            and self._inter_host_bw == other._inter_host_bw
            and self._intra_host_bw == other._intra_host_bw
        )


class CustomTopologyData:
    """Per-rank capacities (``hbm_cap``, ``ddr_cap``, ``ssd_cap``: one value per rank)."""

    supported_fields = ["ddr_cap", "hbm_cap", "ssd_cap"]

    def __init__(self, data: dict[str, list[int]], world_size: int) -> None:
        unknown = [k for k in data if k not in self.supported_fields]
        if unknown:
            raise ValueError(f"CustomTopologyData: fields {unknown} are not supported; "
                             f"use {self.supported_fields}")
        wrong = {k: len(v) for k, v in data.items() if len(v) != world_size}
        if wrong:
            raise ValueError(f"CustomTopologyData: {wrong} values given; each field needs one "
                             f"per rank ({world_size})")
        self._data = data
        self._world_size = world_size

    def get_data(self, key: str) -> list[int]:
        if key not in self.supported_fields:
            raise ValueError(f"CustomTopologyData: {key!r} is not one of {self.supported_fields}")
        return self._data[key]

    def has_data(self, key: str) -> bool:
        return key in self._data


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
