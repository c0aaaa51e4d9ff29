"""The quantized sequence collections, at their former path: they live in
:mod:`recsys_core.quant.quant_sequence` (below the distributed runtime, whose quant sharders use
them); this module only re-exports."""

from recsys_core.quant.quant_sequence import (
    QuantEmbeddingCollection,
    QuantManagedCollisionEmbeddingCollection,
    QuantTBESequence,
    cast_values,
    sequence_lookup,
)

__all__ = [
    "QuantEmbeddingCollection",
    "QuantManagedCollisionEmbeddingCollection",
    "QuantTBESequence",
    "cast_values",
    "sequence_lookup",
]
