"""TorchRec's ``torchrec.distributed.quant_embeddingbag`` path: the sharder of quantized
(inference) EmbeddingBagCollections.

Shards go on the devices of one process, one per rank of ``env`` (TorchRec's inference
sharding): rank ``r`` is ``cuda:r`` for a CUDA device, the host for CPU. Tables are placed
table-wise with the QUANT kernel (``recsys_core.quant.sharding``)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from recsys_core.distributed.embedding_types import BaseQuantEmbeddingSharder, M
from recsys_core.distributed.types import (
    EmbeddingModuleShardingPlan,
    ParameterSharding,
    ShardingEnv,
    ShardingType,
    rank_device,
)
from recsys_core.quant.quant_embedding import (
    QuantEmbeddingBagCollection,
    QuantFeatureProcessedEmbeddingBagCollection,
)
from recsys_core.quant.sharding import (
    ShardedQuantEmbeddingBagCollection,
    ShardedQuantFeatureProcessedEmbeddingBagCollection,
    sharded_quant_module,
)


class TableWiseQuantSharder(BaseQuantEmbeddingSharder[M]):
    """What the quantized collections' sharders do alike: table-wise placement (the one this
    library executes for quantized tables) on the devices of one process
    (:func:`process_devices`), built by ``recsys_core.quant.sharding.sharded_quant_module``."""

    def sharding_types(self, compute_device_type: str) -> list[str]:
        """TABLE_WISE: the placement this library executes for quantized tables."""
        return [ShardingType.TABLE_WISE.value]

    def sharded_module(
        self, module: M, params: Mapping[str, ParameterSharding], env: ShardingEnv,
        device: torch.device,
    ) -> nn.Module:
        return sharded_quant_module(
            module, EmbeddingModuleShardingPlan(params), process_devices(env, device)
        )


class QuantEmbeddingBagCollectionSharder(TableWiseQuantSharder[QuantEmbeddingBagCollection]):
    """Places a QuantEmbeddingBagCollection's tables table-wise on the devices of one process
    (its sharded form: a ``ShardedQuantEmbeddingBagCollection``)."""

    @property
    def module_type(self) -> type[QuantEmbeddingBagCollection]:
        return QuantEmbeddingBagCollection


class QuantFeatureProcessedEmbeddingBagCollectionSharder(QuantEmbeddingBagCollectionSharder):
    """Places a quantized feature-processed collection's tables table-wise on the devices of one
    process; the processors run on the input's device."""

    @property
    def module_type(self) -> type[QuantFeatureProcessedEmbeddingBagCollection]:
        return QuantFeatureProcessedEmbeddingBagCollection


def process_devices(env: ShardingEnv, device: torch.device | None) -> list[torch.device]:
    """The device of each rank when one process drives all of them (inference sharding)."""
    kind = torch.device(device or "cpu").type
    return [rank_device(kind, r) for r in range(env.world_size)]


__all__ = [
    "QuantEmbeddingBagCollection",
    "QuantEmbeddingBagCollectionSharder",
    "QuantFeatureProcessedEmbeddingBagCollectionSharder",
    "ShardedQuantEmbeddingBagCollection",
    "ShardedQuantFeatureProcessedEmbeddingBagCollection",
    "process_devices",
]
