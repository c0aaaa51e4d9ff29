"""Plan data: sharding types, parameter shardings, module and model plans, plan generators and
their validation, the sharding environment and the sharder interface.

The layer below both the planner (which produces plans) and the distributed runtime (which
executes them): it imports only ``recsys_core.modules`` and torch, so neither of them imports
the other to read a plan. ``recsys_core.distributed.types`` and
``recsys_core.distributed.sharding_plan`` re-export these names under TorchRec's module paths.
"""

from recsys_core.plan.env import ShardingEnv
from recsys_core.plan.generators import (
    ParameterShardingGenerator,
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_blocks,
    row_wise,
    table_column_wise,
    table_row_wise,
    table_wise,
)
from recsys_core.plan.params import BoundsCheckMode, CacheAlgorithm, CacheParams, KeyValueParams
from recsys_core.plan.sharder import Sharder
from recsys_core.plan.spec import EnumerableShardingSpec
from recsys_core.plan.types import (
    EmbeddingComputeKernel,
    EmbeddingModuleShardingPlan,
    ParameterSharding,
    ShardingPlan,
    ShardingType,
    ShardMetadata,
    device_placement,
)
from recsys_core.plan.validation import TRAINING_KERNELS, validate_module_sharding_plan

__all__ = [
    "BoundsCheckMode",
    "CacheAlgorithm",
    "CacheParams",
    "EnumerableShardingSpec",
    "KeyValueParams",
    "TRAINING_KERNELS",
    "EmbeddingComputeKernel",
    "EmbeddingModuleShardingPlan",
    "ParameterSharding",
    "ParameterShardingGenerator",
    "Sharder",
    "ShardMetadata",
    "ShardingEnv",
    "ShardingPlan",
    "ShardingType",
    "column_wise",
    "construct_module_sharding_plan",
    "data_parallel",
    "device_placement",
    "row_blocks",
    "row_wise",
    "table_column_wise",
    "table_row_wise",
    "table_wise",
    "validate_module_sharding_plan",
]
