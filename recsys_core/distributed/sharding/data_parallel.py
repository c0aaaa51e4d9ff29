"""Data-parallel tables: a full replica on every rank.

No input or output communication: each rank looks up its own batch. In backward, the torch
kernel sums each table's gradient (and which rows were touched) over all ranks before the fused
update, so every replica applies the same exact update as the unsharded module on the global
batch: by gathering the touched rows when few rows are touched (world * rows touched <
table rows), else by summing a dense [rows, dim + 1] buffer; all tables of a kernel in one
exchange per backward (a sum of the row counts, then one of the payloads). Replicas start
equal: rank 0's weights are broadcast at construction.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from recsys_core.distributed.awaitable import Awaitable, LazyNoWait
from recsys_core.distributed.comm import all_reduce_sum_
from recsys_core.distributed.comm_ops import get_gradient_division
from recsys_core.distributed.sharding.local_kernels import KernelContext
from recsys_core.distributed.sharding.shards import ShardedTable, Slot
from recsys_core.distributed.sharding.strategy import StrategyBase
from recsys_core.distributed.types import ShardingEnv
from recsys_core.kernels.config import KernelBackend
from recsys_core.kernels.packed import column_permutation, select_columns
from recsys_core.kernels.torch_tbe import TorchTableBatchedEmbedding
from recsys_core.modules.embedding_configs import PoolingType
from recsys_core.sparse import KeyedJaggedTensor


class ReplicaSharding(StrategyBase):
    """What both data-parallel strategies do alike (the fused replicas of
    :class:`DpPooledSharding` and the DENSE ones of ``DpDenseSharding``): where the collection's
    features sit in this rank's replica kernels, the slots (SUM tables first, then MEAN: one
    kernel per pooling type); the input dist permutes the local features into slot order, the
    output dist permutes the pooled columns back to the collection's feature order (no
    communication in forward)."""

    def __init__(self, tables: Sequence[ShardedTable], env: ShardingEnv, ctx: KernelContext) -> None:
        super().__init__(tables, env, ctx)
        by_table = {sh.table: sh for t in tables for sh in t.shards if sh.rank == env.rank}
        self._replica_slots = [
            Slot(f, by_table[t.config.name], pooling)
            for pooling in (PoolingType.SUM, PoolingType.MEAN)
            for t in tables if t.config.pooling is pooling
            for f in t.embedding_names
        ]
        self._input_order = [self.output_features.index(s.feature) for s in self._replica_slots]
        dims = [s.shard.cols for s in self._replica_slots]
        starts = [sum(dims[:i]) for i in range(len(dims))]
        position = {s.feature: i for i, s in enumerate(self._replica_slots)}
        self._columns = column_permutation([
            c for f in self.output_features
            for c in range(starts[position[f]], starts[position[f]] + dims[position[f]])
        ])

    def input_dist(self, features: KeyedJaggedTensor) -> Awaitable[KeyedJaggedTensor]:
        if self._input_order == list(range(len(self._input_order))):
            return LazyNoWait(features)
        return LazyNoWait(features.permute(self._input_order))

    def output_dist(
        self,
        pooled: torch.Tensor,
        local_features: KeyedJaggedTensor,
        batch_size_per_rank: Sequence[int] | None = None,
    ) -> Awaitable[torch.Tensor]:
        return LazyNoWait(select_columns(pooled, self._columns))


class DpPooledSharding(ReplicaSharding):
    """DATA_PARALLEL tables of one collection (always on the torch kernel, whose backward can
    sum gradients across ranks before updating)."""

    def __init__(self, tables: Sequence[ShardedTable], env: ShardingEnv, ctx: KernelContext) -> None:
        super().__init__(tables, env, ctx)
        self._build_kernels(self._replica_slots, ctx, backend=KernelBackend.TORCH)
        for kernel in self.local.kernels:
            assert isinstance(kernel, TorchTableBatchedEmbedding)
            if ctx.sync_replica_gradients:  # else each replica steps on its own gradient
                kernel.gradient_reducer = self._make_reducer(kernel)
            if env.pg is not None and env.world_size > 1 and ctx.device.type != "meta":
                dist.broadcast(kernel.weights, src=0, group=env.pg)

    def _make_reducer(
        self, kernel: TorchTableBatchedEmbedding
    ) -> Callable[[list[tuple[int, torch.Tensor, torch.Tensor]]],
                  list[tuple[torch.Tensor, torch.Tensor]]]:
        """The kernel's ``gradient_reducer``: (table rows, touched rows, summed grads) entries
        -> the same rows' gradients summed over the ranks (see :func:`_sum_over_ranks`)."""
        group = self._env.pg
        world, rank = self._env.world_size, self._env.rank

        def reduce(
            touched: list[tuple[int, torch.Tensor, torch.Tensor]],
        ) -> list[tuple[torch.Tensor, torch.Tensor]]:
            if group is None or world == 1 or not touched:
                return [(rows, grads) for _, rows, grads in touched]
            # The replicas step on the MEAN of the ranks' gradients, as DistributedDataParallel
            # averages the dense part's (and TorchRec's data-parallel tables, which DDP wraps);
            # on the sum with gradient division off (comm_ops).
            scale = 1.0 / world if get_gradient_division() else 1.0
            most = _most_rows([rows.numel() for _, rows, _ in touched], world, rank, group)
            return _sum_over_ranks(touched, most, world, rank, group, scale)

        return reduce


def _most_rows(counts: list[int], world: int, rank: int, group: dist.ProcessGroup) -> list[int]:
    """Each table's largest touched-row count over the ranks (the same list on every rank, so
    every rank takes the same path per table): one sum of a [world, tables] buffer in which
    each rank fills its own row."""
    every = torch.zeros(world, len(counts), dtype=torch.int64)
    every[rank] = torch.tensor(counts, dtype=torch.int64)
    return all_reduce_sum_(every, group).amax(0).tolist()


def _sum_over_ranks(
    touched: list[tuple[int, torch.Tensor, torch.Tensor]], most: list[int], world: int,
    rank: int, group: dist.ProcessGroup, scale: float,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every entry's (a table of ``rows`` rows, its touched rows and their gradients) rows and
    gradients summed over the ranks: all entries in one float sum, plus one int64 sum for the
    ids of gathered entries, instead of collectives per table.

    An entry whose ranks touch few rows (world * most < its rows) is gathered: each rank writes
    its rows (padded with id -1 to ``most``) and their gradients into its own slot of a buffer
    that is zero elsewhere, so the sum hands every rank every rank's part unchanged; the parts
    are then added rank by rank in row order. (A gather through the sum, rather than the
    transport's all-gather, keeps gathered and summed entries in the same collective.) Any
    other entry is summed densely: a [rows, dim + 1] buffer of its gradients and a touched flag
    per row."""
    grads0 = touched[0][2]
    floats, ids = [], []  # per table: (offset, length) in the float / id buffer
    float_size = id_size = 0
    for (rows, _, grads), n in zip(touched, most, strict=True):
        dim = grads.shape[1]
        if world * n < rows:
            floats.append((float_size, world * n * dim))
            ids.append((id_size, world * n))
            id_size += world * n
        else:
            floats.append((float_size, rows * (dim + 1)))
            ids.append(None)
        float_size += floats[-1][1]
    flat = grads0.new_zeros(float_size)
    flat_ids = torch.zeros(id_size, dtype=torch.int64, device=grads0.device)
    for (num_rows, rows, grads), n, (f0, fn), id_at in zip(touched, most, floats, ids,
                                                           strict=True):
        dim = grads.shape[1]
        if id_at is None:
            dense = flat[f0:f0 + fn].view(num_rows, dim + 1)
            dense[rows, :dim] = grads
            dense[rows, dim] = 1.0  # touched on this rank
            continue
        mine = slice(id_at[0] + rank * n, id_at[0] + (rank + 1) * n)
        flat_ids[mine] = -1
        flat_ids[mine][: rows.numel()] = rows
        flat[f0 + rank * n * dim:f0 + (rank + 1) * n * dim].view(n, dim)[: rows.numel()] = grads
    all_reduce_sum_(flat, group)
    if id_size:
        all_reduce_sum_(flat_ids, group)
    out = []
    for (num_rows, _, grads), n, (f0, fn), id_at in zip(touched, most, floats, ids,
                                                        strict=True):
        dim = grads.shape[1]
        if id_at is None:
            dense = flat[f0:f0 + fn].view(num_rows, dim + 1)
            rows = dense[:, dim].nonzero().squeeze(1)
            out.append((rows, dense.index_select(0, rows)[:, :dim].mul_(scale)))
            continue
        gathered_rows = flat_ids[id_at[0]:id_at[0] + id_at[1]]
        gathered_grads = flat[f0:f0 + fn].view(world * n, dim)
        keep = gathered_rows >= 0
        unique, inverse = torch.unique(gathered_rows[keep], return_inverse=True)
        summed = grads.new_zeros(unique.numel(), dim).index_add_(0, inverse, gathered_grads[keep])
        out.append((unique, summed.mul_(scale)))
    return out
