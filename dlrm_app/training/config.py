"""``dlrm-app train``'s configuration: ``TrainConfig``, a tree of sections (model, optimizer,
schedule, parallel, validation, checkpoint, log, days; data, out, seed, resume and overwrite at
its top), each a frozen dataclass checking its own fields, and ``TrainCommand``, the command that
holds it. The flags stay flat (``dlrm_app.flags`` generates one per field, grouped by section in
``--help``).

A run directory's ``config.json`` holds this tree (one object per section); ``TrainConfig.load``
also reads the flat form of earlier releases (``migrate``), and is strict: unknown keys are
errors. Like ``dlrm_app.config``, this module imports nothing heavy.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from pathlib import Path
from typing import Any

from dlrm_app.config import Interaction, ModelConfig, check_kind, required


class EmbeddingOptimizer(enum.Enum):
    """The fused optimizer of the embedding tables (applied inside backward)."""

    SGD = "sgd"
    ADAGRAD = "adagrad"
    ROWWISE_ADAGRAD = "rowwise_adagrad"

    @property
    def kernel(self) -> str:
        """The fused kernel's update rule: a member name of
        ``recsys_core.kernels.config.EmbOptimType`` (not imported here: the CLI parses without
        torch)."""
        return "EXACT_" + self.name


class CommPrecision(enum.Enum):
    """What the pooled embeddings and their gradients travel in between ranks."""

    AUTO = "auto"
    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"


class DenseOptimizer(enum.Enum):
    SGD = "sgd"
    ADAGRAD = "adagrad"
    ADAM = "adam"


STEPS_PER_EPOCH_TARGET = 64
EPOCHS_TIME_ORDERED, EPOCHS_DEFAULT = 1, 3
"""Automatic ``--epochs``: Criteo logs (rows in time order), everything else."""
MIN_AUTO_BATCH, MAX_AUTO_BATCH = 32, 1024
"""The automatic batch's bounds. 1024, not 2048, at the top: on the demo's data (400k train
rows, 3 seeds) test AUC 0.7415 against 0.7348 at 8% fewer samples/s (bench: docs/training.md)."""
VALIDATIONS_PER_EPOCH = 4
MAX_AUTO_VALIDATE_EVERY = 10_000

DURATION_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}


def parse_save_every(value: int | str, flag: str) -> int | str:
    """``--save-every``'s value: a step count (an int >= 0; digits alone are one) or a duration
    (a positive number and a unit, ``s``, ``m`` or ``h``: ``"10m"``); a clear error otherwise."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(f"{flag} must be >= 0 steps or a duration like 10m, got {value}")
        return value
    if isinstance(value, str) and duration_seconds(value) is not None:
        return value.strip()
    raise ValueError(f"{flag} must be a step count (500) or a duration (30s, 10m, 2h), got "
                     f"{value!r}")


def duration_seconds(text: str) -> float | None:
    """``"10m"`` -> 600.0; None where ``text`` is no positive duration."""
    text = text.strip()
    unit = DURATION_UNITS.get(text[-1:])
    try:
        number = float(text[:-1])
    except ValueError:
        return None
    return number * unit if unit is not None and number > 0 and math.isfinite(number) else None


def lr_scale(step: int, warmup: int, decay_start: int, decay_steps: int) -> float:
    """The reference DLRM's schedule: linear warm-up, constant, then polynomial (power 2) decay
    to ``MIN_LR_SCALE`` over ``decay_steps`` from ``decay_start``, and that floor afterwards."""
    if step < warmup:
        return (step + 1) / warmup
    if decay_steps and step >= decay_start:
        done = step - decay_start
        if done >= decay_steps:
            return MIN_LR_SCALE
        return max(MIN_LR_SCALE, ((decay_steps - done) / decay_steps) ** 2)
    return 1.0


MIN_LR_SCALE = 1e-7


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """The two optimizers: the tables' (fused into backward) and the MLPs'."""

    embedding_optimizer: EmbeddingOptimizer = EmbeddingOptimizer.ROWWISE_ADAGRAD
    """Optimizer of the tables, fused into backward."""
    embedding_learning_rate: float = 0.05
    """Learning rate of the tables."""
    dense_optimizer: DenseOptimizer = DenseOptimizer.ADAGRAD
    """Optimizer of the MLPs."""
    learning_rate: float = 0.01
    """Learning rate of the MLPs."""
    embedding_eps: float = 1e-2
    """Epsilon of the tables' Adagrad."""
    eps: float = 1e-8
    """Epsilon of the MLPs' optimizer."""

    def __post_init__(self) -> None:
        for name in ("learning_rate", "embedding_learning_rate", "eps", "embedding_eps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got "
                                 f"{getattr(self, name)}")
        check_kind("embedding_optimizer", self.embedding_optimizer, EmbeddingOptimizer)
        check_kind("dense_optimizer", self.dense_optimizer, DenseOptimizer)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScheduleConfig:
    """How long and in what order: epochs, steps, the batch, the rows' order and the learning
    rate's warm-up and decay."""

    epochs: int | None = None
    """Passes; None: 1 on Criteo, else 3."""
    max_steps: int | None = None
    """Cap on steps in all (None: no cap)."""
    batch_size: int | None = None
    """Rows per rank per step; None: about 64 steps an epoch."""
    lr_warmup_steps: int = 0
    """Linear warm-up steps."""
    lr_decay_start: int = 0
    """Step where the decay (power 2) starts."""
    lr_decay_steps: int = 0
    """Steps of the decay to 1e-7x (0: none)."""
    shuffle: bool = True
    """Shuffle the train rows per (seed, epoch)."""

    def __post_init__(self) -> None:
        if self.batch_size is not None and (isinstance(self.batch_size, bool) or not isinstance(
                self.batch_size, int) or self.batch_size < 1):
            raise ValueError(f"--batch-size must be a positive int, got {self.batch_size!r}")
        if self.epochs is not None and (isinstance(self.epochs, bool) or not isinstance(
                self.epochs, int) or self.epochs < 1):
            raise ValueError(f"--epochs must be a positive int, got {self.epochs!r}")
        for name in ("lr_warmup_steps", "lr_decay_start", "lr_decay_steps"):
            _check_count(name, getattr(self, name))
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"--max-steps must be >= 1, got {self.max_steps}")

    def lr_scale(self, step: int) -> float:
        """The learning rates' factor at ``step`` (``lr_scale`` with this schedule's steps)."""
        return lr_scale(step, self.lr_warmup_steps, self.lr_decay_start, self.lr_decay_steps)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """How the model runs on the ranks: overlap, precision, the sharding plan and its memory,
    the collectives' timeout, threads."""

    pipelined: bool = True
    """Overlap the next batch's copy and all-to-all with this step."""
    amp: bool | None = None
    """bf16 autocast (auto: where native)."""
    comm_precision: CommPrecision = CommPrecision.AUTO
    """Precision of pooled embeddings between ranks (auto: bf16 across hosts where lossless)."""
    plan: str | None = None
    """Use this plan.json, no planning."""
    memory_per_rank: float | None = None
    """GiB per rank for the planner (None: detected)."""
    offload: bool = True
    """Tables larger than memory live on local disk."""
    offload_dir: str | None = dataclasses.field(default=None, metadata={"metavar": "DIR"})
    """Directory of offloaded tables (None: OUT/offload)."""
    timeout: float = 600.0
    """Seconds a rank waits in a collective."""
    threads: int | None = None
    """torch threads per rank (None: auto)."""

    def __post_init__(self) -> None:
        if isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float)) or not (
                self.timeout > 0):
            raise ValueError(f"--timeout must be > 0 seconds, got {self.timeout!r}")
        if self.memory_per_rank is not None and not (
                isinstance(self.memory_per_rank, (int, float)) and math.isfinite(
                    self.memory_per_rank) and self.memory_per_rank > 0):
            raise ValueError(f"--memory-per-rank {self.memory_per_rank}: give a positive number "
                             "of GiB per rank, e.g. --memory-per-rank 16")
        check_kind("comm_precision", self.comm_precision, CommPrecision)
        if self.threads is not None and (isinstance(self.threads, bool)
                                         or not isinstance(self.threads, int) or self.threads < 1):
            raise ValueError(f"--threads must be a positive int, got {self.threads!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ValidationConfig:
    """When the Validator runs, on how much, and when its results stop the run."""

    validate_every: int | None = None
    """Steps between validations; None: 4 an epoch; 0: epoch ends."""
    val_batches: int = 0
    """Validation batches per rank (0: all)."""
    patience: int = 3
    """Stop after N stale validations (0: never)."""
    target_auc: float | None = None
    """Stop once validation AUC reaches this."""

    def __post_init__(self) -> None:
        for name in ("val_batches", "patience"):
            _check_count(name, getattr(self, name))
        if self.validate_every is not None:
            _check_count("validate_every", self.validate_every)
        if self.target_auc is not None and not 0.5 < self.target_auc <= 1.0:
            raise ValueError(f"--target-auc must be in (0.5, 1], got {self.target_auc}")

    def interval(self, steps_per_epoch: int) -> int:
        """Steps between validations (0: only at epoch ends); see ``validate_every``."""
        if self.validate_every is not None:
            return self.validate_every
        return min(max(1, math.ceil(steps_per_epoch / VALIDATIONS_PER_EPOCH)),
                   MAX_AUTO_VALIDATE_EVERY)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """When the Checkpointer saves, how many it keeps, and the time a SIGTERM leaves to save."""

    save_every: int | str = dataclasses.field(
        default=0, metadata={"type": lambda text: parse_save_every(text, "--save-every"),
                             "metavar": "N|DURATION"})
    """Also checkpoint every N steps or DURATION (30s, 10m, 2h)."""
    keep_checkpoints: int = 2
    """Checkpoints kept besides the best."""
    background_checkpoints: bool = False
    """Write checkpoints on a thread while training goes on."""
    grace_period: float = 30.0
    """Seconds from SIGTERM to SIGKILL."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "save_every", parse_save_every(self.save_every, "--save-every"))
        if isinstance(self.keep_checkpoints, bool) or not isinstance(
                self.keep_checkpoints, int) or self.keep_checkpoints < 1:
            raise ValueError(f"--keep-checkpoints must be a positive int, got "
                             f"{self.keep_checkpoints!r}")
        if isinstance(self.grace_period, bool) or not isinstance(
                self.grace_period, (int, float)) or not self.grace_period > 0:
            raise ValueError(f"--grace-period must be > 0 seconds, got {self.grace_period!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LogConfig:
    """The metrics log (metrics.jsonl)."""

    log_every: int = 50
    """Steps between metrics-log lines."""

    def __post_init__(self) -> None:
        if isinstance(self.log_every, bool) or not isinstance(
                self.log_every, int) or self.log_every < 1:
            raise ValueError(f"--log-every must be a positive int, got {self.log_every!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DaysConfig:
    """Day-by-day training (docs/training.md, "Day by day"): ``--follow`` and the flags that
    exist only with it."""

    follow: bool = False
    """Evaluate, then train on each new day."""
    wait: float | None = dataclasses.field(default=None, metadata={"metavar": "SECONDS"})
    """Poll for new days every SECONDS."""
    publish: str | None = dataclasses.field(default=None, metadata={"metavar": "PATH"})
    """Export each day's model to PATH."""

    def __post_init__(self) -> None:
        if not self.follow:
            for name in ("wait", "publish"):
                if getattr(self, name) is not None:
                    raise ValueError(f"--{name} goes with --follow (day-by-day training); add "
                                     f"--follow or drop --{name}")
            return
        if self.wait is not None and (isinstance(self.wait, bool) or not isinstance(
                self.wait, (int, float)) or not math.isfinite(self.wait) or self.wait <= 0):
            raise ValueError(f"--wait must be a number of seconds > 0, got {self.wait!r}")
        if self.publish is not None and not str(self.publish).endswith(".pt2"):
            raise ValueError(f"--publish {self.publish}: the published model is a .pt2 "
                             "artifact, its name must end in .pt2")


def _check_count(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"--{name.replace('_', '-')} must be an int >= 0, got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything ``dlrm-app train`` needs: the run's data, directory and seed, and one section
    per part of the run (``SECTIONS``). Each leaf field is one flag, its docstring the flag's
    help (what each does in full, and the measurements behind the defaults: docs/training.md,
    "dlrm-app train flags in detail"); the flags stay flat (``--batch-size``, not
    ``--schedule.batch-size``)."""

    data: str
    """Dataset directory; required unless --resume."""
    out: str = required()
    """Run directory (config, logs, checkpoints, report)."""
    model: ModelConfig = ModelConfig()
    """Layer sizes and interaction."""
    schedule: ScheduleConfig = ScheduleConfig()
    """Epochs, steps, batch, row order, learning-rate schedule."""
    optimizer: OptimizerConfig = OptimizerConfig()
    """The tables' and the MLPs' optimizers."""
    parallel: ParallelConfig = ParallelConfig()
    """Overlap, precision, plan, memory, timeout, threads."""
    seed: int = 0
    """Seed of the initialization and data order."""
    validation: ValidationConfig = ValidationConfig()
    """When to validate and stop."""
    checkpoint: CheckpointConfig = CheckpointConfig()
    """When to save, how many to keep."""
    resume: bool = False
    """Continue the run in --out."""
    overwrite: bool = False
    """Delete the run in --out, start over."""
    log: LogConfig = LogConfig()
    """The metrics log."""
    days: DaysConfig = DaysConfig()
    """Day-by-day training."""

    def __post_init__(self) -> None:
        for name, kind in SECTIONS.items():
            check_kind(f"TrainConfig.{name}", getattr(self, name), kind)
        if self.resume and self.overwrite:
            raise ValueError("--resume and --overwrite contradict each other: --resume continues "
                             "the run in --out, --overwrite deletes it; pass one")
        if self.days.follow and self.schedule.max_steps is not None:
            raise ValueError("--max-steps would stop --follow inside a day; drop it (--follow "
                             "trains one pass over each day)")

    @classmethod
    def from_flags(cls, **values: Any) -> TrainConfig:
        """A config from values named as the flags are (``batch_size=256``, ``model=...``), each
        put in its section; the rest at their defaults."""
        return cls.from_json_dict(nest(values), where="TrainConfig.from_flags")

    def replace(self, **values: Any) -> TrainConfig:
        """This config with the values named as the flags are changed (``epochs=1``)."""
        return self.from_flags(**{**flatten(self.to_json_dict()), **values})

    def to_json_dict(self) -> dict[str, Any]:
        """The nested form of config.json: the top-level fields, and a dict per section."""
        def plain(value: Any) -> Any:
            if isinstance(value, enum.Enum):
                return value.value
            if isinstance(value, tuple):
                return list(value)
            if dataclasses.is_dataclass(value) and not isinstance(value, type):
                return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
            return value

        return {f.name: plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def with_batch_size(self, train_rows: int, world_size: int) -> TrainConfig:
        """This config with ``batch_size`` decided (see the field) for ``train_rows`` rows."""
        if self.schedule.batch_size is not None:
            return self
        target = max(1, train_rows // (STEPS_PER_EPOCH_TARGET * world_size))
        size = min(MAX_AUTO_BATCH, max(MIN_AUTO_BATCH, 1 << (target.bit_length() - 1)))
        return dataclasses.replace(self, schedule=dataclasses.replace(self.schedule,
                                                                      batch_size=size))

    def with_epochs(self, time_ordered: bool) -> TrainConfig:
        """This config with ``epochs`` decided (see the field): one pass over a click log in
        time order, whose later rows are the future the model is scored on (further passes
        memorize the train rows: forward AUC 0.7276 with 3, 0.7330 with 1 on the Kaggle sample,
        docs/training.md "Quality forward in time"), three elsewhere."""
        if self.schedule.epochs is not None:
            return self
        epochs = EPOCHS_TIME_ORDERED if time_ordered else EPOCHS_DEFAULT
        return dataclasses.replace(self, schedule=dataclasses.replace(self.schedule,
                                                                      epochs=epochs))

    @classmethod
    def from_json_dict(cls, data: dict[str, Any], where: str = "config") -> TrainConfig:
        """A config from config.json's dict: the nested form, or the flat form of earlier
        releases (``migrate``); strict: unknown keys are errors."""
        if is_flat(data):
            data = migrate(data)
        top = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - top)
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {unknown}; known: {sorted(top)}")
        values = dict(data)
        for name, kind in SECTIONS.items():
            if name in values and not isinstance(values[name], kind):
                values[name] = _section(kind, name, values[name], where)
        return cls(**values)

    def save(self, path: Path) -> None:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_json_dict(), indent=2) + "\n")
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> TrainConfig:
        """A run's saved ``config.json``, in either form; one saved by an earlier release means
        what it meant then (``migrate``)."""
        return cls.from_json_dict(json.loads(path.read_text()), where=str(path))


SECTIONS: dict[str, type] = {
    "model": ModelConfig, "optimizer": OptimizerConfig, "schedule": ScheduleConfig,
    "parallel": ParallelConfig, "validation": ValidationConfig, "checkpoint": CheckpointConfig,
    "log": LogConfig, "days": DaysConfig}
"""``TrainConfig``'s sections, by field name."""
FLAT_KEYS: dict[str, str] = {f.name: name for name, kind in SECTIONS.items() if name != "model"
                             for f in dataclasses.fields(kind)}
"""Each section field's section (but the model's, a dict of its own in both forms): where a key
of the flat form goes."""


def _section(kind: type, name: str, values: Any, where: str) -> Any:
    """Section ``kind`` from its JSON dict (enums from their values, lists as tuples)."""
    if not isinstance(values, dict):
        raise ValueError(f"{where}: {name} must be an object of {kind.__name__}'s fields, got "
                         f"{values!r}")
    known = {f.name for f in dataclasses.fields(kind)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"{where}: unknown {name} key(s) {unknown}; known: {sorted(known)}")
    enums = {"interaction": Interaction, "embedding_optimizer": EmbeddingOptimizer,
             "dense_optimizer": DenseOptimizer, "comm_precision": CommPrecision}
    typed = {}
    for key, value in values.items():
        if key in enums:
            value = enums[key](value)
        elif isinstance(value, list):
            value = tuple(value)
        typed[key] = value
    return kind(**typed)


def is_flat(data: dict[str, Any]) -> bool:
    """``data`` is config.json's flat form (earlier releases: every section's field at the top
    but the model's), not the nested one."""
    return any(key in FLAT_KEYS for key in data)


def nest(flat: dict[str, Any]) -> dict[str, Any]:
    """The flat form's keys put in their sections (a nested form's sections kept, and their
    keys given flat merged in); nothing renamed or added."""
    nested: dict[str, Any] = {}
    for key, value in flat.items():
        if key in FLAT_KEYS:
            nested.setdefault(FLAT_KEYS[key], {})[key] = value
        elif key in SECTIONS and key != "model" and isinstance(value, dict):
            nested.setdefault(key, {}).update(value)
        else:
            nested[key] = value
    return nested


def flatten(nested: dict[str, Any]) -> dict[str, Any]:
    """``nest`` undone: config.json's flat form, keyed as the flags are (the model's dict
    kept); a flat form comes back as it is."""
    flat: dict[str, Any] = {}
    for key, value in nested.items():
        if key in SECTIONS and key != "model" and isinstance(value, dict):
            flat.update(value)
        else:
            flat[key] = value
    return flat


def migrate(flat: dict[str, Any]) -> dict[str, Any]:
    """A flat config.json of an earlier release in today's nested form, meaning what it meant
    then: keys added since take the value that release used, not today's default."""
    flat = dict(flat)
    if "eps" in flat and "embedding_eps" not in flat:
        # saved before the tables had an epsilon of their own: --eps was both
        flat["embedding_eps"] = flat["eps"]
    if isinstance(flat.get("model"), dict) and "wide" not in flat["model"]:
        flat["model"] = {**flat["model"], "wide": False}  # saved before the wide part: plain DLRM
    return nest(flat)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainCommand:
    """``dlrm-app train``: the run's ``TrainConfig`` (saved in its config.json) and how the
    console shows it."""

    quiet: bool = False
    """No progress bar or summary on stderr."""
    config: TrainConfig
    """The run."""

