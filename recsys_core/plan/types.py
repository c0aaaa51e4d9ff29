"""Plain-data types of model parallelism: how each table is split and where its shards live.

A :class:`ShardingPlan` is pure data: it prints as TorchRec's two tables and round-trips through
JSON, so a plan can be computed once, reviewed, stored and reused.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from enum import Enum, unique
from typing import Any

import torch


@unique
class ShardingType(Enum):
    """How one table is split across ranks."""

    DATA_PARALLEL = "data_parallel"  # full replica on every rank, gradients summed
    TABLE_WISE = "table_wise"  # whole table on one rank
    ROW_WISE = "row_wise"  # row blocks on every rank
    COLUMN_WISE = "column_wise"  # column blocks, each on one rank
    TABLE_ROW_WISE = "table_row_wise"  # row blocks on the ranks of one host
    TABLE_COLUMN_WISE = "table_column_wise"  # column blocks on ranks of one host

    def __str__(self) -> str:
        return self.value


@unique
class EmbeddingComputeKernel(Enum):
    """Which kernel holds a shard. On CPU every fused variant keeps the table in host memory."""

    DENSE = "dense"
    FUSED = "fused"
    FUSED_UVM = "fused_uvm"
    FUSED_UVM_CACHING = "fused_uvm_caching"
    QUANT = "quant"

    def __str__(self) -> str:
        return self.value


@dataclass
class ShardMetadata:
    """One shard: its offsets and sizes within the ``[rows, dim]`` table and its placement.

    ``placement`` reads ``"rank:<r>/<device>"`` (e.g. ``"rank:0/cpu"``, ``"rank:1/cuda:1"``).
    """

    shard_offsets: list[int]
    shard_sizes: list[int]
    placement: str

    @property
    def rank(self) -> int:
        head, _, _ = self.placement.partition("/")
        number = head[len("rank:"):]
        if not head.startswith("rank:") or not number.isdigit():
            raise ValueError(
                f"shard placement {self.placement!r} must read 'rank:<r>/<device>', "
                "e.g. 'rank:0/cpu'"
            )
        return int(number)

    @property
    def device(self) -> str:
        _, sep, device = self.placement.partition("/")
        if not sep or not device:
            raise ValueError(
                f"shard placement {self.placement!r} must read 'rank:<r>/<device>', "
                "e.g. 'rank:0/cpu'"
            )
        return device

    def to_dict(self) -> dict[str, Any]:
        return {
            "shard_offsets": list(self.shard_offsets),
            "shard_sizes": list(self.shard_sizes),
            "placement": self.placement,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ShardMetadata:
        return cls(list(data["shard_offsets"]), list(data["shard_sizes"]), str(data["placement"]))


@dataclass
class ParameterSharding:
    """How one table (parameter) is sharded.

    Attributes:
        sharding_type: the split.
        compute_kernel: the kernel that holds each shard.
        ranks: the ranks holding a shard, in shard order.
        sharding_spec: one :class:`ShardMetadata` per shard (None for DATA_PARALLEL).
        cache_params: UVM-caching parameters as plain data (JSON-able), used only with
            FUSED_UVM_CACHING on CUDA.
    """

    sharding_type: ShardingType
    compute_kernel: EmbeddingComputeKernel
    ranks: list[int] = field(default_factory=list)
    sharding_spec: list[ShardMetadata] | None = None
    cache_params: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.sharding_type = ShardingType(getattr(self.sharding_type, "value", self.sharding_type))
        self.compute_kernel = EmbeddingComputeKernel(
            getattr(self.compute_kernel, "value", self.compute_kernel)
        )
        self.ranks = [int(r) for r in self.ranks]

    @property
    def shards(self) -> list[ShardMetadata]:
        return list(self.sharding_spec or [])

    def to_dict(self) -> dict[str, Any]:
        return {
            "sharding_type": self.sharding_type.value,
            "compute_kernel": self.compute_kernel.value,
            "ranks": list(self.ranks),
            "sharding_spec": None
            if self.sharding_spec is None
            else [s.to_dict() for s in self.sharding_spec],
            "cache_params": None if self.cache_params is None else dict(self.cache_params),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ParameterSharding:
        spec = data.get("sharding_spec")
        return cls(
            sharding_type=ShardingType(data["sharding_type"]),
            compute_kernel=EmbeddingComputeKernel(data["compute_kernel"]),
            ranks=list(data.get("ranks") or []),
            sharding_spec=None if spec is None else [ShardMetadata.from_dict(s) for s in spec],
            cache_params=data.get("cache_params"),
        )


class EmbeddingModuleShardingPlan(dict[str, ParameterSharding]):
    """``{table name: ParameterSharding}`` for one module; prints as two tables."""

    def __str__(self) -> str:
        params = [
            [name, str(ps.sharding_type), str(ps.compute_kernel), str(ps.ranks)]
            for name, ps in self.items()
        ]
        shards = [
            [name, str(s.shard_offsets), str(s.shard_sizes), s.placement]
            for name, ps in self.items()
            for s in ps.shards
        ]
        return (
            "\n"
            + _tabulate(params, ["param", "sharding type", "compute kernel", "ranks"])
            + "\n"
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
        return "\n".join(f"module: {path}{module_plan}" for path, module_plan in self.plan.items())

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
