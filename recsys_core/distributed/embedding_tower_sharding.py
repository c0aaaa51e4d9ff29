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

from recsys_core.distributed.embedding_types import BaseEmbeddingSharder, M, table_weights
from recsys_core.distributed.types import (
    ParameterSharding,
    QuantizedCommCodecs,
    ShardingEnv,
    ShardingType,
)
from recsys_core.modules.embedding_tower import EmbeddingTower, EmbeddingTowerCollection


class TowerSharderBase(BaseEmbeddingSharder[M]):
    """What both tower sharders answer alike: TorchRec's arguments, table-wise and column-wise
    types; :meth:`sharded_module` refuses (see the module docstring)."""

    def __init__(
        self,
        fused_params: Mapping[str, Any] | None = None,
        qcomm_codecs_registry: Mapping[str, QuantizedCommCodecs] | None = None,
    ) -> None:
        super().__init__(fused_params, qcomm_codecs_registry)

    def sharding_types(self, compute_device_type: str) -> list[str]:
        return [ShardingType.TABLE_WISE.value, ShardingType.COLUMN_WISE.value]

    def sharded_module(
        self, module: M, params: Mapping[str, ParameterSharding], env: ShardingEnv,
        device: torch.device,
    ) -> nn.Module:
        raise ValueError(
            f"sharding an {self.module_type.__name__} (a tower's tables and interaction on one "
            "rank) is not implemented by recsys_core; shard the "
            "EmbeddingBagCollection/EmbeddingCollection inside each tower instead (the "
            "interaction module then trains data-parallel)"
        )


class EmbeddingTowerSharder(TowerSharderBase[EmbeddingTower]):
    """TorchRec's EmbeddingTower sharder (table-wise placement of the whole tower)."""

    @property
    def module_type(self) -> type[EmbeddingTower]:
        return EmbeddingTower

    def shardable_parameters(self, module: EmbeddingTower) -> dict[str, nn.Parameter]:
        """The tables of the tower's embedding module (not its interaction's weights)."""
        return table_weights(module.embedding)  # type: ignore[return-value]


class EmbeddingTowerCollectionSharder(TowerSharderBase[EmbeddingTowerCollection]):
    """TorchRec's EmbeddingTowerCollection sharder."""

    @property
    def module_type(self) -> type[EmbeddingTowerCollection]:
        return EmbeddingTowerCollection

    def shardable_parameters(self, module: EmbeddingTowerCollection) -> dict[str, nn.Parameter]:
        """The tables of every tower's embedding module (not the interactions' weights)."""
        out: dict[str, nn.Parameter] = {}
        for tower in module.towers:
            out.update(table_weights(tower.embedding))  # type: ignore[arg-type]
        return out


__all__ = ["EmbeddingTowerCollectionSharder", "EmbeddingTowerSharder"]
