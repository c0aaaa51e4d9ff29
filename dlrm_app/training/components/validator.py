"""Validation during training: when, the best AUC so far, and early stopping."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from dlrm_app.data.loader import ParquetLoader
from dlrm_app.training.components.metrics_logger import MetricsLogger
from dlrm_app.training.components.state import TrainState
from dlrm_app.training.config import ValidationConfig
from dlrm_app.training.evaluate import evaluate_model
from dlrm_app.training.tables import OutOfVocabulary


@dataclasses.dataclass(frozen=True)
class Validation:
    """What a validation found: its metrics, and whether the model is the best so far (the
    trainer then saves it as the ``best`` checkpoint)."""

    metrics: dict[str, float]
    best: bool


class Validator:
    """Schedule: every ``config.interval(steps_per_epoch)`` steps (about 4 times an
    epoch by default; 0: never in an epoch) and at each epoch's end unless it just ran. Each
    validation returns a ``Validation``; ``--patience`` validations in a row without a better
    AUC, or reaching ``--target-auc``, set the state's stop reason. A non-finite model output
    stops the run with ``TrainingDiverged``. ``amp``: evaluated in the precision the run trains
    in (``--amp``)."""

    def __init__(self, model: torch.nn.Module, loader: ParquetLoader | OutOfVocabulary,
                 device: torch.device,
                 config: ValidationConfig, *, amp: bool | None, steps_per_epoch: int,
                 logger: MetricsLogger) -> None:
        self._model, self._loader, self._device, self._config = model, loader, device, config
        self._amp = amp
        self.every = config.interval(steps_per_epoch)
        self._logger = logger
        self._last_step = -1

    def after_step(self, state: TrainState) -> Validation | None:
        if self.every and state.step % self.every == 0:
            return self.validate(state)
        return None

    def at_epoch_end(self, state: TrainState) -> Validation | None:
        if self._last_step != state.step:
            return self.validate(state)
        return None

    def validate(self, state: TrainState) -> Validation:
        config = self._config
        try:
            metrics = evaluate_model(self._model, self._loader, self._device, config.val_batches,
                                     self._amp)
        except ValueError as e:
            if "non-finite" not in str(e):
                raise
            raise self._logger.diverged("the model's validation output is not finite",
                                        state) from None
        self._last_step = state.step
        self._logger.write({"event": "validation", "step": state.step, "epoch": state.epoch,
                            **metrics})
        best = metrics["auc"] > state.best_auc  # NaN (one class only) never improves
        if best:
            state.best_auc, state.best_step, state.stale_validations = metrics["auc"], state.step, 0
        else:
            state.stale_validations += 1
        if config.target_auc is not None and metrics["auc"] >= config.target_auc:
            state.stop_reason = f"validation AUC reached --target-auc {config.target_auc}"
        elif config.patience and state.stale_validations >= config.patience:
            state.stop_reason = (f"no better validation AUC in {config.patience} validations "
                                 f"(--patience); best {state.best_auc:.4f} at step "
                                 f"{state.best_step}")
        return Validation(metrics=metrics, best=best)

    def final(self, out: Path) -> dict[str, Any]:
        """The kept model's metrics on the whole validation split (its scores saved in ``out``
        for the report's curves)."""
        return evaluate_model(self._model, self._loader, self._device, self._config.val_batches,
                              self._amp, save_to=(out, "validation"))
