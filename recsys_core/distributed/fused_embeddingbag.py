"""``ShardedFusedEmbeddingBagCollection`` and ``FusedEmbeddingBagCollectionSharder``.

A FusedEmbeddingBagCollection carries its own optimizer (``optimizer_type`` and
``optimizer_kwargs``); sharding it keeps that optimizer: the sharded collection's fused kernels
apply the same update in backward, with the same settings, and its weights start as the fused
module's::

    fused = FusedEmbeddingBagCollection(tables, optimizer_type=torch.optim.SGD,
                                        optimizer_kwargs={"lr": 0.02})
    model = DistributedModelParallel(Model(fused))   # the default sharders include this one
    model.module.sparse.fused_optimizer                # lr 0.02, as the unsharded module's
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from recsys_core.distributed.embedding_types import ModuleOptimizerSharder
from recsys_core.distributed.embeddingbag import ShardedEmbeddingBagCollection, cached_or_fused
from recsys_core.distributed.table_init import TableInitializer
from recsys_core.distributed.types import (
    EmbeddingComputeKernel,
    ParameterSharding,
    QuantizedCommCodecs,
    ShardingEnv,
    ShardingType,
)
from recsys_core.kernels.config import KernelBackend
from recsys_core.modules.fused_embedding_modules import FusedEmbeddingBagCollection


class ShardedFusedEmbeddingBagCollection(ShardedEmbeddingBagCollection):
    """The sharded form of a FusedEmbeddingBagCollection: a ShardedEmbeddingBagCollection whose
    fused optimizer is the unsharded module's (type and hyper-parameters)."""

    def __init__(
        self,
        module: FusedEmbeddingBagCollection,
        table_name_to_parameter_sharding: Mapping[str, ParameterSharding],
        env: ShardingEnv,
        device: torch.device | None = None,
        backend: KernelBackend = KernelBackend.AUTO,
        table_init: TableInitializer | None = None,
        offload_dir: str | None = None,
        qcomm_codecs_registry: Mapping[str, QuantizedCommCodecs] | None = None,
    ) -> None:
        super().__init__(
            module, table_name_to_parameter_sharding, env, torch.device(device or "cpu"),
            module.optimizer_config(), backend, table_init, offload_dir, qcomm_codecs_registry,
        )


class FusedEmbeddingBagCollectionSharder(ModuleOptimizerSharder[FusedEmbeddingBagCollection]):
    """Shards FusedEmbeddingBagCollections (TorchRec's sharding types: DATA_PARALLEL,
    TABLE_WISE, COLUMN_WISE, TABLE_COLUMN_WISE, and on CUDA also ROW_WISE, TABLE_ROW_WISE; a
    given plan may use any sharding type).

    TorchRec's arguments first (``fused_params``, ``qcomm_codecs_registry``; the module carries
    its own optimizer, so ``fused_params`` may only be empty), then this library's."""

    @property
    def module_type(self) -> type[nn.Module]:
        return FusedEmbeddingBagCollection

    def sharding_types(self, compute_device_type: str) -> list[str]:
        types = [
            ShardingType.DATA_PARALLEL, ShardingType.TABLE_WISE, ShardingType.COLUMN_WISE,
            ShardingType.TABLE_COLUMN_WISE,
        ]
        if compute_device_type == "cuda":
            types += [ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE]
        return [t.value for t in types]

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        # the fused collection's optimizer lives in its kernels: never DENSE
        dense = EmbeddingComputeKernel.DENSE.value
        return [k for k in cached_or_fused(sharding_type) if k != dense]

    def shardable_parameters(self, module: FusedEmbeddingBagCollection) -> dict[str, torch.Tensor]:
        """Table name -> weight, as in the module's state dict."""
        return {
            name.split(".")[-2]: weight
            for name, weight in module.state_dict().items()
            if name.endswith(".weight")
        }

    def sharded_module(
        self,
        module: FusedEmbeddingBagCollection,
        params: Mapping[str, ParameterSharding],
        env: ShardingEnv,
        device: torch.device,
    ) -> ShardedFusedEmbeddingBagCollection:
        return ShardedFusedEmbeddingBagCollection(
            module, params, env, device, self._backend, self._table_init, self._offload_dir,
            self.qcomm_codecs_registry,
        )
