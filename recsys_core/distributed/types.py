"""TorchRec's ``torchrec.distributed.types`` path: plan data (re-exported from
:mod:`recsys_core.plan`), awaitables, and the sharder interface (:class:`ModuleSharder`).

The plan definitions live in :mod:`recsys_core.plan`, the layer below the planner and the runtime.
"""

from __future__ import annotations

import abc
from enum import Enum, unique
from typing import TYPE_CHECKING, Generic, TypeVar

import torch
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor

from recsys_core.distributed.awaitable import (
    Awaitable,
    GetItemLazyAwaitable,
    LazyAwaitable,
    LazyGetItemMixin,
    LazyNoWait,
    NoWait,
)
from recsys_core.distributed.qcomm_types import (
    CommOp,
    NoOpQuantizedCommCodec,
    QuantizedCommCodec,
    QuantizedCommCodecs,
    check_collective_support,
)
from recsys_core.modules.embedding_configs import DataType
from recsys_core.plan.env import ShardingEnv
from recsys_core.plan.params import (
    BoundsCheckMode,
    CacheAlgorithm,
    CacheParams,
    CacheStatistics,
    KeyValueParams,
    MultiPassPrefetchConfig,
)
from recsys_core.plan.spec import EnumerableShardingSpec
from recsys_core.plan.types import (
    EmbeddingComputeKernel,
    EmbeddingModuleShardingPlan,
    ModuleShardingPlan,
    ParameterSharding,
    ShardingPlan,
    ShardingType,
    ShardMetadata,
    device_placement,
)

if TYPE_CHECKING:
    from collections.abc import Mapping

M = TypeVar("M", bound=nn.Module)


@unique
class PipelineType(Enum):
    """The training pipelines TorchRec names (see ``recsys_core.distributed.train_pipeline``)."""

    NONE = "none"
    TRAIN_BASE = "train_base"
    TRAIN_SPARSE_DIST = "train_sparse_dist"
    TRAIN_PREFETCH_SPARSE_DIST = "train_prefetch_sparse_dist"


@unique
class ParameterStorage(Enum):
    """Memory a shard occupies: device memory (HBM) or host memory (DDR)."""

    HBM = "hbm"
    DDR = "ddr"


@unique
class StorageUsageType(Enum):
    """How :func:`compute_storage_usage` counts a tensor (named after the sharder kinds)."""

    BASE_QUANT = "BaseQuantEmbeddingSharder"
    BASE = "BaseEmbeddingSharder"
    DEFAULT = "ModuleSharder"


@unique
class ComputeDevice(Enum):
    CUDA = "cuda"
    CPU = "cpu"
    MTIA = "mtia"


@unique
class ComputeKernel(Enum):
    """The kernel of a plain :class:`ModuleSharder` (not an embedding kernel)."""

    DEFAULT = "default"


@unique
class ShardingStrategy(Enum):
    """How ``DMPCollection`` shards (TorchRec's 2D parallelism). Only DEFAULT is executed here:
    ``DistributedModelParallel`` shards each module once over all ranks."""

    DEFAULT = "default"
    PER_MODULE = "per_module"
    FULLY_SHARDED = "fully_sharded"


class DMPCollectionConfig:
    """One submodule's 2D-parallel configuration (TorchRec's fields). ``DMPCollection`` (2D
    parallelism) is not implemented by this library: see ``model_parallel.DMPCollection``."""

    def __init__(
        self,
        module: type[nn.Module],
        plan: ShardingPlan,
        sharding_group_size: int,
        node_group_size: int | None = None,
        use_inter_host_allreduce: bool = False,
        sharding_strategy: ShardingStrategy = ShardingStrategy.DEFAULT,
    ) -> None:
        self.module = module
        self.plan = plan
        self.sharding_group_size = sharding_group_size
        self.node_group_size = node_group_size
        self.use_inter_host_allreduce = use_inter_host_allreduce
        self.sharding_strategy = sharding_strategy

    def __repr__(self) -> str:
        return (
            f"DMPCollectionConfig(module={self.module}, "
            f"sharding_group_size={self.sharding_group_size}, "
            f"node_group_size={self.node_group_size}, "
            f"use_inter_host_allreduce={self.use_inter_host_allreduce}, "
            f"sharding_strategy={self.sharding_strategy})"
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DMPCollectionConfig):
            return NotImplemented
        return vars(self) == vars(other)

    __hash__ = None  # type: ignore[assignment]


def get_tensor_size_bytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s elements (``numel * element_size``)."""
    return t.numel() * t.element_size()


def compute_storage_usage(
    tensor: torch.Tensor,
    compute_device_type: str,
    compute_kernel: str,
    storage_usage_type: StorageUsageType,
) -> dict[str, int]:
    """``{"hbm" | "ddr": bytes}`` a shard of ``tensor`` takes (TorchRec's rule): UVM kernels keep
    it in DDR; otherwise CUDA (and MTIA, except for quantized tables) means HBM, CPU means DDR.
    Quantized tables add 4 bytes per row (the row's scale and bias)."""
    size = get_tensor_size_bytes(tensor)
    kernel = getattr(compute_kernel, "value", compute_kernel)
    hbm, ddr = ParameterStorage.HBM.value, ParameterStorage.DDR.value
    if storage_usage_type is StorageUsageType.BASE_QUANT:
        size += tensor.shape[0] * 4
        if kernel in {"quant_uvm", "quant_uvm_caching"}:
            return {ddr: size}
        return {hbm if compute_device_type == "cuda" else ddr: size}
    if storage_usage_type is StorageUsageType.BASE and kernel in {"fused_uvm", "fused_uvm_caching"}:
        return {ddr: size}
    return {ddr if compute_device_type == "cpu" else hbm: size}


class ModuleSharder(abc.ABC, Generic[M]):
    """Shards one module type (TorchRec's interface): the planner asks ``sharding_types``,
    ``compute_kernels``, ``shardable_parameters`` and ``storage_usage``;
    ``DistributedModelParallel`` calls ``shard``."""

    def __init__(self, qcomm_codecs_registry: Mapping[str, QuantizedCommCodecs] | None = None) -> None:
        check_collective_support(qcomm_codecs_registry)
        self._qcomm_codecs_registry = qcomm_codecs_registry

    @abc.abstractmethod
    def shard(
        self,
        module: M,
        params: EmbeddingModuleShardingPlan,
        env: ShardingEnv,
        device: torch.device | None = None,
        module_fqn: str | None = None,
    ) -> nn.Module: ...

    @property
    @abc.abstractmethod
    def module_type(self) -> type[M]: ...

    @property
    def qcomm_codecs_registry(self) -> Mapping[str, QuantizedCommCodecs] | None:
        return self._qcomm_codecs_registry

    @qcomm_codecs_registry.setter
    def qcomm_codecs_registry(self, value: Mapping[str, QuantizedCommCodecs] | None) -> None:
        check_collective_support(value)
        self._qcomm_codecs_registry = value

    def shardable_parameters(self, module: M) -> dict[str, nn.Parameter]:
        return dict(module.named_parameters())

    def sharding_types(self, compute_device_type: str) -> list[str]:
        return [ShardingType.DATA_PARALLEL.value]

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        return [ComputeKernel.DEFAULT.value]

    storage_usage_type = StorageUsageType.DEFAULT
    """How :meth:`storage_usage` counts this class's tensors (the planner's ``SharderData``
    reads it from the class, as TorchRec decides by the sharder's class)."""

    def storage_usage(
        self, tensor: torch.Tensor, compute_device_type: str, compute_kernel: str
    ) -> dict[str, int]:
        if compute_device_type not in {"cuda", "cpu", "mtia"}:
            raise ValueError(
                f"storage_usage: compute device {compute_device_type!r} is not one of cuda, cpu, "
                "mtia"
            )
        return compute_storage_usage(
            tensor, compute_device_type, compute_kernel, StorageUsageType.DEFAULT
        )


class ShardingPlanner(abc.ABC):
    """Produces a :class:`ShardingPlan` (``recsys_core.planner.EmbeddingShardingPlanner``)."""

    @abc.abstractmethod
    def plan(self, module: nn.Module, sharders: list[ModuleSharder[nn.Module]]) -> ShardingPlan: ...

    @abc.abstractmethod
    def collective_plan(
        self, module: nn.Module, sharders: list[ModuleSharder[nn.Module]]
    ) -> ShardingPlan: ...


def rank_device(device_type: str, rank: int) -> torch.device:
    """``cpu``, or ``<device_type>:<rank>``."""
    if device_type == "cpu":
        return torch.device("cpu")
    return torch.device(f"{device_type}:{rank}")


__all__ = [
    "CacheStatistics",
    "DataType",
    "Awaitable",
    "BoundsCheckMode",
    "CacheAlgorithm",
    "CacheParams",
    "MultiPassPrefetchConfig",
    "CommOp",
    "ComputeDevice",
    "ComputeKernel",
    "DMPCollectionConfig",
    "EmbeddingComputeKernel",
    "EmbeddingModuleShardingPlan",
    "EnumerableShardingSpec",
    "GetItemLazyAwaitable",
    "KeyValueParams",
    "LazyAwaitable",
    "LazyGetItemMixin",
    "LazyNoWait",
    "ModuleSharder",
    "ModuleShardingPlan",
    "NoOpQuantizedCommCodec",
    "NoWait",
    "ParameterSharding",
    "ParameterStorage",
    "PipelineType",
    "QuantizedCommCodec",
    "QuantizedCommCodecs",
    "ShardMetadata",
    "ShardedTensor",
    "ShardingEnv",
    "ShardingPlan",
    "ShardingPlanner",
    "ShardingStrategy",
    "ShardingType",
    "StorageUsageType",
    "compute_storage_usage",
    "device_placement",
    "get_tensor_size_bytes",
    "rank_device",
]
