"""The strategy protocol every sharding type implements, and what strategies check alike.

A strategy owns some tables of an EmbeddingBagCollection and implements three steps:

    input_dist(local KJT)      -> awaitable KJT of the ids this rank's shards look up
    lookup(KJT)                -> pooled rows for those shards
    output_dist(pooled, KJT, batch_size_per_rank)
                               -> awaitable [local batch, sum of its features' dims]

Ranks may use different batch sizes: the input dist reports every rank's
(``dist_data.batch_sizes``) and the output dist sends each rank its own rows.

The output columns follow ``output_features`` (each feature at its table's full dim).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from recsys_core.distributed.awaitable import Awaitable
from recsys_core.distributed.sharding.local_kernels import KernelContext, LocalKernels
from recsys_core.distributed.sharding.shards import ShardedTable, Slot
from recsys_core.distributed.types import ShardingEnv
from recsys_core.kernels.config import KernelBackend
from recsys_core.sparse import KeyedJaggedTensor


class PooledSharding(Protocol):
    """The interface every strategy implements (see the module docstring)."""

    output_features: list[str]
    local: LocalKernels

    def input_dist(self, features: KeyedJaggedTensor) -> Awaitable[KeyedJaggedTensor]: ...

    def lookup(self, features: KeyedJaggedTensor) -> torch.Tensor: ...

    def output_dist(
        self,
        pooled: torch.Tensor,
        local_features: KeyedJaggedTensor,
        batch_size_per_rank: Sequence[int] | None = None,
    ) -> Awaitable[torch.Tensor]: ...


def require_process_group(env: ShardingEnv, module: str) -> None:
    """Sharding over several ranks needs a process group: without one every collective would
    degenerate to a local copy and the results would be silently wrong."""
    if env.pg is None and env.world_size > 1:
        raise ValueError(
            f"{module}: sharding over {env.world_size} ranks needs a process group; build the "
            "environment with ShardingEnv.from_process_group(pg) (from_local is for planning "
            "and single-rank use)"
        )


class StrategyBase:
    """The defaults every strategy starts from: its ``env``, whether lookups carry per-sample
    weights, ``output_features`` (its tables' embedding names, in table order), the position of
    each of them, local kernels over this rank's slots, and the pooled lookup through them."""

    output_features: list[str]
    local: LocalKernels

    def __init__(self, tables: Sequence[ShardedTable], env: ShardingEnv, ctx: KernelContext) -> None:
        self._env, self._is_weighted = env, ctx.is_weighted
        self._configs = {t.config.name: t.config for t in tables}
        self.output_features = [f for t in tables for f in t.embedding_names]

    def _feature_index(self) -> dict[str, int]:
        """Each output feature's position in ``output_features``."""
        return {f: i for i, f in enumerate(self.output_features)}

    def _build_kernels(
        self, slots: Sequence[Slot], ctx: KernelContext, backend: KernelBackend | None = None,
    ) -> None:
        self.local = LocalKernels(slots, ctx, self._configs, backend=backend)

    def lookup(self, features: KeyedJaggedTensor) -> torch.Tensor:
        return self.local.lookup(features, self._is_weighted)
