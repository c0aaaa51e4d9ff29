"""``dlrm-app train``: DLRM training as one process or under ``torchrun``.

    torchrun --nproc-per-node 2 -m dlrm_app train --data data/synthetic --out runs/a

``Trainer`` sets a run up (process group from ``dlrm_app.training.runtime``, the sharded model and
optimizers from ``dlrm_app.training.build``, the run directory from ``dlrm_app.training.run_dir``), runs the step
loop (``fit``; batches staged by ``dlrm_app.training.pipeline``) and ends it (``finish``). The loop only
steps: the components in ``dlrm_app.training.components`` each decide when they act after a step (metrics
log, validation and early stopping, checkpoints).

Keeping the best model: validation runs on a schedule that suits the data (about 4 times an
epoch by default); every better validation AUC saves a checkpoint recorded as ``best``, which
``evaluate`` and ``export`` use by default; ``patience`` validations in a row without a better
AUC stop training. A non-finite train loss or validation output stops it with an error (the
best checkpoint stays). At the end the best checkpoint is loaded back, so the returned summary,
the final validation curves and the report describe the model that is kept.

Gradients: each rank's loss is its rows' summed log loss divided by the *global* batch
(``batch_size * world_size``), and both the embedding gradients (through the sharded
collections' output dist) and the dense gradients (DDP, with a summing comm hook) are summed over
ranks. Every step therefore applies exactly the gradient of the global batch's mean loss, so N
ranks with ``batch_size`` rows each follow the same trajectory as one rank with
``N * batch_size`` rows (up to float summation order); the rows of a global batch differ,
since each rank reads its own contiguous share of the data (tested by giving one rank a copy
interleaved like the shares, in tests/integration/test_torchrun.py).
"""

from __future__ import annotations

import contextlib
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from dlrm_app.data.loader import ParquetLoader
from dlrm_app.data.schema import DatasetKind, DatasetSpec
from dlrm_app.reporting.report import write_report
from dlrm_app.threads import configure_threads
from dlrm_app.training import resume
from dlrm_app.training.build import (
    build_model,
    build_optimizer,
    comm_precision,
    plan_summary,
    set_learning_rates,
    world_hosts,
)
from dlrm_app.training.checkpoint import latest_checkpoint
from dlrm_app.training.components import (
    Checkpointer,
    DataPosition,
    MetricsLogger,
    Preempted,
    PreemptionGuard,
    RngState,
    TrainingDiverged,
    TrainState,
    Validation,
    Validator,
    checkpoint_step,
)
from dlrm_app.training.config import TrainConfig
from dlrm_app.training.pipeline import device_batches
from dlrm_app.training.run_dir import prepare_run_dir
from dlrm_app.training.runtime import (
    amp_enabled,
    amp_warning,
    autocast,
    gather,
    init_distributed,
    peak_memory_mb,
    world,
)
from dlrm_app.training.tables import OutOfVocabulary, model_tables, smaller_tables

__all__ = ["Preempted", "Trainer", "TrainingDiverged", "train"]


def train(config: TrainConfig, progress: bool = True) -> dict[str, Any]:
    """Train (and validate, checkpoint) as configured; returns the summary rank 0 prints.

    A Ctrl-C that ends it (a second one, or one outside the steps: while saving the stop's
    checkpoint, while finishing) carries in ``where`` the step and how to go on; one while the
    trainer is made carries none (nothing was trained)."""
    trainer = Trainer(config, progress)
    try:
        if trainer.config.days.follow:
            from dlrm_app.training.follow import DayFollower

            follower = DayFollower(trainer)
            follower.run()
            if trainer.preempted:
                raise trainer.stop_preempted()
            return follower.finish()
        trainer.fit()
        if trainer.preempted:
            raise trainer.stop_preempted()
        return trainer.finish()
    except KeyboardInterrupt as stop:
        trainer.checkpointer.wait()  # a background save in progress completes first
        stop.where = trainer.interrupted_at()  # type: ignore[attr-defined]
        raise
    except BaseException:
        with contextlib.suppress(Exception):  # the run's own error is the one to report
            trainer.checkpointer.wait()
        raise


class Trainer:
    """One training run: set up by the constructor (resuming where ``--resume`` says), trained
    by ``fit``, ended by ``finish`` (the best model loaded back, validated, summarized)."""

    def __init__(self, config: TrainConfig, progress: bool = True) -> None:
        threads = configure_threads(config.parallel.threads)
        self.device = device = init_distributed(config.parallel.timeout)
        self.rank, self.world_size = world()
        world_size = self.world_size
        config = resume.restarted(config, self.rank)
        if self.rank == 0 and progress:
            print(threads.describe(), file=sys.stderr)
        if self.rank == 0 and threads.warning:
            print(threads.warning, file=sys.stderr)
        self.spec = spec = DatasetSpec.load(config.data)
        if not config.days.follow:  # refused before the run directory is made: a retry needs no
            check_validation_labels(spec, config.data)  # --overwrite
        previous_data = resume.previous_data(config, spec)
        self.config = config = prepare_run_dir(
            config.with_batch_size(spec.split("train").rows, world_size)
            .with_epochs(spec.kind is DatasetKind.CRITEO), self.rank)
        self.out = out = Path(config.out)
        follow = config.days.follow
        if follow:  # no validation split: each day's progressive evaluation is the yardstick
            from dlrm_app.training.follow import refuse_other_data

            refuse_other_data(config, previous_data)
        self.model_spec = model_tables(spec, out, self.rank)
        """The dataset as the model reads it: its table sizes when the run started."""
        self.rows_if_grown = smaller_tables(self.model_spec, spec)
        """The model's rows per table where the dataset's vocabulary grew since the run
        started (its ids past them read row 0), else None."""
        torch.manual_seed(config.seed)

        self.model = build_model(config, self.model_spec, device)
        self.optimizer = build_optimizer(config.optimizer, self.model)
        self.base_lrs = [float(g["lr"]) for g in self.optimizer.param_groups]
        if self.rank == 0:
            (out / "plan.json").write_text(self.model.plan.to_json() + "\n")
            if progress:  # the per-table tables: plan.json and the report's "Sharding plan"
                print(f"{plan_summary(self.model.plan, world_size)}; per table: "
                      f"{out / 'plan.json'}", file=sys.stderr)
        self.train_loader = ParquetLoader(
            config.data, "train", batch_size=config.schedule.batch_size, rank=self.rank,
            world_size=world_size, shuffle=config.schedule.shuffle, seed=config.seed,
            drop_last=True)
        self.steps_per_epoch = len(self.train_loader)
        if self.steps_per_epoch == 0 and not follow:
            raise ValueError(f"the train split of {config.data} has fewer than --batch-size "
                             f"({config.schedule.batch_size}) rows per rank; use a smaller "
                             "batch size")
        self.total_steps = self.steps_per_epoch * config.schedule.epochs
        if config.schedule.max_steps is not None:
            self.total_steps = min(self.total_steps, config.schedule.max_steps)

        self.state = TrainState(days_done=0 if follow else None)
        data = DataPosition(self.train_loader, self.state, world_size, config.schedule.batch_size,
                            self.steps_per_epoch)
        self.checkpointer = Checkpointer(
            out / "checkpoints", self.model, self.optimizer,
            {"train_state": self.state, "data": data, "rng": RngState()}, config.checkpoint)
        resumed = resume.restore(self.checkpointer, self.state, data, config.resume,
                                 previous_data)
        new_data = resumed.previous_data is not None
        if new_data:
            self.total_steps += self.state.step
        self.start_step = self.state.step
        if self.rank == 0 and resumed.checkpoint is not None:
            print(f"resumed from {resumed.checkpoint} at step {self.start_step}"
                  + (f", continuing on {config.data}" if new_data else ""), file=sys.stderr)
        self.new_data_from = self.start_step + 1 if new_data else 0
        """The first step on new data (0: not continued on new data)."""
        self.global_batch = config.schedule.batch_size * world_size
        self.metrics = MetricsLogger(
            out / "metrics.jsonl", writer=self.rank == 0, progress=progress, config=config.log,
            rates=config.optimizer, total_steps=self.total_steps, start_step=self.start_step,
            global_batch=self.global_batch, optimizer=self.optimizer, device=device)
        if not follow:
            val_loader = ParquetLoader(config.data, "validation", rank=self.rank,
                                       batch_size=config.schedule.batch_size, world_size=world_size,
                                       drop_last=False, pad_last=True)
            self.validator = Validator(self.model, self._read(val_loader), device,
                                       config.validation,
                                       amp=config.parallel.amp,
                                       steps_per_epoch=self.steps_per_epoch, logger=self.metrics)
        self.comm_precision = comm_precision(config.parallel, config.model, device, world_hosts())
        """What the pooled embeddings travel in between ranks (``--comm-precision`` resolved)."""
        self.metrics.write({
            "event": "start", "world_size": world_size, "device": str(device),
            "amp": amp_enabled(device, config.parallel.amp),
            "comm_precision": self.comm_precision.value,
            "steps_per_epoch": self.steps_per_epoch, "total_steps": self.total_steps,
            "validate_every": None if follow else self.validator.every,
            "resumed_from": None if resumed.checkpoint is None else str(resumed.checkpoint),
            "continued_on_new_data": config.data if new_data else None,
            "previous_data": resumed.previous_data,
            "start_step": self.start_step, "threads": threads.intra_op,
            "interop_threads": threads.inter_op, "threads_reason": threads.reason})
        if self.rank == 0 and (message := amp_warning(device, config.parallel.amp)) is not None:
            print(message, file=sys.stderr)
        self._autocast = autocast(device, config.parallel.amp)
        self._started = time.perf_counter()
        self.phase = "training"
        """What the run is doing: "training" (``fit``), "stopping" (saving the step a signal
        stopped at), "finishing" (the last checkpoint, the best model validated, the report)."""
        self.preempted = 0
        """The signal (SIGTERM, SIGINT) that stopped ``fit`` after a step (every rank the
        same one); 0: none did."""

    def interrupted_at(self) -> str:
        """Where a Ctrl-C stopped the run and how to go on, for the one-line message."""
        newest = latest_checkpoint(self.out / "checkpoints")
        kept = (f"the newest checkpoint is {newest.name}: `dlrm-app train --out {self.out} "
                "--resume` continues from it" if newest is not None else
                "no checkpoint was saved yet: start again")
        step = self.state.step
        where = {"training": f"at step {step}",
                 "stopping": f"after step {step}, while saving its checkpoint (not saved)",
                 "finishing": f"after the last step ({step}), while finishing the run (its "
                              "last checkpoint, the kept model's validation, the report)"}
        return f" {where[self.phase]}; {kept}"

    def stop_preempted(self) -> Preempted:
        """After SIGTERM: the step's checkpoint (saved together by every rank), an event in the
        metrics log, and the one-line message of the stop."""
        state = self.state
        self.phase = "stopping"
        self.metrics.bar.close()
        self.checkpointer.at_end(state, self.start_step)
        newest = latest_checkpoint(self.out / "checkpoints")
        self.metrics.write({"event": "preempted", "step": state.step,
                            "checkpoint": None if newest is None else newest.name})
        kept = (f"checkpoint {newest.name} saved: `dlrm-app train --out {self.out} --resume` "
                "continues from it" if newest is not None else "no step trained, nothing saved")
        return Preempted(f"stopped by {signal.Signals(self.preempted).name} after step "
                         f"{state.step}; {kept}", self.preempted)

    def fit(self) -> None:
        """Step until the epochs or ``--max-steps`` are done, a component stops the run, or
        SIGTERM does (``preempted``: after the step in progress, on every rank alike)."""
        with PreemptionGuard(self.world_size, self.device,
                             grace_period_s=self.config.checkpoint.grace_period) as guard:
            self._fit(guard)

    def _read(self, loader: ParquetLoader) -> ParquetLoader | OutOfVocabulary:
        """``loader``, its ids past the model's rows read as row 0 where the dataset grew."""
        return loader if self.rows_if_grown is None else OutOfVocabulary(loader,
                                                                         self.rows_if_grown)

    def _fit(self, guard: PreemptionGuard) -> None:
        state, config, metrics = self.state, self.config, self.metrics
        self.model.train()
        while state.step < self.total_steps and state.epoch < config.schedule.epochs \
                and not state.stop_reason:
            if state.epoch_batches >= self.steps_per_epoch:  # resumed exactly at an epoch's end
                self._next_epoch()
                continue
            batches = device_batches(self._read(self.train_loader), self.device, self.model,
                                     config.parallel.pipelined)
            ready = time.perf_counter()
            for batch in batches:
                metrics.add_time(data=time.perf_counter() - ready)
                loss_sum = self.step(batch)
                state.step += 1
                state.epoch_batches += 1
                metrics.after_step(state, loss_sum, len(batch.labels))
                self._keep_if_best(self.validator.after_step(state))
                stop = guard.agreed()
                self.checkpointer.after_step(state, guard.since_save_s)
                if self.checkpointer.saved_at == state.step:  # the best one too
                    guard.saved()
                if stop:
                    self.preempted = int(guard.signal or signal.SIGTERM)
                    state.stop_reason = f"preempted ({signal.Signals(self.preempted).name})"
                if state.stop_reason or state.step >= self.total_steps:
                    break
                ready = time.perf_counter()
            batches.close()  # type: ignore[attr-defined]
            if self.preempted:
                return
            if state.epoch_batches >= self.steps_per_epoch or state.step >= self.total_steps:
                self._keep_if_best(self.validator.at_epoch_end(state))
                if state.step < self.total_steps and not state.stop_reason:
                    self._next_epoch()

    def _keep_if_best(self, validation: Validation | None) -> None:
        """A validation that found the best model so far: its checkpoint, recorded as best."""
        if validation is not None and validation.best:
            self.checkpointer.save(self.state, best=True)
            self.metrics.write({"event": "best", "step": self.state.step,
                                "auc": self.state.best_auc})

    def step(self, batch: Any) -> torch.Tensor:
        """One optimizer step on ``batch``; returns the summed log loss of its rows.

        The loss backpropagated is that sum over the *global* batch: see the module's docs."""
        t0 = time.perf_counter()
        set_learning_rates(self.model, self.optimizer, self.base_lrs,
                           self.config.schedule.lr_scale(self.state.step))
        with self._autocast:
            logits = self.model(batch.dense, batch.sparse).squeeze(1)
        loss_sum = F.binary_cross_entropy_with_logits(logits.float(), batch.labels,
                                                      reduction="sum")
        t1 = time.perf_counter()
        self.optimizer.zero_grad()
        (loss_sum / self.global_batch).backward()
        t2 = time.perf_counter()
        self.optimizer.step()
        self.metrics.add_time(forward=t1 - t0, backward=t2 - t1,
                              optimizer=time.perf_counter() - t2)
        return loss_sum

    def _next_epoch(self) -> None:
        self.state.next_epoch()
        self.train_loader.set_epoch(self.state.epoch)

    def finish(self) -> dict[str, Any]:
        """The last checkpoint, the best model loaded back and validated, the summary (written
        to the metrics log; rank 0 also writes the report)."""
        state, config, device = self.state, self.config, self.device
        self.phase = "finishing"
        self.metrics.bar.close()
        elapsed = time.perf_counter() - self._started
        if state.stop_reason is None:
            state.stop_reason = ("max steps reached" if config.schedule.max_steps is not None
                                 and state.step >= config.schedule.max_steps else "epochs done")
        self.checkpointer.at_end(state, self.start_step)
        # continued on new data: a best chosen on the old data's validation is not kept
        kept = self.checkpointer.keep_best(chosen_from=self.new_data_from)
        if self.rank == 0 and kept is not None and self.new_data_from and \
                state.best_step < self.new_data_from:
            why = ("the newest" if checkpoint_step(kept) >= self.new_data_from
                   else f"from before this run, which trained no step on {config.data}")
            print(f"kept {kept.name}, {why}: no validation on {config.data} chose a "
                  "checkpoint (a best of the earlier data is not kept for new data)",
                  file=sys.stderr)
        final = self.validator.final(self.out)
        trained = state.step - self.start_step
        summary = {
            "event": "summary",
            "steps": state.step,
            "trained_steps": trained,
            "epochs": state.epoch + state.epoch_batches / self.steps_per_epoch,
            "world_size": self.world_size,
            "amp": amp_enabled(device, config.parallel.amp),
            "comm_precision": self.comm_precision.value,
            "global_batch": self.global_batch,
            "samples_per_s": trained * self.global_batch / elapsed if elapsed > 0 else 0.0,
            "seconds": elapsed,
            "phase_fraction": self.metrics.phase_fraction(),
            "peak_memory_mb_per_rank": gather(round(peak_memory_mb(device), 1)),
            "stopped": state.stop_reason,
            "stopped_early": state.stop_reason not in ("epochs done", "max steps reached"),
            "best_step": state.best_step,
            "validation": final,
            "teacher_auc": self.spec.teacher_auc,
            "checkpoint": str(kept) if self.rank == 0 else None,
        }
        self.metrics.write(summary)
        self.metrics.close()
        if self.rank == 0:
            summary["report"] = str(write_report(self.out))
        return summary


def check_validation_labels(spec: DatasetSpec, data: str) -> None:
    """Refuse a validation split on which no AUC can be computed: no model could be kept as
    the best, early stopping could not work, and the run would end with a NaN."""
    if "validation" not in {s.name for s in spec.splits}:
        return
    note = spec.split("validation").one_label_note()
    if note is not None:
        raise ValueError(
            f"--data {data}: {note}, so no checkpoint could be kept as the best; preprocess "
            "more rows (more of the input file) so that the validation split has both labels")
