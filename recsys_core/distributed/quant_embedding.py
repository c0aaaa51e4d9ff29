"""TorchRec's ``torchrec.distributed.quant_embedding`` path: the sharders of quantized (inference)
EmbeddingCollections, plain and behind managed collision.

As for quantized bag collections (``distributed.quant_embeddingbag``), shards go on the devices
of one process, one per rank of ``env`` (rank ``r`` is ``cuda:r`` for a CUDA device, the host for
CPU); tables are placed table-wise with the QUANT kernel (``recsys_core.quant.sharding``).
"""

from __future__ import annotations

from recsys_core.distributed.quant_embeddingbag import TableWiseQuantSharder
from recsys_core.quant.quant_sequence import (
    QuantEmbeddingCollection,
    QuantManagedCollisionEmbeddingCollection,
)
from recsys_core.quant.sharding import (
    ShardedQuantEmbeddingCollection,
    ShardedQuantManagedCollisionEmbeddingCollection,
)


class QuantEmbeddingCollectionSharder(TableWiseQuantSharder[QuantEmbeddingCollection]):
    """Places a QuantEmbeddingCollection's tables table-wise on the devices of one process (its
    sharded form: a ``ShardedQuantEmbeddingCollection``)."""

    @property
    def module_type(self) -> type[QuantEmbeddingCollection]:
        return QuantEmbeddingCollection


class QuantManagedCollisionEmbeddingCollectionSharder(QuantEmbeddingCollectionSharder):
    """Places a QuantManagedCollisionEmbeddingCollection's tables table-wise on the devices of
    one process; its (frozen) managed collision collection remaps ids on the input's device."""

    def __init__(
        self,
        e_sharder: QuantEmbeddingCollectionSharder | None = None,
        mc_sharder: object | None = None,
        *,
        fused_params: dict | None = None,
        shardable_params: list[str] | None = None,
    ) -> None:
        """``e_sharder``: its fused params are used (TorchRec's pair of sharders); ``mc_sharder``
        is accepted and not needed (the remapping runs unsharded, on the input's device)."""
        del mc_sharder
        if e_sharder is not None and fused_params is None:
            fused_params = e_sharder.fused_params
        super().__init__(fused_params=fused_params, shardable_params=shardable_params)

    @property
    def module_type(self) -> type[QuantManagedCollisionEmbeddingCollection]:
        return QuantManagedCollisionEmbeddingCollection


__all__ = [
    "QuantEmbeddingCollection",
    "QuantEmbeddingCollectionSharder",
    "QuantManagedCollisionEmbeddingCollection",
    "QuantManagedCollisionEmbeddingCollectionSharder",
    "ShardedQuantEmbeddingCollection",
    "ShardedQuantManagedCollisionEmbeddingCollection",
]
