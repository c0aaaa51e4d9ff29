"""The optimizer view of a fused embedding kernel.

The update already happened inside backward, so ``step()`` only forwards a changed learning rate
(set by a scheduler or by hand in ``param_groups``) to the kernel. Its state dict holds the
kernel's optimizer state per table, keyed by parameter name, so it checkpoints like any
KeyedOptimizer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from recsys_core.kernels.tbe import TableBatchedKernel
from recsys_core.optim.keyed import KeyedOptimizer


class EmbeddingFusedOptimizer(KeyedOptimizer):
    """One param group (``lr``) over the per-table weights of one kernel.

    Args:
        kernel: the table-batched kernel that applies the update in backward.
        params: ``{parameter name: weight view}`` in the kernel's table order.
        table_names: the kernel's tables, same order; state keys are ``"<table>.<state>"``.
    """

    def __init__(
        self,
        kernel: TableBatchedKernel,
        params: Mapping[str, torch.Tensor],
        table_names: Sequence[str],
    ) -> None:
        self._kernel = kernel
        weights = list(params.values())
        state: dict[torch.Tensor, dict[str, Any]] = {}
        for weight, table, table_state in zip(
            weights, table_names, kernel.split_optimizer_states(), strict=True
        ):
            state[weight] = {f"{table}.{k}": v for k, v in table_state.items()}
        # The configured value, not the kernel's: FBGEMM keeps lr as float32 (0.02 -> 0.0199999).
        self._kernel_lr = kernel.optimizer.learning_rate
        groups = [{"params": weights, "lr": self._kernel_lr}] if weights else []
        super().__init__(params, state, groups)

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = closure() if closure is not None else None
        self._sync_learning_rate()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None  # fused: no gradients are materialized

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._sync_learning_rate()

    def _sync_learning_rate(self) -> None:
        if self.param_groups:
            lr = float(self.param_groups[0]["lr"])
            if lr != self._kernel_lr:
                self._kernel.set_learning_rate(lr)
                self._kernel_lr = lr
