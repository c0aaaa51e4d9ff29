"""What the fused collections share: optimizer arguments, per-table weight holders and the
object ``fused_optimizer()`` returns."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from recsys_core.kernels.config import EmbOptimType, FusedOptimizerConfig
from recsys_core.optim.keyed import CombinedOptimizer
from recsys_core.optim.rowwise_adagrad import RowWiseAdagrad


def resolve_fused_config(
    optimizer_type: Any, optimizer_kwargs: Mapping[str, Any] | None
) -> FusedOptimizerConfig:
    """``optimizer_type`` is an EmbOptimType (ours or FBGEMM's; kwargs are fused_params keys such
    as ``learning_rate``) or a torch optimizer class (kwargs as for that class, e.g. ``lr``)."""
    if isinstance(optimizer_type, FusedOptimizerConfig):
        if optimizer_kwargs:
            raise ValueError("pass either a FusedOptimizerConfig or optimizer_kwargs, not both")
        return optimizer_type
    kwargs = dict(optimizer_kwargs or {})
    if isinstance(optimizer_type, type) and issubclass(optimizer_type, torch.optim.Optimizer):
        return FusedOptimizerConfig.from_torch_optimizer(optimizer_type, kwargs)
    return FusedOptimizerConfig.from_fused_params(
        {**kwargs, "optimizer": EmbOptimType.coerce(optimizer_type)}
    )


def convert_optimizer_type_and_kwargs(
    optimizer_type: type[torch.optim.Optimizer], optimizer_kwargs: Mapping[str, Any]
) -> tuple[EmbOptimType, dict[str, Any]] | None:
    """TorchRec's mapping of a torch optimizer class to the fused kernel's optimizer (``lr``
    becomes ``learning_rate``); None for a class that has no fused counterpart."""
    fused = {
        torch.optim.SGD: EmbOptimType.EXACT_SGD,
        torch.optim.Adagrad: EmbOptimType.EXACT_ADAGRAD,
        RowWiseAdagrad: EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        torch.optim.Adam: EmbOptimType.ADAM,
    }.get(optimizer_type)
    if fused is None:
        return None
    kwargs = dict(optimizer_kwargs)
    if "lr" in kwargs:
        kwargs["learning_rate"] = kwargs.pop("lr")
    return fused, kwargs


def check_location(location: Any, device: torch.device, module: str) -> None:
    """TorchRec's ``location`` (an FBGEMM EmbeddingLocation): only where the device puts the
    tables anyway is accepted; caching locations come from the planner (CacheParams)."""
    if location is None:
        return
    name = getattr(location, "name", str(location)).upper()
    expected = "DEVICE" if device.type == "cuda" else "HOST"
    if name not in (expected, "DEVICE" if device.type == "meta" else expected):
        raise ValueError(
            f"{module}: location {name} is not supported on device {device.type}; leave "
            f"location=None (tables live in {expected} memory), or shard the module with a "
            "plan whose CacheParams asks for UVM caching"
        )


class FusedCombinedOptimizer(CombinedOptimizer):
    """The optimizer a fused collection returns from ``fused_optimizer()`` (TorchRec's method).

    Calling it returns itself, so code written for the earlier property form
    (``module.fused_optimizer.step()``) keeps working alongside ``module.fused_optimizer()``.
    """

    def __call__(self) -> FusedCombinedOptimizer:
        return self


class TableWeight(nn.Module):
    """Holds one table's weight: a view into its kernel's storage."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight
