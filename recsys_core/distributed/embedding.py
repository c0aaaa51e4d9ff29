"""``ShardedEmbeddingCollection`` and ``EmbeddingCollectionSharder`` (unpooled, sequence lookups).

The sharded module splits the collection's tables by sharding type into sequence strategies
(``sharding/sequence.py``), runs each strategy's input dist -> lookup -> output dist, and
returns the unsharded module's ``{feature: JaggedTensor}`` through a LazyAwaitable.

Example, 2 ranks, table "t" (feature "f", dim 8) row-wise, rank 0's input f: [[7, 2], []]:

    input_dist:               id 2 -> rank 0 (local row 2), id 7 -> rank 1 (local row 2)
    compute_and_output_dist:  each owner looks up its rows, rows come back, input order restored
    wait():                   {"f": JaggedTensor(values [2, 8] = [t[7], t[2]], lengths [2, 0])}
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from recsys_core.distributed.awaitable import Awaitable, LazyAwaitable
from recsys_core.distributed.embedding_types import TrainingEmbeddingSharder
from recsys_core.distributed.sharded_collection import (
    CollectionSpec,
    DistInputs,
    StrategyFactory,
)
from recsys_core.distributed.sharded_module import ShardedEmbeddingModule
from recsys_core.distributed.sharding.local_kernels import KernelContext
from recsys_core.distributed.sharding.row_wise import RwSequenceSharding
from recsys_core.distributed.sharding.sequence import SequenceSharding
from recsys_core.distributed.sharding.shards import ShardedTable
from recsys_core.distributed.sharding.table_wise import TwSequenceSharding
from recsys_core.distributed.table_init import TableInitializer
from recsys_core.distributed.types import (
    EmbeddingComputeKernel,
    ParameterSharding,
    QuantizedCommCodecs,
    ShardingEnv,
    ShardingType,
)
from recsys_core.kernels.config import FusedOptimizerConfig, KernelBackend
from recsys_core.modules.embedding_modules import EmbeddingCollection
from recsys_core.optim.optimizers import sharder_fused_config
from recsys_core.sparse import JaggedTensor, KeyedJaggedTensor

_TW_FAMILY = (ShardingType.TABLE_WISE, ShardingType.COLUMN_WISE)
SUPPORTED_SHARDING_TYPES = (*_TW_FAMILY, ShardingType.ROW_WISE)


class EmbeddingCollectionAwaitable(LazyAwaitable[dict[str, JaggedTensor]]):
    """The sharded forward's result: waits for every strategy's output dist.

    ``parts[i]`` gives the rows of ``part_features[i]`` (embedding names); each output
    JaggedTensor takes its lengths (and, with ``need_indices``, its ids as weights) from this
    rank's input feature ``feature_of[name]`` (``f`` for ``f@t``).
    """

    def __init__(
        self,
        parts: list[Awaitable[list[torch.Tensor]]],
        part_features: list[list[str]],
        features: KeyedJaggedTensor,
        feature_of: dict[str, str],
        need_indices: bool = False,
    ) -> None:
        super().__init__()
        self._parts, self._part_features = parts, part_features
        self._features, self._feature_of, self._need_indices = features, feature_of, need_indices

    def _wait_impl(self) -> dict[str, JaggedTensor]:
        rows: dict[str, torch.Tensor] = {}
        for part, names in zip(self._parts, self._part_features, strict=True):
            rows.update(zip(names, part.wait(), strict=True))
        inputs = self._features.to_dict()
        return {
            name: JaggedTensor(
                values=rows[name],
                lengths=inputs[feature].lengths(),
                weights=inputs[feature].values() if self._need_indices else None,
            )
            for name, feature in self._feature_of.items()
        }


def sequence_strategy_factory(env: ShardingEnv) -> StrategyFactory:
    """Builds the sequence strategy of each sharding family (see ``_FAMILIES``)."""

    def build(family: ShardingType, tables: list[ShardedTable], ctx: KernelContext) -> SequenceSharding:
        if family is ShardingType.ROW_WISE:
            return RwSequenceSharding(tables, env, ctx)
        return TwSequenceSharding(tables, env, ctx)

    return build


class ShardedEmbeddingCollection(ShardedEmbeddingModule[EmbeddingCollectionAwaitable]):
    """An EmbeddingCollection whose tables are sharded over ``env`` according to ``plan``.

    Same input and output as the unsharded module (``forward(...).wait()`` is a
    ``dict[str, JaggedTensor]`` equal to the unsharded result for this rank's batch). Table
    updates are fused into backward; ``fused_optimizer`` exposes their learning rate and state;
    ``state_dict()`` holds ``embeddings.<table>.weight`` per table (as the unsharded module).
    Supported sharding types: TABLE_WISE, COLUMN_WISE, ROW_WISE.
    """

    def __init__(
        self,
        module: EmbeddingCollection,
        plan: Mapping[str, ParameterSharding],
        env: ShardingEnv,
        device: torch.device | None = None,
        optimizer: FusedOptimizerConfig | None = None,
        backend: KernelBackend = KernelBackend.AUTO,
        table_init: TableInitializer | None = None,
        qcomm_codecs_registry: Mapping[str, QuantizedCommCodecs] | None = None,
    ) -> None:
        super().__init__()
        spec = CollectionSpec(
            name="ShardedEmbeddingCollection", state_prefix="embeddings",
            configs=tuple(module.embedding_configs()),
            supported=SUPPORTED_SHARDING_TYPES, families=(_TW_FAMILY, (ShardingType.ROW_WISE,)),
        )
        self._attach_new_core(
            module, spec, plan, env, sequence_strategy_factory(env), device=device,
            optimizer=optimizer, backend=backend, is_weighted=False, table_init=table_init,
            qcomm_codecs_registry=qcomm_codecs_registry,
        )
        self._need_indices = module.need_indices()

    def compute_and_output_dist(
        self, features: KeyedJaggedTensor, dist_inputs: DistInputs
    ) -> EmbeddingCollectionAwaitable:
        strategies: list[SequenceSharding] = self._core.strategies  # type: ignore[assignment]
        parts: list[Awaitable[list[torch.Tensor]]] = []
        for strategy, batch in zip(strategies, self._core.wait_inputs(dist_inputs), strict=True):
            parts.append(strategy.output_dist(strategy.lookup(batch), batch))
        return EmbeddingCollectionAwaitable(
            parts,
            [s.output_features for s in strategies],
            features,
            self._core.feature_of,
            self._need_indices,
        )

class EmbeddingCollectionSharder(TrainingEmbeddingSharder[EmbeddingCollection]):
    """Shards EmbeddingCollections (TABLE_WISE, COLUMN_WISE and ROW_WISE tables).

    ``fused_params`` is TorchRec's dict (``{"optimizer": EmbOptimType..., "learning_rate":
    ...}``); when absent, the optimizer recorded by ``apply_optimizer_in_backward`` on the
    module's weights is used, else EXACT_SGD with lr 0.01 (TorchRec's default).
    ``table_init`` fills every shard independently of the plan (e.g. ``SeededUniformInit``).
    """

    def __init__(
        self,
        fused_params: Mapping[str, Any] | None = None,
        qcomm_codecs_registry: Mapping[str, QuantizedCommCodecs] | None = None,
        backend: KernelBackend = KernelBackend.AUTO,
        table_init: TableInitializer | None = None,
    ) -> None:
        super().__init__(fused_params, qcomm_codecs_registry, backend, table_init)

    @property
    def module_type(self) -> type[nn.Module]:
        return EmbeddingCollection

    def sharding_types(self, compute_device_type: str) -> list[str]:
        return [t.value for t in SUPPORTED_SHARDING_TYPES]

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        return [EmbeddingComputeKernel.FUSED.value]

    def optimizer_config(self, module: EmbeddingCollection) -> FusedOptimizerConfig:
        """TorchRec's rule: ``fused_params``, updated by an optimizer applied in backward to
        the tables (see :func:`~recsys_core.optim.optimizers.sharder_fused_config`)."""
        return sharder_fused_config(module, self.fused_params)

    def sharded_module(
        self,
        module: EmbeddingCollection,
        params: Mapping[str, ParameterSharding],
        env: ShardingEnv,
        device: torch.device,
    ) -> ShardedEmbeddingCollection:
        return ShardedEmbeddingCollection(
            module, params, env, device, self.optimizer_config(module),
            self._backend, self._table_init, self.qcomm_codecs_registry,
        )
