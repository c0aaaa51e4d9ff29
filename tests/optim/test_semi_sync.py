"""SemisyncOptimizer (TorchRec 1.8's torchrec.optim.semi_sync): local steps every step, a global
step every num_local_steps, the prefixed keyed state, checkpoint resume equal to no interruption."""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

import pytest
import torch

from recsys_core.optim import SemisyncOptimizer
from recsys_core.optim.keyed import KeyedOptimizerWrapper
from recsys_core.optim.semi_sync import (
    SEMISYNC_GLOBAL_STEP_COUNTER_KEY,
    SEMISYNC_LOCAL_STEP_COUNTER_KEY,
)


class OuterSGD(torch.optim.Optimizer):
    """A DiLoCo-like outer optimizer: anchor <- anchor - lr * (anchor - w); w <- anchor."""

    def __init__(self, params: Iterable[torch.Tensor], lr: float) -> None:
        super().__init__(params, {"lr": lr})
        self.calls: list[int] = []
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["anchor"] = p.detach().clone()

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        raise AssertionError("the semi-sync optimizer calls global_step, never step")

    @torch.no_grad()
    def global_step(self, local_steps: torch.Tensor, closure: Any = None) -> None:
        self.calls.append(int(local_steps))
        for group in self.param_groups:
            for p in group["params"]:
                anchor = self.state[p]["anchor"]
                anchor.sub_(group["lr"] * (anchor - p))
                p.copy_(anchor)


def build(w: torch.Tensor, momentum: float = 0.0) -> SemisyncOptimizer:
    local = KeyedOptimizerWrapper({"w": w}, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=momentum))
    outer = KeyedOptimizerWrapper({"w": w}, lambda ps: OuterSGD(ps, lr=0.5))
    return SemisyncOptimizer([w], local, outer, num_local_steps=2)


def train(opt: SemisyncOptimizer, w: torch.Tensor, steps: int) -> None:
    for _ in range(steps):
        opt.zero_grad()
        (w * torch.tensor([1.0, 3.0])).sum().backward()
        opt.step()


def test_local_and_global_steps_by_hand() -> None:
    w = torch.nn.Parameter(torch.tensor([1.0, 1.0]))
    opt = build(w)
    values = []
    for _ in range(5):
        train(opt, w, 1)
        values.append(w[0].item())
    # local SGD moves w[0] by -0.1 per step; after steps 2 and 4 the anchor takes half the way
    assert values == pytest.approx([0.9, 0.9, 0.8, 0.8, 0.7])
    assert opt._global_optimizer._optimizer.calls == [2, 4]  # type: ignore[attr-defined]
    assert int(opt._local_step_counter) == 5 and int(opt._global_step_counter) == 2


def test_keyed_views() -> None:
    w = torch.nn.Parameter(torch.ones(2))
    opt = build(w, momentum=0.5)
    assert set(opt.params) == {"w", SEMISYNC_GLOBAL_STEP_COUNTER_KEY, SEMISYNC_LOCAL_STEP_COUNTER_KEY}
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.5]
    train(opt, w, 1)
    assert set(opt.state[w]) == {
        "semi_sync_local_momentum_buffer", "semi_sync_global_anchor",
        SEMISYNC_GLOBAL_STEP_COUNTER_KEY, SEMISYNC_LOCAL_STEP_COUNTER_KEY,
    }
    assert int(opt.state_dict()["state"]["w"][SEMISYNC_LOCAL_STEP_COUNTER_KEY]) == 1
    assert repr(opt).startswith("semi_sync_local_optim: ")
    other = KeyedOptimizerWrapper({"w": torch.nn.Parameter(torch.ones(2))}, lambda ps: OuterSGD(ps, lr=0.5))
    with pytest.raises(ValueError, match="names different tensors"):
        _ = SemisyncOptimizer([w], opt._optimizer, other).params


def test_checkpoint_resume_equals_uninterrupted() -> None:
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    opt = build(w, momentum=0.5)
    train(opt, w, 3)
    saved_w, saved = w.detach().clone(), copy.deepcopy(opt.state_dict())
    train(opt, w, 3)
    w2 = torch.nn.Parameter(saved_w)
    resumed = build(w2, momentum=0.5)
    resumed.init_state()  # creates the local momentum state that the checkpoint fills
    resumed.load_state_dict(saved)
    assert int(resumed._local_step_counter) == 3 and int(resumed._global_step_counter) == 1
    train(resumed, w2, 3)
    torch.testing.assert_close(w2.detach(), w.detach(), rtol=0, atol=0)
    assert int(resumed._global_step_counter) == int(opt._global_step_counter) == 3


def test_empty_global_params_and_prefix_extraction() -> None:
    w = torch.nn.Parameter(torch.ones(2))
    opt = build(w)
    with pytest.raises(ValueError, match="global_params is empty"):
        SemisyncOptimizer([], opt._optimizer, opt._global_optimizer)
    with pytest.raises(IndexError):  # TorchRec raised IndexError here
        SemisyncOptimizer([], opt._optimizer, opt._global_optimizer)
    state = {"semi_sync_local_a": 1, "semi_sync_global_b": 2, "c": 3}
    assert SemisyncOptimizer._extract_prefixed_state(state, "semi_sync_local_") == {"a": 1}
