"""TorchRec's ``torchrec.distributed.embedding_lookup`` path: the grouped lookups a sharded
collection runs on each rank.

In this library one :class:`~recsys_core.distributed.sharding.local_kernels.LocalKernels` per sharding
strategy holds a rank's shards, one table-batched kernel per pooling type: TorchRec's
``GroupedPooledEmbeddingsLookup`` (pooled) and ``GroupedEmbeddingsLookup`` (sequence, whose ids
are looked up as bags of one). Its kernels and lookups are a
:class:`~recsys_core.kernels.batched.BatchedTables` (TorchRec's ``BatchedFusedEmbeddingBag``
and grouped lookups in one class), where the unsharded fused collections keep their tables too;
LocalKernels adds the shards' geometry, their initialization and the caches' upkeep."""

from __future__ import annotations

from recsys_core.distributed.sharding.local_kernels import LocalKernels
from recsys_core.plan.types import EmbeddingComputeKernel

GroupedPooledEmbeddingsLookup = LocalKernels
"""A rank's pooled lookups of one strategy (the same class: see the module docstring)."""

GroupedEmbeddingsLookup = LocalKernels
"""A rank's sequence lookups of one strategy (the same class: see the module docstring)."""


__all__ = ["EmbeddingComputeKernel", "GroupedEmbeddingsLookup", "GroupedPooledEmbeddingsLookup"]
