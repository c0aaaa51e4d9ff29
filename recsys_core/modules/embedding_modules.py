"""Unsharded embedding collections: one ``nn.EmbeddingBag`` / ``nn.Embedding`` per table.

These are the reference oracles: every fused or sharded variant must produce the same outputs,
gradients and post-update weights as these modules with a plain torch optimizer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from recsys_core.kernels.tbe import IdOutOfRangeError
from recsys_core.modules.embedding_configs import (
    EmbeddingBagConfig,
    EmbeddingConfig,
    PoolingType,
    check_unique_tables,
)
from recsys_core.sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor


def _device_of(device: torch.device | str | None) -> torch.device:
    return torch.device(device) if device is not None else torch.device("cpu")


def check_features(
    features: KeyedJaggedTensor, needed: Sequence[str], module: str, is_weighted: bool
) -> None:
    """The input carries every feature a module needs, as integer ids (and weights if weighted)."""
    if not isinstance(features, KeyedJaggedTensor):
        raise TypeError(f"{module}: expected a KeyedJaggedTensor, got {type(features).__name__}")
    keys = set(features.keys())
    missing = [f for f in needed if f not in keys]
    if missing:
        raise ValueError(
            f"{module}: input KeyedJaggedTensor lacks feature(s) {missing}; it has "
            f"{list(features.keys())}. Add them (empty bags are fine) or remove the tables."
        )
    values = features.values()
    if values.is_floating_point() or values.dtype == torch.bool or values.is_complex():
        raise ValueError(
            f"{module}: feature ids must be int32 or int64, got values of dtype {values.dtype} "
            f"(features {list(features.keys())}); cast with .long()"
        )
    if is_weighted and features.weights_or_none() is None:
        raise ValueError(
            f"{module}: the collection is weighted (is_weighted=True) but the input "
            f"KeyedJaggedTensor has no weights; pass weights= for features {list(needed)}"
        )


def _lookup_error(feature: str, num_embeddings: int, ids: torch.Tensor) -> IdOutOfRangeError | None:
    bad = ((ids < 0) | (ids >= num_embeddings)).nonzero()
    if bad.numel() == 0:
        return None
    return IdOutOfRangeError(
        f"feature {feature!r}: id {int(ids[int(bad[0, 0])])} is outside [0, {num_embeddings}) of "
        f"its table; {bad.numel()} bad id(s) in this feature. Hash or clip ids to the table size."
    )


class EmbeddingBagCollection(nn.Module):
    """Pooled embedding lookups for many tables: ``KeyedJaggedTensor -> KeyedTensor``.

    Example::

        tables: product_table (4096 x 64, feature "product"), user_table (4096 x 64, "user")
        input  KJT  "product": [[101, 202], [], [303]]   "user": [[404], [505], [606]]
        output KT   keys ["product", "user"], values [3, 128] (64 columns per key)

    ``device="meta"`` allocates nothing; the sharders materialize the tables later.
    """

    def __init__(
        self,
        tables: Sequence[EmbeddingBagConfig],
        is_weighted: bool = False,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        check_unique_tables(tables, "EmbeddingBagCollection")
        self._embedding_bag_configs = list(tables)
        self._is_weighted = is_weighted
        self._device = _device_of(device)
        self.embedding_bags = nn.ModuleDict()
        for config in tables:
            if not isinstance(config, EmbeddingBagConfig):
                raise TypeError(f"EmbeddingBagCollection takes EmbeddingBagConfig, got {config!r}")
            self.embedding_bags[config.name] = nn.EmbeddingBag(
                config.num_embeddings,
                config.embedding_dim,
                mode="mean" if config.pooling is PoolingType.MEAN else "sum",
                device=self._device,
                include_last_offset=True,
            )
        self._feature_names = [list(c.feature_names) for c in tables]
        self._embedding_names = [f for c in tables for f in c.feature_names]
        self._lengths_per_embedding = [c.embedding_dim for c in tables for _ in c.feature_names]
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self._device.type == "meta":
            return
        for config in self._embedding_bag_configs:
            config.init_weight_(self.embedding_bags[config.name].weight)

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return list(self._embedding_bag_configs)

    def is_weighted(self) -> bool:
        return self._is_weighted

    @property
    def device(self) -> torch.device:
        return self._device

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """Look up and pool every feature; returns a KeyedTensor keyed by feature name."""
        check_features(features, self._embedding_names, "EmbeddingBagCollection", self._is_weighted)
        feature_dict = features.to_dict()
        pooled: list[torch.Tensor] = []
        for config in self._embedding_bag_configs:
            bag = self.embedding_bags[config.name]
            for name in config.feature_names:
                jt = feature_dict[name]
                pooled.append(self._pool(bag, config, name, jt))
        return KeyedTensor(
            keys=self._embedding_names,
            length_per_key=self._lengths_per_embedding,
            values=torch.cat(pooled, dim=1) if pooled else torch.empty(features.stride(), 0),
        )

    def _pool(
        self, bag: nn.EmbeddingBag, config: EmbeddingBagConfig, name: str, jt: JaggedTensor
    ) -> torch.Tensor:
        ids, offsets = jt.values(), jt.offsets()
        weights = jt.weights() if self._is_weighted else None
        try:
            if weights is not None and config.pooling is PoolingType.MEAN:
                # nn.EmbeddingBag has no weighted mean; FBGEMM's is sum(w_i * e_i) / length.
                summed = nn.functional.embedding_bag(
                    ids, bag.weight, offsets, mode="sum", per_sample_weights=weights,
                    include_last_offset=True,
                )
                return summed / jt.lengths().clamp(min=1).unsqueeze(1).to(summed.dtype)
            return bag(input=ids, offsets=offsets, per_sample_weights=weights).float()
        except (IndexError, RuntimeError) as exc:
            error = _lookup_error(name, config.num_embeddings, ids)
            if error is None:
                raise
            raise error from exc


class EmbeddingCollection(nn.Module):
    """Unpooled lookups: ``KeyedJaggedTensor -> {feature: JaggedTensor of [N, dim] rows}``.

    Each output JaggedTensor keeps the input's lengths; with ``need_indices=True`` its weights
    carry the looked-up ids (TorchRec's convention).
    """

    def __init__(
        self,
        tables: Sequence[EmbeddingConfig],
        device: torch.device | str | None = None,
        need_indices: bool = False,
    ) -> None:
        super().__init__()
        check_unique_tables(tables, "EmbeddingCollection")
        self._embedding_configs = list(tables)
        self._device = _device_of(device)
        self._need_indices = need_indices
        self.embeddings = nn.ModuleDict()
        for config in tables:
            if not isinstance(config, EmbeddingConfig):
                raise TypeError(f"EmbeddingCollection takes EmbeddingConfig, got {config!r}")
            self.embeddings[config.name] = nn.Embedding(
                config.num_embeddings, config.embedding_dim, device=self._device
            )
        self._embedding_names = [f for c in tables for f in c.feature_names]
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self._device.type == "meta":
            return
        for config in self._embedding_configs:
            config.init_weight_(self.embeddings[config.name].weight)

    def embedding_configs(self) -> list[EmbeddingConfig]:
        return list(self._embedding_configs)

    def need_indices(self) -> bool:
        return self._need_indices

    @property
    def device(self) -> torch.device:
        return self._device

    def forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        check_features(features, self._embedding_names, "EmbeddingCollection", False)
        feature_dict = features.to_dict()
        out: dict[str, JaggedTensor] = {}
        for config in self._embedding_configs:
            table = self.embeddings[config.name]
            for name in config.feature_names:
                jt = feature_dict[name]
                ids = jt.values()
                try:
                    rows = table(ids)
                except (IndexError, RuntimeError) as exc:
                    error = _lookup_error(name, config.num_embeddings, ids)
                    if error is None:
                        raise
                    raise error from exc
                out[name] = JaggedTensor(
                    values=rows,
                    lengths=jt.lengths(),
                    weights=ids if self._need_indices else None,
                )
        return out
