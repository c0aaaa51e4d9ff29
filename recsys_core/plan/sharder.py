"""What the planner asks of a sharder: a structural interface the runtime's sharders implement.

Declared here, below both the planner and the distributed runtime, so the planner can name it
without importing the runtime (``EmbeddingBagCollectionSharder`` matches it structurally).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from enum import Enum
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

if TYPE_CHECKING:
    from recsys_core.kernels.config import EmbOptimType


class Sharder(Protocol):
    """What the planner asks a sharder (EmbeddingBagCollectionSharder matches this)."""

    @property
    def module_type(self) -> type[nn.Module]: ...

    def sharding_types(self, compute_device_type: str) -> list[str]: ...

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]: ...


class _OptimizerConfig(Protocol):
    @property
    def optimizer(self) -> EmbOptimType: ...


class PlanningSharder(Sharder, Protocol):
    """What the planner reads of a sharder beyond :class:`Sharder`, when the sharder has it.

    Every ``ModuleSharder`` of ``recsys_core.distributed`` has all of it but ``optimizer_config``
    (the collection sharders have that); a sharder that is only a :class:`Sharder` gets the
    defaults of the functions below. The planner reads sharders only through these, so it never
    imports the runtime.
    """

    @property
    def fused_params(self) -> Mapping[str, Any] | None:
        """TorchRec's fused-optimizer dict (``{"optimizer": ..., "learning_rate": ...}``)."""
        ...

    @property
    def qcomm_codecs_registry(self) -> Mapping[str, Any] | None:
        """``{CommOp name: codecs}``: the precision of the embedding collectives."""
        ...

    storage_usage_type: Enum
    """TorchRec's ``StorageUsageType`` of the sharder's class: how its tensors are counted
    (:func:`storage_usage`)."""

    def shardable_parameters(self, module: nn.Module) -> dict[str, nn.Parameter]:
        """``{table name: weight}`` this sharder shards in ``module``."""
        ...

    def storage_usage(
        self, tensor: torch.Tensor, compute_device_type: str, compute_kernel: str
    ) -> dict[str, int]:
        """``{"hbm" | "ddr": bytes}`` a shard of ``tensor`` takes with ``compute_kernel``."""
        ...

    def optimizer_config(self, module: nn.Module) -> _OptimizerConfig:
        """The fused optimizer this sharder gives ``module``'s tables."""
        ...


def fused_params_of(sharder: object) -> dict[str, Any]:
    """The sharder's ``fused_params`` as a new dict (empty when it has none)."""
    return dict(getattr(sharder, "fused_params", None) or {})


def qcomm_codecs_of(sharder: object) -> Mapping[str, Any]:
    """The sharder's ``qcomm_codecs_registry`` (empty when it has none)."""
    return getattr(sharder, "qcomm_codecs_registry", None) or {}


def storage_usage_type_of(sharder: object) -> Enum | None:
    """The ``storage_usage_type`` of the sharder's class (None when it has none). Read from
    ``__class__``, as TorchRec decides by the sharder's class (a mock made with
    ``spec=SomeSharder`` reports its spec's)."""
    kind = getattr(sharder.__class__, "storage_usage_type", None)
    return kind if isinstance(kind, Enum) else None


_UVM_KERNELS = frozenset({"fused_uvm", "fused_uvm_caching"})
_QUANT_UVM_KERNELS = frozenset({"quant_uvm", "quant_uvm_caching"})


def storage_usage(tensor: torch.Tensor, compute_device_type: str, compute_kernel: str,
                  storage_usage_type: Enum | None) -> dict[str, int]:
    """``{"hbm" | "ddr": bytes}`` a shard of ``tensor`` takes, by TorchRec's rule for a
    ``StorageUsageType`` (named: ``BASE_QUANT``, ``BASE``, anything else the default):
    quantized tables add 4 bytes per row (scale and bias) and sit in host memory with a UVM
    kernel, else in HBM on CUDA; training tables with a UVM kernel sit in host memory;
    otherwise host memory on CPU, device memory elsewhere. The same rule as
    ``recsys_core.distributed.types.compute_storage_usage`` (which the sharders use)."""
    size = tensor.numel() * tensor.element_size()
    kernel = getattr(compute_kernel, "value", compute_kernel)
    kind = getattr(storage_usage_type, "name", None)
    if kind == "BASE_QUANT":
        size += tensor.shape[0] * 4
        if kernel in _QUANT_UVM_KERNELS:
            return {"ddr": size}
        return {"hbm" if compute_device_type == "cuda" else "ddr": size}
    if kind == "BASE" and kernel in _UVM_KERNELS:
        return {"ddr": size}
    return {"ddr" if compute_device_type == "cpu" else "hbm": size}


def shardable_parameters_of(sharder: object, module: nn.Module) -> dict[str, nn.Parameter] | None:
    """The sharder's ``shardable_parameters(module)`` (None when it has no such method)."""
    method = getattr(sharder, "shardable_parameters", None)
    return dict(method(module)) if callable(method) else None


def optimizer_of(sharder: object, module: nn.Module) -> EmbOptimType | None:
    """The fused optimizer the sharder's ``optimizer_config(module)`` names (None when it has
    no such method)."""
    method = getattr(sharder, "optimizer_config", None)
    return method(module).optimizer if callable(method) else None


_default_sharders: Callable[[], list[Sharder]] | None = None


def register_default_sharders(factory: Callable[[], list[Sharder]]) -> None:
    """Set what :func:`default_sharders` returns (the runtime registers TorchRec's default list
    when ``recsys_core.distributed`` is imported, so the planner never imports the runtime)."""
    global _default_sharders
    _default_sharders = factory


def default_sharders() -> list[Sharder]:
    """TorchRec's default sharders, for planner calls given ``sharders=None``."""
    if _default_sharders is None:
        raise ValueError(
            "no sharders given and none registered: pass sharders=[...] (e.g. "
            "EmbeddingBagCollectionSharder()), or import recsys_core.distributed first"
        )
    return _default_sharders()
