"""Sequence (unpooled) sharding of an EmbeddingCollection: what its strategies share.

The strategies themselves live with their pooled counterparts, one file per sharding type:
``table_wise.TwSequenceSharding`` and ``row_wise.RwSequenceSharding``.

An unpooled lookup returns one row per id, so the rows themselves travel back, not pooled bags.
A strategy owns some tables of the collection and implements three steps:

    input_dist(local KJT)     -> awaitable SequenceBatch: the ids this rank's shards look up
                                 (global batch) and how many rows each shard will send back here
    lookup(batch)             -> one row per received id, per local (feature, shard) slot
    output_dist(rows, batch)  -> awaitable ``[n_ids, dim]`` rows per feature, in input id order

Lookups reuse the pooled table-batched kernels: every id becomes a bag of length one (SUM), so
each pooled "bag" is exactly one id's row and the fused backward applies the exact update. A
kernel needs the same bag count per feature, so slot ``i`` with ``n_i`` ids is padded with
empty bags up to ``max(n)`` (empty bags read nothing, get no gradient and update nothing);
the padded output is ``[max(n), sum(cols)]``, so very uneven slots cost some transient memory.

Table/column-wise example, 2 ranks, batch 1 each, table A (8 columns) on rank 1, feature "a":

    rank 0 input a: [[3, 5]]               rank 1 input a: [[4]]
    input dist:  rank 1 receives a = [[3, 5], [4]]   (global batch, rank 0's samples first)
    lookup:      rank 1 reads A[3], A[5], A[4]       -> [3, 8]
    output dist: [A[3], A[5]] (2 x 8 floats) go to rank 0, [A[4]] stays on rank 1
    column-wise: with A[:, 0:4] on rank 0 and A[:, 4:8] on rank 1, rank 0 receives [2, 4] from
                 each and concatenates them in column order to [2, 8].

Row-wise example, table A of 10 rows (0-4 on rank 0, 5-9 on rank 1), rank 0's bag [7, 2, 9]:

    bucketize:   owners [1, 0, 1]; stable sort by owner -> order [1, 0, 2]
                 rank 0 gets local id [2], rank 1 local ids [2, 4] (= 7 - 5, 9 - 5)
    output dist: rank 0 receives [A[2]] from itself and [A[7], A[9]] from rank 1
    restore:     rows in owner order [A[2], A[7], A[9]] -> index_select(inverse of order)
                 -> [A[7], A[2], A[9]], the input order

All row movement is one differentiable all-to-all per strategy (``all_to_all_1d``), issued on
every rank even when it sends nothing, so backward's reverse all-to-all stays in step.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from recsys_core.distributed.awaitable import Awaitable, FunctionAwaitable
from recsys_core.distributed.comm import all_to_all_1d
from recsys_core.distributed.dist_data import SparseFeaturesAllToAll
from recsys_core.distributed.sharding.local_kernels import KernelContext, LocalKernels
from recsys_core.distributed.sharding.shards import ShardedTable, Slot
from recsys_core.distributed.sharding.strategy import StrategyBase
from recsys_core.distributed.types import CommOp, QuantizedCommCodecs, ShardingEnv
from recsys_core.modules.embedding_configs import PoolingType
from recsys_core.sparse import KeyedJaggedTensor


@dataclass(frozen=True)
class SequenceBatch:
    """One batch between input dist and output dist.

    Attributes:
        features: the ids this rank's shards look up: keys are this rank's slot keys, stride is
            the global batch (source rank 0's samples first).
        sent: ``sent[o][j]`` = how many of this rank's ids slot ``j`` of rank ``o`` looks up,
            i.e. how many rows it sends back here.
        restore: per output feature, the index that puts received rows back in input order
            (None when they already arrive in input order).
        batch_size_per_rank: each source rank's batch size (ranks may differ); ``features``
            holds their samples in rank order, ``sum(batch_size_per_rank)`` in all.
    """

    features: KeyedJaggedTensor
    sent: list[list[int]]
    restore: list[torch.Tensor | None]
    batch_size_per_rank: list[int]


class SequenceSharding(Protocol):
    """The interface every sequence strategy implements (see the module docstring)."""

    output_features: list[str]
    local: LocalKernels

    def input_dist(self, features: KeyedJaggedTensor) -> Awaitable[SequenceBatch]: ...

    def lookup(self, batch: SequenceBatch) -> list[torch.Tensor]: ...

    def output_dist(
        self, rows: list[torch.Tensor], batch: SequenceBatch
    ) -> Awaitable[list[torch.Tensor]]: ...


def sequence_slots(tables: Sequence[ShardedTable], world_size: int) -> list[list[Slot]]:
    """Each rank's lookups: table, then shard, then feature (a shard's features stay adjacent,
    which FBGEMM needs for exact updates of a table shared by several features)."""
    out: list[list[Slot]] = [[] for _ in range(world_size)]
    for t in tables:
        for shard in t.shards:
            for feature in t.embedding_names:
                out[shard.rank].append(Slot(feature, shard, PoolingType.SUM))
    return out


def return_rows(
    rows: list[torch.Tensor],
    batch: SequenceBatch,
    slots: list[list[Slot]],
    env: ShardingEnv,
    codecs: QuantizedCommCodecs | None = None,
) -> Callable[[], list[list[torch.Tensor]]]:
    """Start the all-to-all that sends each looked-up row back to its id's rank.

    Returns a function that waits and gives ``blocks[o][j]``: the ``[sent[o][j], cols]`` rows
    slot ``j`` of rank ``o`` looked up for this rank's ids, in the order this rank sent them.
    """
    world, mine = env.world_size, slots[env.rank]
    received = batch.features
    sizes = batch.batch_size_per_rank
    # received ids are feature-major, source-major inside a feature: count per (slot, source)
    per_source: list[list[int]] = []
    if mine and all(b == sizes[0] for b in sizes):
        per_source = received.lengths().reshape(len(mine), world, sizes[0]).sum(dim=2).tolist()
    elif mine:
        by_slot = received.lengths().reshape(len(mine), sum(sizes))
        per_source = torch.stack(
            [part.sum(dim=1) for part in by_slot.split(sizes, dim=1)], dim=1
        ).tolist()
    chunks = [r.split(c) for r, c in zip(rows, per_source, strict=True)]
    send = [chunks[i][src].reshape(-1) for src in range(world) for i in range(len(mine))]
    in_splits = [
        sum(per_source[i][src] * s.shard.cols for i, s in enumerate(mine)) for src in range(world)
    ]
    out_sizes = [
        [n * s.shard.cols for n, s in zip(batch.sent[o], slots[o], strict=True)]
        for o in range(world)
    ]
    out_splits = [sum(sizes) for sizes in out_sizes]
    device = received.values().device
    buffer = torch.cat(send) if send else torch.zeros(0, device=device)
    inflight = all_to_all_1d(buffer, in_splits, out_splits, env.pg, codecs)

    def blocks() -> list[list[torch.Tensor]]:
        flat = inflight.wait()
        return [
            [
                b.view(n, s.shard.cols)
                for b, n, s in zip(piece.split(out_sizes[o]), batch.sent[o], slots[o], strict=True)
            ]
            for o, piece in enumerate(flat.split(out_splits))
        ]

    return blocks


class SequenceStrategyBase(StrategyBase, abc.ABC):
    """What every sequence strategy does alike: its slots (:func:`sequence_slots`) and their
    kernels, the input features each rank's slots read (``_slot_features``), one row per id as
    the lookup, and the output dist: the rows go back (:func:`return_rows`) and
    :meth:`_assemble` puts them in output order. A strategy adds its input dist and
    :meth:`_assemble`."""

    def __init__(self, tables: Sequence[ShardedTable], env: ShardingEnv, ctx: KernelContext) -> None:
        super().__init__(tables, env, ctx)
        self._codecs = ctx.codecs(CommOp.SEQUENCE_EMBEDDINGS_ALL_TO_ALL)
        self._slots = sequence_slots(tables, env.world_size)
        self._build_kernels(self._slots[env.rank], ctx)
        index = self._feature_index()
        self._slot_features = [[index[s.feature] for s in sl] for sl in self._slots]

    def lookup(self, batch: SequenceBatch) -> list[torch.Tensor]:
        return self.local.lookup_rows(batch.features)

    def output_dist(
        self, rows: list[torch.Tensor], batch: SequenceBatch
    ) -> Awaitable[list[torch.Tensor]]:
        blocks = return_rows(rows, batch, self._slots, self._env, self._codecs)
        return FunctionAwaitable(lambda: self._assemble(blocks(), batch))

    @abc.abstractmethod
    def _assemble(self, blocks: list[list[torch.Tensor]], batch: SequenceBatch) -> list[torch.Tensor]:
        """Per output feature, its rows in input order, from ``blocks[o][j]`` (see
        :func:`return_rows`)."""

    @staticmethod
    def _batch(
        ids: SparseFeaturesAllToAll, sent: list[list[int]], restore: list[torch.Tensor | None]
    ) -> Awaitable[SequenceBatch]:
        """The input dist's result once ``ids`` (the KJT all-to-all in flight) arrives."""
        return FunctionAwaitable(
            lambda: SequenceBatch(ids.wait(), sent, restore, ids.batch_size_per_rank)
        )
