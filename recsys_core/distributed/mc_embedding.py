"""TorchRec's ``torchrec.distributed.mc_embedding`` path: a ManagedCollisionEmbeddingCollection
sharded row-wise (see :mod:`recsys_core.distributed.mc_embedding_modules`); its forward returns
``(LazyAwaitable[dict[str, JaggedTensor]], LazyAwaitable[remapped KJT] | None)``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from recsys_core.distributed.embedding import (
    EmbeddingCollectionSharder,
    ShardedEmbeddingCollection,
)
from recsys_core.distributed.embedding_types import BaseEmbeddingSharder
from recsys_core.distributed.mc_embedding_modules import (
    BaseManagedCollisionEmbeddingCollectionSharder,
    BaseShardedManagedCollisionEmbeddingCollection,
)
from recsys_core.distributed.mc_modules import (
    EmbeddingCollectionContext,
    KJTList,
    ManagedCollisionCollectionSharder,
)
from recsys_core.distributed.types import (
    ParameterSharding,
    QuantizedCommCodecs,
    ShardingEnv,
)
from recsys_core.modules.mc_embedding_modules import ManagedCollisionEmbeddingCollection


@dataclass
class ManagedCollisionEmbeddingCollectionContext(EmbeddingCollectionContext):
    """TorchRec's forward context, with the remapped KJTs."""

    evictions_per_table: dict[str, torch.Tensor | None] | None = None
    remapped_kjt: KJTList | None = None


class ShardedManagedCollisionEmbeddingCollection(BaseShardedManagedCollisionEmbeddingCollection):
    """A ManagedCollisionEmbeddingCollection sharded row-wise."""

    def __init__(
        self,
        module: ManagedCollisionEmbeddingCollection,
        table_name_to_parameter_sharding: Mapping[str, ParameterSharding],
        ec_sharder: BaseEmbeddingSharder[Any],
        mc_sharder: ManagedCollisionCollectionSharder,
        env: ShardingEnv,
        device: torch.device,
    ) -> None:
        super().__init__(
            module, table_name_to_parameter_sharding, ec_sharder, mc_sharder, env, device
        )

    @property
    def _embedding_collection(self) -> ShardedEmbeddingCollection:
        return self._embedding_module  # type: ignore[return-value]

    def create_context(self) -> ManagedCollisionEmbeddingCollectionContext:
        return ManagedCollisionEmbeddingCollectionContext(sharding_contexts=[])


class ManagedCollisionEmbeddingCollectionSharder(
    BaseManagedCollisionEmbeddingCollectionSharder[ManagedCollisionEmbeddingCollection]
):
    """Shards ManagedCollisionEmbeddingCollections row-wise."""

    def __init__(
        self,
        ec_sharder: EmbeddingCollectionSharder | None = None,
        mc_sharder: ManagedCollisionCollectionSharder | None = None,
        fused_params: Mapping[str, Any] | None = None,
        qcomm_codecs_registry: Mapping[str, QuantizedCommCodecs] | None = None,
    ) -> None:
        # TorchRec's signature: ``fused_params`` goes to the default inner sharder
        super().__init__(
            ec_sharder or EmbeddingCollectionSharder(
                fused_params=fused_params, qcomm_codecs_registry=qcomm_codecs_registry
            ),
            mc_sharder or ManagedCollisionCollectionSharder(),
            qcomm_codecs_registry=qcomm_codecs_registry,
        )

    @property
    def module_type(self) -> type[ManagedCollisionEmbeddingCollection]:
        return ManagedCollisionEmbeddingCollection

    @property
    def sharded_module_type(self) -> type[nn.Module]:
        return ShardedManagedCollisionEmbeddingCollection


__all__ = [
    "KJTList",
    "ManagedCollisionEmbeddingCollectionContext",
    "ManagedCollisionEmbeddingCollectionSharder",
    "ShardedManagedCollisionEmbeddingCollection",
]
