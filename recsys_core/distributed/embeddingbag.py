"""``ShardedEmbeddingBagCollection`` and ``EmbeddingBagCollectionSharder``.

The sharded module splits the collection's tables by sharding type into strategies (see
``sharding/``), runs each strategy's input dist -> lookup -> output dist, and reassembles one
KeyedTensor in the unsharded module's key order. ``forward`` returns a LazyAwaitable.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from recsys_core.distributed.awaitable import Awaitable, LazyAwaitable
from recsys_core.distributed.sharded_state import (
    LocalShard,
    ShardedFusedOptimizer,
    export_tensor,
    import_tensor,
    shards_by_table,
)
from recsys_core.distributed.sharding.common import (
    ColumnPermutation,
    PooledSharding,
    ShardedTable,
    check_kernel_placement,
    column_permutation,
    require_process_group,
    resolve_shards,
    select_columns,
)
from recsys_core.distributed.sharding.data_parallel import DpPooledSharding
from recsys_core.distributed.sharding.row_wise import RwPooledSharding
from recsys_core.distributed.sharding.table_wise import TwPooledSharding
from recsys_core.distributed.sharding_plan import validate_module_sharding_plan
from recsys_core.distributed.types import (
    EmbeddingComputeKernel,
    EmbeddingModuleShardingPlan,
    ParameterSharding,
    ShardingEnv,
    ShardingType,
)
from recsys_core.kernels.config import FusedOptimizerConfig, KernelBackend
from recsys_core.kernels.tbe import IdOutOfRangeError
from recsys_core.modules.embedding_modules import EmbeddingBagCollection, check_features
from recsys_core.optim.fused import EmbeddingFusedOptimizer
from recsys_core.optim.keyed import CombinedOptimizer
from recsys_core.optim.optimizers import recorded_fused_config
from recsys_core.sparse import KeyedJaggedTensor, KeyedTensor

_TW_FAMILY = (ShardingType.TABLE_WISE, ShardingType.COLUMN_WISE, ShardingType.TABLE_COLUMN_WISE)


class _HostGroups:
    """Process subgroups for table-row-wise: one per host and one per local index.

    ``dist.new_group`` is collective, so every rank creates every group in the same order."""

    def __init__(self, env: ShardingEnv) -> None:
        local, hosts = env.local_world_size, env.num_hosts
        self.host: dist.ProcessGroup | None = env.pg
        self.cross: dist.ProcessGroup | None = None
        if env.pg is None or hosts == 1:
            return
        for h in range(hosts):
            group = dist.new_group([h * local + j for j in range(local)])
            if env.host_of(env.rank) == h:
                self.host = group
        for j in range(local):
            group = dist.new_group([h * local + j for h in range(hosts)])
            if env.rank % local == j:
                self.cross = group


class ShardedInputs(list):  # list[Awaitable[KeyedJaggedTensor]]
    """The input dists in flight, one per strategy, with the local features each one was given
    (the output dist needs this rank's lengths and batch size)."""

    def __init__(
        self, awaitables: list[Awaitable[KeyedJaggedTensor]], local_features: list[KeyedJaggedTensor]
    ) -> None:
        super().__init__(awaitables)
        self.local_features = local_features


class EmbeddingBagCollectionAwaitable(LazyAwaitable[KeyedTensor]):
    """The sharded forward's result: waits for every strategy's output dist."""

    def __init__(
        self,
        parts: list[Awaitable[torch.Tensor]],
        keys: list[str],
        length_per_key: list[int],
        columns: ColumnPermutation | None,
    ) -> None:
        super().__init__()
        self._parts, self._keys, self._lengths, self._columns = parts, keys, length_per_key, columns

    def _wait_impl(self) -> KeyedTensor:
        outs = [p.wait() for p in self._parts]
        values = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        values = select_columns(values, self._columns)
        return KeyedTensor(keys=self._keys, length_per_key=self._lengths, values=values)


class ShardedEmbeddingBagCollection(nn.Module):
    """An EmbeddingBagCollection whose tables are sharded over ``env`` according to ``plan``.

    Same input and output as the unsharded module (``forward(...).wait()`` is a KeyedTensor
    equal to the unsharded result). Table updates are fused into backward; ``fused_optimizer``
    exposes their learning rate and state.
    """

    def __init__(
        self,
        module: EmbeddingBagCollection,
        plan: Mapping[str, ParameterSharding],
        env: ShardingEnv,
        device: torch.device,
        optimizer: FusedOptimizerConfig,
        backend: KernelBackend = KernelBackend.AUTO,
    ) -> None:
        super().__init__()
        configs = module.embedding_bag_configs()
        names = [c.name for c in configs]
        missing = [n for n in names if n not in plan]
        if missing:
            raise ValueError(
                f"sharding plan has no entry for table(s) {missing}; every table of the "
                "EmbeddingBagCollection needs one (e.g. table_wise(rank=0))"
            )
        extra = [n for n in plan if n not in names]
        if extra:
            raise ValueError(f"sharding plan names table(s) {extra} that the module lacks: {names}")
        # rejects ranks outside the world, shards that do not tile a table, uneven column
        # splits, DENSE/QUANT kernels... before any communication
        validate_module_sharding_plan(
            module, EmbeddingModuleShardingPlan(plan), env.world_size, env.local_world_size
        )
        check_kernel_placement(plan, device)
        require_process_group(env, "ShardedEmbeddingBagCollection")
        self._env, self._device = env, device
        self._is_weighted = module.is_weighted()
        self._embedding_names = [f for c in configs for f in c.feature_names]
        self._dims = [c.embedding_dim for c in configs for _ in c.feature_names]
        source = None
        if not any(p.is_meta for p in module.parameters()):
            source = {c.name: module.embedding_bags[c.name].weight.detach() for c in configs}
        tables = [resolve_shards(c, plan[c.name], env.world_size) for c in configs]

        def of(*types: ShardingType) -> list[ShardedTable]:
            return [t for t in tables if t.sharding.sharding_type in types]

        common: dict[str, Any] = {"device": device, "optimizer": optimizer, "is_weighted": self._is_weighted, "source": source}
        self._strategies: list[PooledSharding] = []
        if of(*_TW_FAMILY):
            self._strategies.append(TwPooledSharding(of(*_TW_FAMILY), env, backend=backend, **common))
        if of(ShardingType.ROW_WISE):
            self._strategies.append(RwPooledSharding(
                of(ShardingType.ROW_WISE), env, env.world_size, backend=backend,
                domain_group=env.pg, cross_group=None, **common,
            ))
        if of(ShardingType.TABLE_ROW_WISE):
            groups = _HostGroups(env)
            self._strategies.append(RwPooledSharding(
                of(ShardingType.TABLE_ROW_WISE), env, env.local_world_size, backend=backend,
                domain_group=groups.host, cross_group=groups.cross, **common,
            ))
        if of(ShardingType.DATA_PARALLEL):
            self._strategies.append(DpPooledSharding(of(ShardingType.DATA_PARALLEL), env, **common))
        self.lookups = nn.ModuleList([s.local for s in self._strategies])
        self._input_orders: dict[tuple[str, ...], list[list[int]]] = {}
        self._rows = {c.name: c.num_embeddings for c in configs}
        self._feature_rows = {f: c.num_embeddings for c in configs for f in c.feature_names}
        self._id_limits: dict[tuple[str, ...], torch.Tensor] = {}
        order = [f for s in self._strategies for f in s.output_features]
        dims = dict(zip(self._embedding_names, self._dims, strict=True))
        start, pos = {}, 0
        for f in order:
            start[f], pos = pos, pos + dims[f]
        self._columns = column_permutation(
            [start[f] + d for f in self._embedding_names for d in range(dims[f])]
        )
        self._tables = tables
        self._prefetched: deque[tuple[KeyedJaggedTensor, ShardedInputs]] = deque()
        self._fused_optimizer = self._build_optimizer(optimizer)
        self._register_state_dict_hook(_export_tables)
        self._register_load_state_dict_pre_hook(_import_tables, with_module=True)

    def _build_optimizer(self, config: FusedOptimizerConfig) -> ShardedFusedOptimizer:
        optims = []
        kernels = []
        for local in self.lookups:
            for kernel, shards in zip(local.kernels, local.kernel_shards, strict=True):
                params: dict[str, nn.Parameter] = {}
                for sh, view in zip(shards, kernel.split_embedding_weights(), strict=True):
                    # shard weights are not registered parameters: the state dict exposes whole
                    # tables instead, and DDP must never touch them
                    weight = nn.Parameter(view[: sh.rows])
                    params[f"embedding_bags.{sh.table}.weight[{sh.row_offset}:,{sh.col_offset}:]"] = weight
                optim = EmbeddingFusedOptimizer(kernel, params, [sh.table for sh in shards])
                for weight in params.values():
                    weight._in_backward_optimizers = [optim]  # type: ignore[attr-defined]
                optims.append(optim)
                kernels.append(kernel)
        return ShardedFusedOptimizer(
            CombinedOptimizer(optims), self._tables, self.table_shards, self._env, config, kernels
        )

    def table_shards(self) -> dict[str, list[LocalShard]]:
        """This rank's shards of each table: shard geometry, weight view, optimizer state views."""
        return shards_by_table(self.lookups)

    def sharded_tables(self) -> list[ShardedTable]:
        return list(self._tables)

    @property
    def fused_optimizer(self) -> ShardedFusedOptimizer:
        return self._fused_optimizer

    @property
    def env(self) -> ShardingEnv:
        return self._env

    @property
    def strategies(self) -> list[PooledSharding]:
        """The per-sharding-type strategies, in output order (for benchmarks and debugging)."""
        return list(self._strategies)

    def input_dist(self, features: KeyedJaggedTensor) -> ShardedInputs:
        """Start every strategy's input all-to-all (checks ids first: no bad id is sent)."""
        check_features(features, self._embedding_names, "ShardedEmbeddingBagCollection", self._is_weighted)
        self._check_ids(features)
        keys = tuple(features.keys())
        if keys not in self._input_orders:
            index = {k: i for i, k in enumerate(keys)}
            self._input_orders[keys] = [[index[f] for f in s.output_features] for s in self._strategies]
        local = [
            features if order == list(range(len(keys))) else features.permute(order)
            for order in self._input_orders[keys]
        ]
        return ShardedInputs(
            [s.input_dist(kjt) for s, kjt in zip(self._strategies, local, strict=True)], local
        )

    def _check_ids(self, features: KeyedJaggedTensor) -> None:
        """One pass (and one host sync) over all ids against each feature's table size."""
        keys = features.keys()
        limits = self._id_limits.get(tuple(keys))
        if limits is None:
            limits = torch.tensor([self._feature_rows.get(k, 2**62) for k in keys])
            self._id_limits[tuple(keys)] = limits
        values = features.values()
        per_value = torch.repeat_interleave(
            limits.to(values.device), torch.tensor(features.length_per_key(), device=values.device),
            output_size=values.numel(),
        )
        bad = (values < 0) | (values >= per_value)
        if not bool(bad.any()):
            return
        position = int(bad.nonzero()[0, 0])
        feature = next(i for i, end in enumerate(features.offset_per_key()[1:]) if position < end)
        raise IdOutOfRangeError(
            f"feature {keys[feature]!r}: id {int(values[position])} is outside "
            f"[0, {int(limits[feature])}) of its table (rank {self._env.rank}); hash or clip ids "
            "to the table size before lookup"
        )

    def compute_and_output_dist(
        self, features: KeyedJaggedTensor, dist_inputs: ShardedInputs
    ) -> EmbeddingBagCollectionAwaitable:
        parts = [
            strategy.output_dist(strategy.lookup(awaitable.wait()), local)
            for strategy, awaitable, local in zip(
                self._strategies, dist_inputs, dist_inputs.local_features, strict=True
            )
        ]
        return EmbeddingBagCollectionAwaitable(parts, self._embedding_names, self._dims, self._columns)

    def prefetch(self, features: KeyedJaggedTensor) -> None:
        """Start the input dist of ``features`` now; the forward that later receives this same
        KJT object uses it instead of starting another (the train pipeline calls this one batch
        ahead, so the ids' all-to-all overlaps the current batch's compute).

        Every rank must prefetch the same batches in the same order (collectives match in
        issue order); :meth:`drop_prefetched` waits for and discards unused ones.
        """
        self._prefetched.append((features, self.input_dist(features)))

    def drop_prefetched(self) -> None:
        """Finish and discard prefetched input dists no forward consumed."""
        while self._prefetched:
            _, inputs = self._prefetched.popleft()
            for awaitable in inputs:
                awaitable.wait()

    def forward(self, features: KeyedJaggedTensor) -> EmbeddingBagCollectionAwaitable:
        if self._prefetched and self._prefetched[0][0] is features:
            return self.compute_and_output_dist(features, self._prefetched.popleft()[1])
        return self.compute_and_output_dist(features, self.input_dist(features))


def _export_tables(
    module: ShardedEmbeddingBagCollection, state_dict: dict[str, Any], prefix: str, _meta: Any
) -> None:
    shards = module.table_shards()
    for table in module.sharded_tables():
        name = table.config.name
        state_dict[f"{prefix}embedding_bags.{name}.weight"] = export_tensor(
            table, shards.get(name, []), module.env, None, False
        )


def _import_tables(
    module: ShardedEmbeddingBagCollection,
    state_dict: dict[str, Any],
    prefix: str,
    _meta: Any,
    _strict: bool,
    missing_keys: list[str],
    _unexpected: list[str],
    _errors: list[str],
) -> None:
    shards = module.table_shards()
    for table in module.sharded_tables():
        key = f"{prefix}embedding_bags.{table.config.name}.weight"
        if key not in state_dict:
            missing_keys.append(key)
            continue
        import_tensor(table, shards.get(table.config.name, []), state_dict.pop(key), None, key)


class EmbeddingBagCollectionSharder:
    """Shards EmbeddingBagCollections.

    ``fused_params`` is TorchRec's dict (``{"optimizer": EmbOptimType..., "learning_rate":
    ...}``); when absent, the optimizer recorded by ``apply_optimizer_in_backward`` on the
    module's weights is used, else EXACT_SGD with lr 0.01 (TorchRec's default).
    """

    def __init__(
        self,
        fused_params: Mapping[str, Any] | None = None,
        backend: KernelBackend = KernelBackend.AUTO,
    ) -> None:
        self._fused = None if fused_params is None else FusedOptimizerConfig.from_fused_params(fused_params)
        self._backend = backend

    @property
    def module_type(self) -> type[nn.Module]:
        return EmbeddingBagCollection

    def sharding_types(self, compute_device_type: str) -> list[str]:
        return [t.value for t in ShardingType]

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        return [EmbeddingComputeKernel.FUSED.value]

    def optimizer_config(self, module: EmbeddingBagCollection) -> FusedOptimizerConfig:
        if self._fused is not None:
            return self._fused
        return recorded_fused_config(module) or FusedOptimizerConfig()

    def shard(
        self,
        module: EmbeddingBagCollection,
        params: Mapping[str, ParameterSharding] | EmbeddingModuleShardingPlan,
        env: ShardingEnv,
        device: torch.device | None = None,
    ) -> ShardedEmbeddingBagCollection:
        return ShardedEmbeddingBagCollection(
            module, params, env, torch.device(device or "cpu"), self.optimizer_config(module), self._backend,
        )
