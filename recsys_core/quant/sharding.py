"""``shard_quant_model``: quantized tables placed table-wise on one or several devices.

Inference sharding runs in ONE process that drives every device (no process group): each
device holds a :class:`QuantTBEBag` with its tables; a forward splits the KJT by device, looks
up on each device and brings the pooled outputs back to the input's device in declaration order.

Default plan: tables by size (bytes in their kernel buffer), largest first, each onto the device
holding the fewest bytes so far (ties: the lower rank)::

    t_big 4 MB, t_mid 3 MB, t_small 2 MB, 2 devices
      -> rank 0: t_big (4 MB)    rank 1: t_mid, t_small (5 MB)

A plan is the training plan's plain data (:class:`ShardingPlan` with ``table_wise(rank,
EmbeddingComputeKernel.QUANT)`` entries), so it prints, round-trips through JSON and is checked
by :func:`validate_module_sharding_plan` before anything is built.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from recsys_core.kernels.config import KernelBackend
from recsys_core.kernels.quant_tbe import default_row_alignment, table_offsets
from recsys_core.modules.collection_tables import (
    PooledCollectionTables,
    SequenceCollectionTables,
)
from recsys_core.modules.embedding_configs import (
    BaseEmbeddingConfig,
    EmbeddingBagConfig,
    PoolingType,
)
from recsys_core.modules.embedding_modules import check_features
from recsys_core.plan.generators import construct_module_sharding_plan, table_wise
from recsys_core.plan.types import (
    EmbeddingComputeKernel,
    EmbeddingModuleShardingPlan,
    ShardingPlan,
    ShardingType,
)
from recsys_core.plan.validation import validate_module_sharding_plan
from recsys_core.quant.quant_embedding import (
    QuantEmbeddingBagCollection,
    QuantFeatureProcessedEmbeddingBagCollection,
    QuantTableWeight,
    QuantTBEBag,
    pooled_lookup,
    quant_table_specs,
    table_of_features,
)
from recsys_core.quant.quant_sequence import (
    QuantEmbeddingCollection,
    QuantManagedCollisionEmbeddingCollection,
    QuantTBESequence,
    cast_values,
    sequence_lookup,
)
from recsys_core.sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor
from recsys_core.sparse.key_order import KeyOrder

_NAME = "ShardedQuantEmbeddingBagCollection"


def quant_table_bytes(configs: Sequence[EmbeddingBagConfig], device_type: str) -> dict[str, int]:
    """Bytes each quantized table takes in a kernel buffer on a ``device_type`` device."""
    alignment = default_row_alignment(torch.device(device_type))
    return {
        spec.name: table_offsets([spec], alignment)[-1] for spec in quant_table_specs(configs)
    }


def quant_table_wise_plan(
    module: QuantEmbeddingBagCollection | QuantEmbeddingCollection,
    world_size: int,
    device_type: str = "cpu",
) -> EmbeddingModuleShardingPlan:
    """Every table whole on one rank, balanced by bytes (largest first onto the lightest rank)."""
    configs = _configs(module)
    sizes = quant_table_bytes(configs, device_type)
    load = [0] * world_size
    generators = {}
    for name in sorted(sizes, key=lambda n: -sizes[n]):  # stable: declaration order on ties
        rank = min(range(world_size), key=lambda r: load[r])
        load[rank] += sizes[name]
        generators[name] = table_wise(rank, EmbeddingComputeKernel.QUANT)
    return construct_module_sharding_plan(
        configs, generators, world_size, world_size, device_type, inference=True
    )


class _ShardedQuantTables(nn.Module):
    """What the sharded quantized collections share: one kernel module per rank that holds
    tables (``shards``, in ``ranks`` order), each table's rows as a view into its kernel's
    buffer, and the refusal to be moved (each shard's rows are laid out for its device)."""

    def _place(
        self,
        module: nn.Module,
        configs: Sequence[BaseEmbeddingConfig],
        plan: EmbeddingModuleShardingPlan,
        devices: Sequence[torch.device],
        make: Callable[..., QuantTBEBag],
    ) -> tuple[dict[int, list[BaseEmbeddingConfig]], dict[str, torch.Tensor]]:
        """Build ``make(tables, specs, feature_table_map, device, rows, use_fbgemm)`` for each
        rank's tables; returns the tables by rank and every table's row view."""
        rows = module.quantized_weights()
        by_rank: dict[int, list[BaseEmbeddingConfig]] = {}
        for c in configs:
            by_rank.setdefault(plan[c.name].ranks[0], []).append(c)
        self.ranks = sorted(by_rank)
        self.shards = nn.ModuleList()
        views: dict[str, torch.Tensor] = {}
        use_fbgemm = None if module.kernel_backend() is KernelBackend.FBGEMM else False
        for rank in self.ranks:
            tables = by_rank[rank]
            kernel = make(
                tables,
                quant_table_specs(tables),
                table_of_features(tables),
                devices[rank],
                [rows[c.name].cpu() for c in tables],
                use_fbgemm,
            )
            self.shards.append(kernel)
            views.update(zip((c.name for c in tables), kernel.table_weights(), strict=True))
        return by_rank, views

    def tables_per_rank(self) -> dict[int, list[str]]:
        return {r: [s.name for s in m.specs] for r, m in zip(self.ranks, self.shards, strict=True)}

    def bytes_per_rank(self) -> dict[int, int]:
        return {r: int(m.weights.numel()) for r, m in zip(self.ranks, self.shards, strict=True)}

    def devices_per_rank(self) -> dict[int, torch.device]:
        return {r: m.weights.device for r, m in zip(self.ranks, self.shards, strict=True)}

    def _apply(self, fn: Any, recurse: bool = True) -> _ShardedQuantTables:
        for device in self.devices_per_rank().values():
            if fn(torch.zeros(1, device=device)).device != device:
                raise ValueError(
                    f"{type(self).__name__} cannot be moved (each shard's rows are laid out for "
                    "its device); place the tables with shard_quant_model(model, devices=[...]) "
                    "instead"
                )
        return super()._apply(fn, recurse)


class ShardedQuantEmbeddingBagCollection(_ShardedQuantTables, PooledCollectionTables):
    """A QuantEmbeddingBagCollection with its tables spread over devices; same forward contract
    (KeyedJaggedTensor in, KeyedTensor out on the input's device, same keys and columns).

    The result is returned directly, not as an awaitable: nothing is in flight between calls.
    ``state_dict`` has the unsharded keys (``embedding_bags.<table>.weight``, each on its device).

    Args:
        module: the quantized collection (its rows are copied, not requantized).
        plan: table-wise QUANT entries for every table (see :func:`quant_table_wise_plan`).
        devices: the device of each rank.
    """

    def __init__(
        self,
        module: QuantEmbeddingBagCollection,
        plan: EmbeddingModuleShardingPlan,
        devices: Sequence[torch.device],
    ) -> None:
        super().__init__()
        configs = module.embedding_bag_configs()
        _check_plan(configs, plan, devices)
        self.plan = plan
        self._embedding_bag_configs = configs
        self._is_weighted = module.is_weighted()
        self._feature_names = [f for c in configs for f in c.feature_names]
        self._dims = [c.embedding_dim for c in configs for _ in c.feature_names]
        pooling_mean = {c.name: c.pooling is PoolingType.MEAN for c in configs}
        _, views = self._place(module, configs, plan, devices, lambda tables, specs, ftm, device,
                               rows, use_fbgemm: QuantTBEBag(
            specs, ftm, [f for c in tables for f in c.feature_names],
            [pooling_mean[c.name] for c in tables for _ in c.feature_names],
            device=device, tables=rows, use_fbgemm=use_fbgemm))
        self.embedding_bags = nn.ModuleDict({c.name: QuantTableWeight(views[c.name]) for c in configs})

        kernel_order = [f for bag in self.shards for f in bag.feature_names]
        self._key_order = KeyOrder(kernel_order, "ShardedQuantEmbeddingBagCollection")
        start, column_of = 0, {}
        dims = dict(zip(self._feature_names, self._dims, strict=True))
        for name in kernel_order:
            column_of[name] = start
            start += dims[name]
        columns = [column_of[n] + d for n in self._feature_names for d in range(dims[n])]
        self._columns = None if columns == list(range(start)) else torch.tensor(columns)

    @property
    def tbes(self) -> list[QuantTBEBag]:
        """The kernel modules, one per rank that holds tables (TorchRec's ``tbes``)."""
        return list(self.shards)

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        check_features(features, self._feature_names, _NAME, self._is_weighted)
        kjt = self._key_order.apply(features)
        parts = kjt.split([len(bag.feature_names) for bag in self.shards])
        out_device = features.device()
        pooled = [
            pooled_lookup(bag, part, self._is_weighted, _NAME).to(out_device)
            for bag, part in zip(self.shards, parts, strict=True)
        ]
        values = torch.cat(pooled, dim=1)
        if self._columns is not None:
            values = values.index_select(1, self._columns.to(out_device))
        return KeyedTensor(keys=self._feature_names, length_per_key=self._dims, values=values)


class ShardedQuantEmbeddingCollection(_ShardedQuantTables, SequenceCollectionTables):
    """A QuantEmbeddingCollection with its tables spread over devices; same forward contract
    (KeyedJaggedTensor in, ``{embedding name: JaggedTensor}`` out on the input's device).

    ``state_dict`` has the unsharded keys (``embeddings.<table>.weight``, each on its device).
    Arguments as :class:`ShardedQuantEmbeddingBagCollection`.
    """

    def __init__(
        self,
        module: QuantEmbeddingCollection,
        plan: EmbeddingModuleShardingPlan,
        devices: Sequence[torch.device],
    ) -> None:
        super().__init__()
        configs = module.embedding_configs()
        _check_plan(configs, plan, devices, "ShardedQuantEmbeddingCollection")
        self.plan = plan
        self._embedding_configs = configs
        self._need_indices = module.need_indices()
        self._output_dtype = module.output_dtype()
        self._embedding_dim = module.embedding_dim()
        self._embedding_names_by_table = module.embedding_names_by_table()
        self._feature_names = [f for c in configs for f in c.feature_names]
        names_of = {c.name: n for c, n in zip(configs, self._embedding_names_by_table, strict=True)}
        by_rank, views = self._place(
            module, configs, plan, devices, lambda tables, specs, ftm, device, rows, use_fbgemm:
            QuantTBESequence(specs, ftm, [n for c in tables for n in names_of[c.name]],
                             device=device, tables=rows, use_fbgemm=use_fbgemm))
        self.embeddings = nn.ModuleDict({c.name: QuantTableWeight(views[c.name]) for c in configs})
        # Kernel inputs: per rank, its tables' features (a feature in several tables repeats).
        self._kernel_features = [
            [f for c in by_rank[r] for f in c.feature_names] for r in self.ranks
        ]
        self._key_order = KeyOrder(
            [f for per_rank in self._kernel_features for f in per_rank],
            "ShardedQuantEmbeddingCollection",
        )

    def output_dtype(self) -> torch.dtype:
        return self._output_dtype

    @property
    def tbes(self) -> list[QuantTBESequence]:
        """The kernel modules, one per rank that holds tables."""
        return list(self.shards)

    def forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        name = "ShardedQuantEmbeddingCollection"
        check_features(features, self._feature_names, name, False)
        kjt = self._key_order.apply(features)
        parts = kjt.split([len(f) for f in self._kernel_features])
        out_device = features.device()
        out: dict[str, JaggedTensor] = {}
        for lookup, part in zip(self.shards, parts, strict=True):
            out.update(sequence_lookup(lookup, part, self._need_indices, name, out_device))
        if self._output_dtype != torch.float32:
            out = {k: cast_values(jt, self._output_dtype) for k, jt in out.items()}
        return {n: out[n] for names in self._embedding_names_by_table for n in names}



def shard_quant_model(
    model: nn.Module,
    devices: Sequence[torch.device | str] | None = None,
    *,
    world_size: int | None = None,
    plan: ShardingPlan | EmbeddingModuleShardingPlan | None = None,
) -> nn.Module:
    """Place the tables of every QuantEmbeddingBagCollection of ``model`` table-wise on devices.

    Each collection is replaced (in place; returned) by a :class:`ShardedQuantEmbeddingBagCollection`.
    Dense layers stay where they are.

    Args:
        model: a model after :func:`quantize_inference_model` (or a QuantEmbeddingBagCollection).
        devices: the device of each rank, e.g. ``["cuda:0", "cuda:1"]`` (repeats allowed).
        world_size: instead of ``devices``: that many CPU devices.
        plan: a ShardingPlan keyed by module path ("" for the model itself), or one module's plan
            when the model has one collection; default :func:`quant_table_wise_plan`.
    """
    placed = _resolve_devices(devices, world_size)
    found = [
        (p, m)
        for p, m in model.named_modules()
        if isinstance(m, QuantEmbeddingBagCollection | QuantEmbeddingCollection)
    ]
    if not found:
        raise ValueError(
            "shard_quant_model: the model has no QuantEmbeddingBagCollection or "
            "QuantEmbeddingCollection; call quantize_inference_model(model, ...) first"
        )
    if isinstance(plan, EmbeddingModuleShardingPlan):
        if len(found) != 1:
            raise ValueError(
                f"shard_quant_model: one module plan given but the model has {len(found)} "
                f"quantized collections ({[p for p, _ in found]}); pass a ShardingPlan keyed by path"
            )
        plan = ShardingPlan({found[0][0]: plan})
    for path, module in found:
        module_plan = None if plan is None else plan.get_plan_for_module(path)
        if plan is not None and module_plan is None:
            raise ValueError(
                f"shard_quant_model: the plan has no entry for collection {path!r} (it covers "
                f"{list(plan.plan)}); add one or pass plan=None"
            )
        if module_plan is None:
            types = sorted({d.type for d in placed})
            if len(types) > 1:
                raise ValueError(
                    f"shard_quant_model: the devices mix types {types}; the default plan places "
                    "by bytes on one device type, so pass an explicit plan"
                )
            module_plan = quant_table_wise_plan(module, len(placed), placed[0].type)
        sharded = sharded_quant_module(module, module_plan, placed)
        if not path:
            return sharded
        parent_path, _, name = path.rpartition(".")
        setattr(model.get_submodule(parent_path), name, sharded)
    return model


def sharded_quant_module(
    module: nn.Module, plan: EmbeddingModuleShardingPlan, devices: Sequence[torch.device]
) -> nn.Module:
    """The sharded form of a quantized collection (EBC, FP-EBC, EC or managed-collision EC)."""
    if isinstance(module, QuantManagedCollisionEmbeddingCollection):
        return ShardedQuantManagedCollisionEmbeddingCollection(module, plan, devices)
    if isinstance(module, QuantEmbeddingCollection):
        return ShardedQuantEmbeddingCollection(module, plan, devices)
    if isinstance(module, QuantFeatureProcessedEmbeddingBagCollection):
        return ShardedQuantFeatureProcessedEmbeddingBagCollection(module, plan, devices)
    return ShardedQuantEmbeddingBagCollection(module, plan, devices)


class ShardedQuantFeatureProcessedEmbeddingBagCollection(ShardedQuantEmbeddingBagCollection):
    """A quantized feature-processed collection spread over devices: the (float) processors run
    on the input's device, then the sharded lookup."""

    def __init__(
        self,
        module: QuantEmbeddingBagCollection,
        plan: EmbeddingModuleShardingPlan,
        devices: Sequence[torch.device],
    ) -> None:
        super().__init__(module, plan, devices)
        self.feature_processor = module.feature_processor

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        return super().forward(self.feature_processor(features))


class ShardedQuantManagedCollisionEmbeddingCollection(ShardedQuantEmbeddingCollection):
    """A quantized managed-collision collection with its tables spread over devices: ids are
    remapped by the (frozen) managed collision collection on the input's device, then looked up.
    ``forward`` returns ``(embeddings, remapped KJT)`` as the unsharded module."""

    def __init__(
        self,
        module: QuantEmbeddingCollection,
        plan: EmbeddingModuleShardingPlan,
        devices: Sequence[torch.device],
    ) -> None:
        super().__init__(module, plan, devices)
        self._managed_collision_collection = module._managed_collision_collection
        self._return_remapped_features = module._return_remapped_features

    def forward(  # type: ignore[override]
        self, features: KeyedJaggedTensor
    ) -> tuple[dict[str, JaggedTensor], KeyedJaggedTensor]:
        remapped = self._managed_collision_collection(features)
        return super().forward(remapped), remapped


def _configs(module: nn.Module) -> list[BaseEmbeddingConfig]:
    if hasattr(module, "embedding_bag_configs"):
        return list(module.embedding_bag_configs())
    return list(module.embedding_configs())


def _resolve_devices(
    devices: Sequence[torch.device | str] | None, world_size: int | None
) -> list[torch.device]:
    if devices is None and world_size is None:
        raise ValueError("shard_quant_model: pass devices=[...] or world_size=N (N CPU devices)")
    if devices is not None and world_size is not None and len(devices) != world_size:
        raise ValueError(
            f"shard_quant_model: {len(devices)} devices but world_size {world_size}; pass one"
        )
    placed = [torch.device(d) for d in devices] if devices is not None else [
        torch.device("cpu")
    ] * int(world_size or 0)
    if not placed:
        raise ValueError("shard_quant_model: needs at least one device")
    return placed


def _check_plan(
    configs: Sequence[BaseEmbeddingConfig],
    plan: EmbeddingModuleShardingPlan,
    devices: Sequence[torch.device],
    module_name: str = _NAME,
) -> None:
    world_size = len(devices)
    missing = [c.name for c in configs if c.name not in plan]
    if missing:
        raise ValueError(
            f"{module_name}: the plan places no shard of tables {missing}; every table of an inference "
            "collection must be placed (use table_wise(rank, EmbeddingComputeKernel.QUANT))"
        )
    validate_module_sharding_plan(configs, plan, world_size, world_size, inference=True)
    for name, sharding in plan.items():
        if sharding.sharding_type is not ShardingType.TABLE_WISE:
            raise ValueError(
                f"{module_name}: table {name!r} is {sharding.sharding_type}; quantized inference "
                "places whole tables: use table_wise(rank, EmbeddingComputeKernel.QUANT)"
            )
        shard = sharding.shards[0]
        wanted = torch.device(shard.device).type
        if wanted != devices[shard.rank].type:
            raise ValueError(
                f"{module_name}: table {name!r} is planned on {shard.placement!r} but rank "
                f"{shard.rank}'s device is {devices[shard.rank]}; make the plan's device type "
                "match the devices passed"
            )
