"""TorchRec's ``torchrec.distributed.mc_embedding_modules`` path: what the sharded
managed-collision embedding collections (bag and sequence) share.

A sharded managed-collision collection is a sharded ManagedCollisionCollection in front of
the sharded embedding collection, both row-wise with one plan, so that the rows a rank's
remapping module hands out are the rows its table shard holds::

    features (raw ids) -> MCC input dist -> remap on the owning rank (+ evictions: the rows
    given to new ids are re-initialised with their optimizer state) -> MCC output dist
    (global rows, the input's positions) -> sharded EBC / EC -> embeddings

The remapped ids travel back to their rank and then forward again through the embedding
collection's own input dist (two id all-to-alls more than TorchRec, which looks the rows up
where they were remapped), so the embedding collection is the ordinary sharded one.

Checkpoints: the remapping state loads as a pending row-indexed state; the first forward
after a load installs it, moving every id whose rank changed (another world size) to its new
rank together with its embedding row and optimizer state. (It waits for that forward because
a checkpoint loads the optimizer state after the model.)
"""

from __future__ import annotations

import abc
import logging
import math
from collections.abc import Mapping
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from recsys_core.distributed.awaitable import LazyAwaitable, LazyNoWait
from recsys_core.distributed.embedding_types import BaseEmbeddingSharder
from recsys_core.distributed.mc_modules import (
    ManagedCollisionCollectionSharder,
    ShardedManagedCollisionCollection,
)
from recsys_core.distributed.types import (
    EmbeddingComputeKernel,
    EmbeddingModuleShardingPlan,
    ParameterSharding,
    QuantizedCommCodecs,
    ShardingEnv,
    ShardingType,
)
from recsys_core.modules.embedding_configs import BaseEmbeddingConfig
from recsys_core.sparse import KeyedJaggedTensor

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=nn.Module)
_INT64_MAX = torch.iinfo(torch.int64).max


def check_mc_plan(kind: str, plan: Mapping[str, ParameterSharding]) -> None:
    """Managed-collision tables shard row-wise with the FUSED kernel (evicted rows are reset
    in the kernel's storage)."""
    for table, ps in plan.items():
        if ps.sharding_type is not ShardingType.ROW_WISE:
            raise ValueError(
                f"{kind}: table {table!r} is planned {ps.sharding_type.value}; managed-collision "
                "tables shard row_wise only (rows are handed out per rank)"
            )
        if ps.compute_kernel is not EmbeddingComputeKernel.FUSED:
            raise ValueError(
                f"{kind}: table {table!r} is planned with the {ps.compute_kernel.value} kernel; "
                "managed-collision tables run the fused kernel only (evicted rows are reset "
                "in its storage)"
            )


class BaseShardedManagedCollisionEmbeddingCollection(nn.Module):
    """The sharded embedding collection (``_embedding_module``) behind the sharded
    ManagedCollisionCollection (``_managed_collision_collection``).

    ``forward(features)`` returns ``(embeddings, remapped KJT or None)`` as LazyAwaitables,
    the unsharded module's pair.
    """

    remaps_features = True
    """Its embedding collection looks up remapped ids, not the model's input: training
    pipelines do not start that collection's input dist early (``prefetching_modules``)."""

    def __init__(
        self,
        module: nn.Module,
        table_name_to_parameter_sharding: Mapping[str, ParameterSharding],
        e_sharder: BaseEmbeddingSharder[Any],
        mc_sharder: ManagedCollisionCollectionSharder,
        env: ShardingEnv,
        device: torch.device,
    ) -> None:
        super().__init__()
        plan = dict(table_name_to_parameter_sharding)
        check_mc_plan(f"Sharded{type(module).__name__}", plan)
        self._device, self._env = torch.device(device), env
        self.bagged: bool = hasattr(module._embedding_module, "embedding_bag_configs")
        self._embedding_module = e_sharder.shard(
            module._embedding_module, EmbeddingModuleShardingPlan(plan), env, self._device
        )
        self._managed_collision_collection: ShardedManagedCollisionCollection = (
            mc_sharder.shard(module._managed_collision_collection, plan, env, device=self._device)
        )
        self._return_remapped_features: bool = module._return_remapped_features
        self._allow_in_place_embed_weight_update: bool = (
            module._allow_in_place_embed_weight_update
        )
        self._table_name_to_config: dict[str, BaseEmbeddingConfig] = dict(
            module._managed_collision_collection._table_name_to_config
        )

    @property
    def fused_optimizer(self) -> Any:
        return self._embedding_module.fused_optimizer

    def forward(
        self, features: KeyedJaggedTensor
    ) -> tuple[LazyAwaitable[Any], LazyAwaitable[KeyedJaggedTensor] | None]:
        mcc = self._managed_collision_collection
        if mcc.has_pending_state():
            self.install_loaded_state()
        ctx = mcc.create_context()
        received = mcc.input_dist(ctx, features).wait().wait()
        local = mcc.compute(ctx, received)
        self._evict(mcc.evict())
        remapped = mcc.output_dist(ctx, local).wait()
        embeddings = self._embedding_module(remapped)
        return embeddings, (LazyNoWait(remapped) if self._return_remapped_features else None)

    # ---- evictions ----------------------------------------------------------------------------
    def _evict(self, evictions_per_table: Mapping[str, torch.Tensor | None]) -> None:
        """Re-initialise the rows given to new ids (the table's init, as at construction) and
        zero their optimizer state."""
        if all(rows is None or rows.numel() == 0 for rows in evictions_per_table.values()):
            return
        shards = self._embedding_module.table_shards()
        for table, rows in evictions_per_table.items():
            if rows is None or rows.numel() == 0:
                continue
            (shard,) = shards[table]
            rows = rows.to(device=shard.weight.device, dtype=torch.int64)
            logger.debug("table %s: resetting %d rows given to new ids", table, rows.numel())
            with torch.no_grad():
                shard.weight[rows] = _fresh_rows(
                    self._table_name_to_config[table], rows.numel(), shard.weight
                )
                for state in shard.state.values():
                    if state.dim() >= 1:
                        state[rows] = 0

    # ---- loading a remapping state ------------------------------------------------------------
    def install_loaded_state(self) -> None:
        """Install the loaded remapping state (collective: every rank calls it, as the first
        forward after a load does): each id goes to the rank its value routes to, with its
        embedding row and optimizer state; the rank's miss row is kept free. When a rank gets
        more ids than it has rows, the ones its eviction policy ranks highest stay (a warning
        counts the others)."""
        mcc = self._managed_collision_collection
        shards = self._embedding_module.table_shards()
        for table in mcc._managed_collision_modules:
            (shard,) = shards[table]
            mcc.set_row_state(table, _rehome(mcc, table, shard.weight, shard.state))


def _fresh_rows(config: BaseEmbeddingConfig, n: int, like: torch.Tensor) -> torch.Tensor:
    fresh = torch.empty(n, like.size(1), dtype=like.dtype, device=like.device)
    if config.init_fn is not None:
        returned = config.init_fn(fresh)
        if isinstance(returned, torch.Tensor):
            fresh = returned.to(like.dtype)
        return fresh
    return fresh.uniform_(config.get_weight_init_min(), config.get_weight_init_max())


def _exchange(
    x: torch.Tensor, send: list[int], recv: list[int], env: ShardingEnv
) -> torch.Tensor:
    """Uneven all-to-all of the rows of a 2-D tensor (synchronous)."""
    if env.pg is None or env.world_size == 1:
        return x
    width = x.shape[1]
    out = x.new_empty(sum(recv), width)
    dist.all_to_all_single(
        out.view(-1), x.contiguous().view(-1), [n * width for n in recv],
        [n * width for n in send], group=env.pg,
    )
    return out


def _rehome(
    mcc: ShardedManagedCollisionCollection, table: str, weight: torch.Tensor,
    optimizer_state: Mapping[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    env = mcc.env
    offset, rows, _ = mcc._mc_module_name_shard_metadata[table]
    state = {k: v.clone() for k, v in mcc.row_state(table).items()}
    meta_names = [k for k in state if k != "raw"]
    states = [v for v in optimizer_state.values() if v.dim() >= 1 and v.size(0) == rows]
    raw = state["raw"]
    index = torch.arange(rows, device=raw.device)
    miss = rows - 1
    valid = raw != _INT64_MAX
    home = mcc.route(table, raw)
    moving = valid & ~((home == env.rank) & (index != miss))
    out_rows = moving.nonzero().squeeze(1)
    out_rows = out_rows[torch.argsort(home[out_rows], stable=True)]
    send = torch.bincount(home[out_rows], minlength=env.world_size)
    if env.pg is not None and env.world_size > 1:
        recv_t = torch.empty_like(send)
        dist.all_to_all_single(recv_t, send, group=env.pg)
    else:
        recv_t = send
    send_l, recv_l = send.tolist(), recv_t.tolist()
    ints = torch.stack([raw[out_rows]] + [state[m][out_rows] for m in meta_names], dim=1)
    widths = [math.prod(s.shape[1:]) for s in states]
    with torch.no_grad():
        floats = torch.cat(
            [weight[out_rows].float()]
            + [s[out_rows].reshape(len(out_rows), w).float() for s, w in zip(states, widths, strict=True)],
            dim=1,
        )
    got_ints = _exchange(ints, send_l, recv_l, env)
    got_floats = _exchange(floats, send_l, recv_l, env)

    raw[moving] = _INT64_MAX
    for m in meta_names:
        state[m][moving] = 0
    free = ((raw == _INT64_MAX) & (index != miss)).nonzero().squeeze(1)
    arriving = got_ints.shape[0]
    keep = torch.arange(arriving, device=raw.device)
    if arriving > free.numel():
        if meta_names:  # highest first by the policy's first metadata (counts, last access)
            keep = torch.argsort(got_ints[:, 1], descending=True, stable=True)
        keep = keep[: free.numel()]
        logger.warning(
            "table %s, rank %d: %d ids route here after resharding but only %d rows are free; "
            "%d ids are dropped (they get new rows when they come back)",
            table, env.rank, arriving, free.numel(), arriving - free.numel(),
        )
    targets = free[: keep.numel()]
    raw[targets] = got_ints[keep, 0]
    for i, m in enumerate(meta_names):
        state[m][targets] = got_ints[keep, 1 + i]
    with torch.no_grad():
        dim = weight.shape[1]
        weight[targets] = got_floats[keep, :dim].to(weight.dtype)
        col = dim
        for s, width in zip(states, widths, strict=True):
            s[targets] = got_floats[keep, col : col + width].reshape(-1, *s.shape[1:]).to(s.dtype)
            col += width
    return state


class BaseManagedCollisionEmbeddingCollectionSharder(BaseEmbeddingSharder[M]):
    """Pairs the embedding collection's sharder (``_e_sharder``) with the collision module's
    (``_mc_sharder``): the sharding types both accept (row-wise), the fused kernel, the
    embedding sharder's parameters and fused parameters."""

    def __init__(
        self,
        e_sharder: BaseEmbeddingSharder[Any],
        mc_sharder: ManagedCollisionCollectionSharder,
        qcomm_codecs_registry: Mapping[str, QuantizedCommCodecs] | None = None,
    ) -> None:
        super().__init__(qcomm_codecs_registry=qcomm_codecs_registry)
        self._e_sharder = e_sharder
        self._mc_sharder = mc_sharder

    def shardable_parameters(self, module: M) -> dict[str, nn.Parameter]:
        return self._e_sharder.shardable_parameters(module._embedding_module)

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        # TorchRec also lists the UVM and key-value kernels; evictions reset rows in the fused
        # kernel's storage here.
        return [EmbeddingComputeKernel.FUSED.value]

    def sharding_types(self, compute_device_type: str) -> list[str]:
        mc = set(self._mc_sharder.sharding_types(compute_device_type))
        return [t for t in self._e_sharder.sharding_types(compute_device_type) if t in mc]

    @property
    def fused_params(self) -> dict[str, Any] | None:
        return self._e_sharder.fused_params

    @property
    @abc.abstractmethod
    def sharded_module_type(self) -> type[nn.Module]:
        """The sharded class this sharder builds (its constructor takes the module, its plan,
        the embedding and collision sharders, env and device)."""

    def sharded_module(
        self, module: M, params: Mapping[str, ParameterSharding], env: ShardingEnv,
        device: torch.device,
    ) -> nn.Module:
        return self.sharded_module_type(
            module, params, self._embedding_sharder(module), self._mc_sharder, env, device
        )

    def _embedding_sharder(self, module: M) -> BaseEmbeddingSharder[Any]:
        """The sharder of ``module``'s embedding collection: ``_e_sharder``."""
        return self._e_sharder


__all__ = [
    "BaseManagedCollisionEmbeddingCollectionSharder",
    "BaseShardedManagedCollisionEmbeddingCollection",
    "check_mc_plan",
]
