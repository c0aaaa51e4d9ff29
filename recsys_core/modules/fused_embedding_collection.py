"""``FusedEmbeddingCollection``: unpooled lookups whose tables live in one table-batched kernel,
with the optimizer applied inside backward (TorchRec's sequence counterpart of the fused EBC).

Import it from ``recsys_core.modules.fused_embedding_modules`` (TorchRec's path).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from recsys_core.kernels.batched import BatchedTables
from recsys_core.kernels.config import EmbOptimType, KernelBackend
from recsys_core.kernels.packed import PackedTable
from recsys_core.modules.collection_tables import SequenceCollectionTables
from recsys_core.modules.embedding_collection import check_equal_dims
from recsys_core.modules.embedding_configs import (
    EmbeddingConfig,
    check_table_names,
    get_embedding_names_by_table,
)
from recsys_core.modules.fused_common import (
    FusedCollectionBase,
    check_location,
    fused_table_weights,
)
from recsys_core.modules.lookup import check_features, check_lengths, meta_jagged
from recsys_core.sparse import JaggedTensor, KeyedJaggedTensor

_NAME = "FusedEmbeddingCollection"


class FusedEmbeddingCollection(FusedCollectionBase, SequenceCollectionTables):
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
        self._embedding_configs = list(tables)
        self._need_indices = need_indices
        self._device = torch.device(device) if device is not None else torch.empty(0).device
        check_location(location, self._device, _NAME)
        self._set_optimizer(optimizer_type, optimizer_kwargs)
        self._feature_names = [f for c in tables for f in c.feature_names]
        self._embedding_names_by_table = get_embedding_names_by_table(tables)
        self._embedding_names = [n for names in self._embedding_names_by_table for n in names]

        # Not registered as a submodule (as TorchRec): the module tree is an EmbeddingCollection's.
        def fill(index: int, view: torch.Tensor) -> None:
            tables[index].init_weight_(view)

        self._batched = BatchedTables.grouped(
            [PackedTable(name=c.name, rows=c.num_embeddings, dim=c.embedding_dim) for c in tables],
            [c.feature_names for c in tables],
            [False] * len(tables),
            device=self._device,
            optimizer=self._optimizer_config,
            backend=backend,
            fill=None if self._device.type == "meta" else fill,
        )
        holders, self._fused_optimizer = fused_table_weights(
            self._batched, [c.name for c in tables], "embeddings"
        )
        self.embeddings = nn.ModuleDict(holders)

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
        values = torch.cat(ids) if ids else torch.empty(0, dtype=torch.long)
        try:
            rows = self._batched.lookup_rows(values, [int(i.numel()) for i in ids])
        except (RuntimeError, ValueError):
            features.validate()  # a lengths/values mismatch names its key here
            raise
        out: dict[str, JaggedTensor] = {}
        for f, (feature, name) in enumerate(zip(self._feature_names, self._embedding_names, strict=True)):
            out[name] = JaggedTensor(
                values=rows[f],
                lengths=jts[feature].lengths(),
                weights=ids[f] if self._need_indices else None,
            )
        return out

    def _get_name(self) -> str:
        return _NAME
