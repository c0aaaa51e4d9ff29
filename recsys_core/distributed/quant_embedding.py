"""TorchRec's ``torchrec.distributed.quant_embedding`` path: the sharders of quantized (inference)
EmbeddingCollections, plain and behind managed collision.

As for quantized bag collections (``distributed.quant_embeddingbag``), shards go on the devices
of one process, one per rank of ``env`` (rank ``r`` is ``cuda:r`` for a CUDA device, the host for
CPU); tables are placed table-wise with the QUANT kernel (``recsys_core.quant.sharding``).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from recsys_core.distributed.embedding_types import BaseQuantEmbeddingSharder
from recsys_core.distributed.quant_embeddingbag import process_devices
from recsys_core.distributed.types import (
    EmbeddingModuleShardingPlan,
    ParameterSharding,
    ShardingEnv,
    ShardingType,
)
from recsys_core.quant.quant_sequence import (
    QuantEmbeddingCollection,
    QuantManagedCollisionEmbeddingCollection,
)
from recsys_core.quant.sharding import (
    ShardedQuantEmbeddingCollection,
    ShardedQuantManagedCollisionEmbeddingCollection,
    sharded_quant_module,
)


class QuantEmbeddingCollectionSharder(BaseQuantEmbeddingSharder[QuantEmbeddingCollection]):
    """Places a QuantEmbeddingCollection's tables table-wise on the devices of one process."""

    @property
    def module_type(self) -> type[QuantEmbeddingCollection]:
        return QuantEmbeddingCollection

    def sharding_types(self, compute_device_type: str) -> list[str]:
        """TABLE_WISE: the placement this library executes for quantized tables."""
        return [ShardingType.TABLE_WISE.value]

    def sharded_module(
        self,
        module: QuantEmbeddingCollection,
        params: Mapping[str, ParameterSharding],
        env: ShardingEnv,
        device: torch.device,
    ) -> ShardedQuantEmbeddingCollection:
        return sharded_quant_module(  # type: ignore[return-value]
            module, EmbeddingModuleShardingPlan(params), process_devices(env, device)
        )


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
