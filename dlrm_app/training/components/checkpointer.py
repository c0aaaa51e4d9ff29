"""Checkpoints during training: when to save, and saving and restoring the parts it is given
(the model, the optimizer, and ``Stateful`` parts: the train state, the data position, the
RNG), as torchtitan's checkpointer does."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from dlrm_app.training.checkpoint import (
    BackgroundSaver,
    best_checkpoint,
    latest_checkpoint,
    load_checkpoint,
    newest_intact_checkpoint,
    save_checkpoint,
)
from dlrm_app.training.components.state import Stateful, TrainState
from dlrm_app.training.config import CheckpointConfig, duration_seconds


class Checkpointer:
    """Schedule: the best checkpoint whenever the trainer is told of a better validation AUC
    (``save(..., best=True)``), one every ``--save-every`` steps, and the last state at the end
    (``at_end``) for ``--resume``; never twice at one step. ``--keep-checkpoints`` complete ones
    are kept besides the best; ``--background-checkpoints`` writes them on a thread.

    A checkpoint holds ``model``, ``optimizer`` and the ``parts``' ``state_dict()`` values
    (their keys are disjoint: one flat record, as checkpoints have always had); ``restore``
    loads them back in the parts' order."""

    def __init__(self, directory: Path, model: torch.nn.Module, optimizer: Any,
                 parts: Mapping[str, Stateful], config: CheckpointConfig) -> None:
        self.directory, self._model, self._optimizer = directory, model, optimizer
        self._parts, self._keep = dict(parts), config.keep_checkpoints
        self._every = config.save_every
        self._saved_at = -1
        # --background-checkpoints: collective (a process group of its own), every rank here
        self._background = BackgroundSaver() if config.background_checkpoints else None

    def save(self, state: TrainState, best: bool = False) -> None:
        save = save_checkpoint if self._background is None else self._background.save
        save(self.directory, state.step, model=self._model, optimizer=self._optimizer,
             best=best, keep=self._keep, extra=self._record())
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
        every = self._every
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

    def _record(self) -> dict[str, Any]:
        record: dict[str, Any] = {}
        for name, part in self._parts.items():
            values = part.state_dict()
            if clash := set(values) & set(record):
                raise ValueError(f"checkpoint part {name!r} repeats the keys {sorted(clash)}")
            record.update(values)
        return record

    def restore(self) -> Path | None:
        """The newest intact checkpoint loaded into the model, the optimizer and the parts
        (in their order); None where there is none."""
        path = newest_intact_checkpoint(self.directory)
        if path is None:
            return None
        saved = load_checkpoint(path, model=self._model, optimizer=self._optimizer,
                                extra=self._record(), verified=True)
        for part in self._parts.values():
            part.load_state_dict({key: saved[key] for key in part.state_dict()})
        return path


def checkpoint_step(path: Path) -> int:
    """The step of a ``step_NNNNNNNN`` checkpoint directory."""
    return int(path.name.removeprefix("step_"))
