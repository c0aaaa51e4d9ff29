"""TorchRec 1.9's ``scratch_buffers()`` on the optimizer wrappers: each hands on the scratch
buffers of what it wraps (in order), and an optimizer without any gives none."""

from __future__ import annotations

import torch

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
