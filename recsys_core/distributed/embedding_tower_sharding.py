"""TorchRec's ``torchrec.distributed.embedding_tower_sharding`` path: the sharders of
``EmbeddingTower`` and ``EmbeddingTowerCollection``.

TorchRec places each tower (its tables and its interaction module) on one rank and moves the
tower's input there. This library does not implement tower sharding: the sharders answer the
planner's questions (types, kernels) but :meth:`shard` raises an error saying so. Shard the
towers' EmbeddingBagCollections instead (their interaction modules then train data-parallel).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from recsys_core.distributed.embedding_types import BaseEmbeddingSharder, table_weights
from recsys_core.distributed.types import (
    ParameterSharding,
    QuantizedCommCodecs,
    ShardingEnv,
    ShardingType,
)
from recsys_core.modules.embedding_tower import EmbeddingTower, EmbeddingTowerCollection


def _refuse(kind: str) -> ValueError:
    return ValueError(
        f"sharding an {kind} (a tower's tables and interaction on one rank) is not implemented "
        "by recsys_core; shard the EmbeddingBagCollection/EmbeddingCollection inside each tower "
        "instead (the interaction module then trains data-parallel)"
    )


class EmbeddingTowerSharder(BaseEmbeddingSharder[EmbeddingTower]):
    """TorchRec's EmbeddingTower sharder (table-wise placement of the whole tower)."""

    def __init__(
        self,
        fused_params: Mapping[str, Any] | None = None,
        qcomm_codecs_registry: Mapping[str, QuantizedCommCodecs] | None = None,
    ) -> None:
        super().__init__(fused_params, qcomm_codecs_registry)

    @property
    def module_type(self) -> type[EmbeddingTower]:
        return EmbeddingTower

    def sharding_types(self, compute_device_type: str) -> list[str]:
        return [ShardingType.TABLE_WISE.value, ShardingType.COLUMN_WISE.value]

    def shardable_parameters(self, module: EmbeddingTower) -> dict[str, nn.Parameter]:
        """The tables of the tower's embedding module (not its interaction's weights)."""
        return table_weights(module.embedding)  # type: ignore[return-value]

    def sharded_module(
        self,
        module: EmbeddingTower,
        params: Mapping[str, ParameterSharding],
        env: ShardingEnv,
        device: torch.device,
    ) -> nn.Module:
        raise _refuse("EmbeddingTower")


class EmbeddingTowerCollectionSharder(BaseEmbeddingSharder[EmbeddingTowerCollection]):
    """TorchRec's EmbeddingTowerCollection sharder."""

    def __init__(
        self,
        fused_params: Mapping[str, Any] | None = None,
        qcomm_codecs_registry: Mapping[str, QuantizedCommCodecs] | None = None,
    ) -> None:
        super().__init__(fused_params, qcomm_codecs_registry)

    @property
    def module_type(self) -> type[EmbeddingTowerCollection]:
        return EmbeddingTowerCollection

    def sharding_types(self, compute_device_type: str) -> list[str]:
        return [ShardingType.TABLE_WISE.value, ShardingType.COLUMN_WISE.value]

    def shardable_parameters(self, module: EmbeddingTowerCollection) -> dict[str, nn.Parameter]:
        """The tables of every tower's embedding module (not the interactions' weights)."""
        out: dict[str, nn.Parameter] = {}
        for tower in module.towers:
            out.update(table_weights(tower.embedding))  # type: ignore[arg-type]
        return out

    def sharded_module(
        self,
        module: EmbeddingTowerCollection,
        params: Mapping[str, ParameterSharding],
        env: ShardingEnv,
        device: torch.device,
    ) -> nn.Module:
        raise _refuse("EmbeddingTowerCollection")


__all__ = ["EmbeddingTowerCollectionSharder", "EmbeddingTowerSharder"]
