"""Embedding modules and their configs."""

from recsys_core.modules.embedding_configs import (
    BaseEmbeddingConfig,
    DataType,
    EmbeddingBagConfig,
    EmbeddingConfig,
    PoolingType,
    get_embedding_names_by_table,
)
from recsys_core.modules.embedding_modules import (
    EmbeddingBagCollection,
    EmbeddingBagCollectionInterface,
    EmbeddingCollection,
    EmbeddingCollectionInterface,
)
from recsys_core.modules.fused_embedding_modules import (
    FusedEmbeddingBagCollection,
    FusedEmbeddingCollection,
    fuse_embedding_optimizer,
)
from recsys_core.modules.mc_embedding_modules import (
    ManagedCollisionEmbeddingBagCollection,
    ManagedCollisionEmbeddingCollection,
)
from recsys_core.modules.mc_modules import (
    ManagedCollisionCollection,
    ManagedCollisionModule,
    MCHManagedCollisionModule,
)

__all__ = [
    "BaseEmbeddingConfig",
    "DataType",
    "EmbeddingBagCollection",
    "EmbeddingBagCollectionInterface",
    "EmbeddingBagConfig",
    "EmbeddingCollection",
    "EmbeddingCollectionInterface",
    "EmbeddingConfig",
    "FusedEmbeddingBagCollection",
    "FusedEmbeddingCollection",
    "MCHManagedCollisionModule",
    "ManagedCollisionCollection",
    "ManagedCollisionEmbeddingBagCollection",
    "ManagedCollisionEmbeddingCollection",
    "ManagedCollisionModule",
    "PoolingType",
    "fuse_embedding_optimizer",
    "get_embedding_names_by_table",
]
