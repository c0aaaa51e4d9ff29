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
from typing import Any, NamedTuple

import torch
from torch import nn

from recsys_core.types import DataType


@unique
class PoolingType(Enum):
    """How the rows looked up for one bag are reduced to one vector."""

    SUM = "SUM"
    MEAN = "MEAN"
    NONE = "NONE"


class ShardingType(Enum):
    """TorchRec's well-known sharding types at the config level (same values as
    ``recsys_core.distributed.ShardingType``; modules must not import the distributed layer)."""

    DATA_PARALLEL = "data_parallel"
    TABLE_WISE = "table_wise"
    COLUMN_WISE = "column_wise"
    ROW_WISE = "row_wise"
    TABLE_ROW_WISE = "table_row_wise"
    TABLE_COLUMN_WISE = "table_column_wise"


DATA_TYPE_BITS: dict[DataType, int] = {
    DataType.FP32: 32,
    DataType.FP16: 16,
    DataType.BF16: 16,
    DataType.INT64: 64,
    DataType.INT32: 32,
    DataType.INT8: 8,
    DataType.UINT8: 8,
    DataType.NFP8: 8,
    DataType.INT4: 4,
    DataType.INT2: 2,
}
DATA_TYPE_NUM_BITS = DATA_TYPE_BITS  # TorchRec's name

_TORCH_DTYPES: dict[DataType, torch.dtype] = {
    DataType.FP32: torch.float32,
    DataType.FP16: torch.float16,
    DataType.BF16: torch.bfloat16,
    DataType.NFP8: torch.float8_e4m3fn,
    DataType.INT64: torch.int64,
    DataType.INT32: torch.int32,
    DataType.INT8: torch.int8,
    DataType.UINT8: torch.uint8,
    DataType.INT4: torch.quint4x2,
    DataType.INT2: torch.quint2x4,
}
# Several torch dtypes name one DataType (the quantized 8-bit ones are INT8).
_DATA_TYPES: dict[torch.dtype, DataType] = {
    **{dtype: data_type for data_type, dtype in _TORCH_DTYPES.items()},
    torch.quint8: DataType.INT8,
    torch.qint8: DataType.INT8,
}


def data_type_to_dtype(data_type: DataType) -> torch.dtype:
    """The torch dtype of a DataType (INT4/INT2 are torch's packed ``quint4x2``/``quint2x4``)."""
    dtype = _TORCH_DTYPES.get(DataType(data_type.value))
    if dtype is None:
        raise ValueError(f"DataType {data_type} cannot be converted to dtype")
    return dtype


def dtype_to_data_type(dtype: torch.dtype) -> DataType:
    """The DataType of a torch dtype; ``ValueError`` for one without a DataType (e.g. float64)."""
    data_type = _DATA_TYPES.get(dtype)
    if data_type is None:
        raise ValueError(
            f"Invalid data type {dtype}: no DataType stores it (known: "
            f"{sorted(str(d) for d in _DATA_TYPES)})"
        )
    return data_type


def data_type_to_sparse_type(data_type: DataType) -> object:
    """FBGEMM's ``SparseType`` for a table DataType (UINT8 is stored as INT8). Needs FBGEMM."""
    from recsys_core.kernels._fbgemm import tbe_training_module

    name = {DataType.UINT8: "INT8"}.get(DataType(data_type.value), data_type.value)
    if name in ("INT64", "INT32"):
        raise ValueError(f"Invalid DataType {data_type}: FBGEMM has no embedding storage for it")
    return tbe_training_module().SparseType[name]


def pooling_type_to_pooling_mode(
    pooling_type: PoolingType, sharding_type: ShardingType | None = None
) -> object:
    """FBGEMM's ``PoolingMode`` for a pooling type. Row-wise sharded MEAN tables pool as SUM
    in the kernel (each shard sees part of a bag; the mean is taken after the reduction)."""
    from recsys_core.kernels._fbgemm import tbe_training_module

    modes = tbe_training_module().PoolingMode
    row_wise = sharding_type is not None and sharding_type.value in ("row_wise", "table_row_wise")
    if pooling_type.value == "MEAN" and row_wise:
        return modes.SUM
    return modes[pooling_type.value]


def pooling_type_to_str(pooling_type: PoolingType) -> str:
    """``"sum"`` or ``"mean"`` (what ``nn.EmbeddingBag(mode=...)`` takes)."""
    if pooling_type.value not in ("SUM", "MEAN"):
        raise ValueError(f"Unsupported pooling type {pooling_type}")
    return pooling_type.value.lower()


@dataclass
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
        input_dim, total_num_buckets, use_virtual_table, virtual_table_eviction_policy,
            enable_embedding_update, stash_weights: TorchRec's hints for its sharded key-value
            ("virtual") tables and bucketized managed collisions. Stored so that TorchRec configs
            construct; the unsharded modules ignore them, as TorchRec's do.
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
    input_dim: int | None = None
    total_num_buckets: int | None = None
    use_virtual_table: bool = False
    virtual_table_eviction_policy: VirtualTableEvictionPolicy | None = None
    enable_embedding_update: bool = False
    stash_weights: bool = False

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
        if self.total_num_buckets is not None and (
            isinstance(self.total_num_buckets, bool)
            or not isinstance(self.total_num_buckets, int)
            or self.total_num_buckets <= 0
        ):
            raise ValueError(
                f"{where}: total_num_buckets must be a positive int, got {self.total_num_buckets!r}"
            )
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


@dataclass
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


@dataclass
class EmbeddingConfig(BaseEmbeddingConfig):
    """An unpooled (sequence) table: one vector per id."""


@dataclass
class EmbeddingTableConfig(BaseEmbeddingConfig):
    """TorchRec's table description used by sharded modules: any pooling (NONE for sequence
    tables), whether the features are weighted or feature-processed, and the output names."""

    pooling: PoolingType = PoolingType.SUM
    is_weighted: bool = False
    has_feature_processor: bool = False
    embedding_names: list[str] = field(default_factory=list)


class QuantConfig(NamedTuple):
    """TorchRec's quantization recipe for ``torch.ao.quantization.quantize_dynamic``: observers
    whose dtype says what to quantize to, optionally per table."""

    activation: Any
    weight: Any
    per_table_weight_dtype: dict[str, torch.dtype] | None = None


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


# -- TorchRec's eviction policies of virtual (key-value) tables: plain data, for configs ------------


@dataclass
class VirtualTableEvictionPolicy:
    """Base of the eviction policies of a virtual table (mutable, as TorchRec's: the sharder
    fills in the metadata header once it knows the table)."""

    meta_header_len: int = 0
    embedding_dim: int = 0
    initialized: bool = False

    def init_metaheader_config(self, data_type: DataType, embedding_dim: int) -> None:
        """A 16-byte metadata header, counted in elements of the table's dtype."""
        if self.initialized:
            return
        self.meta_header_len = 16 // data_type_to_dtype(data_type).itemsize
        self.embedding_dim = embedding_dim
        self.initialized = True

    def get_meta_header_len(self) -> int:
        return self.meta_header_len

    def get_embedding_dim(self) -> int:
        return self.embedding_dim


@dataclass
class CountBasedEvictionPolicy(VirtualTableEvictionPolicy):
    """Evict ids seen fewer than ``eviction_threshold`` times (counts decay by ``decay_rate``)."""

    training_id_eviction_trigger_count: int = 0
    eviction_threshold: int = 15
    decay_rate: float = 0.99
    inference_eviction_threshold: int | None = None  # defaults to eviction_threshold

    def __post_init__(self) -> None:
        if self.inference_eviction_threshold is None:
            self.inference_eviction_threshold = self.eviction_threshold


@dataclass
class FeatureScoreBasedEvictionPolicy(VirtualTableEvictionPolicy):
    """Evict ids by a decayed feature score (or by age when ``eviction_ttl_mins`` is set)."""

    decay_rate: float = 0.99
    training_id_eviction_trigger_count: int = 0
    training_id_keep_count: int = 0
    eviction_ttl_mins: int = 0
    max_inference_id_num_per_rank: int = 0  # defaults to training_id_keep_count
    inference_eviction_feature_score_threshold: float | None = None  # defaults to 0
    inference_eviction_ttl_mins: int | None = None  # defaults to eviction_ttl_mins
    feature_score_mapping: dict[str, float] | None = None
    feature_score_default_value: float | None = None
    enable_auto_feature_score_collection: bool = False
    enable_eviction: bool = True

    def __post_init__(self) -> None:
        if self.inference_eviction_feature_score_threshold is None:
            self.inference_eviction_feature_score_threshold = 0
        if self.inference_eviction_ttl_mins is None:
            self.inference_eviction_ttl_mins = self.eviction_ttl_mins
        if self.max_inference_id_num_per_rank == 0:
            self.max_inference_id_num_per_rank = self.training_id_keep_count
        if self.enable_auto_feature_score_collection and self.feature_score_mapping is None:
            self.feature_score_mapping = {}


@dataclass
class FeatureScoreMapping:
    """Per-feature scores of a feature-score eviction policy."""

    feature_score_mapping: dict[str, float] = field(default_factory=dict)
    eviction_enabled: bool = False


@dataclass
class TimestampBasedEvictionPolicy(VirtualTableEvictionPolicy):
    """Evict ids not seen for ``eviction_ttl_mins`` minutes."""

    training_id_eviction_trigger_count: int = 0
    eviction_ttl_mins: int = 24 * 60
    inference_eviction_ttl_mins: int | None = None  # defaults to eviction_ttl_mins
    max_inference_id_num_per_rank: int = 0

    def __post_init__(self) -> None:
        if self.inference_eviction_ttl_mins is None:
            self.inference_eviction_ttl_mins = self.eviction_ttl_mins


@dataclass
class CountTimestampMixedEvictionPolicy(VirtualTableEvictionPolicy):
    """Evict ids that are rare or old (either rule)."""

    training_id_eviction_trigger_count: int = 0
    eviction_threshold: int = 15
    decay_rate: float = 0.99
    eviction_ttl_mins: int = 24 * 60
    inference_eviction_threshold: int | None = None  # defaults to eviction_threshold
    inference_eviction_ttl_mins: int | None = None  # defaults to eviction_ttl_mins

    def __post_init__(self) -> None:
        if self.inference_eviction_ttl_mins is None:
            self.inference_eviction_ttl_mins = self.eviction_ttl_mins
        if self.inference_eviction_threshold is None:
            self.inference_eviction_threshold = self.eviction_threshold


@dataclass
class FeatureL2NormBasedEvictionPolicy(VirtualTableEvictionPolicy):
    """Evict ids whose embedding's L2 norm is below ``eviction_threshold``."""

    training_id_eviction_trigger_count: int = 0
    eviction_threshold: float = 0.0
    inference_eviction_threshold: float | None = None  # defaults to eviction_threshold

    def __post_init__(self) -> None:
        if self.inference_eviction_threshold is None:
            self.inference_eviction_threshold = self.eviction_threshold


@dataclass
class NoEvictionPolicy(VirtualTableEvictionPolicy):
    """Never evict."""


def init_table_weights(configs: Sequence[BaseEmbeddingConfig], tables: nn.ModuleDict) -> None:
    """Initialize each config's table (``tables[config.name].weight``) from the config; tables
    still on meta are skipped."""
    for config in configs:
        weight = tables[config.name].weight
        if not weight.is_meta:
            config.init_weight_(weight)


def meta_weight(config: BaseEmbeddingConfig, device: torch.device | str | None) -> torch.Tensor | None:
    """An empty meta weight for a table built on meta (``device``, or the default device
    without one), else None. Given as ``_weight``, it spares ``nn.EmbeddingBag`` /
    ``nn.Embedding`` their ``normal_`` initialization, which on meta runs a Python
    decomposition whose first call in a process took 0.45 s (every ``dlrm-app train`` paid
    it building its model); the values of a meta table do not exist either way."""
    where = torch.device(device) if device is not None else torch.get_default_device()
    if where.type != "meta":
        return None
    return torch.empty(config.num_embeddings, config.embedding_dim, device="meta",
                       dtype=table_dtype(config))
