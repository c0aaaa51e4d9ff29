"""TorchRec's ``torchrec.distributed.mc_embedding`` path: sharding a
ManagedCollisionEmbeddingCollection (refused: see :mod:`recsys_core.distributed.mc_modules`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from recsys_core.distributed.embedding import EmbeddingCollectionSharder
from recsys_core.distributed.mc_embedding_modules import (
    BaseManagedCollisionEmbeddingCollectionSharder,
    refuse_managed_collision,
)
from recsys_core.distributed.mc_modules import ManagedCollisionCollectionSharder
from recsys_core.distributed.types import QuantizedCommCodecs
from recsys_core.modules.mc_embedding_modules import ManagedCollisionEmbeddingCollection


class ShardedManagedCollisionEmbeddingCollection(nn.Module):
    """TorchRec's sharded managed-collision EC; constructing one raises (not implemented)."""

    def __init__(self, module: ManagedCollisionEmbeddingCollection, *args: Any, **kwargs: Any) -> None:
        refuse_managed_collision(type(module).__name__)


class ManagedCollisionEmbeddingCollectionSharder(
    BaseManagedCollisionEmbeddingCollectionSharder[ManagedCollisionEmbeddingCollection]
):
    def __init__(
        self,
        ec_sharder: EmbeddingCollectionSharder | None = None,
        mc_sharder: ManagedCollisionCollectionSharder | None = None,
        qcomm_codecs_registry: Mapping[str, QuantizedCommCodecs] | None = None,
    ) -> None:
        super().__init__(
            ec_sharder or EmbeddingCollectionSharder(qcomm_codecs_registry=qcomm_codecs_registry),
            mc_sharder or ManagedCollisionCollectionSharder(),
            qcomm_codecs_registry=qcomm_codecs_registry,
        )

    @property
    def module_type(self) -> type[ManagedCollisionEmbeddingCollection]:
        return ManagedCollisionEmbeddingCollection


__all__ = [
    "ManagedCollisionEmbeddingCollectionSharder",
    "ShardedManagedCollisionEmbeddingCollection",
]
