"""The parts of a training run that decide their own "when", as torchtitan's components do:
the trainer's loop calls each after every step and at each epoch's end, and each one acts on
its own schedule.

- ``MetricsLogger`` (``metrics_logger``): the metrics log, the progress bar, phase times; a
  train-loss line every ``--log-every`` steps, and the divergence check on that loss.
- ``Validator`` (``validator``): validation about 4 times an epoch (``--validate-every``) and at
  each epoch's end, the best AUC, early stopping (``--patience``, ``--target-auc``); each
  returns a ``Validation`` (the trainer saves a best one).
- ``Checkpointer`` (``checkpointer``): the best checkpoint (when the trainer gives it one),
  every ``--save-every`` steps, the last state; it saves and restores the parts it is given.
- ``TrainState``, ``DataPosition``, ``RngState`` (``state``): where training is, in a few
  numbers, each saving and restoring itself (``Stateful``).
- ``PreemptionGuard`` (``preemption``): SIGTERM or SIGINT ends training after the step in
  progress, the ranks agreeing on the step, with a checkpoint of it (``Preempted``, exit code
  143 or 130).
"""

from dlrm_app.training.components.checkpointer import Checkpointer, checkpoint_step
from dlrm_app.training.components.metrics_logger import PHASES, MetricsLogger
from dlrm_app.training.components.preemption import Preempted, PreemptionGuard
from dlrm_app.training.components.state import (
    DataPosition,
    RngState,
    Stateful,
    TrainingDiverged,
    TrainState,
    diverged,
)
from dlrm_app.training.components.validator import Validation, Validator

__all__ = ["PHASES", "Checkpointer", "DataPosition", "MetricsLogger", "Preempted",
           "PreemptionGuard", "RngState", "Stateful", "TrainState", "TrainingDiverged",
           "Validation", "Validator", "checkpoint_step", "diverged"]
