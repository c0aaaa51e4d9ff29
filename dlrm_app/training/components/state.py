"""Where a training run is: a few numbers, saved in every checkpoint and restored by
``--resume``; each part saves and restores itself (``state_dict`` / ``load_state_dict``), the
checkpointer only stores what the parts give it."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Protocol

import torch

from dlrm_app.data.loader import ParquetLoader
from dlrm_app.training.config import OptimizerConfig


class Stateful(Protocol):
    """A part of a checkpoint: plain values (and tensors) out, the same back in."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclasses.dataclass
class TrainState:
    step: int = 0
    epoch: int = 0
    epoch_batches: int = 0
    """Batches of the current epoch trained so far, on each rank (the rows seen in the epoch:
    this times the global batch). The pipelined loop pulls one batch ahead, so the loader's own
    count can be one higher."""
    best_auc: float = -1.0
    best_step: int = -1
    stale_validations: int = 0
    """Validations since the best one."""
    stop_reason: str | None = None
    """Set by the component that ends training early (the validator)."""
    days_done: int | None = None
    """``--follow``: the days trained to their end (the next day to evaluate and train is
    this index); None: a run of epochs."""
    day_batches: int = 0
    """``--follow``: batches of the day in progress trained so far, on each rank (0: the day
    has not started; more: a restart continues it after them, its evaluation logged)."""

    def next_epoch(self) -> None:
        self.epoch, self.epoch_batches = self.epoch + 1, 0

    def state_dict(self) -> dict[str, Any]:
        # the keys checkpoints have always had (``batches_yielded``: the epoch's batches)
        return {"step": self.step, "epoch": self.epoch, "batches_yielded": self.epoch_batches,
                "best_auc": self.best_auc, "best_step": self.best_step,
                "stale_validations": self.stale_validations,
                **({} if self.days_done is None else
                   {"days_done": self.days_done, "day_batches": self.day_batches})}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.epoch = int(state["step"]), int(state["epoch"])
        self.epoch_batches = int(state["batches_yielded"])
        self.best_auc, self.best_step = float(state["best_auc"]), int(state["best_step"])
        self.stale_validations = int(state["stale_validations"])
        if "days_done" in state:
            self.days_done, self.day_batches = int(state["days_done"]), int(state["day_batches"])
        self.stop_reason = None


class DataPosition:
    """The train loader's place: the epoch and batches the ``TrainState`` counts, and the world
    and batch size they were counted in. Restored (after the state) under another world size or
    batch size, the position is the same number of global rows into the epoch."""

    def __init__(self, loader: ParquetLoader, state: TrainState, world_size: int,
                 batch_size: int, steps_per_epoch: int) -> None:
        self._loader, self._state = loader, state
        self._world_size, self._batch_size = world_size, batch_size
        self._steps_per_epoch = steps_per_epoch

    def state_dict(self) -> dict[str, Any]:
        return {"world_size": self._world_size, "batch_size": self._batch_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        batches = self._state.epoch_batches
        saved = int(state["world_size"]), int(state["batch_size"])
        if saved != (self._world_size, self._batch_size):
            batches = batches * saved[0] * saved[1] // (self._batch_size * self._world_size)
        self.start_epoch(self._state.epoch, min(batches, self._steps_per_epoch))

    def start_epoch(self, epoch: int, batches: int = 0) -> None:
        """Continue ``epoch`` after ``batches`` batches (0: from its start)."""
        self._state.epoch, self._state.epoch_batches = epoch, batches
        self._loader.load_state_dict({"epoch": epoch, "batches_yielded": batches})


class RngState:
    """torch's global random generator, as the run left it."""

    def state_dict(self) -> dict[str, Any]:
        return {"rng": torch.get_rng_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["rng"])


class TrainingDiverged(ValueError):
    """The loss or the model's output stopped being finite."""


def diverged(what: str, state: TrainState, config: OptimizerConfig,
             out: str | Path) -> TrainingDiverged:
    """The error that stops the run in ``out`` whose loss or output is no longer finite: where,
    the flags that help (the learning rates of ``config``), and what was kept."""
    kept = (f"the best checkpoint (step {state.best_step}, validation AUC {state.best_auc:.4f}) "
            f"is kept in {out}/checkpoints" if state.best_step >= 0 else
            "no checkpoint was kept")
    return TrainingDiverged(
        f"{what} at step {state.step} (epoch {state.epoch}): training diverged; lower "
        f"--learning-rate (now {config.learning_rate}) and --embedding-learning-rate (now "
        f"{config.embedding_learning_rate}), or add --lr-warmup-steps; {kept}")
