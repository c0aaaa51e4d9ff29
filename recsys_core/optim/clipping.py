"""Gradient clipping around a KeyedOptimizer (TorchRec's ``torchrec.optim.clipping``).

``GradientClippingOptimizer(optimizer, clipping=GradientClipping.NORM, max_gradient=1.0)``
rescales the gradients before each ``step()`` so that their total ``norm_type``-norm is at most
``max_gradient`` (``VALUE`` clamps each element to ``[-max_gradient, max_gradient]``).

Norm clipping of parameters sharded over process groups (``enable_global_grad_clip`` with
``param_to_pgs``) sums ``|g|^p`` over each group's ranks, so the clip factor is that of the whole
(unsharded) gradient::

    total = (sum_replicated |g|^p + sum_groups all_reduce(sum_local_shards |g|^p)) ^ (1/p)
    g <- g * min(1, max_gradient / (total + 1e-6))
"""

from __future__ import annotations

import logging
from collections import defaultdict
from enum import Enum, unique
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from recsys_core.optim.keyed import KeyedOptimizer, OptimizerWrapper

logger: logging.Logger = logging.getLogger(__name__)

log_grad_norm: bool = False
"""TorchRec's module flag; kept for import compatibility (nothing reads it in 1.8 either)."""
use_64bit_grad_norm: bool = False
"""Accumulate the per-tensor norms in float64 (the result is float32), as in TorchRec."""


@unique
class GradientClipping(Enum):
    NORM = "norm"
    VALUE = "value"
    NONE = "none"


class GradientClippingOptimizer(OptimizerWrapper):
    """Clips gradients, then steps the wrapped optimizer.

    Args:
        optimizer: the KeyedOptimizer to wrap.
        clipping: NORM (rescale by the total norm), VALUE (clamp elements) or NONE.
        max_gradient: the largest allowed total norm (NORM) or element magnitude (VALUE).
        norm_type: p of the p-norm; ``"inf"`` or ``float("inf")`` for the max-norm.
        enable_global_grad_clip: use ``param_to_pgs`` to compute the norm of sharded parameters
            across their process groups; otherwise every parameter is clipped locally.
        param_to_pgs: ``{parameter: [process groups it is sharded over]}``.
        track_grad_norm: with VALUE or NONE clipping, also compute the total norm each step
            (NORM always does) for ``last_total_grad_norm``.
    """

    def __init__(
        self,
        optimizer: KeyedOptimizer,
        clipping: GradientClipping = GradientClipping.NONE,
        max_gradient: float = 0.1,
        norm_type: float | str = 2.0,
        enable_global_grad_clip: bool = False,
        param_to_pgs: dict[torch.Tensor, list[dist.ProcessGroup]] | None = None,
        track_grad_norm: bool = False,
    ) -> None:
        super().__init__(optimizer)
        self._clipping = clipping
        self._max_gradient = max_gradient
        self._norm_type = float(norm_type)
        self._check_meta = True
        self._enable_global_grad_clip = enable_global_grad_clip
        self._step_num = 0
        self._track_grad_norm = track_grad_norm
        self._last_total_grad_norm: torch.Tensor | None = None
        self._replicate_params: list[torch.Tensor] = []
        self._sharded_params: dict[tuple[dist.ProcessGroup, ...], list[torch.Tensor]] = (
            defaultdict(list)
        )
        for group in self.param_groups:
            for param in group["params"]:
                pgs = (param_to_pgs or {}).get(param) if enable_global_grad_clip else None
                if pgs:
                    self._sharded_params[tuple(pgs)].append(param)
                else:
                    self._replicate_params.append(param)
        sharded = sum(len(ps) for ps in self._sharded_params.values())
        logger.info(
            "Optimizer found %d dist params and %d replicate params.",
            sharded, len(self._replicate_params),
        )
        if clipping is GradientClipping.VALUE and sharded > 0:
            raise NotImplementedError(
                "clip_grad_value_ for sharded parameters is not supported yet; use "
                "GradientClipping.NORM or disable enable_global_grad_clip"
            )

    @property
    def last_total_grad_norm(self) -> torch.Tensor | None:
        """The total gradient norm of the latest step (None before the first one)."""
        return self._last_total_grad_norm

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        if self._check_meta:
            # Parameters on the meta device (a model not yet materialized) have no values to clip.
            params = [*self._replicate_params, *(p for ps in self._sharded_params.values() for p in ps)]
            if any(p.device.type == "meta" for p in params):
                self._last_total_grad_norm = None
                super().step(closure)
                return
            self._check_meta = False
        if self._clipping is GradientClipping.NORM:
            if not self._sharded_params:
                local = [p._local_tensor if isinstance(p, DTensor) else p for p in self._replicate_params]
                local = [p for p in local if p.grad is not None and p.grad.numel() > 0]
                self._last_total_grad_norm = (
                    torch.nn.utils.clip_grad_norm_(
                        local, max_norm=self._max_gradient, norm_type=self._norm_type
                    )
                    if local else None
                )
            else:
                self._last_total_grad_norm = self.clip_grad_norm_()
        elif self._clipping is GradientClipping.VALUE:
            if self._track_grad_norm:
                self._last_total_grad_norm = self._grad_norm_for_logging()
            torch.nn.utils.clip_grad_value_(self._replicate_params, clip_value=self._max_gradient)
        elif self._track_grad_norm:
            self._last_total_grad_norm = self._grad_norm_for_logging()
        super().step(closure)
        self._step_num += 1

    def _grad_norm_for_logging(self) -> torch.Tensor | None:
        """The norm ``track_grad_norm`` records (TorchRec 1.9): over the ranks for sharded
        parameters, else torch's ``get_total_norm`` of the non-empty local gradients, None when
        there are none."""
        if self._sharded_params:
            return self.compute_total_grad_norm()[0]
        local = [p._local_tensor if isinstance(p, DTensor) else p for p in self._replicate_params]
        grads = [p.grad for p in local if p.grad is not None and p.grad.numel() > 0]
        if not grads:
            return None
        return torch.nn.utils.get_total_norm(grads, norm_type=self._norm_type)

    def compute_total_grad_norm(self) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The total norm of all gradients (no clipping) and the gradients it covers."""
        sharded = {pgs: _get_grads(ps) for pgs, ps in self._sharded_params.items()}
        replicated = _get_grads(self._replicate_params)
        grads = [g for gs in sharded.values() for g in gs] + replicated
        total = _compute_total_norm(replicated, sharded, self._norm_type, self._max_gradient)
        return total, grads

    def clip_grad_norm_(self) -> torch.Tensor:
        """Rescale all gradients by ``min(1, max_gradient / (total norm + 1e-6))``."""
        total, grads = self.compute_total_grad_norm()
        coef = torch.clamp(self._max_gradient / (total + 1e-6), max=1.0)
        if grads:
            torch._foreach_mul_(grads, coef.to(grads[0].device))
        return total


def _get_grads(param_list: list[torch.Tensor]) -> list[torch.Tensor]:
    """Non-empty gradients of ``param_list`` (DTensor gradients as their local tensors)."""
    return [
        p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad
        for p in param_list
        if p.grad is not None and p.grad.numel() > 0
    ]


def _dedup_to_base_tensors(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each distinct storage once: a view is replaced by its base, first occurrence kept.

    FSDP2 gives every gradient of one module views of one flat buffer, so the norm of the
    bases equals the norm of the views with far fewer tensors (TorchRec's helper; the views
    must tile their base exactly, which FSDP2 guarantees)."""
    seen: set[int] = set()
    bases: list[torch.Tensor] = []
    for tensor in tensors:
        base = tensor._base if tensor._base is not None else tensor
        if id(base) not in seen:
            seen.add(id(base))
            bases.append(base)
    return bases


def _batch_cal_norm(
    grad_list: list[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    process_groups: tuple[dist.ProcessGroup, ...] | None = None,
) -> torch.Tensor:
    """``sum |g|^p`` over ``grad_list`` (the max ``|g|`` for the inf-norm), all-reduced over
    ``process_groups`` (sum, or max for the inf-norm). ``max_norm`` is unused (TorchRec's
    signature)."""
    del max_norm
    if norm_type == torch.inf:
        grad_list = [g for g in grad_list if g.numel() > 0]
        if not grad_list:
            return torch.tensor(float("-inf"))
    dtype = torch.float64 if use_64bit_grad_norm else None
    per_tensor = torch._foreach_norm(grad_list, norm_type, dtype=dtype)
    norms = torch.linalg.vector_norm(torch.stack(per_tensor), norm_type)
    if norm_type == torch.inf:
        for pg in process_groups or ():
            dist.all_reduce(norms, op=dist.ReduceOp.MAX, group=pg)
    else:
        norms = norms**norm_type
        for pg in process_groups or ():
            dist.all_reduce(norms, group=pg)
    return norms.to(torch.float32) if use_64bit_grad_norm else norms


def _compute_total_norm(
    replicate_grads: list[torch.Tensor],
    sharded_grads: dict[tuple[dist.ProcessGroup, ...], list[torch.Tensor]],
    norm_type: float = 2.0,
    max_grad_norm: float = 1.0,
) -> torch.Tensor:
    """The ``norm_type``-norm of all gradients: replicated ones local, sharded ones summed
    (maxed for the inf-norm) over their process groups."""
    is_inf = norm_type == torch.inf
    combine = torch.maximum if is_inf else torch.add
    initial = float("-inf") if is_inf else 0.0
    sharded_total = torch.tensor(initial)
    for pgs, grads in sharded_grads.items():
        part = _batch_cal_norm(grads, max_grad_norm, norm_type, pgs)
        sharded_total = combine(sharded_total.to(part.device), part)
    replicated_total = (
        _batch_cal_norm(replicate_grads, max_grad_norm, norm_type)
        if replicate_grads else torch.tensor(initial)
    ).to(sharded_total.device)
    combined = combine(replicated_total, sharded_total)
    return combined if is_inf else combined.pow(1.0 / norm_type)
