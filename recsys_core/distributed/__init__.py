"""Model parallelism: sharding types, plans, sharders and DistributedModelParallel."""

from recsys_core.distributed.awaitable import Awaitable, LazyAwaitable, LazyNoWait
from recsys_core.distributed.embedding import (
    EmbeddingCollectionSharder,
    ShardedEmbeddingCollection,
)
from recsys_core.distributed.embeddingbag import (
    EmbeddingBagCollectionSharder,
    ShardedEmbeddingBagCollection,
)
from recsys_core.distributed.model_parallel import DistributedModelParallel
from recsys_core.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_column_wise,
    table_row_wise,
    table_wise,
    validate_module_sharding_plan,
)
from recsys_core.distributed.types import (
    EmbeddingComputeKernel,
    EmbeddingModuleShardingPlan,
    ParameterSharding,
    ShardingEnv,
    ShardingPlan,
    ShardingType,
    ShardMetadata,
)

__all__ = [
    "Awaitable",
    "DistributedModelParallel",
    "EmbeddingBagCollectionSharder",
    "EmbeddingCollectionSharder",
    "EmbeddingComputeKernel",
    "EmbeddingModuleShardingPlan",
    "LazyAwaitable",
    "LazyNoWait",
    "ParameterSharding",
    "ShardMetadata",
    "ShardedEmbeddingBagCollection",
    "ShardedEmbeddingCollection",
    "ShardingEnv",
    "ShardingPlan",
    "ShardingType",
    "column_wise",
    "construct_module_sharding_plan",
    "data_parallel",
    "row_wise",
    "table_column_wise",
    "table_row_wise",
    "table_wise",
    "validate_module_sharding_plan",
]
