"""TorchRec's ``torchrec.distributed.fused_embedding`` path: sharding a FusedEmbeddingCollection.

The sharded form is a ShardedEmbeddingCollection whose fused optimizer is the unsharded
module's (type and hyper-parameters), as :mod:`recsys_core.distributed.fused_embeddingbag` does
for the pooled collection."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from recsys_core.distributed.embedding import (
    SUPPORTED_SHARDING_TYPES,
    ShardedEmbeddingCollection,
)
from recsys_core.distributed.embedding_types import ModuleOptimizerSharder
from recsys_core.distributed.types import (
    EmbeddingComputeKernel,
    ParameterSharding,
    QuantizedCommCodecs,
    ShardingEnv,
)
from recsys_core.kernels.config import KernelBackend
from recsys_core.modules.fused_embedding_collection import FusedEmbeddingCollection


class ShardedFusedEmbeddingCollection(ShardedEmbeddingCollection):
    """A ShardedEmbeddingCollection trained with the FusedEmbeddingCollection's optimizer."""

    def __init__(
        self,
        module: FusedEmbeddingCollection,
        table_name_to_parameter_sharding: Mapping[str, ParameterSharding],
        env: ShardingEnv,
        device: torch.device | None = None,
        backend: KernelBackend = KernelBackend.AUTO,
        qcomm_codecs_registry: Mapping[str, QuantizedCommCodecs] | None = None,
    ) -> None:
        super().__init__(
            module, table_name_to_parameter_sharding, env, torch.device(device or "cpu"),  # type: ignore[arg-type]
            module.optimizer_config(), backend, None, qcomm_codecs_registry,
        )


class FusedEmbeddingCollectionSharder(ModuleOptimizerSharder[FusedEmbeddingCollection]):
    """Shards FusedEmbeddingCollections (table-wise, column-wise, row-wise; FUSED kernel).
    The module carries its optimizer, so ``fused_params`` may only be empty."""

    def __init__(
        self,
        fused_params: Mapping[str, Any] | None = None,
        qcomm_codecs_registry: Mapping[str, QuantizedCommCodecs] | None = None,
        backend: KernelBackend = KernelBackend.AUTO,
    ) -> None:
        super().__init__(fused_params, qcomm_codecs_registry, backend)

    @property
    def module_type(self) -> type[FusedEmbeddingCollection]:
        return FusedEmbeddingCollection

    def sharding_types(self, compute_device_type: str) -> list[str]:
        return [t.value for t in SUPPORTED_SHARDING_TYPES]

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        return [EmbeddingComputeKernel.FUSED.value]

    def sharded_module(
        self,
        module: FusedEmbeddingCollection,
        params: Mapping[str, ParameterSharding],
        env: ShardingEnv,
        device: torch.device,
    ) -> ShardedFusedEmbeddingCollection:
        return ShardedFusedEmbeddingCollection(
            module, params, env, device, self._backend, self.qcomm_codecs_registry
        )


__all__ = ["FusedEmbeddingCollectionSharder", "ShardedFusedEmbeddingCollection"]
