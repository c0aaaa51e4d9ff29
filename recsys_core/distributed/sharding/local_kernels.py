"""One rank's kernels for one strategy: the context they are built with (device, optimizer,
backend, where the rows come from) and the kernels holding the rank's shards."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from recsys_core.distributed.batched_embedding_kernel import dense_kernel_builder
from recsys_core.distributed.sharding.kernel_plan import DEFAULT_LOAD_FACTOR
from recsys_core.distributed.sharding.shards import ShardSpec, Slot
from recsys_core.distributed.table_init import TableInitializer, TableRegion
from recsys_core.distributed.types import (
    CommOp,
    QuantizedCommCodecs,
)
from recsys_core.kernels.batched import BatchedTables
from recsys_core.kernels.cached_tbe import CachedTableBatchedEmbedding, TableCache, cache_slots
from recsys_core.kernels.config import FusedOptimizerConfig, KernelBackend
from recsys_core.kernels.packed import (
    PackedKernelSpec,
    PackedTable,
    column_permutation,
    select_columns,
)
from recsys_core.modules.embedding_configs import BaseEmbeddingConfig, PoolingType, table_dtype
from recsys_core.plan.params import CacheParams
from recsys_core.sparse import KeyedJaggedTensor


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
