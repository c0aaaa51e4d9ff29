"""The one-process placement of quantized tables, at their former path: they live in
:mod:`recsys_core.quant.sharding` (below the distributed runtime, whose quant sharders use
them); this module only re-exports."""

from recsys_core.quant.sharding import (
    ShardedQuantEmbeddingBagCollection,
    ShardedQuantEmbeddingCollection,
    ShardedQuantFeatureProcessedEmbeddingBagCollection,
    ShardedQuantManagedCollisionEmbeddingCollection,
    quant_table_bytes,
    quant_table_wise_plan,
    shard_quant_model,
    sharded_quant_module,
)

__all__ = [
    "ShardedQuantEmbeddingBagCollection",
    "ShardedQuantEmbeddingCollection",
    "ShardedQuantFeatureProcessedEmbeddingBagCollection",
    "ShardedQuantManagedCollisionEmbeddingCollection",
    "quant_table_bytes",
    "quant_table_wise_plan",
    "shard_quant_model",
    "sharded_quant_module",
]
