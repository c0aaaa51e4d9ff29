"""Inference: quantized embedding collections (FBGEMM int-n-bit tables) and their placement."""

from recsys_core.inference.quantize import quantize_inference_model, resolve_quant_dtype
from recsys_core.quant.quant_embedding import (
    QUANT_DATA_TYPES,
    QuantEmbeddingBagCollection,
    QuantTBEBag,
)
from recsys_core.quant.sharding import (
    ShardedQuantEmbeddingBagCollection,
    quant_table_bytes,
    quant_table_wise_plan,
    shard_quant_model,
)

__all__ = [
    "QUANT_DATA_TYPES",
    "QuantEmbeddingBagCollection",
    "QuantTBEBag",
    "ShardedQuantEmbeddingBagCollection",
    "quant_table_bytes",
    "quant_table_wise_plan",
    "quantize_inference_model",
    "resolve_quant_dtype",
    "shard_quant_model",
]
