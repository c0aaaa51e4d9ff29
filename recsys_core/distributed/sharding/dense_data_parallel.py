"""Data-parallel tables on the DENSE kernel: replicas whose weights are parameters.

Each rank looks up its own batch in its replica; no communication in forward. The strategy
sums the replicas' gradients over the ranks itself, once per backward, after autograd has
accumulated them (one sum of all its tables' gradients), and divides by the world size under
gradient division (``comm_ops``, on by default): the replicas take the step of the MEAN of the
ranks' losses, like every other table, and stay bitwise equal, with or without
``DistributedModelParallel`` around them. TorchRec gets the mean by wrapping each
data-parallel lookup in its own DistributedDataParallel; ``DistributedModelParallel``'s DDP
leaves these weights alone (its output may hold no tensor DDP can see, e.g. a lone
collection's ``KeyedTensor``, and then DDP's static graph never reduces anything).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.autograd import Variable

from recsys_core.distributed.comm import all_reduce_sum_
from recsys_core.distributed.comm_ops import get_gradient_division
from recsys_core.distributed.sharding.data_parallel import ReplicaSharding
from recsys_core.distributed.sharding.local_kernels import KernelContext
from recsys_core.distributed.sharding.shards import ShardedTable
from recsys_core.distributed.types import ShardingEnv
from recsys_core.sparse import KeyedJaggedTensor


class DpDenseSharding(ReplicaSharding):
    """DATA_PARALLEL tables on the DENSE kernel: each rank looks up its own batch in its
    replica; no communication in forward; the replicas' gradients are summed over the ranks
    (and divided by their number under gradient division) at the end of each backward.
    Replicas start equal: rank 0's weights are broadcast at construction. A collection marked by
    ``mark_data_parallel_skip_grad_sync`` skips the sum: each replica keeps its own gradient."""

    def __init__(self, tables: Sequence[ShardedTable], env: ShardingEnv, ctx: KernelContext) -> None:
        super().__init__(tables, env, ctx)
        self._build_kernels(self._replica_slots, ctx)
        group = env.pg if env.world_size > 1 else None
        # A collection marked by mark_data_parallel_skip_grad_sync: no sum in backward.
        self._group = group if ctx.sync_replica_gradients else None
        self._sum_queued = False
        if group is not None and ctx.device.type != "meta":
            for kernel in self.local.kernels:
                for w in kernel.split_embedding_weights():
                    dist.broadcast(w, src=0, group=group)

    def lookup(self, features: KeyedJaggedTensor) -> torch.Tensor:
        pooled = super().lookup(features)
        if self._group is not None and pooled.requires_grad:
            pooled.register_hook(self._queue_gradient_sum)
        return pooled

    def _queue_gradient_sum(self, grad: torch.Tensor) -> None:
        # Runs in backward when the pooled output's gradient is known; the weights' gradients
        # are accumulated later in the same backward, so the sum waits for its end.
        # Once per backward, however many lookups fed it (every rank does the same count).
        if not self._sum_queued:
            self._sum_queued = True
            Variable._execution_engine.queue_callback(self._sum_gradients)

    def _sum_gradients(self) -> None:
        self._sum_queued = False
        weights = [w for kernel in self.local.kernels for w in kernel.parameters()]
        for w in weights:
            if w.grad is None:  # untouched on this rank: its share of the sum is zero
                w.grad = torch.zeros_like(w)
        scale = 1.0 / dist.get_world_size(self._group) if get_gradient_division() else 1.0
        for dtype in dict.fromkeys(w.dtype for w in weights):
            grads = [w.grad for w in weights if w.dtype == dtype]
            if any(g.is_sparse for g in grads):
                raise ValueError(
                    "data-parallel DENSE tables need dense gradients; build the module without "
                    "sparse gradients"
                )
            flat = all_reduce_sum_(torch.cat([g.reshape(-1) for g in grads]), self._group)
            if scale != 1.0:
                flat.mul_(scale)
            start = 0
            for g in grads:
                g.copy_(flat[start:start + g.numel()].view_as(g))
                start += g.numel()
