"""The quantized pooled collections, at their former path: they live in
:mod:`recsys_core.quant.quant_embedding` (below the distributed runtime, whose quant sharders
use them); this module only re-exports."""

from recsys_core.quant.quant_embedding import (
    OUTPUT_DTYPES,
    QUANT_DATA_TYPES,
    QuantEmbeddingBagCollection,
    QuantFeatureProcessedEmbeddingBagCollection,
    QuantTableWeight,
    QuantTBEBag,
    copy_quant_rows,
    pooled_lookup,
    qconfig_dtypes,
    quant_weight_type,
    stored_rows,
)

__all__ = [
    "OUTPUT_DTYPES",
    "QUANT_DATA_TYPES",
    "QuantEmbeddingBagCollection",
    "QuantFeatureProcessedEmbeddingBagCollection",
    "QuantTBEBag",
    "QuantTableWeight",
    "copy_quant_rows",
    "pooled_lookup",
    "qconfig_dtypes",
    "quant_weight_type",
    "stored_rows",
]
