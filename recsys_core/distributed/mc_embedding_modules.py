"""TorchRec's ``torchrec.distributed.mc_embedding_modules`` path: the common part of the
managed-collision collection sharders (an embedding sharder and a collision sharder together).
Sharding itself is refused (see :mod:`recsys_core.distributed.mc_modules`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NoReturn, TypeVar

import torch
from torch import nn

from recsys_core.distributed.embedding_types import BaseEmbeddingSharder
from recsys_core.distributed.mc_modules import ManagedCollisionCollectionSharder
from recsys_core.distributed.types import (
    EmbeddingModuleShardingPlan,
    QuantizedCommCodecs,
    ShardingEnv,
)

M = TypeVar("M", bound=nn.Module)


def refuse_managed_collision(kind: str) -> NoReturn:
    raise ValueError(
        f"sharding a {kind} (managed collisions / zero-collision hashing) is not implemented "
        "by recsys_core; leave it out of the plan (it then trains data-parallel, each rank "
        "remapping its own ids) or use a plain EmbeddingBagCollection/EmbeddingCollection"
    )


class BaseManagedCollisionEmbeddingCollectionSharder(BaseEmbeddingSharder[M]):
    """Pairs the embedding collection's sharder (``_e_sharder``) with the collision module's
    (``_mc_sharder``): the sharding types both accept, the embedding sharder's kernels,
    parameters and fused parameters."""

    def __init__(
        self,
        e_sharder: BaseEmbeddingSharder[Any],
        mc_sharder: ManagedCollisionCollectionSharder,
        qcomm_codecs_registry: Mapping[str, QuantizedCommCodecs] | None = None,
    ) -> None:
        super().__init__(qcomm_codecs_registry=qcomm_codecs_registry)
        self._e_sharder = e_sharder
        self._mc_sharder = mc_sharder

    def shardable_parameters(self, module: M) -> dict[str, nn.Parameter]:
        return self._e_sharder.shardable_parameters(module._embedding_module)  # type: ignore[attr-defined]

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        return self._e_sharder.compute_kernels(sharding_type, compute_device_type)

    def sharding_types(self, compute_device_type: str) -> list[str]:
        mc = set(self._mc_sharder.sharding_types(compute_device_type))
        return [t for t in self._e_sharder.sharding_types(compute_device_type) if t in mc]

    @property
    def fused_params(self) -> dict[str, Any] | None:
        return self._e_sharder.fused_params

    def shard(
        self,
        module: M,
        params: EmbeddingModuleShardingPlan,
        env: ShardingEnv,
        device: torch.device | None = None,
        module_fqn: str | None = None,
    ) -> nn.Module:
        refuse_managed_collision(type(module).__name__)


__all__ = ["BaseManagedCollisionEmbeddingCollectionSharder", "refuse_managed_collision"]
