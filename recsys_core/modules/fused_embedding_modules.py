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

from recsys_core.kernels.config import EmbOptimType, FusedOptimizerConfig, KernelBackend
from recsys_core.kernels.tbe import (
    build_table_batched_embedding,
    checked_lookup,
    kernel_backend,
)
from recsys_core.modules.embedding_collection import EmbeddingCollection
from recsys_core.modules.embedding_configs import (
    EmbeddingBagConfig,
    PoolingType,
    get_embedding_names_by_table,
)
from recsys_core.modules.embedding_modules import EmbeddingBagCollection, check_features
from recsys_core.modules.fused_common import (
    FusedCombinedOptimizer,
    TableWeight,
    check_location,
    convert_optimizer_type_and_kwargs,
    deepcopy_with_kernel_views,
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


class FusedEmbeddingBagCollection(nn.Module):
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
        self._configs = list(tables)
        self._is_weighted = is_weighted
        self._device = torch.device(device) if device is not None else torch.empty(0).device
        check_location(location, self._device, "FusedEmbeddingBagCollection")
        self._optimizer_type = optimizer_type
        self._optimizer_kwargs = dict(optimizer_kwargs or {})
        self._optimizer_config = resolve_fused_config(optimizer_type, optimizer_kwargs)
        self._feature_names = [f for c in tables for f in c.feature_names]
        names_by_table = get_embedding_names_by_table(tables)
        self._embedding_names = [n for names in names_by_table for n in names]
        if len(set(self._embedding_names)) != len(self._embedding_names):
            raise ValueError(
                "FusedEmbeddingBagCollection: tables of the same name share a feature, so two "
                f"outputs would be named alike ({self._embedding_names}); rename a table"
            )
        self._lengths_per_embedding = [c.embedding_dim for c in tables for _ in c.feature_names]

        # One kernel per pooling type, tables in declaration order within each.
        groups: dict[PoolingType, list[int]] = {}
        for index, config in enumerate(tables):
            groups.setdefault(config.pooling, []).append(index)
        # Not registered as submodules (as TorchRec): named_modules/parameters/buffers are those of
        # an EmbeddingBagCollection; train()/eval() are forwarded by hand.
        self._kernels: list[nn.Module] = []
        self._group_features: list[list[str]] = []
        self._group_embeddings: list[list[str]] = []
        self._group_rows: list[list[int]] = []
        table_weights: dict[str, TableWeight] = {}
        optims = []
        for pooling, indices in groups.items():
            configs = [tables[i] for i in indices]
            feature_table_map = [t for t, c in enumerate(configs) for _ in c.feature_names]
            kernel = build_table_batched_embedding(
                rows=[c.num_embeddings for c in configs],
                dims=[c.embedding_dim for c in configs],
                feature_table_map=feature_table_map,
                pooling_mean=pooling is PoolingType.MEAN,
                optimizer=self._optimizer_config,
                device=self._device,
                backend=backend,
                weighted=is_weighted,
            )
            self._kernels.append(kernel)
            self._group_features.append([f for c in configs for f in c.feature_names])
            self._group_embeddings.append([n for i in indices for n in names_by_table[i]])
            self._group_rows.append([c.num_embeddings for c in configs for _ in c.feature_names])
            params: dict[str, nn.Parameter] = {}
            kernel_tables: list[int] = []
            views = kernel.split_embedding_weights()
            for position, (index, config, view) in enumerate(zip(indices, configs, views, strict=True)):
                if self._device.type != "meta":
                    config.init_weight_(view)
                if exposed[config.name] != index:
                    continue  # a same-named table declared later is the one exposed
                weight = nn.Parameter(view)
                table_weights[config.name] = TableWeight(weight)
                params[f"embedding_bags.{config.name}.weight"] = weight
                kernel_tables.append(position)
            optim = EmbeddingFusedOptimizer(
                kernel, params, [configs[t].name for t in kernel_tables], kernel_tables
            )
            for weight in params.values():
                weight._in_backward_optimizers = [optim]  # type: ignore[attr-defined]
            optims.append(optim)
        self._fused_optimizer = FusedCombinedOptimizer(optims)
        # Declaration order, so that state_dict keys line up with EmbeddingBagCollection's.
        self.embedding_bags = nn.ModuleDict({c.name: table_weights[c.name] for c in tables})

        self._kernel_feature_order = [f for names in self._group_features for f in names]
        # Output columns come out in kernel order; this permutation restores declaration order.
        self._column_permutation = self._make_column_permutation(
            [n for names in self._group_embeddings for n in names]
        )
        self._input_permutations: dict[tuple[str, ...], list[int] | None] = {}

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

    def __deepcopy__(self, memo: dict[int, Any]) -> FusedEmbeddingBagCollection:
        return deepcopy_with_kernel_views(self, self._kernels, memo)  # type: ignore[return-value]

    # ---- public API ---------------------------------------------------------------------------
    @property
    def fused_optimizer(self) -> FusedCombinedOptimizer:
        """The optimizer applied in backward. Call it as TorchRec does, ``fused_optimizer()``
        (the returned optimizer is callable and returns itself)."""
        return self._fused_optimizer

    def optimizer_type(self) -> Any:
        return self._optimizer_type

    def optimizer_kwargs(self) -> dict[str, Any]:
        return dict(self._optimizer_kwargs)

    def optimizer_config(self) -> FusedOptimizerConfig:
        return self._optimizer_config

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return list(self._configs)

    def is_weighted(self) -> bool:
        return self._is_weighted

    @property
    def device(self) -> torch.device:
        return self._device

    def kernel_backends(self) -> list[KernelBackend]:
        """Which implementation runs each kernel (one per pooling type)."""
        return [kernel_backend(k) for k in self._kernels]

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
        kjt = self._in_kernel_order(features)
        parts = kjt.split([len(f) for f in self._group_features]) if len(self._kernels) > 1 else [kjt]
        outputs = []
        for kernel, part, names, rows in zip(
            self._kernels, parts, self._group_features, self._group_rows, strict=True
        ):
            values, offsets = part.values(), part.offsets()
            if offsets.dtype != values.dtype:
                offsets = offsets.to(values.dtype)
            weights = part.weights() if self._is_weighted else None
            try:
                outputs.append(
                    checked_lookup(
                        kernel, values, offsets, weights,
                        feature_names=names, rows_per_feature=rows,
                    )
                )
            except (RuntimeError, ValueError) as exc:
                features.validate()  # lengths, offsets or weights that do not fit name their key
                raise exc
        values = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)
        if self._column_permutation is not None:
            values = values.index_select(1, self._column_permutation)
        return KeyedTensor(
            keys=self._embedding_names,
            length_per_key=self._lengths_per_embedding,
            values=values,
        )

    # ---- internals ----------------------------------------------------------------------------
    def _in_kernel_order(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        keys = tuple(features.keys())
        if keys not in self._input_permutations:
            if list(keys) == self._kernel_feature_order:
                self._input_permutations[keys] = None
            else:
                index = {k: i for i, k in enumerate(keys)}
                self._input_permutations[keys] = [index[f] for f in self._kernel_feature_order]
        permutation = self._input_permutations[keys]
        return features if permutation is None else features.permute(permutation)

    def _make_column_permutation(self, kernel_order: list[str]) -> torch.Tensor | None:
        if kernel_order == self._embedding_names:
            return None
        dims = dict(zip(self._embedding_names, self._lengths_per_embedding, strict=True))
        start, column_of = 0, {}
        for name in kernel_order:
            column_of[name] = start
            start += dims[name]
        columns = [column_of[n] + d for n in self._embedding_names for d in range(dims[n])]
        return torch.tensor(columns, dtype=torch.long, device=self._device)

    def _get_name(self) -> str:
        return "FusedEmbeddingBagCollection"

    def train(self, mode: bool = True) -> FusedEmbeddingBagCollection:
        super().train(mode)
        for kernel in self._kernels:
            kernel.train(mode)
        return self

    def _apply(self, fn: Any, recurse: bool = True) -> FusedEmbeddingBagCollection:
        probe = fn(torch.zeros(1, device=self._device))
        if probe.device != self._device or probe.dtype != torch.float32:
            raise ValueError(
                "FusedEmbeddingBagCollection cannot be moved or cast after construction (its "
                "tables live inside table-batched kernels); build it with device=... instead"
            )
        return super()._apply(fn, recurse)


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
    if source and not any(t.is_meta for t in source.values()) and fused.device.type != "meta":  # type: ignore[union-attr]
        fused.load_state_dict(source)
    return fused
