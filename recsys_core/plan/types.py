"""Plain-data types of model parallelism: how each table is split and where its shards live.

A :class:`ShardingPlan` is pure data: it prints as TorchRec's two tables and round-trips through
JSON, so a plan can be computed once, reviewed, stored and reused.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from enum import unique
from typing import Any

import torch

from recsys_core.modules.embedding_configs import DataType
from recsys_core.plan.params import BoundsCheckMode, CacheParams, KeyValueParams
from recsys_core.plan.spec import EnumerableShardingSpec, ShardMetadata
from recsys_core.types import ValueStrEnum


@unique
class ShardingType(str, ValueStrEnum):
    """How one table is split across ranks (a str enum: ``ShardingType.ROW_WISE == "row_wise"``,
    as TorchRec's plans hold the string values)."""

    DATA_PARALLEL = "data_parallel"  # full replica on every rank, gradients summed
    TABLE_WISE = "table_wise"  # whole table on one rank
    ROW_WISE = "row_wise"  # row blocks on every rank
    COLUMN_WISE = "column_wise"  # column blocks, each on one rank
    TABLE_ROW_WISE = "table_row_wise"  # row blocks on the ranks of one host
    TABLE_COLUMN_WISE = "table_column_wise"  # column blocks on ranks of one host
    GRID_SHARD = "grid_shard"  # column blocks, each split by rows over the ranks of one host


@unique
class EmbeddingComputeKernel(str, ValueStrEnum):
    """Which kernel holds a shard (TorchRec 1.8's members).

    Runnable here (see :mod:`recsys_core.plan.kernels`): DENSE (weights are parameters with
    gradients, stepped by an optimizer outside the module), FUSED, FUSED_UVM and
    FUSED_UVM_CACHING (optimizer fused into backward; on CPU the table lives in host memory, the
    caching one over a backing file) for training, QUANT for inference. The others are named so
    that TorchRec plans parse; a plan that uses one is refused with an error naming the kernel.
    """

    DENSE = "dense"
    FUSED = "fused"
    FUSED_UVM = "fused_uvm"
    FUSED_UVM_CACHING = "fused_uvm_caching"
    QUANT = "quant"
    QUANT_UVM = "quant_uvm"
    QUANT_UVM_CACHING = "quant_uvm_caching"
    KEY_VALUE = "key_value"  # SSD key-value store backing a fully materialized table
    CUSTOMIZED_KERNEL = "customized_kernel"
    SSD_VIRTUAL_TABLE = "ssd_virtual_table"
    DRAM_VIRTUAL_TABLE = "dram_virtual_table"
    DRAM_SSD_VIRTUAL_TABLE = "dram_ssd_virtual_table"
    FUSED_TRITON = "fused_triton"


@dataclass
class ParameterSharding:
    """How one table (parameter) is sharded: TorchRec's fields, in TorchRec's order.

    ``sharding_type`` and ``compute_kernel`` accept the enums or their string values (stored as
    the enums, which compare equal to those strings). ``sharding_spec`` is an
    :class:`EnumerableShardingSpec` (a list of :class:`ShardMetadata` is wrapped into one);
    None for DATA_PARALLEL. The remaining fields come from the table's ``ParameterConstraints``
    and are passed to the kernel that holds the table.
    """

    sharding_type: ShardingType
    """The split."""
    compute_kernel: EmbeddingComputeKernel
    """The kernel that holds each shard."""
    ranks: list[int] = field(default_factory=list)
    """The rank of each shard, in shard order (DATA_PARALLEL: every rank)."""
    sharding_spec: EnumerableShardingSpec | None = None
    """Offsets, sizes and placement of each shard."""
    cache_params: CacheParams | None = None
    """UVM cache settings (FUSED_UVM_CACHING); the planner fills in the load factor it chose."""
    enforce_hbm: bool | None = None
    """Keep the table's weights in HBM even with a caching kernel."""
    stochastic_rounding: bool | None = None
    """Stochastic rounding of FP16 weight updates."""
    bounds_check_mode: BoundsCheckMode | None = None
    """What the kernel does with out-of-range ids."""
    output_dtype: DataType | None = None
    """Data type of the table's output embeddings (None: FP32)."""
    key_value_params: KeyValueParams | None = None
    """Key-value store settings (no kernel here uses them)."""

    def __post_init__(self) -> None:
        self.sharding_type = ShardingType(getattr(self.sharding_type, "value", self.sharding_type))
        self.compute_kernel = EmbeddingComputeKernel(
            getattr(self.compute_kernel, "value", self.compute_kernel)
        )
        self.ranks = [int(r) for r in self.ranks or []]
        if self.sharding_spec is not None:
            self.sharding_spec = EnumerableShardingSpec.of(self.sharding_spec)
        if isinstance(self.cache_params, Mapping):  # as stored in plan JSON
            self.cache_params = CacheParams.from_dict(self.cache_params)
        if self.bounds_check_mode is not None:
            self.bounds_check_mode = BoundsCheckMode(
                getattr(self.bounds_check_mode, "value", self.bounds_check_mode)
            )
        if self.output_dtype is not None:
            self.output_dtype = DataType(getattr(self.output_dtype, "value", self.output_dtype))

    @property
    def shards(self) -> list[ShardMetadata]:
        """The shards of ``sharding_spec`` in order (empty for DATA_PARALLEL)."""
        return [] if self.sharding_spec is None else list(self.sharding_spec.shards)

    def to_dict(self) -> dict[str, Any]:
        return {
            "sharding_type": self.sharding_type.value,
            "compute_kernel": self.compute_kernel.value,
            "ranks": list(self.ranks),
            "sharding_spec": None
            if self.sharding_spec is None
            else [s.to_dict() for s in self.shards],
            "cache_params": None if self.cache_params is None else self.cache_params.to_dict(),
            "enforce_hbm": self.enforce_hbm,
            "stochastic_rounding": self.stochastic_rounding,
            "bounds_check_mode": None
            if self.bounds_check_mode is None
            else self.bounds_check_mode.name,
            "output_dtype": None if self.output_dtype is None else self.output_dtype.value,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ParameterSharding:
        spec = data.get("sharding_spec")
        bounds = data.get("bounds_check_mode")
        return cls(
            sharding_type=ShardingType(data["sharding_type"]),
            compute_kernel=EmbeddingComputeKernel(data["compute_kernel"]),
            ranks=list(data.get("ranks") or []),
            sharding_spec=None
            if spec is None
            else EnumerableShardingSpec([ShardMetadata.from_dict(s) for s in spec]),
            cache_params=data.get("cache_params"),
            enforce_hbm=data.get("enforce_hbm"),
            stochastic_rounding=data.get("stochastic_rounding"),
            bounds_check_mode=None if bounds is None else BoundsCheckMode[bounds],
            output_dtype=data.get("output_dtype"),
        )


class ModuleShardingPlan:
    """The plan of one module (TorchRec's base class of module plans)."""

    def _serialize(self) -> dict[str, Any]:
        raise TypeError(f"{type(self).__name__} does not define _serialize()")


class EmbeddingModuleShardingPlan(ModuleShardingPlan, dict[str, ParameterSharding]):
    """``{table name: ParameterSharding}`` for one module; prints as two tables (TorchRec's
    layout: each table after a blank line)."""

    def _serialize(self) -> dict[str, Any]:
        """TorchRec's plain-dict form: type, kernel, ranks and (if sharded) the shards."""
        out: dict[str, Any] = {}
        for name, ps in self.items():
            entry: dict[str, Any] = {
                "sharding_type": ps.sharding_type.value,
                "compute_kernel": ps.compute_kernel.value,
                "ranks": list(ps.ranks),
            }
            if ps.sharding_spec is not None:
                entry["shards"] = [s.to_dict() for s in ps.shards]
            out[name] = entry
        return out

    def __str__(self) -> str:
        params = [
            [name, str(ps.sharding_type), str(ps.compute_kernel), str(ps.ranks)]
            for name, ps in self.items()
        ]
        shards = [
            [name, str(s.shard_offsets), str(s.shard_sizes), str(s.placement)]
            for name, ps in self.items()
            for s in ps.shards
        ]
        return (
            "\n\n"
            + _tabulate(params, ["param", "sharding type", "compute kernel", "ranks"])
            + "\n\n"
            + _tabulate(shards, ["param", "shard offsets", "shard sizes", "placement"])
        )


@dataclass
class ShardingPlan:
    """``{module path: {table name: ParameterSharding}}`` for a whole model.

    The path of a top-level collection is ``""`` (as in the tutorial's ``plan.plan[""]``).
    """

    plan: dict[str, EmbeddingModuleShardingPlan] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.plan = {
            path: p if isinstance(p, EmbeddingModuleShardingPlan) else EmbeddingModuleShardingPlan(p)
            for path, p in self.plan.items()
        }

    def get_plan_for_module(self, module_path: str) -> EmbeddingModuleShardingPlan | None:
        return self.plan.get(module_path)

    def __iter__(self) -> Iterator[str]:
        return iter(self.plan)

    def __str__(self) -> str:
        return "\n\n".join(
            f"module: {path}{module_plan}" for path, module_plan in self.plan.items()
        )

    def _serialize(self) -> dict[str, Any]:
        return {"plan": {path: mp._serialize() for path, mp in self.plan.items()}}

    def to_json(self) -> str:
        return json.dumps(
            {path: {t: ps.to_dict() for t, ps in mp.items()} for path, mp in self.plan.items()},
            indent=1,
        )

    @classmethod
    def from_json(cls, text: str) -> ShardingPlan:
        data = json.loads(text)
        return cls({
            path: EmbeddingModuleShardingPlan(
                {t: ParameterSharding.from_dict(ps) for t, ps in mp.items()}
            )
            for path, mp in data.items()
        })


def _tabulate(rows: list[list[str]], headers: list[str]) -> str:
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]
    lines = [
        " | ".join(h.center(w) for h, w in zip(headers, widths, strict=True)),
        " | ".join("-" * w for w in widths),
    ]
    lines += [" | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(lines)


def device_placement(rank: int, device: torch.device | str, local_size: int | None = None) -> str:
    """``"rank:<r>/<device>"``; for CUDA the device index is the rank's local index
    (``rank % local_size``) unless ``device`` names one."""
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else rank % (local_size or rank + 1)
        return f"rank:{rank}/cuda:{index}"
    return f"rank:{rank}/{device.type}"
