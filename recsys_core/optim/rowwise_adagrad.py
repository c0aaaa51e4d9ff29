"""Row-wise Adagrad for embedding tables (TorchRec's ``torchrec.optim.rowwise_adagrad``).

One accumulator per row, the mean of the squared gradient over the row (FBGEMM's
EXACT_ROWWISE_ADAGRAD rule, so it is the dense oracle of the fused kernel)::

    g    <- -g if maximize;  g <- g + weight_decay * w
    sum  <- sum + mean_d(g[r, d] ** 2)                (per row r)
    clr  =  lr / (1 + (step - 1) * lr_decay)
    w    <- w - clr * g / (sqrt(sum) + eps)

With rows of equal entries this equals ``torch.optim.Adagrad``. Beyond TorchRec it also takes
sparse gradients (``nn.EmbeddingBag(sparse=True)``): only the rows present are updated, exactly
like the fused kernel (TorchRec raises for them).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


class RowWiseAdagrad(torch.optim.Optimizer):
    """Adagrad with one accumulator per embedding row; parameters must be 2-D.

    State per parameter: ``sum`` (one value per row, shape ``[rows]``) and ``step``.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        lr: float = 1e-2,
        lr_decay: float = 0.0,
        weight_decay: float = 0.0,
        initial_accumulator_value: float = 0.0,
        eps: float = 1e-10,
        *,
        maximize: bool = False,
    ) -> None:
        checks = {"lr": lr, "lr_decay": lr_decay, "weight_decay": weight_decay,
                  "initial_accumulator_value": initial_accumulator_value, "eps": eps}
        bad = {k: v for k, v in checks.items() if not v >= 0.0}
        if bad:
            raise ValueError(f"RowWiseAdagrad: these must be >= 0: {bad}")
        defaults = {"lr": lr, "lr_decay": lr_decay, "eps": eps, "weight_decay": weight_decay,
                    "initial_accumulator_value": initial_accumulator_value, "maximize": maximize}
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.dim() != 2:
                    raise ValueError(
                        f"RowWiseAdagrad: parameters must be 2-D embedding tables, got shape "
                        f"{tuple(p.shape)}; use torch.optim.Adagrad for other parameters"
                    )
                self.state[p]["step"] = torch.tensor(0.0)
                self.state[p]["sum"] = torch.full(
                    (p.shape[0],), float(initial_accumulator_value), dtype=p.dtype, device=p.device
                )

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, group)
        return loss

    def _update(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        state = self.state[p]
        state["step"] += 1
        lr = group["lr"] / (1 + (float(state["step"]) - 1) * group["lr_decay"])
        eps, wd = group["eps"], group["weight_decay"]
        grad = -p.grad if group["maximize"] else p.grad
        if grad.is_sparse:
            grad = grad.coalesce()
            rows, g = grad.indices()[0], grad.values()
        else:
            rows, g = None, grad
        w = p if rows is None else p.index_select(0, rows)
        if wd:
            g = g + wd * w
        total = (state["sum"] if rows is None else state["sum"].index_select(0, rows))
        total = total + (g * g).mean(dim=1)
        new_w = w - (lr / (total.sqrt() + eps)).unsqueeze(1) * g
        if rows is None:
            state["sum"].copy_(total)
            p.copy_(new_w)
        else:
            state["sum"].index_copy_(0, rows, total)
            p.index_copy_(0, rows, new_w)
