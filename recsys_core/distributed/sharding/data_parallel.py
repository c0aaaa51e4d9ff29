"""Data-parallel tables: a full replica on every rank.

No input or output communication: each rank looks up its own batch. In backward, the torch
kernel sums each table's gradient (and which rows were touched) over all ranks before the fused
update, so every replica applies the same exact update as the unsharded module on the global
batch. Replicas start equal: rank 0's weights are broadcast at construction.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from recsys_core.distributed.awaitable import Awaitable, LazyNoWait
from recsys_core.distributed.comm import all_reduce_sum_
from recsys_core.distributed.sharding.common import LocalKernels, ShardedTable, Slot
from recsys_core.distributed.types import ShardingEnv
from recsys_core.kernels.config import FusedOptimizerConfig, KernelBackend
from recsys_core.kernels.torch_tbe import TorchTableBatchedEmbedding
from recsys_core.modules.embedding_configs import PoolingType
from recsys_core.sparse import KeyedJaggedTensor


class DpPooledSharding:
    """DATA_PARALLEL tables of one collection (always on the torch kernel, whose backward can
    sum gradients across ranks before updating)."""

    def __init__(
        self,
        tables: Sequence[ShardedTable],
        env: ShardingEnv,
        device: torch.device,
        optimizer: FusedOptimizerConfig,
        is_weighted: bool,
        source: dict[str, torch.Tensor] | None,
    ) -> None:
        self._env, self._is_weighted = env, is_weighted
        self.output_features = [f for t in tables for f in t.config.feature_names]
        mine = [sh for t in tables for sh in t.shards if sh.rank == env.rank]
        by_table = {sh.table: sh for sh in mine}
        slots = [
            Slot(f, by_table[t.config.name], pooling)
            for pooling in (PoolingType.SUM, PoolingType.MEAN)
            for t in tables if t.config.pooling is pooling
            for f in t.config.feature_names
        ]
        configs = {t.config.name: t.config for t in tables}
        self.local = LocalKernels(
            slots, optimizer, device, is_weighted, KernelBackend.TORCH, source, configs
        )
        for kernel in self.local.kernels:
            assert isinstance(kernel, TorchTableBatchedEmbedding)
            kernel.gradient_reducer = self._make_reducer(kernel)
            if env.pg is not None and env.world_size > 1 and device.type != "meta":
                dist.broadcast(kernel.weights, src=0, group=env.pg)
        slot_index = {s.feature: i for i, s in enumerate(slots)}
        self._input_order = [
            self.output_features.index(s.feature) for s in slots
        ]
        dims = [s.shard.cols for s in slots]
        starts = [sum(dims[:i]) for i in range(len(dims))]
        columns: list[int] = []
        for f in self.output_features:
            i = slot_index[f]
            columns.extend(range(starts[i], starts[i] + dims[i]))
        self._columns = torch.tensor(columns, dtype=torch.long)

    def _make_reducer(self, kernel: TorchTableBatchedEmbedding):  # noqa: ANN202
        group = self._env.pg

        def reduce(
            table: int, rows: torch.Tensor, grads: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor]:
            num_rows, dim = kernel.rows[table], kernel.dims[table]
            dense = grads.new_zeros(num_rows, dim + 1)
            dense[rows, :dim] = grads
            dense[rows, dim] = 1.0  # touched on this rank
            all_reduce_sum_(dense, group)
            touched = dense[:, dim].nonzero().squeeze(1)
            return touched, dense.index_select(0, touched)[:, :dim]

        return reduce

    def input_dist(self, features: KeyedJaggedTensor) -> Awaitable[KeyedJaggedTensor]:
        return LazyNoWait(features.permute(self._input_order))

    def lookup(self, features: KeyedJaggedTensor) -> torch.Tensor:
        return self.local.lookup(features, self._is_weighted)

    def output_dist(
        self, pooled: torch.Tensor, local_features: KeyedJaggedTensor
    ) -> Awaitable[torch.Tensor]:
        return LazyNoWait(pooled.index_select(1, self._columns.to(pooled.device)))
