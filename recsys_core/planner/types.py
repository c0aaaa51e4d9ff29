"""TorchRec's ``planner.types`` at its module path: re-exports only.

The values a TorchRec user imports from ``torchrec.distributed.planner.types``, from the modules
that hold them: the inputs (:class:`Topology` in ``topology.py``, :class:`ParameterConstraints`
and :class:`CacheParams` in ``constraints.py``, :class:`PlannerError` in ``errors.py``), the value
types (:class:`Storage`, :class:`Perf`, :class:`Shard` in ``storage.py``,
:class:`ShardingOption` in ``sharding_option.py``), the pluggable interfaces
(``interfaces.py``), the topology factory, TorchRec 1.9's request and result types
(``requests.py``, ``results.py``); and this library's search's own values (:class:`TableSpec`,
:class:`Candidate`, :class:`Placement`: ``search/types.py``).
"""

import logging  # noqa: F401  (TorchRec's tests patch planner.types.logging)

from recsys_core.kernels.config import EmbOptimType
from recsys_core.modules.embedding_configs import BaseEmbeddingConfig
from recsys_core.plan.sharder import Sharder
from recsys_core.plan.types import EmbeddingComputeKernel, ShardingPlan, ShardingType
from recsys_core.planner.comms import (
    BasicCommsBandwidths,
    CollectiveType,
    CustomTopologyData,
    GeneralizedCommsBandwidth,
)
from recsys_core.planner.constraints import CacheAlgorithm, CacheParams, ParameterConstraints
from recsys_core.planner.context_hash import (
    hash_planner_context_inputs,
    hash_planner_context_inputs_str,
    hash_sha256_str,
    hash_sha256_to_int,
    round_to_nearest,
)
from recsys_core.planner.errors import (
    PlannerContextFingerprintError,
    PlannerError,
    PlannerErrorType,
)
from recsys_core.planner.interfaces import (
    Enumerator,
    PartitionByType,
    Partitioner,
    PerfModel,
    PlanDebugStats,
    PlanLoader,
    Proposer,
    SharderData,
    SharderDataMap,
    ShardEstimator,
    Stats,
)
from recsys_core.planner.requests import (
    EmoConfig,
    PlannerConfig,
    PlannerVariant,
    ProposerConfig,
    ProposerGroup,
    ShardingPlanRequest,
    StorageReservationPolicy,
    TrainingFramework,
    TuneClfConfig,
)
from recsys_core.planner.results import (
    ModelArch,
    PlannerSessionContext,
    PlanReportMetadata,
    ShardDetail,
    SharderArch,
    ShardingOptionDetail,
    ShardingPlanResult,
    TableArch,
)
from recsys_core.planner.search.types import Candidate, Placement, TableSpec, cache_slots
from recsys_core.planner.sharding_option import ShardingOption
from recsys_core.planner.storage import DeviceHardware, Perf, Shard, Storage, Tier
from recsys_core.planner.storage_reservations import StorageReservation
from recsys_core.planner.topology import (
    DEFAULT_DDR_CAP,
    DEFAULT_HBM_CAP,
    GB,
    GIB,
    Topology,
)
from recsys_core.planner.topology_factory import (
    HardwareConfig,
    KernelConfig,
    TopologyConfigBase,
    TopologyFactory,
    TrainerConfig,
)

__all__ = [
    "ShardingPlan",  # TorchRec's planner.types re-exports it
    "DeviceHardware", "Perf", "PlannerErrorType", "Shard", "Storage", "Tier",
    "DEFAULT_DDR_CAP", "DEFAULT_HBM_CAP", "GB", "GIB",
    "CacheAlgorithm", "CacheParams", "ParameterConstraints", "Placement", "PlannerError",
    "Sharder", "Candidate", "TableSpec", "Topology", "cache_slots",
    "BasicCommsBandwidths", "CollectiveType", "CustomTopologyData", "Enumerator",
    "GeneralizedCommsBandwidth", "PartitionByType", "Partitioner", "PerfModel",
    "PlanDebugStats", "PlanLoader", "Proposer", "ShardEstimator", "SharderData",
    "SharderDataMap", "ShardingOption", "Stats", "StorageReservation",
    "hash_planner_context_inputs", "hash_planner_context_inputs_str", "hash_sha256_str",
    "hash_sha256_to_int", "round_to_nearest",
    "HardwareConfig", "KernelConfig", "TopologyConfigBase", "TopologyFactory", "TrainerConfig",
    "EmoConfig", "ModelArch", "PlanReportMetadata", "PlannerConfig",
    "PlannerContextFingerprintError", "PlannerSessionContext", "PlannerVariant",
    "ProposerConfig", "ProposerGroup", "ShardDetail", "ShardingOptionDetail",
    "ShardingPlanRequest", "ShardingPlanResult", "SharderArch", "StorageReservationPolicy",
    "TableArch", "TrainingFramework", "TuneClfConfig",
    # importable from here before (module attributes), kept
    "BaseEmbeddingConfig", "EmbOptimType", "EmbeddingComputeKernel", "ShardingType",
]
