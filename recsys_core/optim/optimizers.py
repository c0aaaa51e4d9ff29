"""Optimizer helpers from the TorchRec tutorial, plus a row-wise Adagrad for dense tables."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch.distributed.optim import _apply_optimizer_in_backward

from recsys_core.kernels.config import FusedOptimizerConfig


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


def recorded_fused_config(module: torch.nn.Module) -> FusedOptimizerConfig | None:
    """The fused optimizer recorded on ``module``'s tables by :func:`apply_optimizer_in_backward`,
    or None when no table has one. All tables must carry the same optimizer."""
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
    optimizer_class, kwargs = next(c for c in recorded.values() if c is not None)
    return FusedOptimizerConfig.from_torch_optimizer(optimizer_class, kwargs)


class RowWiseAdagrad(torch.optim.Optimizer):
    """Adagrad with one accumulator per embedding row (FBGEMM's EXACT_ROWWISE_ADAGRAD rule).

    ``state_sum[r] += mean_d(g[r, d]^2)``; ``w[r] -= lr * g[r] / (sqrt(state_sum[r]) + eps)``.
    With a sparse gradient (``nn.EmbeddingBag(sparse=True)``) only the rows present are touched,
    exactly like the fused kernel; with a dense gradient every row is visited (a zero gradient
    row is left unchanged unless weight decay is set).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        lr: float = 1e-2,
        eps: float = 1e-10,
        weight_decay: float = 0.0,
    ) -> None:
        if lr < 0 or eps <= 0 or weight_decay < 0:
            raise ValueError(f"RowWiseAdagrad: need lr >= 0, eps > 0, weight_decay >= 0; got "
                             f"lr={lr}, eps={eps}, weight_decay={weight_decay}")
        super().__init__(params, {"lr": lr, "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.dim() != 2:
                    raise ValueError("RowWiseAdagrad: parameters must be 2-D embedding tables")
                state = self.state[p]
                if "sum" not in state:
                    state["sum"] = torch.zeros(p.shape[0], dtype=p.dtype, device=p.device)
                grad = p.grad
                if grad.is_sparse:
                    grad = grad.coalesce()
                    rows, g = grad.indices()[0], grad.values()
                else:
                    rows, g = None, grad
                w = p if rows is None else p.index_select(0, rows)
                g_decayed = g + wd * w if wd else g
                avg = (g_decayed * g_decayed).mean(dim=1)
                total = (state["sum"] if rows is None else state["sum"].index_select(0, rows)) + avg
                multiplier = (lr / (total.sqrt() + eps)).unsqueeze(1)
                new_w = (1.0 - multiplier * wd) * w - multiplier * g
                if rows is None:
                    state["sum"].copy_(total)
                    p.copy_(new_w)
                else:
                    state["sum"].index_copy_(0, rows, total)
                    p.index_copy_(0, rows, new_w)
        return loss
