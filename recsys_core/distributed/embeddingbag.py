"""``ShardedEmbeddingBagCollection`` and ``EmbeddingBagCollectionSharder``.

The sharded module splits the collection's tables by sharding type into strategies (see
``sharding/``), runs each strategy's input dist -> lookup -> output dist, and reassembles one
KeyedTensor in the unsharded module's key order. ``forward`` returns a LazyAwaitable.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn

from recsys_core.distributed.awaitable import Awaitable, LazyAwaitable
from recsys_core.distributed.dist_data import batch_sizes
from recsys_core.distributed.embedding_types import BaseEmbeddingSharder, TrainingEmbeddingSharder
from recsys_core.distributed.sharded_collection import (
    CollectionSpec,
    DistInputs,
    StrategyFactory,
)
from recsys_core.distributed.sharded_module import ShardedEmbeddingModule
from recsys_core.distributed.sharding.data_parallel import DpPooledSharding
from recsys_core.distributed.sharding.dense_data_parallel import DpDenseSharding
from recsys_core.distributed.sharding.kernel_plan import planned_caches, with_cache_load_factor
from recsys_core.distributed.sharding.local_kernels import KernelContext
from recsys_core.distributed.sharding.row_wise import RwPooledSharding
from recsys_core.distributed.sharding.shards import ShardedTable
from recsys_core.distributed.sharding.strategy import PooledSharding
from recsys_core.distributed.sharding.table_wise import TwPooledSharding
from recsys_core.distributed.table_init import TableInitializer
from recsys_core.distributed.types import (
    EmbeddingComputeKernel,
    ParameterSharding,
    QuantizedCommCodecs,
    ShardingEnv,
    ShardingType,
)
from recsys_core.kernels.config import FusedOptimizerConfig, KernelBackend
from recsys_core.kernels.packed import ColumnPermutation, column_permutation, permute_parts
from recsys_core.modules.embedding_modules import (
    EmbeddingBagCollection,
    should_skip_data_parallel_grad_sync,
)
from recsys_core.optim.optimizers import sharder_fused_config
from recsys_core.sparse import KeyedJaggedTensor, KeyedTensor
from recsys_core.sparse.jagged_tensor_validator import validate_keyed_jagged_tensor

logger = logging.getLogger(__name__)


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


def pooled_strategy_factory(env: ShardingEnv) -> StrategyFactory:
    """Builds the pooled strategy of each sharding family (see ``_SPEC.families``)."""

    def build(family: ShardingType, tables: list[ShardedTable], ctx: KernelContext) -> PooledSharding:
        if family is ShardingType.TABLE_WISE:
            return TwPooledSharding(tables, env, ctx)
        if family is ShardingType.ROW_WISE:
            return RwPooledSharding(
                tables, env, ctx, domain_size=env.world_size, domain_group=env.pg, cross_group=None
            )
        if family is ShardingType.TABLE_ROW_WISE:
            groups = _HostGroups(env)
            return RwPooledSharding(
                tables, env, ctx, domain_size=env.local_world_size, domain_group=groups.host,
                cross_group=groups.cross,
            )
        if ctx.dense:
            return DpDenseSharding(tables, env, ctx)
        return DpPooledSharding(tables, env, ctx)

    return build


_FAMILIES = (
    (ShardingType.TABLE_WISE, ShardingType.COLUMN_WISE, ShardingType.TABLE_COLUMN_WISE),
    (ShardingType.ROW_WISE,),
    (ShardingType.TABLE_ROW_WISE,),
    (ShardingType.DATA_PARALLEL,),
)


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
        values = permute_parts(outs, self._columns)
        return KeyedTensor(keys=self._keys, length_per_key=self._lengths, values=values)


class ShardedEmbeddingBagCollection(ShardedEmbeddingModule[EmbeddingBagCollectionAwaitable]):
    """An EmbeddingBagCollection whose tables are sharded over ``env`` according to ``plan``.

    Same input and output as the unsharded module (``forward(...).wait()`` is a KeyedTensor
    equal to the unsharded result). Table updates are fused into backward; ``fused_optimizer``
    exposes their learning rate and state. ``table_init`` (optional) fills every shard
    independently of the plan (see ``recsys_core.distributed.table_init``).
    """

    def __init__(
        self,
        module: EmbeddingBagCollection,
        plan: Mapping[str, ParameterSharding],
        env: ShardingEnv,
        device: torch.device | None = None,
        optimizer: FusedOptimizerConfig | None = None,
        backend: KernelBackend = KernelBackend.AUTO,
        table_init: TableInitializer | None = None,
        offload_dir: str | None = None,
        qcomm_codecs_registry: Mapping[str, QuantizedCommCodecs] | None = None,
    ) -> None:
        super().__init__()
        configs = module.embedding_bag_configs()
        spec = CollectionSpec(
            name="ShardedEmbeddingBagCollection", state_prefix="embedding_bags",
            configs=tuple(configs), supported=tuple(t for f in _FAMILIES for t in f),
            families=_FAMILIES,
            variable_batch=True,
        )
        self._attach_new_core(
            module, spec, plan, env, pooled_strategy_factory(env), device=device,
            optimizer=optimizer, backend=backend, is_weighted=module.is_weighted(),
            table_init=table_init, qcomm_codecs_registry=qcomm_codecs_registry,
            caches=planned_caches(plan), offload_dir=offload_dir,
            sync_replica_gradients=not should_skip_data_parallel_grad_sync(module),
        )
        self._embedding_names = self._core.embedding_names
        self._dims = [t.config.embedding_dim for t in self._core.tables for _ in t.embedding_names]
        # strategies return their features' columns in strategy order: restore module order
        order = [f for s in self._core.strategies for f in s.output_features]
        dims = dict(zip(self._embedding_names, self._dims, strict=True))
        start, pos = {}, 0
        for f in order:
            start[f], pos = pos, pos + dims[f]
        self._columns = column_permutation(
            [start[f] + d for f in self._embedding_names for d in range(dims[f])]
        )
        self._configs = list(configs)
        self._validated_input = False

    @property
    def strategies(self) -> list[PooledSharding]:
        """The per-sharding-type strategies, in output order (for benchmarks and debugging)."""
        return list(self._core.strategies)  # type: ignore[arg-type]

    def _check_input(self, features: KeyedJaggedTensor) -> None:
        """TorchRec's check of the first input: a consistent KJT with unique keys (ids are
        checked on every batch by the input dist)."""
        if not self._validated_input:
            logger.info("Validating input features...")
            validate_keyed_jagged_tensor(features, self._configs)
            self._validated_input = True

    def compute_and_output_dist(
        self, features: KeyedJaggedTensor, dist_inputs: DistInputs
    ) -> EmbeddingBagCollectionAwaitable:
        received = self._core.wait_inputs(dist_inputs)
        parts = [
            strategy.output_dist(strategy.lookup(kjt), local, batch_sizes(inflight))
            for strategy, kjt, local, inflight in zip(
                self.strategies, received, dist_inputs.local_features, dist_inputs, strict=True
            )
        ]
        return EmbeddingBagCollectionAwaitable(parts, self._embedding_names, self._dims, self._columns)

class EmbeddingBagCollectionSharder(TrainingEmbeddingSharder[EmbeddingBagCollection]):
    """Shards EmbeddingBagCollections.

    ``fused_params`` is TorchRec's dict (``{"optimizer": EmbOptimType..., "learning_rate":
    ...}``); when absent, the optimizer recorded by ``apply_optimizer_in_backward`` on the
    module's weights is used, else EXACT_SGD with lr 0.01 (TorchRec's default).
    ``table_init`` fills every shard independently of the plan (e.g. ``SeededUniformInit``).
    ``offload_dir``: where tables planned as ``fused_uvm_caching`` keep their backing files on
    CPU (None: the system's temporary directory). ``qcomm_codecs_registry`` (from
    ``fbgemm_qcomm_codec.get_qcomm_codecs_registry``): the precision the output dist's pooled
    embeddings and their gradients travel in (None: float32).
    """

    @property
    def module_type(self) -> type[nn.Module]:
        return EmbeddingBagCollection

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        return cached_or_fused(sharding_type)

    def optimizer_config(self, module: EmbeddingBagCollection) -> FusedOptimizerConfig:
        """TorchRec's rule: ``fused_params``, updated by an optimizer applied in backward to
        the tables (see :func:`~recsys_core.optim.optimizers.sharder_fused_config`)."""
        return sharder_fused_config(module, self.fused_params)

    def sharded_module(
        self,
        module: EmbeddingBagCollection,
        params: Mapping[str, ParameterSharding],
        env: ShardingEnv,
        device: torch.device,
    ) -> ShardedEmbeddingBagCollection:
        return ShardedEmbeddingBagCollection(
            module, with_cache_load_factor(params, self.fused_params), env,
            device, self.optimizer_config(module),
            self._backend, self._table_init, self._offload_dir, self.qcomm_codecs_registry,
        )


def cached_or_fused(sharding_type: str) -> list[str]:
    """The kernels a pooled sharder runs: FUSED, and FUSED_UVM_CACHING (the cached kernel, on
    CPU and CUDA) for every sharding type but data-parallel, which runs FUSED (this library's
    fused replicas, the planner's choice) and DENSE (TorchRec's: the replica's weights are
    parameters that the dense optimizer steps; chosen when constraints ask for it)."""
    if ShardingType(sharding_type) is ShardingType.DATA_PARALLEL:
        return [EmbeddingComputeKernel.FUSED.value, EmbeddingComputeKernel.DENSE.value]
    return [EmbeddingComputeKernel.FUSED.value, EmbeddingComputeKernel.FUSED_UVM_CACHING.value]


class EmbeddingBagSharder(BaseEmbeddingSharder[nn.EmbeddingBag]):
    """TorchRec's sharder of a single ``nn.EmbeddingBag``. This library shards collections
    only: :meth:`shard` refuses, naming the fix."""

    @property
    def module_type(self) -> type[nn.EmbeddingBag]:
        return nn.EmbeddingBag

    def sharded_module(
        self,
        module: nn.EmbeddingBag,
        params: Mapping[str, ParameterSharding],
        env: ShardingEnv,
        device: torch.device,
    ) -> nn.Module:
        raise ValueError(
            "EmbeddingBagSharder: sharding a single nn.EmbeddingBag is not supported by "
            "recsys_core; put its table in an EmbeddingBagCollection (EmbeddingBagConfig) and "
            "shard that with EmbeddingBagCollectionSharder"
        )
