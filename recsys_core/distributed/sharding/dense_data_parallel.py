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

from recsys_core.distributed.awaitable import Awaitable
from recsys_core.distributed.sharding.common import KernelContext, LocalKernels, ShardedTable
from recsys_core.distributed.sharding.data_parallel import ReplicaLayout
from recsys_core.distributed.types import ShardingEnv
from recsys_core.sparse import KeyedJaggedTensor


class DpDenseSharding:
    """DATA_PARALLEL tables on the DENSE kernel: each rank looks up its own batch in its
    replica; no communication (the replicas' gradients are averaged by DDP, see the module
    docstring). Replicas start equal: rank 0's weights are broadcast at construction."""

    def __init__(self, tables: Sequence[ShardedTable], env: ShardingEnv, ctx: KernelContext) -> None:
        self._is_weighted = ctx.is_weighted
        self._layout = ReplicaLayout(tables, env.rank)
        self.output_features = self._layout.output_features
        configs = {t.config.name: t.config for t in tables}
        self.local = LocalKernels(self._layout.slots, ctx, configs)
        for kernel in self.local.kernels:
            kernel.replicated = True
        if env.pg is not None and env.world_size > 1 and ctx.device.type != "meta":
            for kernel in self.local.kernels:
                for w in kernel.split_embedding_weights():
                    dist.broadcast(w, src=0, group=env.pg)

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
