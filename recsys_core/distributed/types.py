"""TorchRec's ``torchrec.distributed.types`` path for the plan data (re-exported).

The definitions live in :mod:`recsys_core.plan`, the layer below the planner and the runtime.
"""

from recsys_core.distributed.awaitable import Awaitable, LazyAwaitable, LazyNoWait
from recsys_core.distributed.qcomm_types import (
    CommOp,
    NoOpQuantizedCommCodec,
    QuantizedCommCodec,
    QuantizedCommCodecs,
)
from recsys_core.plan.env import ShardingEnv
from recsys_core.plan.params import BoundsCheckMode, CacheAlgorithm, CacheParams, KeyValueParams
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

__all__ = [
    "Awaitable",
    "LazyAwaitable",
    "LazyNoWait",
    "BoundsCheckMode",
    "CacheAlgorithm",
    "CacheParams",
    "CommOp",
    "NoOpQuantizedCommCodec",
    "QuantizedCommCodec",
    "QuantizedCommCodecs",
    "EnumerableShardingSpec",
    "KeyValueParams",
    "EmbeddingComputeKernel",
    "EmbeddingModuleShardingPlan",
    "ParameterSharding",
    "ShardMetadata",
    "ShardingEnv",
    "ShardingPlan",
    "ShardingType",
    "device_placement",
]
