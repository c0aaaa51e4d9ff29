"""What every sharded collection shares, pooled (EBC) or sequence (EC): one skeleton.

``ShardedCollectionCore`` is composed into ``ShardedEmbeddingBagCollection`` and
``ShardedEmbeddingCollection``, which keep only their forward (how looked-up rows become their
output type). The core does, once for both:

    plan checks          every table planned, no unknown table, supported sharding types,
                         geometry validated before any communication
    strategies           the tables grouped by sharding type, one strategy per group, each
                         with its local kernels initialized (table_init, source weights or config)
    input order          per KJT key order, the permutation each strategy's input dist needs
    id check             every id inside its table before ids leave this rank
    fused optimizer      one KeyedOptimizer over all local kernels, plan-independent state
    table state          ``<prefix>.<table>.weight`` as ShardedTensors of this rank's shard
                         views, built once (TorchRec's ``_initialize_torch_state``); the
                         state-dict hooks hand them out (DCP reshards them)
    prefetch             input dists started a batch ahead (see ``train_pipeline``)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor

from recsys_core.distributed.awaitable import Awaitable
from recsys_core.distributed.batched_embedding_kernel import DenseTableBatchedEmbedding
from recsys_core.distributed.sharded_state import (
    GlobalLayouts,
    LocalShard,
    ShardedFusedOptimizer,
    export_tensor,
    import_tensor,
    local_weight_shards,
    sharded_tensor,
    shards_by_table,
)
from recsys_core.distributed.sharding.kernel_plan import check_kernel_placement, planned_caches
from recsys_core.distributed.sharding.local_kernels import KernelContext, LocalKernels
from recsys_core.distributed.sharding.shards import ShardedTable, resolve_shards
from recsys_core.distributed.sharding.strategy import require_process_group
from recsys_core.distributed.types import (
    EmbeddingComputeKernel,
    EmbeddingModuleShardingPlan,
    ParameterSharding,
    ShardingEnv,
    ShardingType,
)
from recsys_core.distributed.variable_batch import expand_variable_batch
from recsys_core.kernels.id_check import IdRangeCheck, PendingIdCheck
from recsys_core.modules.embedding_configs import (
    BaseEmbeddingConfig,
    get_embedding_names_by_table,
)
from recsys_core.modules.embedding_modules import check_features
from recsys_core.modules.fused_common import TableWeight, kernel_optimizer
from recsys_core.optim.keyed import CombinedOptimizer
from recsys_core.plan.validation import validate_module_sharding_plan
from recsys_core.sparse import KeyedJaggedTensor
from recsys_core.sparse.key_order import KeyOrder


class Strategy(Protocol):
    """What the core needs from a strategy (pooled and sequence strategies both are one)."""

    output_features: list[str]
    local: LocalKernels

    def input_dist(self, features: KeyedJaggedTensor) -> Awaitable[Any]: ...


StrategyFactory = Callable[[ShardingType, list[ShardedTable], KernelContext], Strategy]
"""Builds the strategy for one group of tables sharing a sharding family."""


@dataclass(frozen=True, kw_only=True)
class CollectionSpec:
    """The unsharded collection, as the core sees it."""

    name: str
    """The sharded module's class name, for messages."""
    state_prefix: str
    """State-dict prefix of the tables: ``embedding_bags`` (EBC) or ``embeddings`` (EC)."""
    configs: tuple[BaseEmbeddingConfig, ...]
    """The tables, in the module's order."""
    supported: tuple[ShardingType, ...]
    """Sharding types this collection can run."""
    families: tuple[tuple[ShardingType, ...], ...]
    """Sharding types run by one strategy together (e.g. table- and column-wise), in output
    order; the first type of a family names it for the factory."""
    variable_batch: bool = False
    """Accepts variable-batch KJTs (expanded to the full batch, see ``variable_batch.py``)."""


class DistInputs(list):  # list[Awaitable[...]], one per strategy
    """The input dists in flight, one per strategy, with the local features each one was given
    and the id check that must pass before any of them completes."""

    def __init__(
        self,
        awaitables: list[Awaitable[Any]],
        local_features: list[KeyedJaggedTensor],
        id_check: PendingIdCheck,
    ) -> None:
        super().__init__(awaitables)
        self.local_features = local_features
        self.id_check = id_check


class ShardedCollectionCore:
    """The shared skeleton of a sharded collection (see the module docstring).

    ``source`` are the unsharded module's tables (None for a meta module); the sharded module
    owns ``lookups`` (register it as a submodule), builds the tables' state with
    :meth:`build_table_tensors` and calls :meth:`register_state_hooks`.
    """

    def __init__(
        self,
        spec: CollectionSpec,
        plan: Mapping[str, ParameterSharding],
        env: ShardingEnv,
        ctx: KernelContext,
        factory: StrategyFactory,
    ) -> None:
        configs = list(spec.configs)
        _check_plan(spec, configs, plan, env, ctx.device)
        self.spec, self.env, self.ctx = spec, env, ctx
        names_by_table = get_embedding_names_by_table(configs)
        self.tables = [
            resolve_shards(c, plan[c.name], env.world_size, names)
            for c, names in zip(configs, names_by_table, strict=True)
        ]
        self.strategies: list[Strategy] = []
        for family in spec.families:
            group = [t for t in self.tables if t.sharding.sharding_type in family]
            # DENSE tables get their own strategy of the family, with parameter kernels
            fused = [t for t in group if t.sharding.compute_kernel is not EmbeddingComputeKernel.DENSE]
            dense = [t for t in group if t.sharding.compute_kernel is EmbeddingComputeKernel.DENSE]
            if fused:
                self.strategies.append(factory(family[0], fused, ctx))
            if dense:
                self.strategies.append(factory(family[0], dense, replace(ctx, dense=True)))
        self.lookups = nn.ModuleList([s.local for s in self.strategies])
        # From the plan, the same on every rank: whether a prefetch waits for its input dist
        # (cached tables somewhere). A rank deciding from its own kernels would wait while a
        # rank without cached tables went on to the next collection's input dist, and the
        # ranks' collectives would no longer match (two collections, caches on some ranks).
        self._prefetches_rows = bool(planned_caches(plan))
        self.embedding_names = [n for names in names_by_table for n in names]
        # a feature shared by several tables feeds several outputs (``f@t1``, ``f@t2``)
        self.feature_of = {
            n: f for c, names in zip(configs, names_by_table, strict=True)
            for n, f in zip(names, c.feature_names, strict=True)
        }
        self.feature_names = list(dict.fromkeys(self.feature_of.values()))
        rows: dict[str, int] = {}
        for c in configs:
            for f in c.feature_names:
                rows[f] = min(rows.get(f, c.num_embeddings), c.num_embeddings)
        # each strategy's features from the input, in the order it reads them
        self._key_orders = [
            KeyOrder([self.feature_of[n] for n in s.output_features], spec.name)
            for s in self.strategies
        ]
        self._ids = IdRangeCheck(rows, f"{spec.name}, rank {env.rank}")
        self._prefetched: deque[tuple[KeyedJaggedTensor, DistInputs]] = deque()
        optimizer = ctx.optimizer.optimizer
        self.layouts = GlobalLayouts(self.tables, self.table_shards, env, optimizer.state_names,
                                     optimizer.state_is_rowwise)
        """The global layout of every exported tensor, gathered once (see GlobalLayouts)."""
        self.fused_optimizer = self._build_optimizer()
        self.table_tensors: dict[str, ShardedTensor] = {}
        """Each sharded table's weight as a ShardedTensor of this rank's shard views (see
        :meth:`build_table_tensors`); what ``state_dict()`` and DCP read and write."""

    # ---- optimizer and state -----------------------------------------------------------------
    def _build_optimizer(self) -> ShardedFusedOptimizer:
        optims, kernels = [], []
        self.shard_parameters: dict[str, list[nn.Parameter]] = {}
        """Each table's local shard weights as parameters (see :func:`table_parameters`)."""
        for local in self.lookups:
            for kernel, shards in zip(local.kernels, local.kernel_shards, strict=True):
                if isinstance(kernel, DenseTableBatchedEmbedding):
                    # stepped by an optimizer outside the module
                    for sh, weight in zip(shards, kernel.weights, strict=True):
                        self.shard_parameters.setdefault(sh.table, []).append(weight)
                    continue
                params: dict[str, nn.Parameter] = {}
                for sh, view in zip(shards, kernel.split_embedding_weights(), strict=True):
                    # the state dict exposes whole tables, not these
                    name = f"{self.spec.state_prefix}.{sh.table}.weight[{sh.row_offset}:,{sh.col_offset}:]"
                    params[name] = nn.Parameter(view[: sh.rows])
                    self.shard_parameters.setdefault(sh.table, []).append(params[name])
                optims.append(kernel_optimizer(kernel, params, [sh.table for sh in shards]))
                kernels.append(kernel)
        return ShardedFusedOptimizer(
            CombinedOptimizer(optims), self.tables, self.table_shards, self.env,
            self.ctx.optimizer, kernels, self.spec.state_prefix, self.layouts,
        )

    def table_parameters(self) -> nn.ModuleDict:
        """``<table>.weight`` for each table with one shard on this rank (TorchRec's parameter
        names: a sharded module registers this as ``embedding_bags`` / ``embeddings``, so
        ``named_parameters()`` and ``state_dict()`` name a table alike). Fused shards carry
        their in-backward optimizer; DENSE shards are the kernel's parameters. Saving and
        loading go through the whole-table state dict entries, not through these."""
        return nn.ModuleDict({
            name: TableWeight(params[0], saved=False)
            for name, params in self.shard_parameters.items() if len(params) == 1
        })

    def table_shards(self) -> dict[str, list[LocalShard]]:
        """This rank's shards of each table: shard geometry, weight view, optimizer state views."""
        return shards_by_table(self.lookups)

    def build_table_tensors(self) -> dict[str, ShardedTensor]:
        """Build each sharded table's weight as a ShardedTensor whose local shards are views of
        this rank's kernel storage (no memory copied), kept in :attr:`table_tensors`.

        Collective the first time on a collection (the global layouts are gathered once, see
        ``GlobalLayouts``), local after it. Data-parallel tables stay plain tensors, and a
        single-process environment has nothing to build. An error building one table's tensor
        is raised naming the table, with the cause kept."""
        self.table_tensors = {}
        if self.env.pg is None:
            return self.table_tensors
        self.layouts.gather()
        shards = self.table_shards()
        for table in self.tables:
            name = table.config.name
            if table.sharding.sharding_type is ShardingType.DATA_PARALLEL:
                continue
            metadata = self.layouts.get(name, None)
            if metadata is None:
                continue  # no rank holds a part of it: exported the collective way, as before
            try:
                self.table_tensors[name] = sharded_tensor(
                    local_weight_shards(table, shards.get(name, []), self.env), metadata, self.env)
            except (RuntimeError, ValueError) as e:
                raise (ValueError if isinstance(e, ValueError) else RuntimeError)(
                    f"{self.spec.name}: building the state of table {name!r} (its weight as a "
                    f"ShardedTensor of this rank's shards, rank {self.env.rank}) failed: {e}. "
                    "Check that every rank shards this module with the same plan"
                ) from e
        return self.table_tensors

    def register_state_hooks(self, module: nn.Module) -> None:
        """``module.state_dict()`` holds ``<prefix>.<table>.weight`` per table (a ShardedTensor
        over the ranks, or a plain tensor for data-parallel tables); ``load_state_dict`` takes
        those or full unsharded tensors."""
        module._register_state_dict_hook(self._export_tables)
        module._register_load_state_dict_pre_hook(self._import_tables)

    def _export_tables(self, _module: nn.Module, state_dict: dict[str, Any], prefix: str, _meta: Any) -> None:
        shards = self.table_shards()  # flushes cached tables into the views
        for table in self.tables:
            name = table.config.name
            held = shards.get(name, [])
            built = self.table_tensors.get(name)
            if built is None or not _same_views(built, local_weight_shards(table, held, self.env)):
                # not built, or its kernel storage was replaced since: build it again
                built = export_tensor(table, held, self.env, None, False, self.layouts)
            state_dict[f"{prefix}{self.spec.state_prefix}.{name}.weight"] = built

    def _import_tables(
        self, state_dict: dict[str, Any], prefix: str, _meta: Any, _strict: bool,
        missing_keys: list[str], _unexpected: list[str], _errors: list[str],
    ) -> None:
        shards = self.table_shards()
        for table in self.tables:
            key = f"{prefix}{self.spec.state_prefix}.{table.config.name}.weight"
            if key not in state_dict:
                missing_keys.append(key)
                continue
            import_tensor(table, shards.get(table.config.name, []), state_dict.pop(key), None, key)
        for local in self.lookups:
            local.invalidate_caches()

    # ---- input dist and prefetch -------------------------------------------------------------
    def input_dist(self, features: KeyedJaggedTensor) -> DistInputs:
        """Start every strategy's input all-to-all. Ids are checked first: on the host before
        anything is sent; on a device asynchronously, resolved before any input dist completes."""
        check_features(features, self.feature_names, self.spec.name, self.ctx.is_weighted)
        if features.variable_stride_per_key():
            if not self.spec.variable_batch:
                raise ValueError(
                    f"{self.spec.name}: variable-batch KeyedJaggedTensors (stride_per_key "
                    f"{features.stride_per_key()}) are not supported; give every key the same "
                    "batch size"
                )
            features = expand_variable_batch(features, self.spec.name)
        pending = self._ids.start(features)
        local = [order.apply(features) for order in self._key_orders]
        return DistInputs(
            [s.input_dist(kjt) for s, kjt in zip(self.strategies, local, strict=True)],
            local, pending,
        )

    def prefetch(self, features: KeyedJaggedTensor) -> None:
        """Start the input dist of ``features`` now; the forward that later receives this same
        KJT object uses it instead of starting another.

        Every rank must prefetch the same batches in the same order (collectives match in
        issue order); :meth:`drop_prefetched` waits for and discards unused ones.
        """
        inputs = self.input_dist(features)
        self._prefetched.append((features, inputs))
        if self._prefetches_rows:
            # Cached tables (on some rank): the ids of that batch are needed now, to bring
            # their rows into the caches while the current batch computes.
            for local, received in zip(self.lookups, self.wait_inputs(inputs), strict=True):
                local.prefetch(received)

    def take_input_dist(self, features: KeyedJaggedTensor) -> DistInputs:
        """The prefetched input dist of this very KJT, else a new one."""
        if self._prefetched and self._prefetched[0][0] is features:
            return self._prefetched.popleft()[1]
        return self.input_dist(features)

    def drop_prefetched(self) -> None:
        """Finish and discard prefetched input dists no forward consumed."""
        while self._prefetched:
            _, inputs = self._prefetched.popleft()
            inputs.id_check.result()
            for awaitable in inputs:
                awaitable.wait()
        for local in self.lookups:
            local.drop_prefetched()

    def wait_inputs(self, inputs: DistInputs) -> list[Any]:
        """Every strategy's received input (after the id check's verdict)."""
        inputs.id_check.result()
        return [a.wait() for a in inputs]


def _same_views(built: ShardedTensor, current: list[Any]) -> bool:
    """Whether ``built``'s local shards are still exactly the views ``current`` (same storage,
    offsets, shape and strides)."""
    have = built.local_shards()
    return len(have) == len(current) and all(
        a.tensor.data_ptr() == b.tensor.data_ptr() and a.tensor.shape == b.tensor.shape
        and a.tensor.stride() == b.tensor.stride() and a.tensor.dtype == b.tensor.dtype
        for a, b in zip(have, current, strict=True)
    )


def _check_plan(
    spec: CollectionSpec,
    configs: Sequence[BaseEmbeddingConfig],
    plan: Mapping[str, ParameterSharding],
    env: ShardingEnv,
    device: torch.device,
) -> None:
    names = [c.name for c in configs]
    collection = spec.name.removeprefix("Sharded")
    missing = [n for n in names if n not in plan]
    if missing:
        raise ValueError(
            f"sharding plan has no entry for table(s) {missing}; every table of the "
            f"{collection} needs one (e.g. table_wise(rank=0))"
        )
    extra = [n for n in plan if n not in names]
    if extra:
        raise ValueError(f"sharding plan names table(s) {extra} that the module lacks: {names}")
    supported = ", ".join(t.name for t in spec.supported)
    for name in names:
        if plan[name].sharding_type not in spec.supported:
            raise ValueError(
                f"table {name!r}: sharding type {plan[name].sharding_type.name} is not supported "
                f"by {spec.name}; use one of {supported}"
            )
    # rejects ranks outside the world, shards that do not tile a table, uneven column
    # splits, DENSE/QUANT kernels... before any communication
    validate_module_sharding_plan(
        list(configs), EmbeddingModuleShardingPlan(plan), env.world_size, env.local_world_size
    )
    check_kernel_placement(plan, device)
    require_process_group(env, spec.name)
