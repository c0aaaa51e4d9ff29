"""``FusedEmbeddingCollection``: unpooled lookups whose tables live in one table-batched kernel,
with the optimizer applied inside backward (TorchRec's sequence counterpart of the fused EBC).

Import it from ``recsys_core.modules.fused_embedding_modules`` (TorchRec's path).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from recsys_core.kernels.config import EmbOptimType, FusedOptimizerConfig, KernelBackend
from recsys_core.kernels.tbe import build_table_batched_embedding, checked_lookup
from recsys_core.modules.embedding_collection import check_equal_dims
from recsys_core.modules.embedding_configs import (
    EmbeddingConfig,
    check_table_names,
    get_embedding_names_by_table,
)
from recsys_core.modules.fused_common import (
    FusedCombinedOptimizer,
    TableWeight,
    check_location,
    deepcopy_with_kernel_views,
    resolve_fused_config,
)
from recsys_core.modules.lookup import check_features, check_lengths, meta_jagged
from recsys_core.optim.fused import EmbeddingFusedOptimizer
from recsys_core.sparse import JaggedTensor, KeyedJaggedTensor

_NAME = "FusedEmbeddingCollection"


class FusedEmbeddingCollection(nn.Module):
    """Same interface and outputs as EmbeddingCollection; table updates happen in ``backward()``.

    Args are TorchRec's (``tables, optimizer_type, optimizer_kwargs, device, need_indices,
    location``) plus ``backend``; ``optimizer_type``/``optimizer_kwargs`` are read as by
    FusedEmbeddingBagCollection. Unlike TorchRec (CUDA or meta only) it also runs on CPU.

    The kernel pools bags, so each id is looked up as a bag of its own::

        f1 ids [4, 2, 7]  f2 ids [5]   ->  bags f1: [4] [2] [7]   f2: [5] [] []
        output rows: f1 -> first 3 rows of f1's block, f2 -> first row of f2's block
    """

    def __init__(
        self,
        tables: Sequence[EmbeddingConfig],
        optimizer_type: Any = EmbOptimType.EXACT_SGD,
        optimizer_kwargs: Mapping[str, Any] | None = None,
        device: torch.device | str | None = None,
        need_indices: bool = False,
        location: Any = None,
        backend: KernelBackend = KernelBackend.AUTO,
    ) -> None:
        super().__init__()
        check_table_names(tables, _NAME)
        for config in tables:
            if not isinstance(config, EmbeddingConfig):
                raise TypeError(f"{_NAME} takes EmbeddingConfig, got {config!r}")
        if not tables:
            raise ValueError(f"{_NAME}: give at least one table")
        self._embedding_dim = check_equal_dims(tables, _NAME)
        self._configs = list(tables)
        self._need_indices = need_indices
        self._device = torch.device(device) if device is not None else torch.empty(0).device
        check_location(location, self._device, _NAME)
        self._optimizer_type = optimizer_type
        self._optimizer_kwargs = dict(optimizer_kwargs or {})
        self._optimizer_config = resolve_fused_config(optimizer_type, optimizer_kwargs)
        self._feature_names = [f for c in tables for f in c.feature_names]
        self._embedding_names_by_table = get_embedding_names_by_table(tables)
        self._embedding_names = [n for names in self._embedding_names_by_table for n in names]
        self._rows = [c.num_embeddings for c in tables for _ in c.feature_names]

        # Not a registered submodule (as TorchRec): the module tree is an EmbeddingCollection's.
        self._kernel: nn.Module
        kernel = build_table_batched_embedding(
            rows=[c.num_embeddings for c in tables],
            dims=[c.embedding_dim for c in tables],
            feature_table_map=[t for t, c in enumerate(tables) for _ in c.feature_names],
            pooling_mean=False,
            optimizer=self._optimizer_config,
            device=self._device,
            backend=backend,
        )
        object.__setattr__(self, "_kernel", kernel)
        params: dict[str, nn.Parameter] = {}
        holders: dict[str, TableWeight] = {}
        for config, view in zip(tables, self._kernel.split_embedding_weights(), strict=True):
            if self._device.type != "meta":
                config.init_weight_(view)
            weight = nn.Parameter(view)
            holders[config.name] = TableWeight(weight)
            params[f"embeddings.{config.name}.weight"] = weight
        optim = EmbeddingFusedOptimizer(self._kernel, params, [c.name for c in tables])
        for weight in params.values():
            weight._in_backward_optimizers = [optim]  # type: ignore[attr-defined]
        self._fused_optimizer = FusedCombinedOptimizer([optim])
        self.embeddings = nn.ModuleDict(holders)

    def __deepcopy__(self, memo: dict[int, Any]) -> FusedEmbeddingCollection:
        return deepcopy_with_kernel_views(self, [self._kernel], memo)  # type: ignore[return-value]

    @property
    def fused_optimizer(self) -> FusedCombinedOptimizer:
        """The optimizer applied in backward; call it as TorchRec does, ``fused_optimizer()``."""
        return self._fused_optimizer

    def optimizer_type(self) -> Any:
        return self._optimizer_type

    def optimizer_kwargs(self) -> dict[str, Any]:
        return dict(self._optimizer_kwargs)

    def optimizer_config(self) -> FusedOptimizerConfig:
        return self._optimizer_config

    def embedding_configs(self) -> list[EmbeddingConfig]:
        return list(self._configs)

    def embedding_names_by_table(self) -> list[list[str]]:
        return [list(names) for names in self._embedding_names_by_table]

    def embedding_dim(self) -> int:
        return self._embedding_dim

    def need_indices(self) -> bool:
        return self._need_indices

    @property
    def device(self) -> torch.device:
        return self._device

    def forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        check_features(features, self._feature_names, _NAME, False)
        if features.values().is_meta:  # shapes only: meta tensors hold no ids to look up
            index = {k: i for i, k in enumerate(features.keys())}
            return {
                name: meta_jagged(features, index[f], self._embedding_dim)
                for f, name in zip(self._feature_names, self._embedding_names, strict=True)
            }
        check_lengths(features)
        jts = features.to_dict()
        ids = [jts[f].values() for f in self._feature_names]
        counts = [int(i.numel()) for i in ids]
        width = max(max(counts), 1)  # bags per feature; the kernel needs at least one
        lengths = torch.zeros(len(ids), width, dtype=torch.long, device=self._device)
        for f, n in enumerate(counts):
            lengths[f, :n] = 1
        values = torch.cat(ids) if ids else torch.empty(0, dtype=torch.long)
        offsets = torch.zeros(lengths.numel() + 1, dtype=values.dtype, device=self._device)
        offsets[1:] = lengths.flatten().cumsum(0)
        try:
            rows = checked_lookup(
                self._kernel, values, offsets, None,
                feature_names=self._feature_names, rows_per_feature=self._rows,
            )
        except (RuntimeError, ValueError):
            features.validate()  # a lengths/values mismatch names its key here
            raise
        dim = self._embedding_dim
        out: dict[str, JaggedTensor] = {}
        for f, (feature, name) in enumerate(zip(self._feature_names, self._embedding_names, strict=True)):
            out[name] = JaggedTensor(
                values=rows[: counts[f], f * dim : (f + 1) * dim],
                lengths=jts[feature].lengths(),
                weights=ids[f] if self._need_indices else None,
            )
        return out

    def _get_name(self) -> str:
        return _NAME

    def train(self, mode: bool = True) -> FusedEmbeddingCollection:
        super().train(mode)
        self._kernel.train(mode)
        return self

    def _apply(self, fn: Any, recurse: bool = True) -> FusedEmbeddingCollection:
        probe = fn(torch.zeros(1, device=self._device))
        if probe.device != self._device or probe.dtype != torch.float32:
            raise ValueError(
                f"{_NAME} cannot be moved or cast after construction (its tables live inside a "
                "table-batched kernel); build it with device=... instead"
            )
        return super()._apply(fn, recurse)
