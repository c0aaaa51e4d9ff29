"""Table-wise, column-wise and table-column-wise sharding: pooled (``TwPooledSharding``) and
sequence (``TwSequenceSharding``, see ``sequence.py`` for how rows travel back).

Every shard covers all rows of its table (a whole table, or a block of its columns), so each
bag is sent whole to every rank holding a shard of its feature's table:

    input_dist:  KJT all-to-all; feature f goes to each rank holding a shard of f's table
    lookup:      pooled rows for the global batch, one column block per (feature, shard)
    output_dist: pooled all-to-all back to each sample's rank; column shards are concatenated
                 in column order to rebuild the table's full dim

Example, 2 ranks, tables A (rank 0) and B (columns 0:4 on rank 0, 4:8 on rank 1), batch 2:
rank 0 looks up A and B[:, 0:4] for all 4 samples; rank 1 looks up B[:, 4:8]; rank 0 then
receives [2, dA + 4] from itself and [2, 4] from rank 1 and assembles [A | B].
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from recsys_core.distributed.awaitable import Awaitable, FunctionAwaitable
from recsys_core.distributed.comm import all_to_all_1d, pooled_all_to_all_assembled
from recsys_core.distributed.dist_data import send_whole_bags
from recsys_core.distributed.sharding.local_kernels import KernelContext
from recsys_core.distributed.sharding.sequence import SequenceBatch, SequenceStrategyBase
from recsys_core.distributed.sharding.shards import ShardedTable, Slot
from recsys_core.distributed.sharding.strategy import StrategyBase
from recsys_core.distributed.types import CommOp, ShardingEnv
from recsys_core.kernels.packed import ColumnPermutation, column_permutation, permute_received
from recsys_core.modules.embedding_configs import PoolingType
from recsys_core.sparse import KeyedJaggedTensor


def slots_by_rank(tables: Sequence[ShardedTable], world_size: int) -> list[list[Slot]]:
    """Each rank's lookups in output order: SUM tables first, then MEAN; table, shard, feature.

    Shard before feature keeps each shard's features adjacent in the kernel's feature map.
    """
    out: list[list[Slot]] = [[] for _ in range(world_size)]
    for pooling in (PoolingType.SUM, PoolingType.MEAN):
        for t in tables:
            if t.config.pooling is not pooling:
                continue
            for shard in t.shards:
                for feature in t.embedding_names:
                    out[shard.rank].append(Slot(feature, shard, pooling))
    return out


def whole_bag_routing(
    slots: list[list[Slot]], index: dict[str, int]
) -> tuple[list[int], list[int]]:
    """What :func:`send_whole_bags` needs: the input feature (``index`` of its name) of every
    slot, rank by rank, and each rank's slot count."""
    return [index[s.feature] for sl in slots for s in sl], [len(sl) for sl in slots]


class TwPooledSharding(StrategyBase):
    """TABLE_WISE / COLUMN_WISE / TABLE_COLUMN_WISE tables of one collection."""

    def __init__(self, tables: Sequence[ShardedTable], env: ShardingEnv, ctx: KernelContext) -> None:
        super().__init__(tables, env, ctx)
        self._codecs = ctx.codecs(CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL)
        self._slots = slots_by_rank(tables, env.world_size)
        self._build_kernels(self._slots[env.rank], ctx)
        self._send_order, self._send_counts = whole_bag_routing(self._slots, self._feature_index())
        self._dims = [sum(s.shard.cols for s in slots) for slots in self._slots]
        self._columns = self._column_index(tables)

    def _column_index(self, tables: Sequence[ShardedTable]) -> ColumnPermutation | None:
        """Maps received columns (source rank, slot) to output columns (feature, full dim)."""
        start: dict[tuple[str, int, int], int] = {}
        offset = 0
        for slots in self._slots:
            for s in slots:
                start[(s.feature, s.shard.rank, s.shard.col_offset)] = offset
                offset += s.shard.cols
        columns: list[int] = []
        for t in tables:
            shards = sorted(t.shards, key=lambda sh: sh.col_offset)
            for feature in t.embedding_names:
                for sh in shards:
                    begin = start[(feature, sh.rank, sh.col_offset)]
                    columns.extend(range(begin, begin + sh.cols))
        return column_permutation(columns)

    def input_dist(self, features: KeyedJaggedTensor) -> Awaitable[KeyedJaggedTensor]:
        return send_whole_bags(
            features, self._send_order, self._send_counts,
            [s.key for s in self._slots[self._env.rank]], self._env, self._is_weighted,
            variable_batch=True,
        )

    def output_dist(
        self,
        pooled: torch.Tensor,
        local_features: KeyedJaggedTensor,
        batch_size_per_rank: Sequence[int] | None = None,
    ) -> Awaitable[torch.Tensor]:
        """``pooled``: ``[sum(batch_size_per_rank), local dim]``, source rank 0's samples
        first (None: every rank's batch is this rank's)."""
        batch = local_features.stride()
        world = self._env.world_size
        sizes = [batch] * world if batch_size_per_rank is None else batch_size_per_rank
        in_splits = [b * self.local.output_dim for b in sizes]
        out_splits = [batch * d for d in self._dims]
        direct = self._direct_exchange(pooled, sizes, batch)
        if direct is not None:
            return direct
        inflight = all_to_all_1d(pooled, in_splits, out_splits, self._env.pg, self._codecs)

        def assemble() -> torch.Tensor:
            # one slice copy per run of output columns, straight from the received chunks
            return permute_received(inflight.wait(), batch, self._dims, self._columns)

        return FunctionAwaitable(assemble)


    def _direct_exchange(
        self, pooled: torch.Tensor, sizes: Sequence[int], batch: int
    ) -> Awaitable[torch.Tensor] | None:
        """Through shared memory, unencoded: the received parts go straight to their output
        columns (:func:`pooled_all_to_all_assembled`); None elsewhere."""
        if self._codecs is not None and not self._codecs.is_identity():
            return None
        dims = tuple(self._dims)
        if self._columns is None:
            starts = [sum(dims[:p]) for p in range(len(dims))]
            runs = tuple((p, 0, starts[p], d) for p, d in enumerate(dims) if d)
        else:
            placement = self._columns.placement(dims)
            if not placement.bijective:
                return None
            runs = placement.copies
        return pooled_all_to_all_assembled(pooled, sizes, batch, dims, runs, self._env.pg)


class TwSequenceSharding(SequenceStrategyBase):
    """TABLE_WISE and COLUMN_WISE tables of one EmbeddingCollection.

    Every shard spans all rows, so each feature's ids go whole to every rank holding a shard of
    its table; column shards' rows are concatenated in column order.
    """

    def __init__(self, tables: Sequence[ShardedTable], env: ShardingEnv, ctx: KernelContext) -> None:
        super().__init__(tables, env, ctx)
        self._send_order, self._send_counts = whole_bag_routing(self._slots, self._feature_index())
        # per output feature: (rank, slot index) of each of its table's shards, in column order
        where = {
            (s.feature, s.shard): (r, j)
            for r, slots in enumerate(self._slots)
            for j, s in enumerate(slots)
        }
        self._assembly = [
            [where[(f, sh)] for sh in sorted(t.shards, key=lambda sh: sh.col_offset)]
            for t in tables
            for f in t.embedding_names
        ]

    def input_dist(self, features: KeyedJaggedTensor) -> Awaitable[SequenceBatch]:
        ids = send_whole_bags(
            features, self._send_order, self._send_counts,
            [s.key for s in self._slots[self._env.rank]], self._env, False, variable_batch=True,
        )
        local_counts = features.length_per_key()
        # a whole-table shard looks up every id of its feature: all of them come back
        sent = [[local_counts[i] for i in feats] for feats in self._slot_features]
        return self._batch(ids, sent, [None] * len(self.output_features))

    def _assemble(self, blocks: list[list[torch.Tensor]], batch: SequenceBatch) -> list[torch.Tensor]:
        out = []
        for parts in self._assembly:
            pieces = [blocks[r][j] for r, j in parts]
            out.append(pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1))
        return out
