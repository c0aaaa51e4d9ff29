"""TorchRec's ``torchrec.distributed.mc_embeddingbag`` path: sharding a
ManagedCollisionEmbeddingBagCollection (refused: see :mod:`recsys_core.distributed.mc_modules`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from recsys_core.distributed.embeddingbag import EmbeddingBagCollectionSharder
from recsys_core.distributed.mc_embedding_modules import (
    BaseManagedCollisionEmbeddingCollectionSharder,
    refuse_managed_collision,
)
from recsys_core.distributed.mc_modules import ManagedCollisionCollectionSharder
from recsys_core.distributed.types import QuantizedCommCodecs
from recsys_core.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection


class ShardedManagedCollisionEmbeddingBagCollection(nn.Module):
    """TorchRec's sharded managed-collision EBC; constructing one raises (not implemented)."""

    def __init__(self, module: ManagedCollisionEmbeddingBagCollection, *args: Any, **kwargs: Any) -> None:
        refuse_managed_collision(type(module).__name__)


class ManagedCollisionEmbeddingBagCollectionSharder(
    BaseManagedCollisionEmbeddingCollectionSharder[ManagedCollisionEmbeddingBagCollection]
):
    def __init__(
        self,
        ebc_sharder: EmbeddingBagCollectionSharder | None = None,
        mc_sharder: ManagedCollisionCollectionSharder | None = None,
        qcomm_codecs_registry: Mapping[str, QuantizedCommCodecs] | None = None,
    ) -> None:
        super().__init__(
            ebc_sharder or EmbeddingBagCollectionSharder(qcomm_codecs_registry=qcomm_codecs_registry),
            mc_sharder or ManagedCollisionCollectionSharder(),
            qcomm_codecs_registry=qcomm_codecs_registry,
        )

    @property
    def module_type(self) -> type[ManagedCollisionEmbeddingBagCollection]:
        return ManagedCollisionEmbeddingBagCollection


__all__ = [
    "ManagedCollisionEmbeddingBagCollectionSharder",
    "ShardedManagedCollisionEmbeddingBagCollection",
]
