"""Data-parallel tables: a full replica on every rank.

No input or output communication: each rank looks up its own batch. In backward, the torch
kernel sums each table's gradient (and which rows were touched) over all ranks before the fused
update, so every replica applies the same exact update as the unsharded module on the global
batch: by all-gathering the touched rows when few rows are touched (world * rows touched <
table rows), else by all-reducing a dense [rows, dim + 1] buffer. Replicas start equal: rank
0's weights are broadcast at construction.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from recsys_core.distributed.awaitable import Awaitable, LazyNoWait
from recsys_core.distributed.comm import all_reduce_sum_
from recsys_core.distributed.comm_ops import get_gradient_division
from recsys_core.distributed.sharding.common import (
    KernelContext,
    LocalKernels,
    ShardedTable,
    Slot,
    column_permutation,
    select_columns,
)
from recsys_core.distributed.types import ShardingEnv
from recsys_core.kernels.config import KernelBackend
from recsys_core.kernels.torch_tbe import TorchTableBatchedEmbedding
from recsys_core.modules.embedding_configs import PoolingType
from recsys_core.sparse import KeyedJaggedTensor


class ReplicaLayout:
    """Where a collection's data-parallel features sit in a rank's replica kernels: the slots
    (SUM tables first, then MEAN: one kernel per pooling type), the input permutation into
    slot order and the column permutation back to the collection's feature order. Shared by
    the fused (:class:`DpPooledSharding`) and DENSE (``DpDenseSharding``) replicas."""

    def __init__(self, tables: Sequence[ShardedTable], rank: int) -> None:
        self.output_features = [f for t in tables for f in t.embedding_names]
        by_table = {sh.table: sh for t in tables for sh in t.shards if sh.rank == rank}
        self.slots = [
            Slot(f, by_table[t.config.name], pooling)
            for pooling in (PoolingType.SUM, PoolingType.MEAN)
            for t in tables if t.config.pooling is pooling
            for f in t.embedding_names
        ]
        self._input_order = [self.output_features.index(s.feature) for s in self.slots]
        dims = [s.shard.cols for s in self.slots]
        starts = [sum(dims[:i]) for i in range(len(dims))]
        position = {s.feature: i for i, s in enumerate(self.slots)}
        self._columns = column_permutation([
            c for f in self.output_features
            for c in range(starts[position[f]], starts[position[f]] + dims[position[f]])
        ])

    def input_dist(self, features: KeyedJaggedTensor) -> Awaitable[KeyedJaggedTensor]:
        if self._input_order == list(range(len(self._input_order))):
            return LazyNoWait(features)
        return LazyNoWait(features.permute(self._input_order))

    def output_dist(self, pooled: torch.Tensor) -> Awaitable[torch.Tensor]:
        return LazyNoWait(select_columns(pooled, self._columns))


class DpPooledSharding:
    """DATA_PARALLEL tables of one collection (always on the torch kernel, whose backward can
    sum gradients across ranks before updating)."""

    def __init__(
        self,
        tables: Sequence[ShardedTable],
        env: ShardingEnv,
        ctx: KernelContext,
    ) -> None:
        self._env, self._is_weighted = env, ctx.is_weighted
        self._layout = ReplicaLayout(tables, env.rank)
        self.output_features = self._layout.output_features
        configs = {t.config.name: t.config for t in tables}
        self.local = LocalKernels(self._layout.slots, ctx, configs, backend=KernelBackend.TORCH)
        for kernel in self.local.kernels:
            assert isinstance(kernel, TorchTableBatchedEmbedding)
            kernel.gradient_reducer = self._make_reducer(kernel)
            if env.pg is not None and env.world_size > 1 and ctx.device.type != "meta":
                dist.broadcast(kernel.weights, src=0, group=env.pg)

    def _make_reducer(
        self, kernel: TorchTableBatchedEmbedding
    ) -> Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        group = self._env.pg
        world = self._env.world_size

        def reduce(
            table: int, rows: torch.Tensor, grads: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor]:
            if group is None or world == 1:
                return rows, grads
            num_rows, dim = kernel.rows[table], kernel.dims[table]
            most = torch.tensor([rows.numel()], dtype=torch.int64)
            dist.all_reduce(most, op=dist.ReduceOp.MAX, group=group)
            most_rows = int(most.item())  # same value on every rank: same path everywhere
            # The replicas step on the MEAN of the ranks' gradients, as DistributedDataParallel
            # averages the dense part's (and TorchRec's data-parallel tables, which DDP wraps);
            # on the sum with gradient division off (comm_ops).
            scale = 1.0 / world if get_gradient_division() else 1.0
            if world * most_rows < num_rows:
                touched, summed = _sparse_sum(rows, grads, most_rows, world, group)
                return touched, summed.mul_(scale)
            dense = grads.new_zeros(num_rows, dim + 1)
            dense[rows, :dim] = grads
            dense[rows, dim] = 1.0  # touched on this rank
            all_reduce_sum_(dense, group)
            touched = dense[:, dim].nonzero().squeeze(1)
            return touched, dense.index_select(0, touched)[:, :dim].mul_(scale)

        return reduce

    def input_dist(self, features: KeyedJaggedTensor) -> Awaitable[KeyedJaggedTensor]:
        return self._layout.input_dist(features)

    def lookup(self, features: KeyedJaggedTensor) -> torch.Tensor:
        return self.local.lookup(features, self._is_weighted)

    def output_dist(
        self,
        pooled: torch.Tensor,
        local_features: KeyedJaggedTensor,
        batch_size_per_rank: Sequence[int] | None = None,
    ) -> Awaitable[torch.Tensor]:
        return self._layout.output_dist(pooled)


def _sparse_sum(
    rows: torch.Tensor, grads: torch.Tensor, most_rows: int, world: int,
    group: dist.ProcessGroup,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum row gradients over ranks by gathering only the touched rows (padded to the largest
    count; padding rows carry id -1 and are dropped)."""
    padded_rows = rows.new_full((most_rows,), -1)
    padded_rows[: rows.numel()] = rows
    padded_grads = grads.new_zeros(most_rows, grads.shape[1])
    padded_grads[: rows.numel()] = grads
    all_rows = [torch.empty_like(padded_rows) for _ in range(world)]
    all_grads = [torch.empty_like(padded_grads) for _ in range(world)]
    dist.all_gather(all_rows, padded_rows, group=group)
    dist.all_gather(all_grads, padded_grads, group=group)
    gathered_rows, gathered_grads = torch.cat(all_rows), torch.cat(all_grads)
    keep = gathered_rows >= 0
    unique, inverse = torch.unique(gathered_rows[keep], return_inverse=True)
    summed = grads.new_zeros(unique.numel(), grads.shape[1]).index_add_(0, inverse, gathered_grads[keep])
    return unique, summed
