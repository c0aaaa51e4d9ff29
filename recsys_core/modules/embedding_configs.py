"""Table configurations: what a user declares about each embedding table.

TorchRec-compatible names and field order (``EmbeddingBagConfig(num_embeddings, embedding_dim,
name, ...)``); unlike TorchRec they are frozen and checked at construction, so a bad config fails
where it is written, not deep inside sharding.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum, unique

import torch


@unique
class PoolingType(Enum):
    """How the rows looked up for one bag are reduced to one vector."""

    SUM = "SUM"
    MEAN = "MEAN"
    NONE = "NONE"


@unique
class DataType(Enum):
    """Storage precision of an embedding table."""

    FP32 = "FP32"
    FP16 = "FP16"
    BF16 = "BF16"
    INT8 = "INT8"
    INT4 = "INT4"
    INT2 = "INT2"
    UINT8 = "UINT8"

    def __str__(self) -> str:
        return self.value


DATA_TYPE_BITS: dict[DataType, int] = {
    DataType.FP32: 32,
    DataType.FP16: 16,
    DataType.BF16: 16,
    DataType.INT8: 8,
    DataType.UINT8: 8,
    DataType.INT4: 4,
    DataType.INT2: 2,
}


@dataclass(frozen=True)
class BaseEmbeddingConfig:
    """Fields shared by pooled and unpooled tables.

    Attributes:
        num_embeddings: rows in the table (ids must lie in ``[0, num_embeddings)``).
        embedding_dim: width of each row.
        name: unique table name; it names the parameter ``embedding_bags.<name>.weight``.
        data_type: storage precision (training uses FP32; quantized types are for inference).
        feature_names: the KJT keys looked up in this table; several features may share a table.
            Empty means ``[name]``.
        weight_init_max / weight_init_min: uniform init bounds; default ``±sqrt(1/num_embeddings)``.
        num_embeddings_post_pruning: rows kept after pruning (inference), if pruned.
        init_fn: optional callable that fills the weight in place (used instead of uniform init).
        need_pos: whether the features carry positions (kept for TorchRec compatibility).
    """

    num_embeddings: int
    embedding_dim: int
    name: str = ""
    data_type: DataType = DataType.FP32
    feature_names: list[str] = field(default_factory=list)
    weight_init_max: float | None = None
    weight_init_min: float | None = None
    num_embeddings_post_pruning: int | None = None
    init_fn: Callable[[torch.Tensor], torch.Tensor | None] | None = None
    need_pos: bool = False

    def __post_init__(self) -> None:
        where = f"table {self.name!r}" if self.name else "an embedding config"
        if not self.name:
            raise ValueError("embedding config has an empty name: give every table a unique name")
        if isinstance(self.num_embeddings, bool) or not isinstance(self.num_embeddings, int):
            raise ValueError(f"{where}: num_embeddings must be an int, got {self.num_embeddings!r}")
        if self.num_embeddings <= 0:
            raise ValueError(f"{where}: num_embeddings must be > 0, got {self.num_embeddings}")
        if isinstance(self.embedding_dim, bool) or not isinstance(self.embedding_dim, int):
            raise ValueError(f"{where}: embedding_dim must be an int, got {self.embedding_dim!r}")
        if self.embedding_dim <= 0:
            raise ValueError(f"{where}: embedding_dim must be > 0, got {self.embedding_dim}")
        if not isinstance(self.data_type, DataType):
            raise ValueError(f"{where}: data_type must be a DataType, got {self.data_type!r}")
        if isinstance(self.feature_names, str):
            raise ValueError(
                f"{where}: feature_names must be a list of names, got the string "
                f"{self.feature_names!r}; write feature_names=[{self.feature_names!r}]"
            )
        names = list(self.feature_names) or [self.name]
        if len(set(names)) != len(names):
            raise ValueError(f"{where}: feature_names has duplicates: {names}")
        object.__setattr__(self, "feature_names", names)
        lo, hi = self.get_weight_init_min(), self.get_weight_init_max()
        if lo > hi:
            raise ValueError(f"{where}: weight_init_min {lo} is greater than weight_init_max {hi}")

    @property
    def num_features(self) -> int:
        return len(self.feature_names)

    def get_weight_init_max(self) -> float:
        if self.weight_init_max is not None:
            return float(self.weight_init_max)
        return math.sqrt(1.0 / self.num_embeddings)

    def get_weight_init_min(self) -> float:
        if self.weight_init_min is not None:
            return float(self.weight_init_min)
        return -math.sqrt(1.0 / self.num_embeddings)

    def init_weight_(self, weight: torch.Tensor) -> None:
        """Fill ``weight`` (shape ``[num_embeddings, embedding_dim]``) with this table's init."""
        with torch.no_grad():
            if self.init_fn is not None:
                self.init_fn(weight)
            else:
                weight.uniform_(self.get_weight_init_min(), self.get_weight_init_max())


@dataclass(frozen=True)
class EmbeddingBagConfig(BaseEmbeddingConfig):
    """A pooled table (one vector per bag). ``pooling`` is SUM or MEAN."""

    pooling: PoolingType = PoolingType.SUM

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.pooling not in (PoolingType.SUM, PoolingType.MEAN):
            raise ValueError(
                f"table {self.name!r}: pooling must be PoolingType.SUM or PoolingType.MEAN for an "
                f"EmbeddingBagConfig, got {self.pooling!r}; use EmbeddingConfig for unpooled lookups"
            )


@dataclass(frozen=True)
class EmbeddingConfig(BaseEmbeddingConfig):
    """An unpooled (sequence) table: one vector per id."""


def table_dtype(config: BaseEmbeddingConfig) -> torch.dtype:
    """The weight dtype of a table in the unsharded collections (TorchRec's rule: FP32 tables are
    float32, every other data_type is stored as float16 until quantized)."""
    return torch.float32 if config.data_type is DataType.FP32 else torch.float16


def get_embedding_names_by_table(tables: Sequence[BaseEmbeddingConfig]) -> list[list[str]]:
    """Each table's output names, in table then feature order (TorchRec's names).

    A feature listed by one table keeps its name; a feature listed by several tables is looked up
    in each and its outputs are named ``<feature>@<table>``::

        t1: ["f1", "f2"]   t2: ["f1"]   ->   [["f1@t1", "f2"], ["f1@t2"]]
    """
    counts: dict[str, int] = {}
    for config in tables:
        for feature in config.feature_names:
            counts[feature] = counts.get(feature, 0) + 1
    return [
        [f"{f}@{config.name}" if counts[f] > 1 else f for f in config.feature_names]
        for config in tables
    ]


def check_table_names(tables: Sequence[BaseEmbeddingConfig], module: str) -> None:
    """Table names must be unique across a collection (features may be shared)."""
    seen: set[str] = set()
    for config in tables:
        if config.name in seen:
            raise ValueError(f"{module}: two tables are named {config.name!r}; names must be unique")
        seen.add(config.name)


def check_unique_tables(tables: Sequence[BaseEmbeddingConfig], module: str) -> None:
    """Table names and feature names must be unique across a collection (for modules that do
    not support a feature shared by several tables)."""
    seen_tables: set[str] = set()
    seen_features: dict[str, str] = {}
    for config in tables:
        if config.name in seen_tables:
            raise ValueError(f"{module}: two tables are named {config.name!r}; names must be unique")
        seen_tables.add(config.name)
        for feature in config.feature_names:
            if feature in seen_features:
                raise ValueError(
                    f"{module}: feature {feature!r} is listed by tables {seen_features[feature]!r} "
                    f"and {config.name!r}; a feature may feed only one table"
                )
            seen_features[feature] = config.name
