"""What every sharding strategy shares: shard geometry, local kernels and the strategy protocol.

A strategy owns some tables of an EmbeddingBagCollection and implements three steps:

    input_dist(local KJT)      -> awaitable KJT of the ids this rank's shards look up
    lookup(KJT)                -> pooled rows for those shards
    output_dist(pooled, KJT)   -> awaitable [local batch, sum of its features' dims]

The output columns follow ``output_features`` (each feature at its table's full dim).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from recsys_core.distributed.awaitable import Awaitable
from recsys_core.distributed.types import (
    EmbeddingComputeKernel,
    ParameterSharding,
    ShardingEnv,
    ShardingType,
)
from recsys_core.kernels.config import FusedOptimizerConfig, KernelBackend
from recsys_core.kernels.tbe import build_table_batched_embedding, checked_lookup
from recsys_core.modules.embedding_configs import BaseEmbeddingConfig, PoolingType
from recsys_core.sparse import KeyedJaggedTensor


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
    """A table with its plan entry and resolved shards."""

    config: BaseEmbeddingConfig
    sharding: ParameterSharding
    shards: tuple[ShardSpec, ...]


def resolve_shards(config: BaseEmbeddingConfig, ps: ParameterSharding, world_size: int) -> ShardedTable:
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
    return ShardedTable(config, ps, shards)


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


class LocalKernels(nn.Module):
    """The kernels holding one rank's shards for one strategy: one kernel per pooling type.

    ``slots`` are this rank's lookups in output order (grouped by pooling type, SUM first).
    Shard weights are copied from ``source`` tables (the unsharded module) when given, else
    initialized from the table config.
    """

    def __init__(
        self,
        slots: Sequence[Slot],
        optimizer: FusedOptimizerConfig,
        device: torch.device,
        is_weighted: bool,
        backend: KernelBackend,
        source: dict[str, torch.Tensor] | None,
        configs: dict[str, BaseEmbeddingConfig],
        force_pooling: PoolingType | None = None,
    ) -> None:
        super().__init__()
        self.slots = list(slots)
        self.kernels = nn.ModuleList()
        self.kernel_slots: list[list[Slot]] = []
        self.kernel_shards: list[list[ShardSpec]] = []
        for pooling in (PoolingType.SUM, PoolingType.MEAN):
            group = [s for s in self.slots if s.pooling is pooling]
            if not group:
                continue
            shards: list[ShardSpec] = []
            for s in group:
                if s.shard not in shards:
                    shards.append(s.shard)
            kernel_pooling = force_pooling or pooling
            kernel = build_table_batched_embedding(
                rows=[max(sh.rows, 1) for sh in shards],  # an empty row shard keeps one spare row
                dims=[sh.cols for sh in shards],
                feature_table_map=[shards.index(s.shard) for s in group],
                pooling_mean=kernel_pooling is PoolingType.MEAN,
                optimizer=optimizer,
                device=device,
                backend=backend,
                weighted=is_weighted,
            )
            if device.type != "meta":
                for sh, view in zip(shards, kernel.split_embedding_weights(), strict=True):
                    _init_shard(view[: sh.rows], sh, source, configs[sh.table])
            self.kernels.append(kernel)
            self.kernel_slots.append(group)
            self.kernel_shards.append(shards)
        if [s for g in self.kernel_slots for s in g] != self.slots:
            raise ValueError("LocalKernels: slots must be ordered SUM first, then MEAN")

    @property
    def output_dim(self) -> int:
        return sum(s.shard.cols for s in self.slots)

    def lookup(self, kjt: KeyedJaggedTensor, is_weighted: bool) -> torch.Tensor:
        """Pooled ``[kjt.stride(), output_dim]`` for a KJT whose keys are the slot keys."""
        if not self.slots:
            return torch.zeros(kjt.stride(), 0)
        parts = kjt.split([len(g) for g in self.kernel_slots]) if len(self.kernels) > 1 else [kjt]
        outs = []
        for kernel, group, part in zip(self.kernels, self.kernel_slots, parts, strict=True):
            values, offsets = part.values(), part.offsets()
            if offsets.dtype != values.dtype:
                offsets = offsets.to(values.dtype)
            outs.append(checked_lookup(
                kernel, values, offsets, part.weights() if is_weighted else None,
                feature_names=[s.feature for s in group],
                rows_per_feature=[max(s.shard.rows, 1) for s in group],
            ))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)

    def local_shards(self) -> list[tuple[ShardSpec, torch.Tensor, dict[str, torch.Tensor]]]:
        """``(shard, weight view, optimizer state views)`` for every shard held here."""
        out = []
        for kernel, shards in zip(self.kernels, self.kernel_shards, strict=True):
            weights = kernel.split_embedding_weights()
            states = kernel.split_optimizer_states()
            for sh, w, st in zip(shards, weights, states, strict=True):
                out.append((sh, w[: sh.rows], {
                    k: (v[: sh.rows] if v.dim() >= 1 else v) for k, v in st.items()
                }))
        return out


def _init_shard(
    view: torch.Tensor,
    shard: ShardSpec,
    source: dict[str, torch.Tensor] | None,
    config: BaseEmbeddingConfig,
) -> None:
    with torch.no_grad():
        if source is not None and shard.table in source:
            full = source[shard.table]
            view.copy_(full[shard.row_offset : shard.row_offset + shard.rows,
                            shard.col_offset : shard.col_offset + shard.cols])
        else:
            config.init_weight_(view)


@dataclass(frozen=True)
class ColumnPermutation:
    """Reorders columns in blocks of ``width``: ``x.view(B, -1, width)[:, blocks]``.

    Moving whole blocks (a table's or shard's columns) instead of single columns makes the
    copy and its backward (an index_add over blocks) several times cheaper.
    """

    blocks: torch.Tensor
    width: int


def column_permutation(columns: list[int]) -> ColumnPermutation | None:
    """The block permutation that puts ``columns`` in order, or None if it already is."""
    if columns == list(range(len(columns))):
        return None
    width = 0
    start = 0
    for i in range(1, len(columns) + 1):
        if i == len(columns) or columns[i] != columns[i - 1] + 1:
            width = math.gcd(width, i - start, columns[start])
            start = i
    width = max(width, 1)
    blocks = [columns[b] // width for b in range(0, len(columns), width)]
    return ColumnPermutation(torch.tensor(blocks, dtype=torch.long), width)


def select_columns(x: torch.Tensor, columns: ColumnPermutation | None) -> torch.Tensor:
    if columns is None:
        return x
    rows = x.shape[0]
    blocks = x.reshape(rows, -1, columns.width)
    return blocks.index_select(1, columns.blocks.to(x.device)).reshape(rows, -1)


class PooledSharding(Protocol):
    """The interface every strategy implements (see the module docstring)."""

    output_features: list[str]
    local: LocalKernels

    def input_dist(self, features: KeyedJaggedTensor) -> Awaitable[KeyedJaggedTensor]: ...

    def lookup(self, features: KeyedJaggedTensor) -> torch.Tensor: ...

    def output_dist(
        self, pooled: torch.Tensor, local_features: KeyedJaggedTensor
    ) -> Awaitable[torch.Tensor]: ...


def require_process_group(env: ShardingEnv, module: str) -> None:
    """Sharding over several ranks needs a process group: without one every collective would
    degenerate to a local copy and the results would be silently wrong."""
    if env.pg is None and env.world_size > 1:
        raise ValueError(
            f"{module}: sharding over {env.world_size} ranks needs a process group; build the "
            "environment with ShardingEnv.from_process_group(pg) (from_local is for planning "
            "and single-rank use)"
        )


def check_kernel_placement(plan: Mapping[str, ParameterSharding], device: torch.device) -> None:
    """On CPU every fused kernel keeps its table in host memory, so FUSED_UVM(_CACHING) equal
    FUSED. On CUDA they mean managed memory, which these kernels do not place yet: refuse rather
    than silently put the table in device memory."""
    uvm = (EmbeddingComputeKernel.FUSED_UVM, EmbeddingComputeKernel.FUSED_UVM_CACHING)
    if device.type != "cuda":
        return
    for name, ps in plan.items():
        if ps.compute_kernel in uvm:
            raise ValueError(
                f"table {name!r}: compute kernel {ps.compute_kernel} (UVM) is not available for "
                "sharded CUDA tables yet; use EmbeddingComputeKernel.FUSED"
            )
