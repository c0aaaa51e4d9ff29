"""TorchRec's ``torchrec.distributed.fp_embeddingbag`` path: sharding a
FeatureProcessedEmbeddingBagCollection.

The feature processors (e.g. position weights) run on each rank's own batch before the input
dist, as in the unsharded module; the weighted collection behind them is sharded by an
EmbeddingBagCollectionSharder. The per-sample weights travel with the ids through the input
dist, which does not carry gradients back: processors with trainable parameters are refused
(TorchRec applies them after the input dist, on the rank holding the rows; this library does
not). Frozen processors (``requires_grad=False``, e.g. for evaluation) shard and give the
unsharded module's outputs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from recsys_core.distributed.embedding_types import BaseEmbeddingSharder
from recsys_core.distributed.embeddingbag import EmbeddingBagCollectionSharder
from recsys_core.distributed.types import (
    ParameterSharding,
    QuantizedCommCodecs,
    ShardingEnv,
)
from recsys_core.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection
from recsys_core.sparse import KeyedJaggedTensor


class ShardedFeatureProcessedEmbeddingBagCollection(nn.Module):
    """``sharded_ebc(processors(features))``; state-dict keys as the unsharded module's
    (``_feature_processors.*``, ``_embedding_bag_collection.embedding_bags.<table>.weight``)."""

    def __init__(
        self,
        module: FeatureProcessedEmbeddingBagCollection,
        table_name_to_parameter_sharding: Mapping[str, ParameterSharding],
        ebc_sharder: EmbeddingBagCollectionSharder,
        env: ShardingEnv,
        device: torch.device,
    ) -> None:
        super().__init__()
        processors = module._feature_processors
        trainable = [n for n, p in processors.named_parameters() if p.requires_grad]
        if trainable:
            raise ValueError(
                f"ShardedFeatureProcessedEmbeddingBagCollection: feature processor parameters "
                f"{trainable} are trainable, but their gradients would not cross the input dist "
                "(recsys_core applies processors before it); freeze them with "
                "requires_grad_(False), or leave this module out of the plan (it then trains "
                "data-parallel)"
            )
        if any(t.is_meta for t in list(processors.parameters()) + list(processors.buffers())):
            processors.to_empty(device=device)
            for sub in processors.modules():
                reset = getattr(sub, "reset_parameters", None)
                if callable(reset):
                    reset()
        else:
            processors.to(device)
        self._feature_processors = processors
        self._feature_names = list(module._feature_names)
        self._embedding_bag_collection = ebc_sharder.shard(
            module._embedding_bag_collection, table_name_to_parameter_sharding, env, device
        )

    def forward(self, features: KeyedJaggedTensor) -> Any:
        # the unsharded module's forward, with this module's (sharded) collection behind it
        return FeatureProcessedEmbeddingBagCollection.forward(self, features)  # type: ignore[arg-type]


class FeatureProcessedEmbeddingBagCollectionSharder(
    BaseEmbeddingSharder[FeatureProcessedEmbeddingBagCollection]
):
    """Shards the collection of a FeatureProcessedEmbeddingBagCollection with ``ebc_sharder``
    (default: an EmbeddingBagCollectionSharder with TorchRec's defaults)."""

    def __init__(
        self,
        ebc_sharder: EmbeddingBagCollectionSharder | None = None,
        qcomm_codecs_registry: Mapping[str, QuantizedCommCodecs] | None = None,
    ) -> None:
        super().__init__(qcomm_codecs_registry=qcomm_codecs_registry)
        self._ebc_sharder = ebc_sharder or EmbeddingBagCollectionSharder(
            qcomm_codecs_registry=qcomm_codecs_registry
        )

    @property
    def module_type(self) -> type[FeatureProcessedEmbeddingBagCollection]:
        return FeatureProcessedEmbeddingBagCollection

    @property
    def fused_params(self) -> dict[str, Any] | None:
        return self._ebc_sharder.fused_params

    def shardable_parameters(
        self, module: FeatureProcessedEmbeddingBagCollection
    ) -> dict[str, nn.Parameter]:
        return self._ebc_sharder.shardable_parameters(module._embedding_bag_collection)

    def sharding_types(self, compute_device_type: str) -> list[str]:
        return self._ebc_sharder.sharding_types(compute_device_type)

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        return self._ebc_sharder.compute_kernels(sharding_type, compute_device_type)

    def sharded_module(
        self,
        module: FeatureProcessedEmbeddingBagCollection,
        params: Mapping[str, ParameterSharding],
        env: ShardingEnv,
        device: torch.device,
    ) -> ShardedFeatureProcessedEmbeddingBagCollection:
        return ShardedFeatureProcessedEmbeddingBagCollection(
            module, params, self._ebc_sharder, env, device
        )


__all__ = [
    "FeatureProcessedEmbeddingBagCollectionSharder",
    "ShardedFeatureProcessedEmbeddingBagCollection",
]
