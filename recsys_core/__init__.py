"""recsys_core: TorchRec-compatible sparse primitives on FBGEMM kernels."""

from recsys_core.kernels.config import EmbOptimType, KernelBackend
from recsys_core.kernels.tbe import IdOutOfRangeError
from recsys_core.modules import (
    DataType,
    EmbeddingBagCollection,
    EmbeddingBagCollectionInterface,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    FusedEmbeddingBagCollection,
    PoolingType,
)
from recsys_core.sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor

__version__ = "0.1.0"

__all__ = [
    "DataType",
    "EmbOptimType",
    "EmbeddingBagCollection",
    "EmbeddingBagCollectionInterface",
    "EmbeddingBagConfig",
    "EmbeddingCollection",
    "EmbeddingConfig",
    "FusedEmbeddingBagCollection",
    "IdOutOfRangeError",
    "JaggedTensor",
    "KernelBackend",
    "KeyedJaggedTensor",
    "KeyedTensor",
    "PoolingType",
]
