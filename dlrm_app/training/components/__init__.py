"""The parts of a training run that decide their own "when", as torchtitan's components do:
the trainer's loop calls each after every step and at each epoch's end, and each one acts on
its own schedule.

- ``MetricsLogger`` (``metrics_logger``): the metrics log, the progress bar, phase times; a
  train-loss line every ``--log-every`` steps, and the divergence check on that loss.
- ``Validator`` (``validator``): validation about 4 times an epoch (``--validate-every``) and at
  each epoch's end, the best AUC, early stopping (``--patience``, ``--target-auc``).
- ``Checkpointer`` (``checkpointer``): the best checkpoint (when the validator finds one),
  every ``--save-every`` steps, the last state; ``--resume`` restores from it.
- ``TrainState`` (``state``): where training is, in a few numbers, saved in every checkpoint.
- ``PreemptionGuard`` (``preemption``): SIGTERM or SIGINT ends training after the step in
  progress, the ranks agreeing on the step, with a checkpoint of it (``Preempted``, exit code
  143 or 130).
"""

from dlrm_app.training.components.checkpointer import Checkpointer, checkpoint_step
from dlrm_app.training.components.metrics_logger import PHASES, MetricsLogger
from dlrm_app.training.components.preemption import Preempted, PreemptionGuard
from dlrm_app.training.components.state import TrainingDiverged, TrainState, diverged
from dlrm_app.training.components.validator import Validator

__all__ = ["PHASES", "Checkpointer", "MetricsLogger", "Preempted", "PreemptionGuard",
           "checkpoint_step", "TrainState", "TrainingDiverged", "Validator", "diverged"]
