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

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("maximize", False)
        for param_state in self.state.values():
            if "step" in param_state and not torch.is_tensor(param_state["step"]):
                param_state["step"] = torch.tensor(float(param_state["step"]))

    def share_memory(self) -> None:
        """Move the accumulators to shared memory (for Hogwild-style multi-process training)."""
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["sum"].share_memory_()

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            with_grad = [p for p in group["params"] if p.grad is not None]
            adagrad(
                with_grad,
                [p.grad for p in with_grad],
                [self.state[p]["sum"] for p in with_grad],
                [self.state[p]["step"] for p in with_grad],
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                lr_decay=group["lr_decay"],
                eps=group["eps"],
                maximize=group["maximize"],
            )
        return loss


@torch.no_grad()
def adagrad(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    state_sums: list[torch.Tensor],
    state_steps: list[torch.Tensor],
    *,
    lr: float,
    weight_decay: float,
    lr_decay: float,
    eps: float,
    maximize: bool,
) -> None:
    """The functional form (TorchRec's ``adagrad``): updates ``params``, ``state_sums`` (one per
    row: shape ``[rows]``, or TorchRec's ``[rows, 1]``) and ``state_steps`` in place."""
    if not all(isinstance(t, torch.Tensor) for t in state_steps):
        raise RuntimeError(
            "RowWiseAdagrad: state_steps must be a list of singleton tensors (one per parameter)"
        )
    for param, grad, state_sum, step in zip(params, grads, state_sums, state_steps, strict=True):
        if state_sum.numel() != param.shape[0]:
            raise ValueError(
                f"RowWiseAdagrad: the accumulator has {state_sum.numel()} entries for a table of "
                f"{param.shape[0]} rows (shape {tuple(state_sum.shape)}); it needs one per row"
            )
        # A TorchRec state dict keeps [rows, 1]; read and write through a [rows] view so both work.
        sums = state_sum.view(-1)
        step += 1
        clr = lr / (1 + (float(step) - 1) * lr_decay)
        grad = -grad if maximize else grad
        if grad.is_sparse:
            grad = grad.coalesce()
            rows, g = grad.indices()[0], grad.values()
        else:
            rows, g = None, grad
        w = param if rows is None else param.index_select(0, rows)
        if weight_decay:
            g = g + weight_decay * w
        total = sums if rows is None else sums.index_select(0, rows)
        total = total + (g * g).mean(dim=1)
        new_w = w - (clr / (total.sqrt() + eps)).unsqueeze(1) * g
        if rows is None:
            sums.copy_(total)
            param.copy_(new_w)
        else:
            sums.index_copy_(0, rows, total)
            param.index_copy_(0, rows, new_w)
