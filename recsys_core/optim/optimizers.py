"""Optimizer helpers from the TorchRec tutorial (``RowWiseAdagrad`` is re-exported from
``recsys_core.optim.rowwise_adagrad``) and TorchRec's placeholder optimizer classes (``SGD``, ``Adam``, ``LAMB``, ...) that only name a
fused embedding optimizer for ``apply_optimizer_in_backward``."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

with warnings.catch_warnings():
    # torch.distributed.optim scripts its functional optimizers at import; torch 2.14 prints
    # that deprecation as a FutureWarning in every program importing this module.
    warnings.filterwarnings("ignore", message=r"`torch\.jit\.\w+` is deprecated")
    from torch.distributed.optim import _apply_optimizer_in_backward

from recsys_core.kernels.config import FusedOptimizerConfig
from recsys_core.optim.rowwise_adagrad import RowWiseAdagrad

__all__ = [
    "LAMB", "SGD", "Adagrad", "Adam", "LarsSGD", "PartialRowWiseAdam", "PartialRowWiseLAMB",
    "RowWiseAdagrad", "apply_optimizer_in_backward", "in_backward_optimizer_config",
    "in_backward_optimizer_filter", "recorded_fused_config",
    "recorded_in_backward", "sharder_fused_config",
]


def in_backward_optimizer_filter(
    named_params: Iterable[tuple[str, torch.Tensor]], include: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the parameters NOT updated in backward (``include=True``: only those that are).

    Use it to build the dense optimizer next to ``model.fused_optimizer``.
    """
    for name, param in named_params:
        if hasattr(param, "_in_backward_optimizers") == include:
            yield name, param


def apply_optimizer_in_backward(
    optimizer_class: type[torch.optim.Optimizer],
    params: Iterable[torch.Tensor],
    optimizer_kwargs: Mapping[str, Any],
) -> None:
    """Step ``optimizer_class(param, **optimizer_kwargs)`` for each param as soon as its gradient
    is accumulated (PyTorch's mechanism). Sharders and fused collections read the recorded class
    and kwargs and move the update into the FBGEMM kernel instead."""
    _apply_optimizer_in_backward(optimizer_class, list(params), dict(optimizer_kwargs))


def in_backward_optimizer_config(param: torch.Tensor) -> tuple[type, dict[str, Any]] | None:
    """The (class, kwargs) recorded by :func:`apply_optimizer_in_backward`, if any."""
    classes = getattr(param, "_optimizer_classes", None)
    kwargs = getattr(param, "_optimizer_kwargs", None)
    if not classes:
        return None
    return classes[0], dict(kwargs[0])


def recorded_in_backward(module: torch.nn.Module) -> tuple[type, dict[str, Any]] | None:
    """The (class, kwargs) that :func:`apply_optimizer_in_backward` recorded on ``module``'s
    tables, or None when no table has one. All tables must carry the same optimizer."""
    recorded = {name: in_backward_optimizer_config(p) for name, p in module.named_parameters()}
    if not recorded or all(c is None for c in recorded.values()):
        return None
    missing = [n for n, c in recorded.items() if c is None]
    if missing:
        raise ValueError(
            f"apply_optimizer_in_backward was applied to some tables but not to {missing}; "
            "apply it to every table (one fused optimizer serves them all)"
        )
    distinct = {(c[0], tuple(sorted(c[1].items()))) for c in recorded.values() if c is not None}
    if len(distinct) > 1:
        raise ValueError(
            "tables carry different in-backward optimizers; a fused collection applies one "
            "optimizer to all its tables"
        )
    return next(c for c in recorded.values() if c is not None)


def recorded_fused_config(module: torch.nn.Module) -> FusedOptimizerConfig | None:
    """The fused optimizer recorded on ``module``'s tables by :func:`apply_optimizer_in_backward`,
    or None when no table has one. All tables must carry the same optimizer."""
    recorded = recorded_in_backward(module)
    return None if recorded is None else FusedOptimizerConfig.from_torch_optimizer(*recorded)


def sharder_fused_config(
    module: torch.nn.Module, fused_params: Mapping[str, Any] | None
) -> FusedOptimizerConfig:
    """The fused optimizer a sharder gives ``module``'s tables, by TorchRec's rule: the
    sharder's ``fused_params``, updated by the optimizer applied in backward to the tables (its
    class, and each argument given to it, win key by key). So ``Adagrad(lr=0.1)`` applied in
    backward with a sharder given ``{"eps": 1e-8}`` trains Adagrad at lr 0.1 with eps 1e-8, and
    a sharder's ``{"optimizer": EXACT_SGD, "learning_rate": 0.05}`` cannot replace it; without
    either, EXACT_SGD at lr 0.01 (TorchRec's default)."""
    recorded = recorded_in_backward(module)
    if recorded is None:
        return FusedOptimizerConfig.from_fused_params(fused_params)
    in_backward = FusedOptimizerConfig.from_torch_optimizer(*recorded)
    if fused_params is None:
        return in_backward
    merged = dict(fused_params)
    merged["optimizer"] = in_backward.optimizer
    for name in FusedOptimizerConfig.fields_given(*recorded):
        merged[name] = getattr(in_backward, name)
    return FusedOptimizerConfig.from_fused_params(merged)


class _FusedPlaceholder(torch.optim.Optimizer):
    """Names a fused embedding optimizer for ``apply_optimizer_in_backward``; it cannot step.

    The fused collection or sharder reads the class and its kwargs and applies the update in
    its kernel; a module that was not converted raises on the first backward.
    """

    def __init__(self, params: Iterable[torch.Tensor], **kwargs: Any) -> None:
        self._params = params
        self._kwargs = kwargs

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        raise NotImplementedError(
            f"{type(self).__name__} is a placeholder that names a fused embedding optimizer: "
            "convert the module (FusedEmbeddingBagCollection.from_embedding_bag_collection or "
            "DistributedModelParallel) so that its kernel applies the update, or use torch.optim"
        )


class SGD(_FusedPlaceholder):
    """Placeholder for the fused EXACT_SGD optimizer."""


class LarsSGD(_FusedPlaceholder):
    """Placeholder for the fused LARS_SGD optimizer."""


class LAMB(_FusedPlaceholder):
    """Placeholder for the fused LAMB optimizer."""


class PartialRowWiseLAMB(_FusedPlaceholder):
    """Placeholder for the fused PARTIAL_ROWWISE_LAMB optimizer."""


class Adam(_FusedPlaceholder):
    """Placeholder for the fused ADAM optimizer."""


class PartialRowWiseAdam(_FusedPlaceholder):
    """Placeholder for the fused PARTIAL_ROWWISE_ADAM optimizer."""


class Adagrad(_FusedPlaceholder):
    """Placeholder for the fused EXACT_ADAGRAD optimizer."""
