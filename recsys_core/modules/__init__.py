"""Embedding modules and their configs."""

from recsys_core.modules.embedding_configs import (
    BaseEmbeddingConfig,
    DataType,
    EmbeddingBagConfig,
    EmbeddingConfig,
    PoolingType,
)
from recsys_core.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from recsys_core.modules.fused_embedding_modules import FusedEmbeddingBagCollection

__all__ = [
    "BaseEmbeddingConfig",
    "DataType",
    "EmbeddingBagCollection",
    "EmbeddingBagConfig",
    "EmbeddingCollection",
    "EmbeddingConfig",
    "FusedEmbeddingBagCollection",
    "PoolingType",
]
