"""The contract every sharded embedding collection keeps (TorchRec: ``ShardedEmbeddingModule``).

A sharded collection is a :class:`ShardedCollectionCore` (tables, strategies, optimizer, input
dists; see ``sharded_collection``) plus what its output looks like. This base holds the first
part once: attaching the core, the table parameters under TorchRec's attribute name, and the
delegations (``fused_optimizer``, ``env``, ``table_shards``, ``sharded_tables``, ``input_dist``,
``prefetch``, ``drop_prefetched``, ``forward``). A subclass builds its core and attaches it with
:meth:`ShardedEmbeddingModule._attach_core` and implements ``compute_and_output_dist``::

    forward(kjt) = compute_and_output_dist(kjt, input_dist(kjt) or the prefetched one)
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from typing import Any, Generic, TypeVar

import torch
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor

from recsys_core.distributed.awaitable import LazyAwaitable
from recsys_core.distributed.sharded_collection import (
    CollectionSpec,
    DistInputs,
    ShardedCollectionCore,
    StrategyFactory,
)
from recsys_core.distributed.sharded_state import LocalShard, ShardedFusedOptimizer
from recsys_core.distributed.sharding.local_kernels import KernelContext
from recsys_core.distributed.sharding.shards import ShardedTable
from recsys_core.distributed.table_init import TableInitializer
from recsys_core.distributed.types import ParameterSharding, QuantizedCommCodecs, ShardingEnv
from recsys_core.kernels.config import FusedOptimizerConfig, KernelBackend
from recsys_core.modules.embedding_configs import BaseEmbeddingConfig
from recsys_core.optim.optimizers import sharder_fused_config
from recsys_core.sparse import KeyedJaggedTensor


def dense_source(
    module: nn.Module, state_prefix: str, configs: Sequence[BaseEmbeddingConfig]
) -> dict[str, torch.Tensor] | None:
    """Each table's weight from the unsharded ``module`` (``<state_prefix>.<table>.weight``), or
    None when it lives on the meta device (the tables are initialized, not copied)."""
    state = module.state_dict()  # plain or fused collection: the same keys
    if any(t.is_meta for t in state.values()):
        return None
    return {c.name: state[f"{state_prefix}.{c.name}.weight"].detach() for c in configs}


Out = TypeVar("Out", bound=LazyAwaitable[Any])


class ShardedEmbeddingModule(nn.Module, abc.ABC, Generic[Out]):
    """A collection whose tables are sharded over ``env``: same input and output as the
    unsharded module, through ``forward(...).wait()`` (``Out``: the awaitable it returns)."""

    _core: ShardedCollectionCore

    def _attach_core(self, core: ShardedCollectionCore) -> None:
        """Make ``core`` this module's: its tables' parameters, lookups and state hooks."""
        self._core = core
        self._state_hooks_registered = False
        self._model_parallel_name_to_sharded_tensor: dict[str, ShardedTensor] = {}
        # Before the lookups, so that parameter names are TorchRec's (embedding_bags.<t>.weight).
        self._initialize_torch_state()
        self.lookups = self._core.lookups

    def _attach_new_core(
        self,
        module: nn.Module,
        spec: CollectionSpec,
        plan: Mapping[str, ParameterSharding],
        env: ShardingEnv,
        strategy_factory: StrategyFactory,
        *,
        device: torch.device | None,
        optimizer: FusedOptimizerConfig | None,
        backend: KernelBackend,
        is_weighted: bool,
        table_init: TableInitializer | None,
        qcomm_codecs_registry: Mapping[str, QuantizedCommCodecs] | None,
        **kernel_options: Any,
    ) -> None:
        """Build the core of ``module``'s tables (``spec``) under ``plan`` and attach it. Its
        kernels live on ``device`` (TorchRec: optional; the host), fused with ``optimizer``
        (default: the one applied in backward to the tables, else SGD); shards are copied from
        the module's weights unless it is on the meta device; ``kernel_options``: the rest of
        the :class:`KernelContext`."""
        ctx = KernelContext(
            device=torch.device(device or "cpu"),
            optimizer=optimizer or sharder_fused_config(module, None),
            backend=backend, is_weighted=is_weighted,
            source=dense_source(module, spec.state_prefix, spec.configs), table_init=table_init,
            qcomm_codecs_registry=qcomm_codecs_registry, **kernel_options,
        )
        self._attach_core(ShardedCollectionCore(spec, plan, env, ctx, strategy_factory))

    def _initialize_torch_state(self, skip_registering: bool = False) -> None:
        """Build the module's view of its tables, as TorchRec's method of this name does; the
        constructor calls it.

        Registers ``embedding_bags`` / ``embeddings`` (``<table>.weight``: this rank's shard as
        a parameter, where it holds one), builds each sharded table's weight as a ShardedTensor
        of views of this rank's shards (``_model_parallel_name_to_sharded_tensor``, no memory
        copied: what ``state_dict()`` and ``torch.distributed.checkpoint`` read and write) and,
        unless ``skip_registering``, the state-dict hooks that hand those out (registered once
        however often this is called). A table whose tensor cannot be built raises naming the
        table, with the cause kept.

        Collective on a module's first call (the tables' global layouts are gathered once:
        every rank builds the module together); calls after it are local."""
        self.register_module(self._core.spec.state_prefix, self._core.table_parameters())
        self._model_parallel_name_to_sharded_tensor = self._core.build_table_tensors()
        if not skip_registering and not self._state_hooks_registered:
            self._core.register_state_hooks(self)
            self._state_hooks_registered = True

    @property
    def fused_optimizer(self) -> ShardedFusedOptimizer:
        return self._core.fused_optimizer

    @property
    def env(self) -> ShardingEnv:
        return self._core.env

    def table_shards(self) -> dict[str, list[LocalShard]]:
        """This rank's shards of each table: shard geometry, weight view, optimizer state views."""
        return self._core.table_shards()

    def sharded_tables(self) -> list[ShardedTable]:
        return list(self._core.tables)

    def _check_input(self, features: KeyedJaggedTensor) -> None:
        """Checks a subclass makes before its input leaves the rank (ids are checked anyway)."""

    def input_dist(self, features: KeyedJaggedTensor) -> DistInputs:
        """Start every strategy's input all-to-all (checks ids first: no bad id is sent)."""
        self._check_input(features)
        return self._core.input_dist(features)

    @abc.abstractmethod
    def compute_and_output_dist(
        self, features: KeyedJaggedTensor, dist_inputs: DistInputs
    ) -> Out:
        """Look up the received ids and start the output dist back to this rank's batch."""

    def prefetch(self, features: KeyedJaggedTensor) -> None:
        """Start the input dist of ``features`` now (see ``ShardedCollectionCore.prefetch``)."""
        self._check_input(features)
        self._core.prefetch(features)

    def drop_prefetched(self) -> None:
        """Finish and discard prefetched input dists no forward consumed."""
        self._core.drop_prefetched()

    def forward(self, features: KeyedJaggedTensor) -> Out:
        self._check_input(features)
        return self.compute_and_output_dist(features, self._core.take_input_dist(features))
