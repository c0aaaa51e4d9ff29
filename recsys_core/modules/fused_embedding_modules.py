"""``FusedEmbeddingBagCollection``: an EmbeddingBagCollection whose tables live in table-batched
kernels (FBGEMM TBE, or the torch kernel) with the optimizer applied inside backward.

Its ``state_dict`` has the same keys as :class:`EmbeddingBagCollection`
(``embedding_bags.<table>.weight``), so weights move freely between the two; optimizer state is in
``fused_optimizer().state_dict()``. ``FusedEmbeddingCollection`` and ``fuse_embedding_optimizer``
are importable from here, as from TorchRec's module of the same name.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from recsys_core.kernels.batched import BatchedTables
from recsys_core.kernels.config import EmbOptimType, KernelBackend
from recsys_core.kernels.packed import (
    ColumnPermutation,
    PackedTable,
    column_permutation,
    select_columns,
)
from recsys_core.modules.collection_tables import PooledCollectionTables
from recsys_core.modules.embedding_collection import EmbeddingCollection
from recsys_core.modules.embedding_configs import (
    EmbeddingBagConfig,
    PoolingType,
    get_embedding_names_by_table,
)
from recsys_core.modules.embedding_modules import EmbeddingBagCollection, check_features
from recsys_core.modules.fused_common import (
    FusedCollectionBase,
    check_location,
    convert_optimizer_type_and_kwargs,
    fused_table_weights,
    resolve_fused_config,
)
from recsys_core.modules.fused_embedding_collection import FusedEmbeddingCollection
from recsys_core.optim.fused import EmbeddingFusedOptimizer, FusedOptimizerModule
from recsys_core.optim.optimizers import recorded_fused_config
from recsys_core.sparse import KeyedJaggedTensor, KeyedTensor

__all__ = [
    "EmbeddingFusedOptimizer",
    "FusedEmbeddingBagCollection",
    "FusedEmbeddingCollection",
    "convert_optimizer_type_and_kwargs",
    "fuse_embedding_optimizer",
    "resolve_fused_config",
]


class FusedEmbeddingBagCollection(FusedCollectionBase, PooledCollectionTables):
    """Same interface and outputs as EmbeddingBagCollection; updates happen in ``backward()``.

    Args:
        tables: table configs (SUM and MEAN tables may be mixed: one kernel per pooling type).
        optimizer_type: ``EmbOptimType.EXACT_ROWWISE_ADAGRAD`` etc., or ``torch.optim.SGD`` /
            ``Adagrad`` / ``Adam`` / ``recsys_core.optim.RowWiseAdagrad``.
        optimizer_kwargs: hyper-parameters (``{"learning_rate": 0.02, "eps": 0.002}`` for an
            EmbOptimType, ``{"lr": 0.02}`` for a torch class). Unknown keys are an error.
        is_weighted: features carry per-id weights (weighted pooling).
        device: where the tables live. The module cannot be moved after construction.
        location: TorchRec's FBGEMM EmbeddingLocation; only the device's own memory (HOST on
            CPU, DEVICE on CUDA) is accepted here.
        backend: AUTO picks FBGEMM where it has a kernel for the device and optimizer.

    A feature listed by several tables is looked up in each, keyed ``<feature>@<table>`` as in
    EmbeddingBagCollection. ``fused_optimizer()`` returns the optimizer applied in backward.
    """

    def __init__(
        self,
        tables: Sequence[EmbeddingBagConfig],
        optimizer_type: Any = EmbOptimType.EXACT_SGD,
        optimizer_kwargs: Mapping[str, Any] | None = None,
        is_weighted: bool = False,
        device: torch.device | str | None = None,
        location: Any = None,
        backend: KernelBackend = KernelBackend.AUTO,
    ) -> None:
        super().__init__()
        # Declaration index of the table each name's weight and optimizer state refer to.
        exposed = _exposed_tables(tables)
        for config in tables:
            if not isinstance(config, EmbeddingBagConfig):
                raise TypeError(f"FusedEmbeddingBagCollection takes EmbeddingBagConfig, got {config!r}")
        self._embedding_bag_configs = list(tables)
        self._is_weighted = is_weighted
        self._device = torch.device(device) if device is not None else torch.empty(0).device
        check_location(location, self._device, "FusedEmbeddingBagCollection")
        self._set_optimizer(optimizer_type, optimizer_kwargs)
        self._feature_names = [f for c in tables for f in c.feature_names]
        names_by_table = get_embedding_names_by_table(tables)
        self._embedding_names = [n for names in names_by_table for n in names]
        if len(set(self._embedding_names)) != len(self._embedding_names):
            raise ValueError(
                "FusedEmbeddingBagCollection: tables of the same name share a feature, so two "
                f"outputs would be named alike ({self._embedding_names}); rename a table"
            )
        self._lengths_per_embedding = [c.embedding_dim for c in tables for _ in c.feature_names]

        # One kernel per pooling type, tables in declaration order within each. Not registered as
        # submodules (as TorchRec): named_modules/parameters/buffers are those of an
        # EmbeddingBagCollection; train()/eval() are forwarded by hand.
        def fill(index: int, view: torch.Tensor) -> None:
            tables[index].init_weight_(view)

        self._batched = BatchedTables.grouped(
            [PackedTable(name=c.name, rows=c.num_embeddings, dim=c.embedding_dim) for c in tables],
            [c.feature_names for c in tables],
            [c.pooling is PoolingType.MEAN for c in tables],
            device=self._device,
            optimizer=self._optimizer_config,
            backend=backend,
            weighted=is_weighted,
            fill=None if self._device.type == "meta" else fill,
        )
        holders, self._fused_optimizer = fused_table_weights(
            self._batched, [c.name for c in tables], "embedding_bags",
            [exposed[c.name] == index for index, c in enumerate(tables)],
        )
        # Declaration order, so that state_dict keys line up with EmbeddingBagCollection's.
        self.embedding_bags = nn.ModuleDict({c.name: holders[c.name] for c in tables})
        # Output columns come out in kernel order; this permutation restores declaration order.
        self._columns = self._column_permutation(
            [n for members in self._batched.members for i in members for n in names_by_table[i]]
        )

    @classmethod
    def from_embedding_bag_collection(
        cls,
        ebc: EmbeddingBagCollection,
        optimizer_type: Any = None,
        optimizer_kwargs: Mapping[str, Any] | None = None,
        backend: KernelBackend = KernelBackend.AUTO,
    ) -> FusedEmbeddingBagCollection:
        """A fused copy of ``ebc`` (same tables and weights).

        Without ``optimizer_type`` the optimizer recorded on the EBC's weights by
        ``apply_optimizer_in_backward`` is used (all tables must share it).
        """
        if optimizer_type is None:
            recorded = recorded_fused_config(ebc)
            if recorded is None:
                raise ValueError(
                    "no optimizer given and none recorded on the tables; pass optimizer_type or "
                    "call apply_optimizer_in_backward on every table first"
                )
            optimizer_type, optimizer_kwargs = recorded, None
        fused = cls(
            ebc.embedding_bag_configs(), optimizer_type, optimizer_kwargs,
            is_weighted=ebc.is_weighted(), device=ebc.device, backend=backend,
        )
        if ebc.device.type != "meta":
            fused.load_state_dict(ebc.state_dict())
        return fused

    # ---- public API ---------------------------------------------------------------------------
    def kernel_backends(self) -> list[KernelBackend]:
        """Which implementation runs each kernel (one per pooling type)."""
        return self._batched.backends()

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        check_features(
            features, self._feature_names, "FusedEmbeddingBagCollection", self._is_weighted
        )
        if features.variable_stride_per_key():
            raise ValueError(
                "FusedEmbeddingBagCollection: the input has a different batch size per key "
                f"({dict(zip(features.keys(), features.stride_per_key(), strict=True))}); the "
                "table-batched kernel needs one batch size. Use EmbeddingBagCollection for "
                "variable-batch inputs, or pad every key to the full batch"
            )
        if features.values().is_meta:  # shapes only: meta tensors hold no ids to look up
            values = torch.empty(features.stride(), sum(self._lengths_per_embedding), device="meta")
            return KeyedTensor(self._embedding_names, self._lengths_per_embedding, values)
        try:
            values = self._batched.lookup(self._batched.in_kernel_order(features), self._is_weighted)
        except (RuntimeError, ValueError) as exc:
            features.validate()  # lengths, offsets or weights that do not fit name their key
            raise exc
        values = select_columns(values, self._columns)
        return KeyedTensor(
            keys=self._embedding_names,
            length_per_key=self._lengths_per_embedding,
            values=values,
        )

    # ---- internals ----------------------------------------------------------------------------
    def _column_permutation(self, kernel_order: list[str]) -> ColumnPermutation | None:
        dims = dict(zip(self._embedding_names, self._lengths_per_embedding, strict=True))
        start, column_of = 0, {}
        for name in kernel_order:
            column_of[name] = start
            start += dims[name]
        columns = column_permutation(
            [column_of[n] + d for n in self._embedding_names for d in range(dims[n])]
        )
        if columns is None:
            return None
        return ColumnPermutation(columns.blocks.to(self._device), columns.width)

    def _get_name(self) -> str:
        return "FusedEmbeddingBagCollection"


def _exposed_tables(tables: Sequence[EmbeddingBagConfig]) -> dict[str, int]:
    """Per table name, the declaration index of the table its weight and optimizer state expose.

    TorchRec's FusedEmbeddingBagCollection accepts two tables of one name: both are looked up
    and trained, and the later one's weight replaces the earlier in ``embedding_bags``. So do
    we (the last one is exposed), with a warning: a checkpoint then lacks the others.
    """
    exposed: dict[str, int] = {}
    for index, config in enumerate(tables):
        if config.name in exposed:
            warnings.warn(
                f"FusedEmbeddingBagCollection: two tables are named {config.name!r}. Both are "
                "looked up and trained, but (as in TorchRec) state_dict(), named_parameters() "
                "and the fused optimizer's state hold only the last one, so a checkpoint loses "
                "the others; give every table its own name.",
                stacklevel=3,
            )
        exposed[config.name] = index
    return exposed


# isinstance(module, FusedOptimizerModule) holds as in TorchRec (a virtual subclass, no inheritance).
FusedOptimizerModule.register(FusedEmbeddingBagCollection)
FusedOptimizerModule.register(FusedEmbeddingCollection)


def fuse_embedding_optimizer(
    model: nn.Module,
    optimizer_type: Any,
    optimizer_kwargs: Mapping[str, Any],
    device: torch.device | str | None,
    location: Any = None,
    backend: KernelBackend = KernelBackend.AUTO,
) -> nn.Module:
    """Replace every EmbeddingBagCollection / EmbeddingCollection in ``model`` (the model itself
    included) by its fused counterpart with this optimizer applied in backward.

    As TorchRec's, the call returns the model (or the fused module when ``model`` is itself a
    collection). Unlike TorchRec, the fused tables start from the collection's current weights
    (fresh initialization only where the collection is on meta), and ``is_weighted`` carries over.
    """
    fused = _fused_copy(model, optimizer_type, optimizer_kwargs, device, location, backend)
    if fused is not None:
        return fused

    def replace(parent: nn.Module) -> None:
        for name, child in parent.named_children():
            replacement = _fused_copy(child, optimizer_type, optimizer_kwargs, device, location, backend)
            if replacement is None:
                replace(child)
            else:
                setattr(parent, name, replacement)

    replace(model)
    return model


def _fused_copy(
    module: nn.Module,
    optimizer_type: Any,
    optimizer_kwargs: Mapping[str, Any],
    device: torch.device | str | None,
    location: Any,
    backend: KernelBackend,
) -> nn.Module | None:
    fused: nn.Module
    if isinstance(module, EmbeddingBagCollection):
        fused = FusedEmbeddingBagCollection(
            module.embedding_bag_configs(), optimizer_type, optimizer_kwargs,
            is_weighted=module.is_weighted(), device=device, location=location, backend=backend,
        )
    elif isinstance(module, EmbeddingCollection):
        fused = FusedEmbeddingCollection(
            module.embedding_configs(), optimizer_type, optimizer_kwargs, device=device,
            need_indices=module.need_indices(), location=location, backend=backend,
        )
    else:
        return None
    source = module.state_dict()
    if source and not any(t.is_meta for t in source.values()) and fused.device.type != "meta":
        fused.load_state_dict(source)
    return fused
