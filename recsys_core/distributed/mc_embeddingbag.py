"""TorchRec's ``torchrec.distributed.mc_embeddingbag`` path: a
ManagedCollisionEmbeddingBagCollection sharded row-wise (see
:mod:`recsys_core.distributed.mc_embedding_modules`)::

    plan = construct_module_sharding_plan(
        mc_ebc, {"t0": row_wise(), "t1": row_wise()}, world_size=2,
        sharder=ManagedCollisionEmbeddingBagCollectionSharder(),
    )
    model = DistributedModelParallel(Model(mc_ebc), plan=ShardingPlan({"mc_ebc": plan}))
    embeddings, remapped = model.module.mc_ebc(features)   # LazyAwaitables
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from recsys_core.distributed.embedding_types import BaseEmbeddingSharder
from recsys_core.distributed.embeddingbag import (
    EmbeddingBagCollectionSharder,
    ShardedEmbeddingBagCollection,
)
from recsys_core.distributed.fused_embeddingbag import FusedEmbeddingBagCollectionSharder
from recsys_core.distributed.mc_embedding_modules import (
    BaseManagedCollisionEmbeddingCollectionSharder,
    BaseShardedManagedCollisionEmbeddingCollection,
)
from recsys_core.distributed.mc_modules import ManagedCollisionCollectionSharder
from recsys_core.distributed.types import (
    ParameterSharding,
    QuantizedCommCodecs,
    ShardingEnv,
)
from recsys_core.modules.fused_embedding_modules import FusedEmbeddingBagCollection
from recsys_core.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection


class ShardedManagedCollisionEmbeddingBagCollection(BaseShardedManagedCollisionEmbeddingCollection):
    """A ManagedCollisionEmbeddingBagCollection sharded row-wise: ``forward(features)`` ->
    ``(LazyAwaitable[KeyedTensor], LazyAwaitable[remapped KJT] | None)``."""

    def __init__(
        self,
        module: ManagedCollisionEmbeddingBagCollection,
        table_name_to_parameter_sharding: Mapping[str, ParameterSharding],
        ebc_sharder: BaseEmbeddingSharder[Any],
        mc_sharder: ManagedCollisionCollectionSharder,
        env: ShardingEnv,
        device: torch.device,
    ) -> None:
        super().__init__(
            module, table_name_to_parameter_sharding, ebc_sharder, mc_sharder, env, device
        )

    @property
    def _embedding_bag_collection(self) -> ShardedEmbeddingBagCollection:
        return self._embedding_module  # type: ignore[return-value]


class ManagedCollisionEmbeddingBagCollectionSharder(
    BaseManagedCollisionEmbeddingCollectionSharder[ManagedCollisionEmbeddingBagCollection]
):
    """Shards ManagedCollisionEmbeddingBagCollections row-wise. ``ebc_sharder`` shards the
    embedding bags (a FusedEmbeddingBagCollection inside is sharded with its own optimizer)."""

    def __init__(
        self,
        ebc_sharder: EmbeddingBagCollectionSharder | None = None,
        mc_sharder: ManagedCollisionCollectionSharder | None = None,
        fused_params: Mapping[str, Any] | None = None,
        qcomm_codecs_registry: Mapping[str, QuantizedCommCodecs] | None = None,
    ) -> None:
        # TorchRec's signature: ``fused_params`` goes to the default inner sharder
        super().__init__(
            ebc_sharder or EmbeddingBagCollectionSharder(
                fused_params=fused_params, qcomm_codecs_registry=qcomm_codecs_registry
            ),
            mc_sharder or ManagedCollisionCollectionSharder(),
            qcomm_codecs_registry=qcomm_codecs_registry,
        )

    def _embedding_sharder(
        self, module: ManagedCollisionEmbeddingBagCollection
    ) -> BaseEmbeddingSharder[Any]:
        """``ebc_sharder``, or for a FusedEmbeddingBagCollection inside, its own sharder (the
        module carries its optimizer)."""
        if isinstance(module._embedding_module, FusedEmbeddingBagCollection):
            return FusedEmbeddingBagCollectionSharder(
                qcomm_codecs_registry=self.qcomm_codecs_registry
            )
        return self._e_sharder

    @property
    def module_type(self) -> type[ManagedCollisionEmbeddingBagCollection]:
        return ManagedCollisionEmbeddingBagCollection

    @property
    def sharded_module_type(self) -> type[nn.Module]:
        return ShardedManagedCollisionEmbeddingBagCollection


__all__ = [
    "ManagedCollisionEmbeddingBagCollectionSharder",
    "ShardedManagedCollisionEmbeddingBagCollection",
]
