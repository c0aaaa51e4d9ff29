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
from recsys_core.distributed.sharding.common import (
    ShardedTable,
    check_kernel_placement,
    require_process_group,
    resolve_shards,
)
from recsys_core.distributed.sharding.sequence import (
    RwSequenceSharding,
    SequenceBatch,
    SequenceSharding,
    TwSequenceSharding,
)
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
from recsys_core.modules.embedding_modules import EmbeddingCollection, check_features
from recsys_core.optim.fused import EmbeddingFusedOptimizer
from recsys_core.optim.keyed import CombinedOptimizer
from recsys_core.optim.optimizers import recorded_fused_config
from recsys_core.sparse import JaggedTensor, KeyedJaggedTensor

_TW_FAMILY = (ShardingType.TABLE_WISE, ShardingType.COLUMN_WISE)
SUPPORTED_SHARDING_TYPES = (*_TW_FAMILY, ShardingType.ROW_WISE)


class EmbeddingCollectionAwaitable(LazyAwaitable[dict[str, JaggedTensor]]):
    """The sharded forward's result: waits for every strategy's output dist.

    ``parts[i]`` gives the rows of ``part_features[i]``; each output JaggedTensor takes its
    lengths (and, with ``need_indices``, its ids as weights) from this rank's input.
    """

    def __init__(
        self,
        parts: list[Awaitable[list[torch.Tensor]]],
        part_features: list[list[str]],
        features: KeyedJaggedTensor,
        embedding_names: list[str],
        need_indices: bool,
    ) -> None:
        super().__init__()
        self._parts, self._part_features = parts, part_features
        self._features, self._names, self._need_indices = features, embedding_names, need_indices

    def _wait_impl(self) -> dict[str, JaggedTensor]:
        rows: dict[str, torch.Tensor] = {}
        for part, names in zip(self._parts, self._part_features, strict=True):
            rows.update(zip(names, part.wait(), strict=True))
        inputs = self._features.to_dict()
        return {
            name: JaggedTensor(
                values=rows[name],
                lengths=inputs[name].lengths(),
                weights=inputs[name].values() if self._need_indices else None,
            )
            for name in self._names
        }


class ShardedEmbeddingCollection(nn.Module):
    """An EmbeddingCollection whose tables are sharded over ``env`` according to ``plan``.

    Same input and output as the unsharded module (``forward(...).wait()`` is a
    ``dict[str, JaggedTensor]`` equal to the unsharded result for this rank's batch). Table
    updates are fused into backward; ``fused_optimizer`` exposes their learning rate and state.
    Supported sharding types: TABLE_WISE, COLUMN_WISE, ROW_WISE.
    """

    def __init__(
        self,
        module: EmbeddingCollection,
        plan: Mapping[str, ParameterSharding],
        env: ShardingEnv,
        device: torch.device,
        optimizer: FusedOptimizerConfig,
        backend: KernelBackend = KernelBackend.AUTO,
    ) -> None:
        super().__init__()
        configs = module.embedding_configs()
        names = [c.name for c in configs]
        missing = [n for n in names if n not in plan]
        if missing:
            raise ValueError(
                f"sharding plan has no entry for table(s) {missing}; every table of the "
                "EmbeddingCollection needs one (e.g. table_wise(rank=0))"
            )
        supported = ", ".join(t.name for t in SUPPORTED_SHARDING_TYPES)
        for name, ps in plan.items():
            if ps.sharding_type not in SUPPORTED_SHARDING_TYPES:
                raise ValueError(
                    f"table {name!r}: sharding type {ps.sharding_type.name} is not supported by "
                    f"ShardedEmbeddingCollection; use one of {supported}"
                )
        # Before any communication: a bad plan fails here with a message, not with a hang.
        validate_module_sharding_plan(
            configs, EmbeddingModuleShardingPlan(plan), env.world_size, env.local_world_size
        )
        check_kernel_placement(plan, device)
        require_process_group(env, "ShardedEmbeddingCollection")
        self._env, self._device = env, device
        self._need_indices = module.need_indices()
        self._embedding_names = [f for c in configs for f in c.feature_names]
        source = None
        if not any(p.is_meta for p in module.parameters()):
            source = {c.name: module.embeddings[c.name].weight.detach() for c in configs}
        # resolve_shards reads only the fields EmbeddingConfig shares with EmbeddingBagConfig
        tables = [
            resolve_shards(c, plan[c.name], env.world_size)
            for c in configs
        ]

        def of(*types: ShardingType) -> list[ShardedTable]:
            return [t for t in tables if t.sharding.sharding_type in types]

        common: dict[str, Any] = {
            "device": device, "optimizer": optimizer, "backend": backend, "source": source,
        }
        self._strategies: list[SequenceSharding] = []
        if of(*_TW_FAMILY):
            self._strategies.append(TwSequenceSharding(of(*_TW_FAMILY), env, **common))
        if of(ShardingType.ROW_WISE):
            self._strategies.append(RwSequenceSharding(of(ShardingType.ROW_WISE), env, **common))
        self.lookups = nn.ModuleList([s.local for s in self._strategies])
        self._input_orders: dict[tuple[str, ...], list[list[int]]] = {}
        self._feature_rows = {f: c.num_embeddings for c in configs for f in c.feature_names}
        self._fused_optimizer = self._build_optimizer()

    def _build_optimizer(self) -> CombinedOptimizer:
        optims = []
        for local in self.lookups:
            for kernel, shards in zip(local.kernels, local.kernel_shards, strict=True):
                params: dict[str, nn.Parameter] = {}
                for sh, view in zip(shards, kernel.split_embedding_weights(), strict=True):
                    # Not registered on the module: the kernel owns the storage and updates it
                    # in backward, so DDP (or a dense optimizer) must never see these weights.
                    weight = nn.Parameter(view[: sh.rows])
                    name = f"embeddings.{sh.table}.weight[{sh.row_offset}:,{sh.col_offset}:]"
                    params[name] = weight
                optim = EmbeddingFusedOptimizer(kernel, params, [sh.table for sh in shards])
                for weight in params.values():
                    weight._in_backward_optimizers = [optim]  # type: ignore[attr-defined]
                optims.append(optim)
        return CombinedOptimizer(optims)

    @property
    def fused_optimizer(self) -> CombinedOptimizer:
        return self._fused_optimizer

    @property
    def env(self) -> ShardingEnv:
        return self._env

    def input_dist(self, features: KeyedJaggedTensor) -> list[Awaitable[SequenceBatch]]:
        """Start every strategy's input all-to-all (checks ids first: no bad id is sent)."""
        check_features(features, self._embedding_names, "ShardedEmbeddingCollection", False)
        self._check_ids(features)
        return [
            s.input_dist(features.permute(order))
            for s, order in zip(self._strategies, self._orders(features), strict=True)
        ]

    def _orders(self, features: KeyedJaggedTensor) -> list[list[int]]:
        keys = tuple(features.keys())
        if keys not in self._input_orders:
            index = {k: i for i, k in enumerate(keys)}
            self._input_orders[keys] = [
                [index[f] for f in s.output_features] for s in self._strategies
            ]
        return self._input_orders[keys]

    def _check_ids(self, features: KeyedJaggedTensor) -> None:
        offsets = features.offset_per_key()
        values = features.values()
        for i, key in enumerate(features.keys()):
            rows = self._feature_rows.get(key)
            if rows is None or offsets[i] == offsets[i + 1]:
                continue
            lo, hi = torch.aminmax(values[offsets[i] : offsets[i + 1]])
            if int(lo) < 0 or int(hi) >= rows:
                bad = int(lo) if int(lo) < 0 else int(hi)
                raise IdOutOfRangeError(
                    f"feature {key!r}: id {bad} is outside [0, {rows}) of its table (rank "
                    f"{self._env.rank}); hash or clip ids to the table size before lookup"
                )

    def compute_and_output_dist(
        self, features: KeyedJaggedTensor, dist_inputs: list[Awaitable[SequenceBatch]]
    ) -> EmbeddingCollectionAwaitable:
        parts: list[Awaitable[list[torch.Tensor]]] = []
        for strategy, awaitable in zip(self._strategies, dist_inputs, strict=True):
            batch = awaitable.wait()
            parts.append(strategy.output_dist(strategy.lookup(batch), batch))
        return EmbeddingCollectionAwaitable(
            parts,
            [s.output_features for s in self._strategies],
            features,
            self._embedding_names,
            self._need_indices,
        )

    def forward(self, features: KeyedJaggedTensor) -> EmbeddingCollectionAwaitable:
        return self.compute_and_output_dist(features, self.input_dist(features))


class EmbeddingCollectionSharder:
    """Shards EmbeddingCollections (TABLE_WISE, COLUMN_WISE and ROW_WISE tables).

    ``fused_params`` is TorchRec's dict (``{"optimizer": EmbOptimType..., "learning_rate":
    ...}``); when absent, the optimizer recorded by ``apply_optimizer_in_backward`` on the
    module's weights is used, else EXACT_SGD with lr 0.01 (TorchRec's default).
    """

    def __init__(
        self,
        fused_params: Mapping[str, Any] | None = None,
        backend: KernelBackend = KernelBackend.AUTO,
    ) -> None:
        self._fused = (
            None if fused_params is None else FusedOptimizerConfig.from_fused_params(fused_params)
        )
        self._backend = backend

    @property
    def module_type(self) -> type[nn.Module]:
        return EmbeddingCollection

    def sharding_types(self, compute_device_type: str) -> list[str]:
        return [t.value for t in SUPPORTED_SHARDING_TYPES]

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        return [EmbeddingComputeKernel.FUSED.value]

    def optimizer_config(self, module: EmbeddingCollection) -> FusedOptimizerConfig:
        if self._fused is not None:
            return self._fused
        return recorded_fused_config(module) or FusedOptimizerConfig()

    def shard(
        self,
        module: EmbeddingCollection,
        params: Mapping[str, ParameterSharding] | EmbeddingModuleShardingPlan,
        env: ShardingEnv,
        device: torch.device | None = None,
    ) -> ShardedEmbeddingCollection:
        return ShardedEmbeddingCollection(
            module, params, env, torch.device(device or "cpu"), self.optimizer_config(module),
            self._backend,
        )
