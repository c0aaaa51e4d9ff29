"""Optimizers whose update happens inside backward (TorchRec's ``torchrec.optim.fused``).

``EmbeddingFusedOptimizer`` is the optimizer view of a fused embedding kernel: the update
already happened inside backward, so ``step()`` (and ``zero_grad()``) only forward a changed
learning rate (set by a scheduler, by hand in ``param_groups`` or by a loaded state dict) to the
kernel. Its state dict holds the kernel's optimizer state per table, keyed by parameter name,
so it checkpoints like any KeyedOptimizer.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import optim

from recsys_core.kernels.tbe import TableBatchedKernel
from recsys_core.optim.keyed import KeyedOptimizer


class FusedOptimizer(KeyedOptimizer, abc.ABC):
    """A KeyedOptimizer whose weight update is done during backward: ``step()`` applies
    nothing to the weights."""

    @abc.abstractmethod
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        ...

    @abc.abstractmethod
    def zero_grad(self, set_to_none: bool = False) -> None: ...

    def __repr__(self) -> str:
        return optim.Optimizer.__repr__(self)


class EmptyFusedOptimizer(FusedOptimizer):
    """A fused optimizer over no parameters (no-op ``step`` and ``zero_grad``)."""

    def __init__(self) -> None:
        super().__init__({}, {}, [])

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        return None

    def zero_grad(self, set_to_none: bool = False) -> None:
        return None


class FusedOptimizerModule(abc.ABC):
    """A module that updates its weights during backward and exposes that optimizer."""

    @property
    @abc.abstractmethod
    def fused_optimizer(self) -> KeyedOptimizer: ...


class EmbeddingFusedOptimizer(FusedOptimizer):
    """One param group (``lr``) over the per-table weights of one kernel.

    Args:
        kernel: the table-batched kernel that applies the update in backward.
        params: ``{parameter name: weight view}`` in the kernel's table order.
        table_names: the kernel's tables, same order; state keys are ``"<table>.<state>"``.
        kernel_tables: the kernel table each entry of ``params`` is (default: all, in order);
            a table left out is still updated in backward but has no key here.
    """

    def __init__(
        self,
        kernel: TableBatchedKernel,
        params: Mapping[str, torch.Tensor],
        table_names: Sequence[str],
        kernel_tables: Sequence[int] | None = None,
    ) -> None:
        self._kernel = kernel
        weights = list(params.values())
        states = kernel.split_optimizer_states()
        if kernel_tables is not None:
            states = [states[t] for t in kernel_tables]
        state: dict[torch.Tensor, dict[str, Any]] = {}
        for weight, table, table_state in zip(weights, table_names, states, strict=True):
            state[weight] = {f"{table}.{k}": v for k, v in table_state.items()}
        # The configured value, not the kernel's: FBGEMM keeps lr as float32 (0.02 -> 0.0199999).
        self._kernel_lr = kernel.optimizer.learning_rate
        groups = [{"params": weights, "lr": self._kernel_lr}] if weights else []
        super().__init__(dict(params), state, groups)

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """Forward the param group's ``lr`` to the kernel (``closure`` is not called)."""
        self._sync_learning_rate()

    def zero_grad(self, set_to_none: bool = False) -> None:
        """No gradients are materialized; forwards ``lr`` like ``step()``, as TorchRec does."""
        self._sync_learning_rate()

    def post_load_state_dict(self) -> None:
        self._sync_learning_rate()

    def set_optimizer_step(self, step: int) -> None:
        """Set the kernel's iteration counter (Adam's and LAMB's bias correction read it)."""
        counter = getattr(self._kernel, "iter", None)
        if not isinstance(counter, torch.Tensor):
            raise NotImplementedError(
                f"set_optimizer_step: the {type(self._kernel).__name__} kernel keeps no step "
                "counter"
            )
        counter.fill_(int(step))

    def update_hyper_parameters(self, params_dict: Mapping[str, Any]) -> None:
        """Set hyper-parameters by name; only ``lr`` can change after construction here."""
        unsupported = sorted(set(params_dict) - {"lr"})
        if unsupported:
            raise NotImplementedError(
                f"Setting hyper-parameter(s) {unsupported} is not supported by the fused "
                "embedding optimizer (only 'lr'); build the collection with the new values in "
                "its fused optimizer config instead"
            )
        if "lr" in params_dict:
            for group in self.param_groups:
                group["lr"] = float(params_dict["lr"])
            self._sync_learning_rate()

    def _sync_learning_rate(self) -> None:
        if self.param_groups:
            lr = float(next(iter(self.param_groups))["lr"])
            if lr != self._kernel_lr:
                self._kernel.set_learning_rate(lr)
                self._kernel_lr = lr
