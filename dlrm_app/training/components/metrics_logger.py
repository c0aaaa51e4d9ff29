"""The run's metrics log (``RUN/metrics.jsonl``, written by rank 0), its progress bar and the
time spent in each phase of a step."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from dlrm_app.training.components.state import TrainingDiverged, TrainState, diverged
from dlrm_app.training.config import LogConfig, OptimizerConfig
from dlrm_app.training.runtime import global_mean

PHASES = ("data", "forward", "backward", "optimizer")


class MetricsLogger:
    """Schedule: a ``train`` line (mean loss over the ranks and the steps since the last line,
    learning rate, samples/s) every ``config.log_every`` steps and at the last step. The loss
    stays a device tensor between those lines (no host sync per step); a non-finite one stops
    the run with ``TrainingDiverged`` (``diverged``: its message names ``rates``' learning
    rates, the flags that help)."""

    def __init__(self, path: Path, *, writer: bool, progress: bool, config: LogConfig,
                 rates: OptimizerConfig, total_steps: int, start_step: int, global_batch: int,
                 optimizer: torch.optim.Optimizer, device: torch.device) -> None:
        self._file = path.open("a") if writer else None
        self._config, self._total, self._global_batch = config, total_steps, global_batch
        self._rates, self._run = rates, path.parent
        self._optimizer, self._device = optimizer, device
        self.bar = tqdm(total=total_steps, initial=start_step, disable=not (progress and writer),
                        unit="step", dynamic_ncols=True)
        self.phase_s = dict.fromkeys(PHASES, 0.0)
        self._loss: torch.Tensor | float = 0.0
        self._steps, self._since = 0, time.perf_counter()

    def write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def add_time(self, **seconds: float) -> None:
        for phase, value in seconds.items():
            self.phase_s[phase] += value

    def after_step(self, state: TrainState, loss_sum: torch.Tensor, rows: int) -> None:
        self._loss = self._loss + loss_sum.detach() / rows
        self._steps += 1
        self.bar.update(1)
        if state.step % self._config.log_every and state.step != self._total:
            return
        (loss,) = global_mean([float(self._loss) / self._steps], self._device)
        if not math.isfinite(loss):
            raise self.diverged(f"the train loss is {loss}", state)
        rate = self._steps * self._global_batch / (time.perf_counter() - self._since)
        self.write({"event": "train", "step": state.step, "epoch": state.epoch, "loss": loss,
                    "lr": self._optimizer.param_groups[-1]["lr"], "samples_per_s": rate})
        self.bar.set_postfix(loss=f"{loss:.4f}", samples_per_s=f"{rate:,.0f}")
        self._loss, self._since, self._steps = 0.0, time.perf_counter(), 0

    def diverged(self, what: str, state: TrainState) -> TrainingDiverged:
        """The error that stops this run: ``what`` is not finite at ``state``'s step."""
        return diverged(what, state, self._rates, self._run)

    def phase_fraction(self) -> dict[str, float]:
        busy = sum(self.phase_s.values()) or 1.0
        return {k: v / busy for k, v in self.phase_s.items()}

    def close(self) -> None:
        self.bar.close()
        if self._file is not None:
            self._file.close()
            self._file = None
