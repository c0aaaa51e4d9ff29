"""Data-parallel tables on the DENSE kernel: replicas whose weights are parameters.

Each rank looks up its own batch in its replica; no communication in forward. The replicas'
gradients are averaged over ranks by the DistributedDataParallel that
``DistributedModelParallel`` wraps the dense part in (TorchRec's data-parallel tables); a
sharded module used without it leaves that to the caller, as TorchRec's does.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from recsys_core.distributed.awaitable import Awaitable, LazyNoWait
from recsys_core.distributed.sharding.common import (
    KernelContext,
    LocalKernels,
    ShardedTable,
    Slot,
    column_permutation,
    select_columns,
)
from recsys_core.distributed.types import ShardingEnv
from recsys_core.modules.embedding_configs import PoolingType
from recsys_core.sparse import KeyedJaggedTensor


class DpDenseSharding:
    """DATA_PARALLEL tables on the DENSE kernel: each rank looks up its own batch in its
    replica; no communication (the replicas' gradients are averaged by DDP, see the module
    docstring). Replicas start equal: rank 0's weights are broadcast at construction."""

    def __init__(self, tables: Sequence[ShardedTable], env: ShardingEnv, ctx: KernelContext) -> None:
        self._is_weighted = ctx.is_weighted
        self.output_features = [f for t in tables for f in t.embedding_names]
        by_table = {sh.table: sh for t in tables for sh in t.shards if sh.rank == env.rank}
        slots = [
            Slot(f, by_table[t.config.name], pooling)
            for pooling in (PoolingType.SUM, PoolingType.MEAN)
            for t in tables if t.config.pooling is pooling
            for f in t.embedding_names
        ]
        self.local = LocalKernels(slots, ctx, {t.config.name: t.config for t in tables})
        for kernel in self.local.kernels:
            kernel.replicated = True
        if env.pg is not None and env.world_size > 1 and ctx.device.type != "meta":
            for kernel in self.local.kernels:
                for w in kernel.split_embedding_weights():
                    dist.broadcast(w, src=0, group=env.pg)
        self._input_order = [self.output_features.index(s.feature) for s in slots]
        dims = [s.shard.cols for s in slots]
        starts = [sum(dims[:i]) for i in range(len(dims))]
        position = {s.feature: i for i, s in enumerate(slots)}
        self._columns = column_permutation([
            c for f in self.output_features
            for c in range(starts[position[f]], starts[position[f]] + dims[position[f]])
        ])

    def input_dist(self, features: KeyedJaggedTensor) -> Awaitable[KeyedJaggedTensor]:
        if self._input_order == list(range(len(self._input_order))):
            return LazyNoWait(features)
        return LazyNoWait(features.permute(self._input_order))

    def lookup(self, features: KeyedJaggedTensor) -> torch.Tensor:
        return self.local.lookup(features, self._is_weighted)

    def output_dist(
        self, pooled: torch.Tensor, local_features: KeyedJaggedTensor
    ) -> Awaitable[torch.Tensor]:
        return LazyNoWait(select_columns(pooled, self._columns))
