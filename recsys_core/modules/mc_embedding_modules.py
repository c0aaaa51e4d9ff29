"""Embedding collections behind managed collisions (TorchRec's
``torchrec.modules.mc_embedding_modules``): raw ids are remapped by a
``ManagedCollisionCollection``, then looked up in the wrapped EmbeddingBagCollection /
EmbeddingCollection (plain or fused)::

    KJT (raw ids) -> ManagedCollisionCollection -> KJT (rows) -> collection -> embeddings

When a table update gives rows to new ids, those rows are re-initialised before the lookup (as
at construction: the table's ``init_fn`` or its uniform bounds) and their optimizer state is
zeroed, for a fused collection's optimizer and for optimizers attached with
``apply_optimizer_in_backward``. TorchRec's unsharded module leaves evicted rows untouched
(its ``evict`` is a stub); its sharded module resets rows and fused optimizer state as here.
"""



import torch
from torch import nn

from recsys_core.modules.embedding_configs import BaseEmbeddingConfig
from recsys_core.modules.mc_modules import ManagedCollisionCollection
from recsys_core.sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor

__all__ = [
    "BaseManagedCollisionEmbeddingCollection",
    "ManagedCollisionEmbeddingBagCollection",
    "ManagedCollisionEmbeddingCollection",
    "evict",
    "reset_embedding_rows",
    "return_custom_metadata",
    "return_remapped_lengths_as_mask",
]


@torch.fx.wrap
def return_remapped_lengths_as_mask(features: KeyedJaggedTensor) -> torch.Tensor:
    """Which bags kept at least one id after remapping."""
    return features.lengths().to(torch.bool)


@torch.fx.wrap
def return_custom_metadata(runtime_meta: torch.Tensor) -> torch.Tensor:
    return runtime_meta


def _table_weight(embedding_module: nn.Module, table: str) -> torch.Tensor:
    holder = getattr(embedding_module, "embedding_bags", None)
    if holder is None:
        holder = embedding_module.embeddings
    return holder[table].weight


def _table_configs(embedding_module: nn.Module) -> dict[str, BaseEmbeddingConfig]:
    if hasattr(embedding_module, "embedding_bag_configs"):
        configs = embedding_module.embedding_bag_configs()
    else:
        configs = embedding_module.embedding_configs()
    return {c.name: c for c in configs}


@torch.no_grad()
def reset_embedding_rows(embedding_module: nn.Module, table: str, rows: torch.Tensor) -> None:
    """Re-initialise ``rows`` of ``table`` (its init as at construction) and zero their state in
    every optimizer applied in backward to the table (fused kernels included)."""
    if rows.numel() == 0:
        return
    weight = _table_weight(embedding_module, table)
    config = _table_configs(embedding_module)[table]
    rows = rows.to(device=weight.device, dtype=torch.int64)
    fresh = torch.empty(rows.numel(), weight.size(1), dtype=weight.dtype, device=weight.device)
    if config.init_fn is not None:
        returned = config.init_fn(fresh)
        if isinstance(returned, torch.Tensor):
            fresh = returned.to(weight.dtype)
    else:
        fresh.uniform_(config.get_weight_init_min(), config.get_weight_init_max())
    weight.data[rows] = fresh
    for optimizer in getattr(weight, "_in_backward_optimizers", []):
        for value in optimizer.state.get(weight, {}).values():
            if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.size(0) == weight.size(0):
                value[rows] = 0


def evict(evictions: dict[str, torch.Tensor | None], ebc: nn.Module) -> None:
    """Reset the rows each table's managed collision module gave to new ids."""
    for table, rows in evictions.items():
        if rows is not None:
            reset_embedding_rows(ebc, table, rows)


class BaseManagedCollisionEmbeddingCollection(nn.Module):
    """An embedding collection and the managed collision collection in front of it.

    Args:
        embedding_module: EmbeddingBagCollection / EmbeddingCollection (plain or fused); its
            table configs must equal the managed collision collection's.
        managed_collision_collection: remaps the raw ids.
        return_remapped_features: ``forward`` also returns the remapped KJT.
        allow_in_place_embed_weight_update: TorchRec's switch for resetting evicted rows without
            touching autograd; rows are always reset in place here (through ``.data``), so both
            values behave the same.

    ``forward(features)`` returns ``(embeddings, remapped KJT or None)``.
    """

    def __init__(
        self,
        embedding_module: nn.Module,
        managed_collision_collection: ManagedCollisionCollection,
        return_remapped_features: bool = False,
        allow_in_place_embed_weight_update: bool = False,
    ) -> None:
        super().__init__()
        self._managed_collision_collection = managed_collision_collection
        self._return_remapped_features = return_remapped_features
        self._allow_in_place_embed_weight_update = allow_in_place_embed_weight_update
        self._embedding_module = embedding_module
        kind = "bag " if hasattr(embedding_module, "embedding_bag_configs") else ""
        ours = list(_table_configs(embedding_module).values())
        theirs = list(managed_collision_collection.embedding_configs())
        if ours != theirs:
            raise ValueError(
                f"{type(self).__name__}: the embedding {kind}collection's tables "
                f"{[c.name for c in ours]} and the managed collision collection's "
                f"{[c.name for c in theirs]} must be the same configs"
            )

    def forward(
        self, features: KeyedJaggedTensor, mutate_miss_lengths: bool = True
    ) -> tuple[KeyedTensor | dict[str, JaggedTensor], KeyedJaggedTensor | None]:
        features = self._managed_collision_collection(
            features, mutate_miss_lengths=mutate_miss_lengths
        )
        # New owners get fresh rows before they are looked up (TorchRec's sharded order).
        evict(self._managed_collision_collection.evict(), self._embedding_module)
        embedding_res = self._embedding_module(features)
        if not self._return_remapped_features:
            return embedding_res, None
        return embedding_res, features

    def lookup_remapped_lengths_mask(self, features: KeyedJaggedTensor) -> torch.Tensor:
        features = self._managed_collision_collection(features, mutate_miss_lengths=True)
        return return_remapped_lengths_as_mask(features)

    def lookup_remapped_lengths_mask_and_runtime_meta(
        self, features: KeyedJaggedTensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        features = self._managed_collision_collection(features, mutate_miss_lengths=True)
        mask = return_remapped_lengths_as_mask(features)
        meta = return_custom_metadata(
            self._managed_collision_collection.lookup_custom_runtime_meta(features)
        )
        return mask, meta


class ManagedCollisionEmbeddingCollection(BaseManagedCollisionEmbeddingCollection):
    """Managed collisions in front of an EmbeddingCollection (unpooled)."""

    def __init__(
        self,
        embedding_collection: nn.Module,
        managed_collision_collection: ManagedCollisionCollection,
        return_remapped_features: bool = False,
        allow_in_place_embed_weight_update: bool = False,
    ) -> None:
        super().__init__(
            embedding_collection,
            managed_collision_collection,
            return_remapped_features,
            allow_in_place_embed_weight_update,
        )

    @property
    def _embedding_collection(self) -> nn.Module:
        return self._embedding_module

    def embedding_configs(self) -> list[BaseEmbeddingConfig]:
        """The tables of the collection behind the remapping (what plans and planners read)."""
        return list(self._embedding_module.embedding_configs())


class ManagedCollisionEmbeddingBagCollection(BaseManagedCollisionEmbeddingCollection):
    """Managed collisions in front of an EmbeddingBagCollection (pooled)."""

    def __init__(
        self,
        embedding_bag_collection: nn.Module,
        managed_collision_collection: ManagedCollisionCollection,
        return_remapped_features: bool = False,
        allow_in_place_embed_weight_update: bool = False,
    ) -> None:
        super().__init__(
            embedding_bag_collection,
            managed_collision_collection,
            return_remapped_features,
            allow_in_place_embed_weight_update,
        )

    @property
    def _embedding_bag_collection(self) -> nn.Module:
        return self._embedding_module

    def embedding_bag_configs(self) -> list[BaseEmbeddingConfig]:
        """The tables of the collection behind the remapping (what plans and planners read)."""
        return list(self._embedding_module.embedding_bag_configs())
