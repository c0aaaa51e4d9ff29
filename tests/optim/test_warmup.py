"""WarmupOptimizer: the learning rate after every step, hand-computed per policy, checkpointing of
the schedule's state (TorchRec 1.8's torchrec.optim.warmup)."""

from __future__ import annotations

import copy
import math
from collections import defaultdict
from typing import Any

import pytest
import torch

from recsys_core.optim.keyed import KeyedOptimizer, KeyedOptimizerWrapper
from recsys_core.optim.warmup import WarmupOptimizer, WarmupPolicy, WarmupStage


class NoStep(KeyedOptimizer):
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        return None


def lrs(stages: list[WarmupStage], lr: float, steps: int) -> list[float]:
    """The lr before the first step, then after each of ``steps`` steps."""
    p = torch.tensor([1.0])
    opt = WarmupOptimizer(NoStep({"p": p}, defaultdict(dict), [{"params": [p], "lr": 123.0}]), stages, lr=lr)
    out = [opt.param_groups[0]["lr"]]
    for _ in range(steps):
        opt.step()
        out.append(opt.param_groups[0]["lr"])
    return out


def test_linear_then_constant_one() -> None:
    got = lrs([WarmupStage(WarmupPolicy.LINEAR, max_iters=4, value=0.2)], lr=1.0, steps=6)
    assert got == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0, 1.0, 1.0])


def test_stages_in_sequence() -> None:
    stages = [
        WarmupStage(WarmupPolicy.LINEAR, max_iters=2, value=0.5),
        WarmupStage(WarmupPolicy.STEP, max_iters=6, value=0.5, decay_iters=2),
        WarmupStage(WarmupPolicy.CONSTANT, max_iters=8, value=0.1, lr_scale=2.0),
    ]
    # iteration: 0    1    2    3    4    5    6     7     8     9
    expected = [0.2, 0.3, 0.4, 0.2, 0.1, 0.1, 0.05, 0.08, 0.08, 0.4]
    assert lrs(stages, lr=0.4, steps=9) == pytest.approx(expected)
    assert stages[1].decay_iters == 2 and stages[0].decay_iters == -1  # user stages untouched


def test_poly_step_default_and_invsqrt() -> None:
    assert lrs([WarmupStage(WarmupPolicy.POLY, max_iters=4, value=2.0)], 1.0, 5) == pytest.approx(
        [1.0, 0.5625, 0.25, 0.0625, 0.0, 1.0]
    )
    assert lrs([WarmupStage(WarmupPolicy.STEP, max_iters=3, value=0.5)], 1.0, 3) == pytest.approx(
        [1.0, 0.5, 0.25, 0.125]  # decay_iters defaults to 1 for STEP
    )
    stages = [WarmupStage(WarmupPolicy.LINEAR, max_iters=1, value=0.5), WarmupStage(WarmupPolicy.INVSQRT, max_iters=3)]
    assert lrs(stages, 1.0, 4) == pytest.approx([0.5, 1.0, 1 / math.sqrt(2), 1 / math.sqrt(3), 1.0])


def test_cosine_annealing_warm_restarts() -> None:
    stage = WarmupStage(WarmupPolicy.COSINE_ANNEALING_WARM_RESTARTS, max_iters=10, value=0.1, sgdr_period=4)
    c = math.cos(math.pi / 4)
    expected = [1.0, 0.1 + 0.45 * (1 + c), 0.55, 0.1 + 0.45 * (1 - c), 1.0, 0.1 + 0.45 * (1 + c)]
    assert lrs([stage], 2.0, 5) == pytest.approx([2.0 * e for e in expected])


def test_interpolate() -> None:
    stage = WarmupStage(
        WarmupPolicy.INTERPOLATE, max_iters=200, start_interpolating_iters=100, value=0.01, end_value=0.1
    )
    got = lrs([stage], 1.0, 201)
    assert got[100] == pytest.approx(0.01) and got[150] == pytest.approx(0.055)
    assert got[200] == pytest.approx(0.1) and got[201] == pytest.approx(1.0)


def test_no_stages_keeps_lr_and_bad_stages_are_errors() -> None:
    assert lrs([], 0.3, 2) == pytest.approx([0.3, 0.3, 0.3])
    with pytest.raises(ValueError, match="must be greater than the previous"):
        lrs([WarmupStage(max_iters=5), WarmupStage(max_iters=5)], 1.0, 0)
    with pytest.raises(ValueError, match="needs start_interpolating_iters and end_value"):
        lrs([WarmupStage(WarmupPolicy.INTERPOLATE, max_iters=5)], 1.0, 0)
    with pytest.raises(ValueError, match="undefined at iteration 0"):
        lrs([WarmupStage(WarmupPolicy.INVSQRT, max_iters=5)], 1.0, 0)


def test_schedule_drives_the_wrapped_update() -> None:
    w = torch.nn.Parameter(torch.zeros(1))
    opt = WarmupOptimizer(
        KeyedOptimizerWrapper({"w": w}, lambda ps: torch.optim.SGD(ps, lr=9.0)),
        [WarmupStage(WarmupPolicy.LINEAR, max_iters=2, value=0.5)], lr=1.0,
    )
    for _ in range(4):
        opt.zero_grad()
        w.sum().backward()
        opt.step()
    torch.testing.assert_close(w.detach(), torch.tensor([-(0.5 + 0.75 + 1.0 + 1.0)]))


def make(save_groups: bool) -> WarmupOptimizer:
    p = torch.tensor([1.0, 2.0])
    opt = WarmupOptimizer(
        NoStep({"param_1": p}, defaultdict(dict), [{"params": [p]}]),
        stages=[WarmupStage(WarmupPolicy.LINEAR, max_iters=100, value=1e-2, lr_scale=1)],
    )
    opt.save_param_groups(save_groups)
    return opt


@pytest.mark.parametrize("save_groups", [True, False])
def test_checkpoint_restores_iteration_and_lr(save_groups: bool) -> None:
    first = make(save_groups)
    for _ in range(10):
        first.zero_grad()
        first.step()
    sd = first.state_dict()
    assert sd["state"]["__warmup"]["warmup"].tolist() == [10, 0]
    assert ("param_groups" in sd) == save_groups
    second = make(save_groups)
    second.step()  # the warmup state exists only after a step (or init_state)
    second.load_state_dict(copy.deepcopy(sd))
    expected_lr = 0.1 * (0.01 + 0.99 * 10 / 100)  # post_load_state_dict re-derives it
    assert second.param_groups[0]["lr"] == pytest.approx(expected_lr)
    torch.testing.assert_close(second.state_dict()["state"]["__warmup"]["warmup"], torch.tensor([10, 0]))
    second.step()
    assert second.param_groups[0]["lr"] == pytest.approx(0.1 * (0.01 + 0.99 * 11 / 100))


def test_loading_into_a_fresh_warmup_needs_its_state() -> None:
    first = make(False)
    first.step()
    with pytest.raises(ValueError, match="Different parameter count: 0 vs 1"):
        make(False).load_state_dict(first.state_dict())
