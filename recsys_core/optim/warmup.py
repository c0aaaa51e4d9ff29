"""Learning-rate schedule as an optimizer wrapper (TorchRec's ``torchrec.optim.warmup``).

``WarmupOptimizer(optimizer, stages, lr)`` sets every param group's ``lr`` to
``lr * multiplier(stage, iteration)``. The iteration counts ``step()`` calls from 0 and is not
reset between stages; a stage lasts while ``iteration <= stage.max_iters`` (the first step past
it moves to the next stage), and after the last stage the multiplier is 1. Multipliers
(``it`` the iteration, each scaled by ``stage.lr_scale``)::

    LINEAR    value + (1 - value) * it / max_iters        (value -> 1 over the stage)
    CONSTANT  value
    POLY      (1 - it / decay_iters) ** value              (decay_iters defaults to max_iters)
    STEP      value ** (it // decay_iters)                 (decay_iters defaults to 1)
    INVSQRT   1 / sqrt(it)
    COSINE_ANNEALING_WARM_RESTARTS
              value + (1 - value) * (1 + cos(pi * (it % sgdr_period) / sgdr_period)) / 2
    INTERPOLATE
              value + (end_value - value) * (it - start_interpolating_iters)
                                            / (max_iters - start_interpolating_iters)
    NONE      1

The state ``{"warmup": tensor([iteration, stage index])}`` is kept under the extra parameter
``param_name`` (default ``"__warmup"``), so it is checkpointed with the wrapped optimizer.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from enum import Enum, unique
from typing import Any

import torch

from recsys_core.optim.keyed import KeyedOptimizer, OptimizerWrapper

logger: logging.Logger = logging.getLogger(__name__)


@unique
class WarmupPolicy(Enum):
    NONE = "none"
    LINEAR = "linear"
    CONSTANT = "constant"
    POLY = "poly"
    STEP = "step"
    INVSQRT = "inv_sqrt"
    COSINE_ANNEALING_WARM_RESTARTS = "cosine_annealing_warm_restarts"
    INTERPOLATE = "interpolate"


@dataclass(frozen=True)
class WarmupStage:
    """One stage of the schedule (see the module docstring for each policy's multiplier)."""

    policy: WarmupPolicy = WarmupPolicy.LINEAR
    """How the multiplier depends on the iteration."""
    max_iters: int = 1
    """The last iteration of this stage (counted from the first step, not from the stage)."""
    value: float = 1.0
    """The policy's parameter: start (LINEAR, INTERPOLATE), constant, exponent (POLY), decay
    factor (STEP) or floor (COSINE_ANNEALING_WARM_RESTARTS)."""
    lr_scale: float = 1.0
    """Multiplies the policy's multiplier."""
    decay_iters: int = -1
    """POLY's denominator (default max_iters) or STEP's step size (default 1); <= 0: default."""
    sgdr_period: int = 1
    """COSINE_ANNEALING_WARM_RESTARTS's period in iterations."""
    start_interpolating_iters: int | None = None
    """INTERPOLATE: the iteration at which the multiplier equals ``value``."""
    end_value: float | None = None
    """INTERPOLATE: the multiplier at ``max_iters``."""


_LAST_STAGE = WarmupStage(policy=WarmupPolicy.NONE, max_iters=1 << 63, value=1.0)


def _lr_stages(stages: list[WarmupStage]) -> list[WarmupStage]:
    """Validated stages with default ``decay_iters`` filled in, plus the final NONE stage."""
    out = []
    previous = 0
    for index, stage in enumerate(stages):
        if stage.max_iters <= previous:
            raise ValueError(
                f"warmup stage {index} ({stage.policy.name}): max_iters {stage.max_iters} must be "
                f"greater than the previous stage's max_iters {previous} (max_iters counts from "
                "the first step, not from the start of the stage)"
            )
        if stage.policy is WarmupPolicy.INTERPOLATE:
            start = stage.start_interpolating_iters
            if start is None or stage.end_value is None:
                raise ValueError(
                    f"warmup stage {index}: INTERPOLATE needs start_interpolating_iters and "
                    "end_value"
                )
            if stage.max_iters <= start:
                raise ValueError(
                    f"warmup stage {index}: max_iters ({stage.max_iters}) must be greater than "
                    f"start_interpolating_iters ({start}) for INTERPOLATE"
                )
        if stage.policy is WarmupPolicy.COSINE_ANNEALING_WARM_RESTARTS and stage.sgdr_period <= 0:
            raise ValueError(f"warmup stage {index}: sgdr_period must be > 0, got {stage.sgdr_period}")
        if stage.decay_iters <= 0:
            default = 1 if stage.policy is WarmupPolicy.STEP else stage.max_iters
            stage = dataclasses.replace(stage, decay_iters=default)
        out.append(stage)
        previous = stage.max_iters
    return [*out, _LAST_STAGE]


def _get_multiplier(stage: WarmupStage, iter: int) -> float:  # noqa: A002 (TorchRec's name)
    policy = stage.policy
    if policy is WarmupPolicy.LINEAR:
        multiplier = stage.value + (1.0 - stage.value) * iter / stage.max_iters
    elif policy is WarmupPolicy.CONSTANT:
        multiplier = stage.value
    elif policy is WarmupPolicy.POLY:
        multiplier = math.pow(1 - iter / stage.decay_iters, stage.value)
    elif policy is WarmupPolicy.STEP:
        multiplier = math.pow(stage.value, iter // stage.decay_iters)
    elif policy is WarmupPolicy.INVSQRT:
        if iter <= 0:
            raise ValueError(
                "warmup: INVSQRT is 1/sqrt(iteration), undefined at iteration 0; put a stage "
                "(e.g. LINEAR) before it"
            )
        multiplier = 1.0 / math.sqrt(iter)
    elif policy is WarmupPolicy.COSINE_ANNEALING_WARM_RESTARTS:
        t_cur = iter % stage.sgdr_period
        multiplier = stage.value + (1.0 - stage.value) * 0.5 * (
            1 + math.cos(math.pi * t_cur / stage.sgdr_period)
        )
    elif policy is WarmupPolicy.INTERPOLATE:
        start = float(stage.start_interpolating_iters or 0)
        end_value = float(stage.end_value if stage.end_value is not None else stage.value)
        multiplier = stage.value + (end_value - stage.value) * (iter - start) / (
            stage.max_iters - start
        )
    else:
        multiplier = 1.0
    return multiplier * stage.lr_scale


class WarmupOptimizer(OptimizerWrapper):
    """Sets the wrapped optimizer's learning rate by ``stages`` after every ``step()``.

    Args:
        optimizer: the KeyedOptimizer to wrap.
        stages: the schedule; an empty list keeps ``lr``.
        lr: the base learning rate the multipliers scale.
        lr_param: the param-group entry to set.
        param_name: name of the extra (empty) parameter that holds the schedule's state.
    """

    def __init__(
        self,
        optimizer: KeyedOptimizer,
        stages: list[WarmupStage],
        lr: float = 0.1,
        lr_param: str = "lr",
        param_name: str = "__warmup",
    ) -> None:
        super().__init__(optimizer)
        self._stages = _lr_stages(list(stages))
        self._lr_param = lr_param
        self._lr = lr
        self._warmup_param = torch.nn.Parameter()
        self.params[param_name] = self._warmup_param  # type: ignore[index]
        # a fused optimizer updates in the first backward, before any step(): set lr now
        self._set_lr(0, 0)

    def _set_lr(self, iter_: int, stage_id: int) -> None:
        lr = self._lr * _get_multiplier(self._stages[stage_id], iter_)
        for group in self.param_groups:
            group[self._lr_param] = lr

    def _get_warmup_state(self) -> tuple[int, int]:
        if self._warmup_param in self.state:
            iter_, stage_id = self.state[self._warmup_param]["warmup"].tolist()
            return int(iter_), int(stage_id)
        return 0, 0

    def post_load_state_dict(self) -> None:
        iter_, stage_id = self._get_warmup_state()
        logger.info("Warmup Optimizer set to iteration %d", iter_)
        self._set_lr(iter_, stage_id)

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        super().step(closure)
        iter_, stage_id = self._get_warmup_state()
        iter_ += 1
        if iter_ > self._stages[stage_id].max_iters and stage_id + 1 < len(self._stages):
            stage_id += 1
            logger.info(
                "Warmup Optimizer finishing %s switching to %s",
                self._stages[stage_id - 1], self._stages[stage_id],
            )
        self._set_lr(iter_, stage_id)
        self.state[self._warmup_param] = {
            "warmup": torch.tensor([iter_, stage_id], dtype=torch.long)
        }
