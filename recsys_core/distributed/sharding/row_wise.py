"""Row-wise and table-row-wise sharding: pooled (``RwPooledSharding``) and sequence
(``RwSequenceSharding``, row-wise only; see ``sequence.py`` for how rows travel back).

A table's rows are split in blocks over the ranks of a *domain*: every rank for ROW_WISE, the
ranks of one host for TABLE_ROW_WISE. Each id goes to the rank owning its row:

    input_dist:  bucketize ids by row block, shift them to shard-local rows, KJT all-to-all
    lookup:      partial SUM pooling over the local rows, for the global batch
    output_dist: reduce-scatter inside the domain (sums the partials), then, when there are
                 several hosts, an all-to-all between the ranks with the same local index, so
                 row traffic stays inside a host. MEAN divides by the bag length at the end.

Example, ROW_WISE, 2 ranks, table of 10 rows (rows 0-4 on rank 0, 5-9 on rank 1), one bag
[3, 7]: rank 0 looks up row 3, rank 1 looks up local row 2 (= 7 - 5), the reduce-scatter
adds them on the bag's rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from recsys_core.distributed.awaitable import Awaitable, FunctionAwaitable
from recsys_core.distributed.comm import all_to_all_1d, reduce_scatter_dim0
from recsys_core.distributed.dist_data import bucketize_by_row
from recsys_core.distributed.sharding.local_kernels import KernelContext
from recsys_core.distributed.sharding.sequence import SequenceBatch, SequenceStrategyBase
from recsys_core.distributed.sharding.shards import ShardedTable, Slot
from recsys_core.distributed.sharding.strategy import StrategyBase
from recsys_core.distributed.types import CommOp, ShardingEnv
from recsys_core.kernels.packed import (
    ColumnPermutation,
    column_permutation,
    permute_parts,
    select_columns,
)
from recsys_core.modules.embedding_configs import PoolingType
from recsys_core.sparse import KeyedJaggedTensor


class RwPooledSharding(StrategyBase):
    """ROW_WISE tables (``domain_size = world_size``) or TABLE_ROW_WISE tables
    (``domain_size = local_world_size``; a table's shards all sit on one host)."""

    def __init__(
        self,
        tables: Sequence[ShardedTable],
        env: ShardingEnv,
        ctx: KernelContext,
        *,
        domain_size: int,
        domain_group: dist.ProcessGroup | None,
        cross_group: dist.ProcessGroup | None,
    ) -> None:
        super().__init__(tables, env, ctx)
        self._scatter_codecs = ctx.codecs(CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER)
        self._a2a_codecs = ctx.codecs(CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL)
        self._domain_size = domain_size
        self._num_domains = env.world_size // domain_size
        self._domain_group, self._cross_group = domain_group, cross_group
        self._mean = [t.config.pooling is PoolingType.MEAN for t in tables for _ in t.embedding_names]
        self._dims = [t.config.embedding_dim for t in tables for _ in t.embedding_names]
        self._domain_of_feature: list[int] = []
        self._owners: list[torch.Tensor] = []  # per feature: rank of each row block
        self._starts: list[torch.Tensor] = []  # per feature: first row of each block
        # slots per rank: every feature whose table has a shard on that rank
        self._slots: list[list[Slot]] = [[] for _ in range(env.world_size)]
        for t in tables:
            shards = sorted(t.shards, key=lambda sh: sh.row_offset)
            # empty blocks own no rows: leave them out of routing (their offset is arbitrary)
            owning = [sh for sh in shards if sh.rows > 0]
            domain = shards[0].rank // domain_size
            for feature in t.embedding_names:
                self._domain_of_feature.append(domain)
                self._owners.append(torch.tensor([sh.rank for sh in owning]))
                self._starts.append(torch.tensor([sh.row_offset for sh in owning]))
                for sh in shards:
                    # SUM kernels for all: partial means do not add up, full sums do
                    self._slots[sh.rank].append(Slot(feature, sh, PoolingType.SUM))
        self._build_kernels(self._slots[env.rank], ctx)
        self._my_domain = env.rank // domain_size
        self._domain_features = [
            [i for i, d in enumerate(self._domain_of_feature) if d == dom]
            for dom in range(self._num_domains)
        ]
        self._dims_by_domain = [sum(self._dims[i] for i in f) for f in self._domain_features]
        self._columns = self._column_index()
        feature_index = self._feature_index()
        self._features_per_dest = [
            [feature_index[s.feature] for s in slots] for slots in self._slots
        ]

    def _column_index(self) -> ColumnPermutation | None:
        """Received blocks come domain by domain (each in feature order); map to output order."""
        start, offset = {}, 0
        for feats in self._domain_features:
            for i in feats:
                start[i] = offset
                offset += self._dims[i]
        columns: list[int] = []
        for i, d in enumerate(self._dims):
            columns.extend(range(start[i], start[i] + d))
        return column_permutation(columns)

    def input_dist(self, features: KeyedJaggedTensor) -> Awaitable[KeyedJaggedTensor]:
        return bucketize_by_row(
            features, self._starts, self._owners, self._features_per_dest,
            [s.key for s in self._slots[self._env.rank]], self._env, self._is_weighted,
            variable_batch=True,
        ).exchange

    def output_dist(
        self,
        pooled: torch.Tensor,
        local_features: KeyedJaggedTensor,
        batch_size_per_rank: Sequence[int] | None = None,
    ) -> Awaitable[torch.Tensor]:
        """``pooled``: partial sums ``[sum(batch_size_per_rank), dim]``, source rank 0's
        samples first (None: every rank's batch is this rank's)."""
        batch = local_features.stride()
        if batch_size_per_rank is not None and any(b != batch for b in batch_size_per_rank):
            return self._output_dist_uneven(pooled, local_features, list(batch_size_per_rank))
        size, hosts = self._domain_size, self._num_domains
        dim = pooled.shape[1]
        if hosts > 1:
            # rows arrive ordered by source rank; group them by local index for the scatter
            order = torch.arange(self._env.world_size * batch, device=pooled.device)
            order = order.view(hosts, size, batch).transpose(0, 1).reshape(-1)
            pooled = pooled.index_select(0, order)
        scattered = reduce_scatter_dim0(pooled, self._domain_group, self._scatter_codecs)
        lengths = local_features.lengths()
        # [hosts * batch, dim]: this local index's samples of every host
        return FunctionAwaitable(
            lambda: self._finish(scattered.wait(), [batch * dim] * hosts, lengths, batch)
        )

    def _output_dist_uneven(
        self, pooled: torch.Tensor, local_features: KeyedJaggedTensor, sizes: list[int]
    ) -> Awaitable[torch.Tensor]:
        """The output dist when ranks' batch sizes differ: the reduce-scatter becomes an
        uneven all-to-all plus a local sum (each rank receives every domain member's partial
        sums of its own samples; the gradient is divided by the group size alike).

        Rank ``h * size + j`` is local index ``j`` of host ``h``. Inside a host, local index
        ``j`` receives the samples of ranks ``(h, j)`` of every host ``h``; across hosts, the
        ranks of one local index then swap them, as in the equal-batch path."""
        batch = local_features.stride()
        size, hosts = self._domain_size, self._num_domains
        dim = pooled.shape[1]
        rank = self._env.rank
        # samples of each chunk j: those of ranks (h, j), host by host
        per_chunk = [[sizes[h * size + j] for h in range(hosts)] for j in range(size)]
        if hosts > 1:
            starts = [sum(sizes[:r]) for r in range(len(sizes))]
            order = torch.cat([
                torch.arange(starts[h * size + j], starts[h * size + j] + sizes[h * size + j])
                for j in range(size) for h in range(hosts)
            ]).to(pooled.device)
            pooled = pooled.index_select(0, order)
        mine = per_chunk[rank % size]
        chunk_rows = sum(mine)
        inflight = all_to_all_1d(
            pooled, [sum(c) * dim for c in per_chunk], [chunk_rows * dim] * size,
            self._domain_group, self._scatter_codecs,
        )
        lengths = local_features.lengths()
        return FunctionAwaitable(lambda: self._finish(
            inflight.wait().view(size, chunk_rows, dim).sum(dim=0), [b * dim for b in mine],
            lengths, batch,
        ))

    def _finish(
        self, summed: torch.Tensor, cross_splits: list[int], lengths: torch.Tensor, batch: int
    ) -> torch.Tensor:
        """This rank's ``[batch, dim]`` output from the domain-summed rows of its local index:
        with several hosts, first an all-to-all (``cross_splits``: what goes to each host)
        between the ranks of one local index, which brings each host's domain columns; then
        output column order and MEAN pooling."""
        if self._num_domains == 1:
            return self._apply_mean(select_columns(summed, self._columns), lengths, batch)
        dims = self._dims_by_domain
        sizes = [batch * d for d in dims]
        cross = all_to_all_1d(
            summed, cross_splits, sizes, self._cross_group, self._a2a_codecs
        ).wait()
        blocks = [c.view(batch, d) for c, d in zip(cross.split(sizes), dims, strict=True)]
        return self._apply_mean(permute_parts(blocks, self._columns), lengths, batch)

    def _apply_mean(self, out: torch.Tensor, lengths: torch.Tensor, batch: int) -> torch.Tensor:
        if not any(self._mean):
            return out
        scales = []
        for i, d in enumerate(self._dims):
            if self._mean[i]:
                n = lengths[i * batch : (i + 1) * batch].clamp(min=1).to(out.dtype)
                scales.append((1.0 / n).unsqueeze(1).expand(batch, d))
            else:
                scales.append(out.new_ones(batch, d))
        return out * torch.cat(scales, dim=1)


class RwSequenceSharding(SequenceStrategyBase):
    """ROW_WISE tables of one EmbeddingCollection: each id goes to the rank owning its row."""

    def __init__(self, tables: Sequence[ShardedTable], env: ShardingEnv, ctx: KernelContext) -> None:
        super().__init__(tables, env, ctx)
        self._owners: list[torch.Tensor] = []  # per feature: rank of each non-empty row block
        self._starts: list[torch.Tensor] = []  # per feature: first row of each non-empty block
        for t in tables:
            # Empty shards own no row; leaving them out keeps the bucketing right wherever the
            # plan says an empty shard starts.
            blocks = sorted((sh for sh in t.shards if sh.rows), key=lambda sh: sh.row_offset)
            for _ in t.embedding_names:
                self._owners.append(torch.tensor([sh.rank for sh in blocks]))
                self._starts.append(torch.tensor([sh.row_offset for sh in blocks]))
        # Rows come back grouped by owner rank, ascending (the stable sort by destination).
        where = {(s.feature, r): j for r, sl in enumerate(self._slots) for j, s in enumerate(sl)}
        self._assembly = [
            [(r, where[(f, r)]) for r in sorted({sh.rank for sh in t.shards})]
            for t in tables
            for f in t.embedding_names
        ]

    def input_dist(self, features: KeyedJaggedTensor) -> Awaitable[SequenceBatch]:
        buckets = bucketize_by_row(
            features, self._starts, self._owners, self._slot_features,
            [s.key for s in self._slots[self._env.rank]], self._env, False, variable_batch=True,
        )
        restore: list[torch.Tensor | None] = []
        for order in buckets.orders:
            inverse = torch.empty_like(order)
            inverse[order] = torch.arange(order.numel(), device=order.device)
            restore.append(inverse)
        per_owner = buckets.ids_per_dest
        sent = [[per_owner[i][r] for i in feats] for r, feats in enumerate(self._slot_features)]
        return self._batch(buckets.exchange, sent, restore)

    def _assemble(self, blocks: list[list[torch.Tensor]], batch: SequenceBatch) -> list[torch.Tensor]:
        out = []
        for parts, inverse in zip(self._assembly, batch.restore, strict=True):
            by_owner = torch.cat([blocks[r][j] for r, j in parts])
            # index_select is differentiable: gradients go back to the owner-ordered rows
            out.append(by_owner if inverse is None else by_owner.index_select(0, inverse))
        return out
