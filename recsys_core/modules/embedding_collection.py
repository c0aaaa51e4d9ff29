"""``EmbeddingCollection``: unpooled (sequence) lookups, one ``nn.Embedding`` per table.

Import it from ``recsys_core.modules.embedding_modules`` (TorchRec's path) or ``recsys_core``.
"""


from collections.abc import Sequence

import torch
from torch import nn

from recsys_core.modules.collection_tables import SequenceCollectionTables
from recsys_core.modules.embedding_configs import (
    EmbeddingConfig,
    check_table_names,
    get_embedding_names_by_table,
    init_table_weights,
    meta_weight,
    table_dtype,
)
from recsys_core.modules.lookup import (
    check_lengths,
    lookup_or_diagnose,
    meta_jagged,
    validate_features,
)
from recsys_core.sparse import JaggedTensor, KeyedJaggedTensor

torch.fx.wrap("validate_features")
torch.fx.wrap("check_lengths")


def check_equal_dims(tables: Sequence[EmbeddingConfig], module: str) -> int:
    """Every table of an EmbeddingCollection has one embedding_dim (TorchRec requires it);
    returns it (-1 for no tables)."""
    dim = -1
    for config in tables:
        if dim < 0:
            dim = config.embedding_dim
        elif config.embedding_dim != dim:
            raise ValueError(
                f"{module}: all tables must have the same embedding_dim; table "
                f"{config.name!r} has {config.embedding_dim}, the first table has {dim}. Use one "
                "dim for every table, or put pooled tables in an EmbeddingBagCollection"
            )
    return dim


class EmbeddingCollection(nn.Module, SequenceCollectionTables):
    """Unpooled lookups: ``KeyedJaggedTensor -> {embedding name: JaggedTensor of [N, dim] rows}``.

    Example::

        tables: t1 (10 x 3, features ["f1"]), t2 (10 x 3, features ["f1", "f2"])
        input  KJT  "f1": [[0, 1], [2]]   "f2": [[3], []]
        output {"f1@t1": rows t1[0, 1, 2], lengths [2, 1],
                "f1@t2": rows t2[0, 1, 2], lengths [2, 1],
                "f2":    rows t2[3],       lengths [1, 0]}

    Each output JaggedTensor keeps the input's lengths; with ``need_indices=True`` its weights
    carry the looked-up ids (TorchRec's convention). All tables share one ``embedding_dim``.
    A feature listed by several tables is keyed ``<feature>@<table>``.
    """

    def __init__(
        self,
        tables: Sequence[EmbeddingConfig],
        device: torch.device | str | None = None,
        need_indices: bool = False,
        use_gather_select: bool = False,
        use_gather_select_per_sharding: dict[str, bool] | None = None,
    ) -> None:
        super().__init__()
        check_table_names(tables, "EmbeddingCollection")
        for config in tables:
            if not isinstance(config, EmbeddingConfig):
                raise TypeError(f"EmbeddingCollection takes EmbeddingConfig, got {config!r}")
        self._embedding_dim = check_equal_dims(tables, "EmbeddingCollection")
        self._embedding_configs = list(tables)
        self._need_indices = need_indices
        self._use_gather_select = use_gather_select
        self._use_gather_select_per_sharding = use_gather_select_per_sharding
        self._use_sorted_select = False
        self.embeddings = nn.ModuleDict()
        for config in tables:
            self.embeddings[config.name] = nn.Embedding(
                config.num_embeddings, config.embedding_dim, device=device,
                dtype=table_dtype(config), _weight=meta_weight(config, device),
            )
        self._device = torch.device(device) if device is not None else torch.empty(0).device
        self._feature_names: list[list[str]] = [list(c.feature_names) for c in tables]
        self._embedding_names_by_table = get_embedding_names_by_table(tables)
        self._flat_feature_names = [f for c in tables for f in c.feature_names]
        self._rows_per_feature = [(f, c.num_embeddings) for c in tables for f in c.feature_names]
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initialize every table from its config (tables still on meta are skipped)."""
        init_table_weights(self._embedding_configs, self.embeddings)

    def use_gather_select(self) -> bool:
        return self._use_gather_select

    def use_gather_select_per_sharding(self) -> dict[str, bool] | None:
        return self._use_gather_select_per_sharding

    def use_sorted_select(self) -> bool:
        """TorchRec 1.9's switch (off by default) for expanding deduplicated rows with
        ``sorted_index_select`` (see ``construct_jagged_tensors``). This module's own lookup
        never deduplicates, as TorchRec's unsharded one, so it does not read it."""
        return self._use_sorted_select

    def set_use_sorted_select(self, use_sorted_select: bool) -> None:
        self._use_sorted_select = use_sorted_select

    @property
    def device(self) -> torch.device:
        return self._device

    def forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        if torch.jit.is_scripting():
            return self._lookup(features)
        return self._checked_forward(features)

    @torch.jit.unused
    def _checked_forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        validate_features(features, self._flat_feature_names, "EmbeddingCollection", False)
        if isinstance(features, KeyedJaggedTensor) and features.values().is_meta:
            index = {k: i for i, k in enumerate(features.keys())}
            return {
                name: meta_jagged(features, index[feature], self._embedding_dim)
                for names, feature_names in zip(
                    self._embedding_names_by_table, self._feature_names, strict=True
                )
                for name, feature in zip(names, feature_names, strict=True)
            }
        check_lengths(features)
        return lookup_or_diagnose(
            self._lookup, features, self._rows_per_feature, "EmbeddingCollection"
        )

    def _lookup(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        feature_dict = features.to_dict()
        out: dict[str, JaggedTensor] = {}
        for t, table in enumerate(self.embeddings.values()):
            names = self._embedding_names_by_table[t]
            for j, feature in enumerate(self._feature_names[t]):
                jt = feature_dict[feature]
                ids = jt.values()
                out[names[j]] = JaggedTensor(
                    values=table(ids).float(),
                    lengths=jt.lengths(),
                    weights=ids if self._need_indices else None,
                )
        return out
