"""What a user tells the planner about one table: :class:`ParameterConstraints` (TorchRec's fields,
order and mutability), and the kernel parameters it may carry (re-exported from
:mod:`recsys_core.plan.params`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from recsys_core.modules.embedding_configs import DataType
from recsys_core.plan.params import (
    BoundsCheckMode,
    CacheAlgorithm,
    CacheParams,
    KeyValueParams,
    coerce_enum,
)
from recsys_core.plan.types import EmbeddingComputeKernel, ShardingType

__all__ = [
    "BoundsCheckMode",
    "CacheAlgorithm",
    "CacheParams",
    "KeyValueParams",
    "ParameterConstraints",
]

DEVICE_GROUPS = ("cpu", "cuda")


@dataclass
class ParameterConstraints:
    """What the planner may do with one table, and what it should assume about its traffic.

    Keyed by table name in ``EmbeddingShardingPlanner(constraints={...})``. A plain mutable
    dataclass with TorchRec 1.8's fields in TorchRec's order, so positional use ports unchanged.
    Lists may hold enums or their string values (stored as lists of the enums, which compare
    equal to those strings). Checked when built and again when a plan is made
    (:meth:`checked`), so fields assigned later are checked too.

    ``pooling_factors``, ``num_poolings`` and ``batch_sizes`` hold one value per feature of the
    table (in ``feature_names`` order when given, else the table config's), or one value for all.
    """

    sharding_types: list[ShardingType | str] | None = None
    """Allowed sharding types (None: every type the sharder supports)."""
    compute_kernels: list[EmbeddingComputeKernel | str] | None = None
    """Allowed kernels (None: FUSED on CPU, plus FUSED_UVM_CACHING when the topology has an
    ssd_cap; FUSED, FUSED_UVM_CACHING, FUSED_UVM on CUDA)."""
    min_partition: int | None = None
    """Narrowest column-wise shard, in columns (None: the planner's default, 32)."""
    pooling_factors: list[float] = field(default_factory=lambda: [1.0])
    """Mean ids per bag, per feature."""
    num_poolings: list[float] | None = None
    """Bags per sample, per feature (None: 1)."""
    batch_sizes: list[int] | None = None
    """Samples per rank per step, per feature (None: the planner's batch_size)."""
    is_weighted: bool = False
    """Ids carry weights (adds 4 bytes per id to the input all-to-all)."""
    cache_params: CacheParams | None = None
    """Cache settings of a FUSED_UVM_CACHING table, carried into the plan; its load_factor, if
    set, is used exactly."""
    enforce_hbm: bool | None = None
    """True: keep this table in HBM (FUSED only, never UVM) on a CUDA topology; carried into
    the plan."""
    stochastic_rounding: bool | None = None
    """Stochastic rounding of FP16 updates; carried into the plan for the kernel."""
    bounds_check_mode: BoundsCheckMode | None = None
    """What the kernel does with out-of-range ids; carried into the plan for the kernel."""
    feature_names: list[str] | None = None
    """The order in which the per-feature lists give the table's features (None: its config's
    order); must list each of the table's features once."""
    output_dtype: DataType | None = None
    """Data type of the table's output embeddings (None: FP32): sizes the planner's output
    traffic and buffers, and is carried into the plan."""
    device_group: str | None = None
    """"cpu" or "cuda": where the table must live. This planner plans one device type, so it
    must be the topology's compute_device."""
    key_value_params: KeyValueParams | None = None
    """Key-value (SSD / parameter server) settings: no kernel here stores tables that way, so
    the planner refuses a table that sets them."""
    use_virtual_table: bool = False
    """TorchRec's virtual (key-value) tables: not supported, the planner refuses True."""

    def __post_init__(self) -> None:
        if self.sharding_types is not None:
            types = [coerce_enum(ShardingType, t, "sharding_types") for t in self.sharding_types]
            if not types:
                raise ValueError("ParameterConstraints: sharding_types is empty; allow at least one")
            self.sharding_types = types
        if self.compute_kernels is not None:
            kernels = [
                coerce_enum(EmbeddingComputeKernel, k, "compute_kernels") for k in self.compute_kernels
            ]
            if not kernels:
                raise ValueError("ParameterConstraints: compute_kernels is empty; allow at least one")
            self.compute_kernels = kernels
        if self.min_partition is not None and (
            isinstance(self.min_partition, bool) or int(self.min_partition) != self.min_partition
            or self.min_partition < 1
        ):
            raise ValueError(f"ParameterConstraints: min_partition {self.min_partition} must be an int >= 1")
        for name in ("pooling_factors", "num_poolings", "batch_sizes"):
            values = getattr(self, name)
            if values is None:
                continue
            if isinstance(values, int | float):
                raise ValueError(f"ParameterConstraints: {name} is a list (one value per feature), got {values!r}")
            values = list(values)
            if not values or any(not v > 0 for v in values):
                raise ValueError(f"ParameterConstraints: {name} {values} must be non-empty and > 0")
            setattr(self, name, values)
        if self.cache_params is not None and not isinstance(self.cache_params, CacheParams):
            raise ValueError(
                f"ParameterConstraints: cache_params must be a CacheParams, got {self.cache_params!r}"
            )
        if self.bounds_check_mode is not None:
            self.bounds_check_mode = coerce_enum(BoundsCheckMode, self.bounds_check_mode, "bounds_check_mode")
        if self.output_dtype is not None:
            self.output_dtype = coerce_enum(DataType, self.output_dtype, "output_dtype")
        if self.feature_names is not None:
            if isinstance(self.feature_names, str) or not self.feature_names:
                raise ValueError(
                    f"ParameterConstraints: feature_names must be a non-empty list of feature "
                    f"names, got {self.feature_names!r}"
                )
            self.feature_names = list(self.feature_names)
        if self.device_group is not None and self.device_group not in DEVICE_GROUPS:
            raise ValueError(
                f"ParameterConstraints: device_group {self.device_group!r} must be one of "
                f"{DEVICE_GROUPS} (or None)"
            )

    def checked(self) -> ParameterConstraints:
        """A checked, normalized copy of the current values (fields may have been set later)."""
        return dataclasses.replace(self)

    def __hash__(self) -> int:
        def frozen(value: object) -> object:
            return tuple(value) if isinstance(value, list) else value

        return hash(tuple(frozen(getattr(self, f.name)) for f in dataclasses.fields(self)))
