"""TorchRec 1.9's ``scratch_buffers()`` on the optimizer wrappers (each hands on the scratch
buffers of what it wraps, in order; an optimizer without any gives none) and the gradient norm
``GradientClippingOptimizer(track_grad_norm=True)`` records."""

from __future__ import annotations

import pytest
import torch

from recsys_core.optim.clipping import GradientClipping, GradientClippingOptimizer
from recsys_core.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper, OptimizerWrapper
from recsys_core.optim.semi_sync import SemisyncOptimizer


class _WithScratch(torch.optim.SGD):
    """An optimizer that keeps scratch buffers (as some fused optimizers do)."""

    def __init__(self, params: list[torch.Tensor], *buffers: torch.Tensor) -> None:
        super().__init__(params, lr=0.1)
        self._buffers = buffers

    def scratch_buffers(self) -> tuple[torch.Tensor, ...]:
        return self._buffers


def test_wrappers_hand_on_scratch_buffers() -> None:
    w, v = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))
    a, b, c = torch.zeros(1), torch.zeros(2), torch.zeros(3)
    first = KeyedOptimizerWrapper({"w": w}, lambda ps: _WithScratch(ps, a, b))
    second = KeyedOptimizerWrapper({"v": v}, lambda ps: _WithScratch(ps, c))
    plain = KeyedOptimizerWrapper({"v": v}, lambda ps: torch.optim.SGD(ps, lr=0.1))
    assert first.scratch_buffers() == (a, b)
    assert plain.scratch_buffers() == ()
    assert OptimizerWrapper(first).scratch_buffers() == (a, b)
    assert OptimizerWrapper(plain).scratch_buffers() == ()
    combined = CombinedOptimizer([("x", first), ("p", plain), ("y", second)])
    assert combined.scratch_buffers() == (a, b, c)
    semi = SemisyncOptimizer([w], first, KeyedOptimizerWrapper({"w": w}, lambda ps: _WithScratch(ps, c)))
    assert semi.scratch_buffers() == (a, b, c)


@pytest.mark.parametrize("clipping", [GradientClipping.VALUE, GradientClipping.NONE])
def test_tracked_grad_norm(clipping: GradientClipping) -> None:
    # TorchRec 1.9: track_grad_norm logs torch's get_total_norm of the non-empty local
    # gradients, None when there are none (1.8 logged the norm of nothing: 0)
    w, v = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    opt = GradientClippingOptimizer(
        KeyedOptimizerWrapper({"w": w, "v": v}, lambda ps: torch.optim.SGD(ps, lr=0.1)),
        clipping=clipping, max_gradient=100.0, track_grad_norm=True)
    if clipping is GradientClipping.NONE:  # (VALUE clipping of no gradients fails in torch)
        opt.step()
        assert opt.last_total_grad_norm is None
    w.grad, v.grad = torch.tensor([3.0, 4.0]), torch.tensor([0.0, 12.0])
    opt.step()
    torch.testing.assert_close(opt.last_total_grad_norm, torch.tensor(13.0))
