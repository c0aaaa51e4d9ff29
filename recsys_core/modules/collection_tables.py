"""TorchRec's questions about a collection's tables, answered once for every collection.

The plain, fused and quantized collections (and the quantized sharded ones) answer
``embedding_bag_configs()`` / ``is_weighted()`` (pooled) or ``embedding_configs()``,
``embedding_names_by_table()``, ``embedding_dim()``, ``need_indices()`` (unpooled) from the same
state. Each derives from the class of its kind below and sets, in its ``__init__``, the
attributes that class names (TorchRec's names for them). Results are copies: a caller may
change them without changing the collection.

The attributes are declared for type checkers only: TorchScript reads a module's class
annotations as its attributes' types, and configs are not TorchScript types.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from recsys_core.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig


class PooledCollectionTables:
    """The tables of a pooled collection: ``_embedding_bag_configs`` (its configs) and
    ``_is_weighted`` (whether lookups take per-id weights)."""

    if TYPE_CHECKING:
        _embedding_bag_configs: list[EmbeddingBagConfig]
        _is_weighted: bool

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return list(self._embedding_bag_configs)

    def is_weighted(self) -> bool:
        return self._is_weighted


class SequenceCollectionTables:
    """The tables of an unpooled collection: ``_embedding_configs`` (its configs),
    ``_embedding_names_by_table`` (each table's output names), ``_embedding_dim`` (the one dim
    all tables share) and ``_need_indices`` (whether outputs carry the ids as weights)."""

    if TYPE_CHECKING:
        _embedding_configs: list[EmbeddingConfig]
        _embedding_names_by_table: list[list[str]]
        _embedding_dim: int
        _need_indices: bool

    def embedding_configs(self) -> list[EmbeddingConfig]:
        return list(self._embedding_configs)

    def embedding_names_by_table(self) -> list[list[str]]:
        return [list(names) for names in self._embedding_names_by_table]

    def embedding_dim(self) -> int:
        return self._embedding_dim

    def need_indices(self) -> bool:
        return self._need_indices
