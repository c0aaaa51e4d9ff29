"""Unsharded embedding collections: one ``nn.EmbeddingBag`` / ``nn.Embedding`` per table.

These are the reference oracles: every fused or sharded variant must produce the same outputs,
gradients and post-update weights as these modules with a plain torch optimizer.
"""


import logging
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from recsys_core.modules.collection_tables import PooledCollectionTables
from recsys_core.modules.embedding_collection import EmbeddingCollection
from recsys_core.modules.embedding_configs import (
    EmbeddingBagConfig,
    EmbeddingConfig,
    PoolingType,
    check_table_names,
    get_embedding_names_by_table,
    init_table_weights,
    meta_weight,
    table_dtype,
)
from recsys_core.modules.lookup import (
    bag_offsets,
    check_features,
    combine_pooled,
    lookup_or_diagnose,
    reorder_inverse_indices,
    validate_features,
)
from recsys_core.sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor

# One leaf node each in an fx graph (torch.fx.wrap patches this module's globals).
torch.fx.wrap("validate_features")
torch.fx.wrap("bag_offsets")
torch.fx.wrap("reorder_inverse_indices")
torch.fx.wrap("combine_pooled")

__all__ = [
    "MODULE_ATTR_DATA_PARALLEL_SKIP_GRAD_SYNC",
    "EmbeddingBagCollection",
    "EmbeddingBagCollectionInterface",
    "EmbeddingCollection",
    "EmbeddingCollectionInterface",
    "check_features",
    "get_embedding_names_by_table",
    "mark_data_parallel_skip_grad_sync",
    "process_pooled_embeddings",
    "should_skip_data_parallel_grad_sync",
]

logger: logging.Logger = logging.getLogger(__name__)

MODULE_ATTR_DATA_PARALLEL_SKIP_GRAD_SYNC: str = "_torchrec_data_parallel_skip_grad_sync"
"""The attribute TorchRec 1.9 sets on a collection marked by
:func:`mark_data_parallel_skip_grad_sync` (the same name, so a module marked either way is
read alike)."""


def mark_data_parallel_skip_grad_sync(module: nn.Module) -> None:
    """Leave the DATA_PARALLEL tables of this (unsharded) EmbeddingBagCollection /
    EmbeddingCollection out of the gradient sum over ranks once it is sharded (TorchRec 1.9:
    out of DDP), e.g. for a collection used in forward only. Each rank's replica then keeps its
    own gradient and, stepped, its own weights. Read once when the module is sharded: call it
    before ``DistributedModelParallel`` (a sharded module only gets a warning). Tables of other
    sharding types are unaffected, as is the rest of the model (DMP's DDP)."""
    if hasattr(module, "_core") or hasattr(module, "_lookups"):
        logger.warning(
            "mark_data_parallel_skip_grad_sync() called on an already-sharded %s; the marker "
            "is read when the module is sharded, so this has no effect",
            type(module).__name__,
        )
    setattr(module, MODULE_ATTR_DATA_PARALLEL_SKIP_GRAD_SYNC, True)


def should_skip_data_parallel_grad_sync(module: nn.Module) -> bool:
    """Whether ``module`` was marked by :func:`mark_data_parallel_skip_grad_sync`."""
    return bool(getattr(module, MODULE_ATTR_DATA_PARALLEL_SKIP_GRAD_SYNC, False))


@torch.fx.wrap
def process_pooled_embeddings(
    pooled_embeddings: list[torch.Tensor], inverse_indices: torch.Tensor
) -> torch.Tensor:
    """Per-table pooled outputs side by side (TorchRec's helper). With variable-batch inputs
    the tables' rows are first expanded to the full batch: row ``i`` of table ``t`` is its row
    ``inverse_indices[t, i]`` (an out-of-range index raises ``IndexError``)."""
    if inverse_indices.numel() > 0:
        pooled_embeddings = [
            emb.index_select(0, rows.to(device=emb.device, dtype=torch.long))
            for emb, rows in zip(pooled_embeddings, inverse_indices.unbind(0), strict=True)
        ]
    return torch.cat(pooled_embeddings, dim=1)


@runtime_checkable
class EmbeddingBagCollectionInterface(Protocol):
    """What a pooled collection offers (TorchRec's name; a Protocol here, so ``isinstance``
    holds for EmbeddingBagCollection, FusedEmbeddingBagCollection and quantized collections)."""

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor: ...

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]: ...

    def is_weighted(self) -> bool: ...


@runtime_checkable
class EmbeddingCollectionInterface(Protocol):
    """What an unpooled collection offers (TorchRec's name; a Protocol here)."""

    def forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]: ...

    def embedding_configs(self) -> list[EmbeddingConfig]: ...

    def need_indices(self) -> bool: ...

    def embedding_dim(self) -> int: ...

    def embedding_names_by_table(self) -> list[list[str]]: ...


class EmbeddingBagCollection(nn.Module, PooledCollectionTables):
    """Pooled embedding lookups for many tables: ``KeyedJaggedTensor -> KeyedTensor``.

    Example::

        tables: product_table (4096 x 64, feature "product"), user_table (4096 x 64, "user")
        input  KJT  "product": [[101, 202], [], [303]]   "user": [[404], [505], [606]]
        output KT   keys ["product", "user"], values [3, 128] (64 columns per key)

    A feature listed by several tables is looked up in each; its outputs are keyed
    ``<feature>@<table>`` (see ``get_embedding_names_by_table``). A variable-batch input
    (``stride_per_key_per_rank``) pools each key over its own batch and, with
    ``inverse_indices``, expands the result back to the full batch.

    ``device="meta"`` (or a ``torch.device("meta")`` context) allocates nothing; the sharders
    materialize the tables later, or ``to_empty(device=...)`` then ``reset_parameters()``.
    """

    def __init__(
        self,
        tables: Sequence[EmbeddingBagConfig],
        is_weighted: bool = False,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        check_table_names(tables, "EmbeddingBagCollection")
        self._embedding_bag_configs = list(tables)
        self._is_weighted = is_weighted
        self.embedding_bags = nn.ModuleDict()
        for config in tables:
            if not isinstance(config, EmbeddingBagConfig):
                raise TypeError(f"EmbeddingBagCollection takes EmbeddingBagConfig, got {config!r}")
            self.embedding_bags[config.name] = nn.EmbeddingBag(
                config.num_embeddings,
                config.embedding_dim,
                mode="mean" if config.pooling is PoolingType.MEAN else "sum",
                device=device,
                include_last_offset=True,
                dtype=table_dtype(config),
                _weight=meta_weight(config, device),
            )
        # As TorchRec: without a device, the one the tables landed on (a device context counts).
        self._device = torch.device(device) if device is not None else _default_device()
        self._feature_names: list[list[str]] = [list(c.feature_names) for c in tables]
        self._flat_feature_names: list[str] = [f for c in tables for f in c.feature_names]
        self._embedding_names: list[str] = [
            n for names in get_embedding_names_by_table(tables) for n in names
        ]
        self._lengths_per_embedding: list[int] = [
            c.embedding_dim for c in tables for _ in c.feature_names
        ]
        self._mean: list[bool] = [c.pooling is PoolingType.MEAN for c in tables]
        self._rows_per_feature = [(f, c.num_embeddings) for c in tables for f in c.feature_names]
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initialize every table from its config (tables still on meta are skipped)."""
        init_table_weights(self._embedding_bag_configs, self.embedding_bags)

    @property
    def device(self) -> torch.device:
        return self._device

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """Look up and pool every feature; returns a KeyedTensor keyed by embedding name."""
        if torch.jit.is_scripting():
            return self._pool(features)
        return self._checked_forward(features)

    @torch.jit.unused
    def _checked_forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        validate_features(
            features, self._flat_feature_names, "EmbeddingBagCollection", self._is_weighted
        )
        if isinstance(features, KeyedJaggedTensor) and features.values().is_meta:
            return self._meta_forward(features)
        return lookup_or_diagnose(
            self._pool, features, self._rows_per_feature, "EmbeddingBagCollection"
        )

    def _pool(self, features: KeyedJaggedTensor) -> KeyedTensor:
        if len(self._embedding_names) == 0:
            values = torch.empty(features.stride(), 0, device=self._device)
            return KeyedTensor(keys=[], length_per_key=[], values=values)
        inverse_indices = reorder_inverse_indices(
            features.inverse_indices_or_none(), self._flat_feature_names
        )
        feature_dict = features.to_dict()
        pooled: list[torch.Tensor] = []
        for t, bag in enumerate(self.embedding_bags.values()):
            for name in self._feature_names[t]:
                jt = feature_dict[name]
                weights = jt.weights() if self._is_weighted else None
                if weights is not None:
                    # per-sample weights must match the table's dtype (as it is now: a table
                    # may be cast after construction); a no-op when they already do
                    weights = weights.to(bag.weight.dtype)
                if weights is not None and self._mean[t]:
                    # nn.EmbeddingBag has no weighted mean; FBGEMM's is sum(w_i * e_i) / length.
                    summed = nn.functional.embedding_bag(
                        jt.values(), bag.weight, bag_offsets(jt), mode="sum",
                        per_sample_weights=weights, include_last_offset=True,
                        norm_type=2.0,  # a float literal, so a traced graph stays scriptable
                    )
                    lengths = jt.lengths().clamp(min=1).unsqueeze(1).to(torch.float32)
                    pooled.append(summed.float() / lengths)
                else:
                    out = bag(input=jt.values(), offsets=bag_offsets(jt), per_sample_weights=weights)
                    pooled.append(out.float())
        return KeyedTensor(
            keys=self._embedding_names,
            length_per_key=self._lengths_per_embedding,
            values=combine_pooled(pooled, inverse_indices),
        )

    def _meta_forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """Shapes only: ``[batch, sum(dims)]`` on meta (meta tensors hold no ids to look up)."""
        inverse = features.inverse_indices_or_none()
        batch = inverse[1].shape[-1] if inverse is not None else features.stride()
        values = torch.empty(batch, sum(self._lengths_per_embedding), device="meta")
        return KeyedTensor(
            keys=self._embedding_names, length_per_key=self._lengths_per_embedding, values=values
        )


def _default_device() -> torch.device:
    return torch.empty(0).device



