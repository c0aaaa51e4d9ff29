"""Where a training run is: a few numbers, saved in every checkpoint and restored by
``--resume``."""

from __future__ import annotations

import dataclasses

from dlrm_app.config import TrainConfig


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

    def next_epoch(self) -> None:
        self.epoch, self.epoch_batches = self.epoch + 1, 0


class TrainingDiverged(ValueError):
    """The loss or the model's output stopped being finite."""


def diverged(what: str, state: TrainState, config: TrainConfig) -> TrainingDiverged:
    """The error that stops a run whose loss or output is no longer finite: where, the flags
    that help, and what was kept."""
    kept = (f"the best checkpoint (step {state.best_step}, validation AUC {state.best_auc:.4f}) "
            f"is kept in {config.out}/checkpoints" if state.best_step >= 0 else
            "no checkpoint was kept")
    return TrainingDiverged(
        f"{what} at step {state.step} (epoch {state.epoch}): training diverged; lower "
        f"--learning-rate (now {config.learning_rate}) and --embedding-learning-rate (now "
        f"{config.embedding_learning_rate}), or add --lr-warmup-steps; {kept}")
