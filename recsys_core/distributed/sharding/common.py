"""What every sharding strategy shares: shard geometry, local kernels and the strategy protocol.

A strategy owns some tables of an EmbeddingBagCollection and implements three steps:

    input_dist(local KJT)      -> awaitable KJT of the ids this rank's shards look up
    lookup(KJT)                -> pooled rows for those shards
    output_dist(pooled, KJT, batch_size_per_rank)
                               -> awaitable [local batch, sum of its features' dims]

Ranks may use different batch sizes: the input dist reports every rank's
(``dist_data.batch_sizes``) and the output dist sends each rank its own rows.

The output columns follow ``output_features`` (each feature at its table's full dim).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from recsys_core.distributed.awaitable import Awaitable
from recsys_core.distributed.batched_embedding_kernel import dense_kernel_builder
from recsys_core.distributed.table_init import TableInitializer, TableRegion
from recsys_core.distributed.types import (
    CommOp,
    EmbeddingComputeKernel,
    ParameterSharding,
    QuantizedCommCodecs,
    ShardingEnv,
    ShardingType,
)
from recsys_core.kernels.batched import BatchedTables
from recsys_core.kernels.cached_tbe import CachedTableBatchedEmbedding, TableCache, cache_slots
from recsys_core.kernels.config import FusedOptimizerConfig, KernelBackend
from recsys_core.kernels.packed import ColumnPermutation as ColumnPermutation
from recsys_core.kernels.packed import PackedKernelSpec, PackedTable
from recsys_core.kernels.packed import column_permutation as column_permutation
from recsys_core.kernels.packed import permute_parts as permute_parts
from recsys_core.kernels.packed import permute_received as permute_received
from recsys_core.kernels.packed import select_columns as select_columns
from recsys_core.modules.embedding_configs import BaseEmbeddingConfig, PoolingType, table_dtype
from recsys_core.plan.params import CacheParams
from recsys_core.sparse import KeyedJaggedTensor

# Cache share of a FUSED_UVM_CACHING shard whose plan gives no load factor (TorchRec's default).
DEFAULT_LOAD_FACTOR = 0.2


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


@dataclass(frozen=True, kw_only=True)
class KernelContext:
    """What every strategy's local kernels are built with (one per sharded collection)."""

    device: torch.device
    """Where the shards live."""
    optimizer: FusedOptimizerConfig
    """The optimizer fused into every kernel's backward."""
    backend: KernelBackend
    """FBGEMM, TORCH or AUTO."""
    is_weighted: bool
    """Per-sample weights are passed to the lookups."""
    source: Mapping[str, torch.Tensor] | None
    """Whole tables of the unsharded module to copy shards from (None: a meta module)."""
    table_init: TableInitializer | None
    """Plan-independent initializer; wins over ``source`` and the configs' own init."""
    caches: Mapping[str, CacheParams] = field(default_factory=dict)
    """Tables planned as FUSED_UVM_CACHING: held in a slower tier (a file under
    ``offload_dir`` on CPU, host memory on CUDA) behind a cache of ``load_factor`` of each
    shard's rows."""
    offload_dir: str | None = None
    """Directory of the backing files of cached tables on CPU (None: the temporary directory)."""
    qcomm_codecs_registry: Mapping[str, QuantizedCommCodecs] | None = None
    """Codecs of the output dist's collectives, keyed by ``CommOp.name`` (see
    ``fbgemm_qcomm_codec``); None: float32 payloads."""
    dense: bool = False
    """Build DENSE kernels (weights are parameters with gradients, no fused optimizer) instead
    of fused ones; set per strategy for the tables planned with ``EmbeddingComputeKernel.DENSE``."""
    sync_replica_gradients: bool = True
    """Sum the DATA_PARALLEL replicas' gradients over the ranks in backward; False for a
    collection marked by ``mark_data_parallel_skip_grad_sync`` (each replica keeps its own)."""

    def codecs(self, op: CommOp) -> QuantizedCommCodecs | None:
        registry = self.qcomm_codecs_registry
        return None if registry is None else registry.get(op.name)


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
    """The kernels holding one rank's shards for one strategy, in a
    :class:`~recsys_core.kernels.batched.BatchedTables`: one kernel per pooling type, its tables
    the shards its slots look up (a shard several features read is held once).

    ``slots`` are this rank's lookups in output order (grouped by pooling type, SUM first).
    Shard weights come from ``ctx.table_init`` when given, else from the unsharded module's
    tables (``ctx.source``), else from the table config's initializer.
    """

    def __init__(
        self,
        slots: Sequence[Slot],
        ctx: KernelContext,
        configs: Mapping[str, BaseEmbeddingConfig],
        *,
        backend: KernelBackend | None = None,
    ) -> None:
        super().__init__()
        self.slots = list(slots)
        self.kernel_shards: list[list[ShardSpec]] = []
        """Each kernel's tables: the shards it holds, in kernel order."""
        if [s.pooling for s in self.slots] != sorted(
                (s.pooling for s in self.slots), key=lambda p: p is PoolingType.MEAN):
            raise ValueError("LocalKernels: slots must be ordered SUM first, then MEAN")

        def dtype(slot: Slot) -> torch.dtype:  # a cached table is kept in float32
            if ctx.dense or slot.shard.table in ctx.caches:
                return torch.float32
            return table_dtype(configs[slot.shard.table])

        # one kernel per pooling type and weight dtype (FP16 tables in their own kernel)
        by_kind: dict[tuple[PoolingType, torch.dtype], list[Slot]] = {}
        for s in self.slots:
            by_kind.setdefault((s.pooling, dtype(s)), []).append(s)
        groups = list(by_kind.values())
        in_kernel_order = [s for group in groups for s in group]
        # kernels' outputs come in kernel order; this restores the slots' order (None: the same)
        self._columns = None
        if in_kernel_order != self.slots:
            first = {id(s): sum(t.shard.cols for t in in_kernel_order[:i])
                     for i, s in enumerate(in_kernel_order)}
            self._columns = column_permutation(
                [first[id(s)] + c for s in self.slots for c in range(s.shard.cols)])
            position = {id(s): i for i, s in enumerate(self.slots)}
            self._to_kernel_order = [position[id(s)] for s in in_kernel_order]
            back = {id(s): i for i, s in enumerate(in_kernel_order)}
            self._from_kernel_order = [back[id(s)] for s in self.slots]
        specs = []
        for group in groups:
            shards = list(dict.fromkeys(s.shard for s in group))
            specs.append(PackedKernelSpec(
                tables=tuple(
                    PackedTable(name=sh.table, rows=sh.rows, dim=sh.cols,
                                cache=_table_cache(sh, ctx.caches.get(sh.table)),
                                dtype=dtype(group[0]))
                    for sh in shards
                ),
                feature_table_map=tuple(shards.index(s.shard) for s in group),
                pooling_mean=group[0].pooling is PoolingType.MEAN,
                weighted=ctx.is_weighted,
                optimizer=ctx.optimizer,
                backend=backend or ctx.backend,
                offload_dir=ctx.offload_dir,
                features=tuple(s.feature for s in group),
            ))
            self.kernel_shards.append(shards)
        # the BatchedTables' tables, numbered in kernel order
        self._held = [sh for group in self.kernel_shards for sh in group]

        def fill_rows(index: int, view: torch.Tensor, first_row: int) -> None:
            shard = self._held[index]
            _init_shard(view, shard, ctx, configs[shard.table], first_row)

        self.batched = BatchedTables(
            specs, ctx.device,
            fill_rows=None if ctx.device.type == "meta" else fill_rows,
            build=dense_kernel_builder(
                {name: table_dtype(config) for name, config in configs.items()}
            ) if ctx.dense else None,
        )
        self.kernels = nn.ModuleList(self.batched.kernels)

    @property
    def output_dim(self) -> int:
        return sum(s.shard.cols for s in self.slots)

    def lookup(self, kjt: KeyedJaggedTensor, is_weighted: bool) -> torch.Tensor:
        """Pooled ``[kjt.stride(), output_dim]`` for a KJT whose keys are the slot keys."""
        if self._columns is None:
            return self.batched.lookup(kjt, is_weighted)
        out = self.batched.lookup(kjt.permute(self._to_kernel_order), is_weighted)
        return select_columns(out, self._columns)

    def lookup_rows(self, kjt: KeyedJaggedTensor) -> list[torch.Tensor]:
        """``[n_i, cols_i]``, one row per id, for each slot ``i`` of a KJT whose keys are the
        slot keys (see ``BatchedTables.lookup_rows``)."""
        if self._columns is None:
            return self.batched.lookup_rows(kjt.values(), kjt.length_per_key())
        ordered = kjt.permute(self._to_kernel_order)
        rows = self.batched.lookup_rows(ordered.values(), ordered.length_per_key())
        return [rows[k] for k in self._from_kernel_order]

    def cached_kernels(self) -> list[CachedTableBatchedEmbedding]:
        return [k for k in self.kernels if isinstance(k, CachedTableBatchedEmbedding)]

    def prefetch(self, kjt: KeyedJaggedTensor) -> None:
        """Bring the rows of a future lookup of ``kjt`` into the caches of cached tables."""
        self.batched.prefetch(kjt)

    def drop_prefetched(self) -> None:
        for kernel in self.cached_kernels():
            kernel.drop_prefetched()

    def _caching_kernels(self) -> list[nn.Module]:
        """The kernels with a cache to flush: ours, and FBGEMM's UVM caching on CUDA."""
        return [k for k in self.kernels
                if isinstance(k, CachedTableBatchedEmbedding) or getattr(k, "managed_caching", False)]

    def flush_caches(self) -> None:
        """Write trained cached rows back: the views :meth:`local_shards` gives are current."""
        for kernel in self._caching_kernels():
            kernel.flush()

    def invalidate_caches(self) -> None:
        """Reread cached tables from their backing store (after it was written from outside)."""
        for kernel in self._caching_kernels():
            kernel.invalidate()

    def local_shards(self) -> list[tuple[ShardSpec, torch.Tensor, dict[str, torch.Tensor]]]:
        """``(shard, weight view, optimizer state views)`` for every shard held here (cached
        tables flushed first, so the views are current)."""
        self.flush_caches()
        weights = self.batched.split_embedding_weights()
        states = self.batched.split_optimizer_states()
        return [
            (sh, w[: sh.rows], {k: (v[: sh.rows] if v.dim() >= 1 else v) for k, v in st.items()})
            for sh, w, st in zip(self._held, weights, states, strict=True)
        ]


def _table_cache(shard: ShardSpec, params: CacheParams | None) -> TableCache | None:
    if params is None:
        return None
    load_factor = DEFAULT_LOAD_FACTOR if params.load_factor is None else params.load_factor
    return TableCache(slots=cache_slots(max(shard.rows, 1), load_factor),
                      algorithm=params.algorithm.value)


def _init_shard(
    view: torch.Tensor, shard: ShardSpec, ctx: KernelContext, config: BaseEmbeddingConfig,
    first_row: int = 0,
) -> None:
    """Fill ``view``: rows ``first_row:`` of the shard (the whole shard by default)."""
    row = shard.row_offset + first_row
    with torch.no_grad():
        if ctx.table_init is not None:
            ctx.table_init.fill(view, TableRegion(
                table=shard.table, num_rows=config.num_embeddings, dim=config.embedding_dim,
                row_offset=row, col_offset=shard.col_offset,
            ))
        elif ctx.source is not None and shard.table in ctx.source:
            full = ctx.source[shard.table]
            view.copy_(full[row : row + view.shape[0],
                            shard.col_offset : shard.col_offset + shard.cols])
        else:
            config.init_weight_(view)


class PooledSharding(Protocol):
    """The interface every strategy implements (see the module docstring)."""

    output_features: list[str]
    local: LocalKernels

    def input_dist(self, features: KeyedJaggedTensor) -> Awaitable[KeyedJaggedTensor]: ...

    def lookup(self, features: KeyedJaggedTensor) -> torch.Tensor: ...

    def output_dist(
        self,
        pooled: torch.Tensor,
        local_features: KeyedJaggedTensor,
        batch_size_per_rank: Sequence[int] | None = None,
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
    """FUSED_UVM_CACHING tables run the cached kernel (a cache over a backing file on CPU, over
    host memory on CUDA), except data-parallel ones (replicas are updated densely). On CPU a
    FUSED_UVM table is a FUSED one (host memory is where CPU tables live); on CUDA UVM without a
    cache is not placed by these kernels: refuse rather than put the table in device memory."""
    for name, ps in plan.items():
        caching = ps.compute_kernel is EmbeddingComputeKernel.FUSED_UVM_CACHING
        if caching and ps.sharding_type is ShardingType.DATA_PARALLEL:
            raise ValueError(
                f"table {name!r}: a data-parallel table cannot be cached (fused_uvm_caching); "
                "shard it table-wise or row-wise, or use EmbeddingComputeKernel.FUSED"
            )
        if device.type == "cuda" and ps.compute_kernel is EmbeddingComputeKernel.FUSED_UVM:
            raise ValueError(
                f"table {name!r}: compute kernel {ps.compute_kernel} (UVM without a cache) is "
                "not available for sharded CUDA tables; use fused_uvm_caching or fused"
            )


def with_cache_load_factor(
    plan: Mapping[str, ParameterSharding], fused_params: Mapping[str, Any] | None,
) -> dict[str, ParameterSharding]:
    """``plan`` with the sharder's ``fused_params["cache_load_factor"]`` (TorchRec's key) as
    the load factor of every FUSED_UVM_CACHING table whose plan gives none."""
    clf = (fused_params or {}).get("cache_load_factor")
    out = dict(plan)
    if clf is None:
        return out
    for name, ps in plan.items():
        if ps.compute_kernel is not EmbeddingComputeKernel.FUSED_UVM_CACHING:
            continue
        params = ps.cache_params or CacheParams()
        if params.load_factor is None:
            out[name] = dataclasses.replace(
                ps, cache_params=dataclasses.replace(params, load_factor=float(clf)))
    return out


def planned_caches(plan: Mapping[str, ParameterSharding]) -> dict[str, CacheParams]:
    """The cache settings of the tables ``plan`` puts in FUSED_UVM_CACHING."""
    return {
        name: ps.cache_params or CacheParams()
        for name, ps in plan.items()
        if ps.compute_kernel is EmbeddingComputeKernel.FUSED_UVM_CACHING
    }
