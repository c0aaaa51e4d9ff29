"""Checkpoints during training: when to save, what a checkpoint holds besides the model and
optimizer, and restoring it for ``--resume``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dlrm_app.config import TrainConfig, duration_seconds
from dlrm_app.data.loader import ParquetLoader
from dlrm_app.training.checkpoint import (
    BackgroundSaver,
    best_checkpoint,
    latest_checkpoint,
    load_checkpoint,
    newest_intact_checkpoint,
    save_checkpoint,
)
from dlrm_app.training.components.state import TrainState


class Checkpointer:
    """Schedule: the best checkpoint whenever the validator finds a better AUC (``save(...,
    best=True)``), one every ``--save-every`` steps, and the last state at the end (``at_end``)
    for ``--resume``; never twice at one step. ``--keep-checkpoints`` complete ones are kept
    besides the best."""

    def __init__(self, directory: Path, model: torch.nn.Module, optimizer: Any,
                 config: TrainConfig, world_size: int) -> None:
        self.directory, self._model, self._optimizer = directory, model, optimizer
        self._config, self._world_size = config, world_size
        self._saved_at = -1
        # --background-checkpoints: collective (a process group of its own), every rank here
        self._background = BackgroundSaver() if config.background_checkpoints else None

    def save(self, state: TrainState, best: bool = False) -> None:
        save = save_checkpoint if self._background is None else self._background.save
        save(self.directory, state.step, model=self._model, optimizer=self._optimizer,
             best=best, keep=self._config.keep_checkpoints, extra=self._extra(state))
        self._saved_at = state.step

    def wait(self) -> None:
        """Until every checkpoint asked for is complete on disk (background saves)."""
        if self._background is not None:
            self._background.wait()

    @property
    def saved_at(self) -> int:
        """The step of the last checkpoint this run saved (-1: none yet)."""
        return self._saved_at

    def after_step(self, state: TrainState, since_save_s: float | None = None) -> None:
        """``--save-every``: N steps, or a duration; ``since_save_s`` is the ranks' agreed
        time since the last save (None between agreements: no time-based save)."""
        every = self._config.save_every
        if isinstance(every, str):
            due = since_save_s is not None and since_save_s >= duration_seconds(every)
        else:
            due = bool(every) and state.step % every == 0
        if due and self._saved_at != state.step:
            self.save(state)

    def at_end(self, state: TrainState, start_step: int) -> None:
        if state.step > start_step and self._saved_at != state.step:
            self.save(state)
        self.wait()

    def keep_best(self, chosen_from: int = 0) -> Path | None:
        """Load the best checkpoint back into the model (the one training keeps; the newest
        where no validation could rank the model) and return it. A best chosen before step
        ``chosen_from`` does not count: a run continued on new data keeps a model of the new
        data, the newest, until a validation on it chooses one."""
        self.wait()
        best, latest = best_checkpoint(self.directory), latest_checkpoint(self.directory)
        if best is not None and checkpoint_step(best) < chosen_from:
            best = None
        if best is not None and best != latest:
            load_checkpoint(best, model=self._model, optimizer=None, extra={})
        return best or latest

    def _extra(self, state: TrainState) -> dict[str, Any]:
        return {"step": state.step, "epoch": state.epoch, "batches_yielded": state.epoch_batches,
                "world_size": self._world_size, "batch_size": self._config.batch_size,
                "best_auc": state.best_auc, "best_step": state.best_step,
                "stale_validations": state.stale_validations, "rng": torch.get_rng_state()}

    def restore(self, loader: ParquetLoader, steps_per_epoch: int
                ) -> tuple[TrainState, Path] | None:
        """``--resume``: the newest intact checkpoint's weights, optimizer, RNG, data position
        and best AUC (None where there is none). Under another world size or batch size the
        data position is the same number of global rows into the epoch."""
        path = newest_intact_checkpoint(self.directory)
        if path is None:
            return None
        config = self._config
        extra = load_checkpoint(path, model=self._model, optimizer=self._optimizer,
                                extra=self._extra(TrainState()), verified=True)
        torch.set_rng_state(extra["rng"])
        batches = int(extra["batches_yielded"])
        if (int(extra["world_size"]), int(extra["batch_size"])) != (self._world_size,
                                                                     config.batch_size):
            rows = batches * int(extra["batch_size"]) * int(extra["world_size"])
            batches = rows // (config.batch_size * self._world_size)
        batches = min(batches, steps_per_epoch)
        loader.load_state_dict({"epoch": int(extra["epoch"]), "batches_yielded": batches})
        return TrainState(step=int(extra["step"]), epoch=int(extra["epoch"]),
                          epoch_batches=batches, best_auc=float(extra["best_auc"]),
                          best_step=int(extra["best_step"]),
                          stale_validations=int(extra["stale_validations"])), path


def checkpoint_step(path: Path) -> int:
    """The step of a ``step_NNNNNNNN`` checkpoint directory."""
    return int(path.name.removeprefix("step_"))
