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
from recsys_core.distributed.fused_embeddingbag import (
    FusedEmbeddingBagCollectionSharder,
    ShardedFusedEmbeddingBagCollection,
)
from recsys_core.distributed.model_parallel import DistributedModelParallel, get_default_sharders
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
from recsys_core.distributed.table_init import SeededUniformInit, TableInitializer, TableRegion
from recsys_core.distributed.train_pipeline import (
    TrainPipelineBase,
    TrainPipelineSparseDist,
    pipelined_batches,
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
    "FusedEmbeddingBagCollectionSharder",
    "LazyAwaitable",
    "LazyNoWait",
    "ParameterSharding",
    "SeededUniformInit",
    "ShardMetadata",
    "ShardedEmbeddingBagCollection",
    "ShardedEmbeddingCollection",
    "ShardedFusedEmbeddingBagCollection",
    "ShardingEnv",
    "ShardingPlan",
    "ShardingType",
    "TableInitializer",
    "TableRegion",
    "column_wise",
    "construct_module_sharding_plan",
    "data_parallel",
    "get_default_sharders",
    "pipelined_batches",
    "TrainPipelineBase",
    "TrainPipelineSparseDist",
    "row_wise",
    "table_column_wise",
    "table_row_wise",
    "table_wise",
    "validate_module_sharding_plan",
]
