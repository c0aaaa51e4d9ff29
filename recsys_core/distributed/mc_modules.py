"""TorchRec's ``torchrec.distributed.mc_modules`` path: the sharders of managed-collision
(zero-collision hashing) collections.

TorchRec shards a ManagedCollisionCollection row-wise with its embedding tables: ids are routed
to the rank owning their range, remapped there, and looked up locally. This library does not
shard managed-collision modules: the sharders answer the planner's questions but ``shard``
raises an error saying so. Unsharded, such a module trains data-parallel under
DistributedModelParallel (its remapping state is each rank's own)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import NoReturn

import torch
from torch import nn

from recsys_core.distributed.embedding_types import BaseEmbeddingSharder
from recsys_core.distributed.types import (
    EmbeddingModuleShardingPlan,
    QuantizedCommCodecs,
    ShardingEnv,
    ShardingType,
)
from recsys_core.modules.mc_modules import ManagedCollisionCollection


def refuse_managed_collision(kind: str) -> NoReturn:
    raise ValueError(
        f"sharding a {kind} (managed collisions / zero-collision hashing) is not implemented "
        "by recsys_core; leave it out of the plan (it then trains data-parallel, each rank "
        "remapping its own ids) or use a plain EmbeddingBagCollection/EmbeddingCollection"
    )


class ManagedCollisionCollectionSharder(BaseEmbeddingSharder[ManagedCollisionCollection]):
    """TorchRec's sharder of a ManagedCollisionCollection (row-wise types)."""

    def __init__(
        self, qcomm_codecs_registry: Mapping[str, QuantizedCommCodecs] | None = None
    ) -> None:
        super().__init__(qcomm_codecs_registry=qcomm_codecs_registry)

    @property
    def module_type(self) -> type[ManagedCollisionCollection]:
        return ManagedCollisionCollection

    def sharding_types(self, compute_device_type: str) -> list[str]:
        return [ShardingType.ROW_WISE.value]

    def shardable_parameters(self, module: ManagedCollisionCollection) -> dict[str, nn.Parameter]:
        return {}

    def shard(
        self,
        module: ManagedCollisionCollection,
        params: EmbeddingModuleShardingPlan,
        env: ShardingEnv,
        device: torch.device | None = None,
        module_fqn: str | None = None,
    ) -> nn.Module:
        refuse_managed_collision("ManagedCollisionCollection")


class InferManagedCollisionCollectionSharder(ManagedCollisionCollectionSharder):
    """TorchRec's inference variant (same refusal)."""


__all__ = [
    "InferManagedCollisionCollectionSharder",
    "ManagedCollisionCollectionSharder",
    "refuse_managed_collision",
]
