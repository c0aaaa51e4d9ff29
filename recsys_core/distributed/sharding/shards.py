"""Shard geometry: which rows and columns of which table each rank holds, and the (feature,
shard) lookups a rank performs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from recsys_core.distributed.types import (
    ParameterSharding,
    ShardingType,
)
from recsys_core.modules.embedding_configs import BaseEmbeddingConfig, PoolingType


@dataclass(frozen=True)
class ShardSpec:
    """One shard of one table: ``table[row_offset : +rows, col_offset : +cols]`` on ``rank``."""

    table: str
    rank: int
    row_offset: int
    rows: int
    col_offset: int
    cols: int


@dataclass(frozen=True)
class ShardedTable:
    """A table with its plan entry and resolved shards.

    ``embedding_names`` name the table's outputs, one per feature: the feature's name, or
    ``<feature>@<table>`` for a feature several tables share (TorchRec's naming)."""

    config: BaseEmbeddingConfig
    sharding: ParameterSharding
    shards: tuple[ShardSpec, ...]
    embedding_names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.embedding_names:
            object.__setattr__(self, "embedding_names", tuple(self.config.feature_names))


def resolve_shards(
    config: BaseEmbeddingConfig,
    ps: ParameterSharding,
    world_size: int,
    embedding_names: Sequence[str] = (),
) -> ShardedTable:
    if ps.sharding_type is ShardingType.DATA_PARALLEL:
        ranks = ps.ranks or list(range(world_size))
        shards = tuple(
            ShardSpec(config.name, r, 0, config.num_embeddings, 0, config.embedding_dim)
            for r in ranks
        )
    else:
        shards = tuple(
            ShardSpec(
                config.name, m.rank, m.shard_offsets[0], m.shard_sizes[0],
                m.shard_offsets[1], m.shard_sizes[1],
            )
            for m in ps.shards
        )
    return ShardedTable(config, ps, shards, tuple(embedding_names))


@dataclass(frozen=True)
class Slot:
    """One (feature, shard) lookup performed on some rank."""

    feature: str
    shard: ShardSpec
    pooling: PoolingType

    @property
    def key(self) -> str:
        # unique even when one rank holds two column shards of the same table
        return f"{self.feature}@{self.shard.row_offset}:{self.shard.col_offset}"
