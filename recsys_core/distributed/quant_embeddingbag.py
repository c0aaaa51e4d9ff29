"""TorchRec's ``torchrec.distributed.quant_embeddingbag`` path: the sharder of quantized
(inference) EmbeddingBagCollections.

Shards go on the devices of one process, one per rank of ``env`` (TorchRec's inference
sharding): rank ``r`` is ``cuda:r`` for a CUDA device, the host for CPU. Tables are placed
table-wise with the QUANT kernel (``recsys_core.inference.sharding``)."""

from __future__ import annotations

import torch

from recsys_core.distributed.embedding_types import BaseQuantEmbeddingSharder
from recsys_core.distributed.types import (
    EmbeddingModuleShardingPlan,
    ShardingEnv,
    ShardingType,
    rank_device,
)
from recsys_core.inference.quant_embedding import QuantEmbeddingBagCollection
from recsys_core.inference.sharding import ShardedQuantEmbeddingBagCollection


class QuantEmbeddingBagCollectionSharder(BaseQuantEmbeddingSharder[QuantEmbeddingBagCollection]):
    """Places a QuantEmbeddingBagCollection's tables table-wise on the devices of one process."""

    @property
    def module_type(self) -> type[QuantEmbeddingBagCollection]:
        return QuantEmbeddingBagCollection

    def sharding_types(self, compute_device_type: str) -> list[str]:
        """TABLE_WISE: the placement this library executes for quantized tables."""
        return [ShardingType.TABLE_WISE.value]

    def shard(
        self,
        module: QuantEmbeddingBagCollection,
        params: EmbeddingModuleShardingPlan,
        env: ShardingEnv,
        device: torch.device | None = None,
        module_fqn: str | None = None,
    ) -> ShardedQuantEmbeddingBagCollection:
        kind = torch.device(device or "cpu").type
        devices = [rank_device(kind, r) for r in range(env.world_size)]
        return ShardedQuantEmbeddingBagCollection(
            module, EmbeddingModuleShardingPlan(params), devices
        )


__all__ = ["QuantEmbeddingBagCollectionSharder"]
