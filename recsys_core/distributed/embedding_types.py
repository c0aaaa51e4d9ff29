"""TorchRec's ``torchrec.distributed.embedding_types`` path: the names sharders and planners share,
and the base classes of embedding sharders.

:class:`BaseEmbeddingSharder` is what TorchRec's training sharders derive from: it keeps
``fused_params`` and the qcomm codecs, lists TorchRec's sharding types and kernels, counts a
shard's memory (UVM kernels in DDR) and names each table's weight as a shardable parameter.
:class:`BaseQuantEmbeddingSharder` is the same for quantized (inference) collections.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import torch
from torch import nn

from recsys_core.distributed.table_init import TableInitializer
from recsys_core.distributed.types import (
    ModuleSharder,
    QuantizedCommCodecs,
    ShardingEnv,
    StorageUsageType,
    compute_storage_usage,
)
from recsys_core.kernels.config import FusedOptimizerConfig, KernelBackend
from recsys_core.modules.embedding_configs import EmbeddingTableConfig
from recsys_core.plan.types import EmbeddingComputeKernel, ParameterSharding, ShardingType

M = TypeVar("M", bound=nn.Module)


def table_weights(module: nn.Module) -> dict[str, torch.Tensor]:
    """``{table name: weight}`` of an embedding collection: every ``<...>.<table>.weight`` of
    its state dict (the tensors themselves, so attributes such as in-backward optimizers show)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        if name.endswith(".weight") and name.count(".") >= 2:
            out[name.split(".")[-2]] = tensor
    return out


class EmbeddingSharderBase(ModuleSharder[M]):
    """What the training and the quantized embedding sharders share: the one ``shard``
    (TorchRec's signature, the device defaulted to the host; each sharder says what it builds
    in :meth:`sharded_module`), ``fused_params`` as given, and ``storage_usage`` counted by the
    class's :attr:`storage_usage_type`."""

    _fused_params: dict[str, Any] | None = None

    @property
    def fused_params(self) -> dict[str, Any] | None:
        return self._fused_params

    def storage_usage(
        self, tensor: torch.Tensor, compute_device_type: str, compute_kernel: str
    ) -> dict[str, int]:
        return compute_storage_usage(
            tensor, compute_device_type, compute_kernel, type(self).storage_usage_type
        )

    def shard(
        self,
        module: M,
        params: Mapping[str, ParameterSharding],
        env: ShardingEnv,
        device: torch.device | None = None,
        module_fqn: str | None = None,
    ) -> nn.Module:
        return self.sharded_module(module, params, env, torch.device(device or "cpu"))

    def sharded_module(
        self, module: M, params: Mapping[str, ParameterSharding], env: ShardingEnv,
        device: torch.device,
    ) -> nn.Module:
        """The sharded form of ``module`` on ``device`` under ``params`` (one entry per table)."""
        raise NotImplementedError(
            f"{type(self).__name__} builds no sharded module: implement "
            "sharded_module(module, params, env, device) (or override shard)"
        )


class BaseEmbeddingSharder(EmbeddingSharderBase[M]):
    """Common part of the training sharders (TorchRec's arguments).

    ``fused_params``: TorchRec's dict of the fused optimizer (``{"optimizer": ...,
    "learning_rate": ...}``), or the typed ``FusedOptimizerConfig`` itself, read by the sharder
    (``fused_params`` gives it back as TorchRec's dict); ``qcomm_codecs_registry``: the
    precision of the embedding collectives (``fbgemm_qcomm_codec.get_qcomm_codecs_registry``).
    """

    def __init__(
        self,
        fused_params: Mapping[str, Any] | FusedOptimizerConfig | None = None,
        qcomm_codecs_registry: Mapping[str, QuantizedCommCodecs] | None = None,
    ) -> None:
        super().__init__(qcomm_codecs_registry=qcomm_codecs_registry)
        if isinstance(fused_params, FusedOptimizerConfig):
            fused_params = {f.name: getattr(fused_params, f.name)
                            for f in dataclasses.fields(fused_params)}
        self._fused_params = None if fused_params is None else dict(fused_params)

    def sharding_types(self, compute_device_type: str) -> list[str]:
        """Every sharding type this library executes, on CPU as on CUDA (TorchRec lists
        row-wise types only on CUDA). GRID_SHARD plans are TorchRec's; not executed here."""
        return [t.value for t in ShardingType if t is not ShardingType.GRID_SHARD]

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        """FUSED (and FUSED_UVM_CACHING, the cached kernel) for split tables, FUSED for
        data-parallel ones (this library's fused replicas; TorchRec offers DENSE there). A plan
        may still name DENSE for any table: the sharders run it."""
        if ShardingType(sharding_type) is ShardingType.DATA_PARALLEL:
            return [EmbeddingComputeKernel.FUSED.value]
        return [EmbeddingComputeKernel.FUSED.value, EmbeddingComputeKernel.FUSED_UVM_CACHING.value]

    def shardable_parameters(self, module: M) -> dict[str, nn.Parameter]:
        """``{table name: weight}`` (TorchRec's keys: the table names)."""
        return table_weights(module)  # type: ignore[return-value]

    storage_usage_type = StorageUsageType.BASE
    """How :meth:`storage_usage` counts this class's tensors (the planner's ``SharderData``
    reads it from the class, as TorchRec decides by the sharder's class)."""


class TrainingEmbeddingSharder(BaseEmbeddingSharder[M]):
    """The training collections' sharders: TorchRec's arguments, then this library's: the
    kernels' ``backend``, ``table_init`` (fills every shard independently of the plan) and
    ``offload_dir`` (the backing files of cached tables on CPU). ``fused_params`` is checked
    at construction by :meth:`_check_fused_params`."""

    def __init__(
        self,
        fused_params: Mapping[str, Any] | None = None,
        qcomm_codecs_registry: Mapping[str, QuantizedCommCodecs] | None = None,
        backend: KernelBackend = KernelBackend.AUTO,
        table_init: TableInitializer | None = None,
        offload_dir: str | None = None,
    ) -> None:
        self._check_fused_params(fused_params)
        super().__init__(fused_params, qcomm_codecs_registry)
        self._backend, self._table_init, self._offload_dir = backend, table_init, offload_dir

    def _check_fused_params(self, fused_params: Mapping[str, Any] | None) -> None:
        """Unknown keys fail here, not later."""
        FusedOptimizerConfig.from_fused_params(fused_params)


class ModuleOptimizerSharder(TrainingEmbeddingSharder[M]):
    """Sharders of the fused collections, which carry their optimizer (``optimizer_type`` /
    ``optimizer_kwargs`` on the module): ``fused_params`` may only be empty."""

    def _check_fused_params(self, fused_params: Mapping[str, Any] | None) -> None:
        if fused_params:
            raise ValueError(
                f"{type(self).__name__}: fused_params {dict(fused_params)} would be ignored: a "
                f"{self.module_type.__name__} carries its optimizer (set it with "
                "optimizer_type / optimizer_kwargs on the module)"
            )


class BaseQuantEmbeddingSharder(EmbeddingSharderBase[M]):
    """Common part of the quantized (inference) sharders: QUANT kernel; table-wise, row-wise
    and column-wise types; 4 bytes per row more than the weights (scale and bias).
    ``shardable_params``: shard only these tables (all or none of a module's)."""

    def __init__(
        self,
        fused_params: Mapping[str, Any] | None = None,
        shardable_params: Sequence[str] | None = None,
    ) -> None:
        super().__init__()
        self._fused_params = None if fused_params is None else copy.deepcopy(dict(fused_params))
        self._shardable_params = list(shardable_params or [])

    def sharding_types(self, compute_device_type: str) -> list[str]:
        return [
            ShardingType.TABLE_WISE.value,
            ShardingType.ROW_WISE.value,
            ShardingType.COLUMN_WISE.value,
        ]

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        return [EmbeddingComputeKernel.QUANT.value]

    def shardable_parameters(self, module: M) -> dict[str, nn.Parameter]:
        params = table_weights(module)
        if self._shardable_params:
            chosen = [name in self._shardable_params for name in params]
            if any(chosen) and not all(chosen):
                raise ValueError(
                    f"Cannot partially shard {type(module).__name__}: shardable_params "
                    f"{self._shardable_params} names some of its tables {list(params)}; name "
                    "all of them or none"
                )
            params = {n: p for n, p in params.items() if n in self._shardable_params}
        return params  # type: ignore[return-value]

    storage_usage_type = StorageUsageType.BASE_QUANT
    """How :meth:`storage_usage` counts this class's tensors (the planner's ``SharderData``
    reads it from the class, as TorchRec decides by the sharder's class)."""


__all__ = [
    "BaseEmbeddingSharder",
    "BaseQuantEmbeddingSharder",
    "EmbeddingComputeKernel",
    "EmbeddingTableConfig",
    "ModuleOptimizerSharder",
    "ModuleSharder",
    "ShardingType",
    "TrainingEmbeddingSharder",
    "table_weights",
]
