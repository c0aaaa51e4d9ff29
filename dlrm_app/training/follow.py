"""``dlrm-app train --follow``: train day after day with progressive evaluation.

For each day of ``--data`` not done yet, in order (:class:`DayFollower`):

1. progressive evaluation: the current model on the whole day, data it has not trained on; one
   ``{"event": "day", "day", "name", "rows", "progressive_auc", "ne", "logloss", "oov_ids",
   "model_step", ...}`` line in ``metrics.jsonl`` (what a bench reads). The first day has no
   model yet: its line says ``"progressive_auc": null`` and why (a random init's AUC would
   measure the init, not day-by-day training);
2. one pass of training on the day (the run's batch size, optimizers, learning-rate schedule,
   ``--save-every``; no validation, no early stopping on the day's own rows);
3. a checkpoint that records the day as done (``TrainState.days_done``);
4. ``--publish PATH``: the day's checkpoint exported to PATH (``dlrm_app.serving.export``:
   written beside it, then renamed into place, which a serving process reloads on) by rank 0,
   in a process of its own, polled by every rank, when there are more (:func:`_export_apart`).

Then it stops, or with ``--wait SECONDS`` polls the dataset's days for a new one
(``preprocess criteo --add-day``) until SIGTERM or Ctrl-C, which end the run cleanly (its
summary and report). SIGTERM during a day stops after the step in progress with a checkpoint,
as in a run of epochs; a restart (the same command, ``--resume``, a torchrun restart)
continues with the day in progress after its trained batches, or with the first day not done:
no day trains twice and no day's line is written twice.

Tables that grow: the model's tables are the dataset's sizes when the run started, recorded
in ``OUT/tables.json`` (a restart builds the same shapes). Ids of a later day at or past the
model's rows (a vocabulary grown by ``--add-day``) read the out-of-vocabulary row 0, as an id
without a row of the vocabulary does; the day's line counts them (``oov_ids``, per feature in
``oov_ids_per_feature``). The published model maps them to row 0 too
(:func:`dlrm_app.data.criteo.vocabulary.vocabulary_for_tables`), so its program stays the same
and a grown day publishes weights alone. ``hash`` and ``zch`` datasets never grow. To give the
new ids rows, start a new run on the grown dataset.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from dlrm_app.data.days import Day, read_days
from dlrm_app.data.loader import ParquetLoader
from dlrm_app.reporting.report import write_report
from dlrm_app.training.checkpoint import latest_checkpoint
from dlrm_app.training.components import PreemptionGuard
from dlrm_app.training.config import TrainConfig
from dlrm_app.training.evaluate import evaluate_model
from dlrm_app.training.pipeline import device_batches
from dlrm_app.training.tables import OutOfVocabulary

if TYPE_CHECKING:
    from dlrm_app.training.trainer import Trainer

DAY_EVENT = "day"
TICK_S = 1.0
"""The longest a wait for a new day takes to notice SIGTERM or Ctrl-C."""


def refuse_other_data(config: TrainConfig, previous: str | None) -> None:
    """A ``--follow`` run counts the days of one dataset: ``--resume --data OTHER`` is
    refused (its day indices would mean other rows)."""
    if previous is not None:
        raise ValueError(f"--data {config.data}: this --follow run follows the days of "
                         f"{previous}; resume it without --data (add days to {previous} with "
                         "`dlrm-app preprocess criteo DAY --out ... --add-day`), or start a new "
                         "run in another --out")


class DayFollower:
    """The day loop of a ``--follow`` run, on a set-up :class:`Trainer` (its model, optimizer,
    state, checkpointer and metrics log): ``run`` follows the days, ``finish`` ends the run."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.config, self.state = trainer.config, trainer.state
        self._rows = [f.num_embeddings for f in trainer.model_spec.sparse_features]
        self._features = [f.name for f in trainer.model_spec.sparse_features]
        self.waited_out = False
        """A signal ended the wait for a new day (a clean end: nothing was in progress)."""

    # -- the loop ---------------------------------------------------------------------------

    def run(self) -> None:
        """Every day not done, in order; then stop, or (``--wait``) wait for the next one."""
        trainer = self.trainer
        with PreemptionGuard(trainer.world_size, trainer.device,
                             grace_period_s=self.config.checkpoint.grace_period) as guard:
            available = self._agreed_days(read=True)
            while True:
                days = read_days(self.config.data)[:available] if available else ()
                per_step = (self.config.schedule.batch_size or 1) * trainer.world_size
                trainer.metrics.bar.total = sum(d.rows // per_step for d in days)  # about
                while self.state.days_done is not None and self.state.days_done < len(days):
                    self._day(days[self.state.days_done], guard)
                    if trainer.preempted:
                        return
                if self.config.days.wait is None:
                    self.state.stop_reason = "every day done"
                    return
                available = self._wait(guard, len(days))
                if not available:
                    return

    def _agreed_days(self, read: bool) -> int:
        """The dataset's day count as rank 0 reads it (``read``; else 0), on every rank."""
        count = len(_days_or_refuse(self.config.data)) if read and self.trainer.rank == 0 \
            else 0
        if self.trainer.world_size > 1 and dist.is_initialized():
            t = torch.tensor([float(count)], dtype=torch.float64, device=self.trainer.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            count = int(t.item())
        return count

    def _wait(self, guard: PreemptionGuard, known: int) -> int:
        """Polls for more than ``known`` days every ``--wait`` seconds; returns the new count,
        or 0 when a signal ended the wait (every rank alike)."""
        trainer, wait = self.trainer, float(self.config.days.wait or 0)
        trainer.metrics.write({"event": "waiting", "days": known, "poll_s": wait})
        next_read = time.monotonic() + wait
        while True:
            time.sleep(min(TICK_S, wait))
            due = time.monotonic() >= next_read
            signalled = float(guard.signalled or 0)
            count = len(_days_or_refuse(self.config.data)) if due and trainer.rank == 0 else 0
            if trainer.world_size > 1 and dist.is_initialized():
                t = torch.tensor([signalled, float(count)], dtype=torch.float64,
                                 device=trainer.device)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                signalled, count = float(t[0].item()), int(t[1].item())
            if signalled:
                name = signal.Signals(int(signalled)).name
                self.state.stop_reason = f"{name} while waiting for day {known}"
                self.waited_out = True
                return 0
            if due:
                if count > known:
                    return count
                next_read = time.monotonic() + wait

    def _day(self, day: Day, guard: PreemptionGuard) -> None:
        """Day ``day``: its progressive evaluation (unless a restart continues it), one pass of
        training, the checkpoint that records it done, the published model."""
        trainer, config, state = self.trainer, self.config, self.state
        if state.day_batches == 0:
            self._evaluate(day)
        loader = ParquetLoader(config.data, days=day.index,
                               batch_size=config.schedule.batch_size or 1,
                               rank=trainer.rank, world_size=trainer.world_size,
                               shuffle=config.schedule.shuffle, seed=config.seed, epoch=day.index,
                               drop_last=True)
        if len(loader) == 0:
            raise ValueError(f"--follow: day {day.index} ({day.name}) of {config.data} has "
                             f"{day.rows} rows, fewer than --batch-size "
                             f"({config.schedule.batch_size}) "
                             f"per rank on {trainer.world_size} rank(s); resume with a smaller "
                             "--batch-size")
        if state.day_batches:
            loader.load_state_dict({"epoch": day.index,
                                    "batches_yielded": min(state.day_batches, len(loader))})
        trainer.model.train()
        batches = device_batches(OutOfVocabulary(loader, self._rows), trainer.device,
                                 trainer.model, config.parallel.pipelined)
        ready = time.perf_counter()
        for batch in batches:
            trainer.metrics.add_time(data=time.perf_counter() - ready)
            loss_sum = trainer.step(batch)
            state.step += 1
            state.day_batches += 1
            trainer.metrics.after_step(state, loss_sum, len(batch.labels))
            stop = guard.agreed()
            trainer.checkpointer.after_step(state, guard.since_save_s)
            if trainer.checkpointer.saved_at == state.step:
                guard.saved()
            if stop:
                trainer.preempted = int(guard.signal or signal.SIGTERM)
                state.stop_reason = f"preempted ({signal.Signals(trainer.preempted).name})"
                break
            ready = time.perf_counter()
        batches.close()  # type: ignore[attr-defined]
        if trainer.preempted:
            return
        assert state.days_done is not None
        state.days_done, state.day_batches = day.index + 1, 0
        trainer.checkpointer.save(state)  # again where --save-every saved this step: day done
        trainer.checkpointer.wait()
        guard.saved()
        checkpoint = latest_checkpoint(trainer.out / "checkpoints")
        trainer.metrics.write({"event": "day_done", "day": day.index, "step": state.step,
                               "checkpoint": None if checkpoint is None else checkpoint.name})
        if config.days.publish is not None and checkpoint is not None:
            self._publish(checkpoint, guard)

    def _evaluate(self, day: Day) -> None:
        """The day's progressive evaluation and its line (not written again when the log has
        it: a restart that evaluates the same model again)."""
        trainer, state = self.trainer, self.state
        record: dict[str, Any] = {"event": DAY_EVENT, "day": day.index, "name": day.name,
                                  "rows": day.rows, "model_step": state.step,
                                  "model_days": state.days_done}
        if state.step == 0:
            record.update(progressive_auc=None, ne=None, logloss=None, oov_ids=None,
                          note="no model yet: the first day is trained on, not evaluated")
        else:
            loader = ParquetLoader(self.config.data, days=day.index,
                                   batch_size=self.config.schedule.batch_size or 1,
                                   rank=trainer.rank, world_size=trainer.world_size,
                                   drop_last=False, pad_last=True)
            oov = OutOfVocabulary(loader, self._rows)
            metrics = evaluate_model(trainer.model, oov, trainer.device,
                                     amp=self.config.parallel.amp)
            counts = oov.counts.to(trainer.device)
            if trainer.world_size > 1 and dist.is_initialized():
                dist.all_reduce(counts)
            one_label = metrics["label_rate"] in (0.0, 1.0)
            record.update(
                progressive_auc=None if one_label else metrics["auc"], ne=metrics["ne"],
                logloss=metrics["logloss"], label_rate=metrics["label_rate"],
                oov_ids=int(counts.sum()),
                oov_ids_per_feature={n: int(c) for n, c in zip(self._features, counts.tolist(),
                                                               strict=True) if c},
                **({"note": "one label in the day: no AUC"} if one_label else {}))
        if trainer.rank == 0 and day.index not in logged_days(trainer.out):
            trainer.metrics.write(record)

    def _publish(self, checkpoint: Path, guard: PreemptionGuard) -> None:
        """The day's checkpoint exported to ``--publish`` by rank 0; with more ranks in a
        process of its own, which every rank polls together (:func:`_export_apart`)."""
        from dlrm_app.serving import export as exporting

        trainer, publish = self.trainer, str(self.config.days.publish)
        try:
            if trainer.world_size > 1 and dist.is_initialized():
                signum = _export_apart(trainer.out, publish, checkpoint, trainer.rank,
                                       trainer.device, guard)
                if signum:
                    trainer.preempted = signum
                    self.state.stop_reason = (f"preempted ({signal.Signals(signum).name}) "
                                              f"while publishing {checkpoint.name}")
                    return
            elif trainer.rank == 0:
                exporting.export_model(trainer.out, publish, checkpoint=str(checkpoint))
        except ValueError as e:
            raise ValueError(
                f"--publish {publish}: exporting {checkpoint} failed ({e}); its day is trained "
                f"and checkpointed: fix the cause and --resume (it continues with the next "
                f"day), or resume without --publish") from None
        if trainer.rank == 0:
            print(f"published {checkpoint.name} to {publish}", file=sys.stderr)

    # -- the end ----------------------------------------------------------------------------

    def finish(self) -> dict[str, Any]:
        """The summary (with every day's line of the run, also those before a restart),
        written to the metrics log; rank 0 also writes the report."""
        trainer, state = self.trainer, self.state
        trainer.phase = "finishing"
        trainer.metrics.bar.close()
        trainer.checkpointer.wait()
        elapsed = time.perf_counter() - trainer._started
        trained = state.step - trainer.start_step
        days = list(logged_days(trainer.out).values()) if trainer.rank == 0 else []
        aucs = [d["progressive_auc"] for d in days if d.get("progressive_auc") is not None]
        newest = latest_checkpoint(trainer.out / "checkpoints")
        summary = {
            "event": "summary", "follow": True, "steps": state.step, "trained_steps": trained,
            "days_done": state.days_done, "world_size": trainer.world_size,
            "global_batch": trainer.global_batch,
            "samples_per_s": trained * trainer.global_batch / elapsed if elapsed > 0 else 0.0,
            "seconds": elapsed, "phase_fraction": trainer.metrics.phase_fraction(),
            "stopped": state.stop_reason, "stopped_early": False,
            "days": days,
            "mean_progressive_auc": sum(aucs) / len(aucs) if aucs else None,
            "checkpoint": str(newest) if trainer.rank == 0 and newest is not None else None,
        }
        trainer.metrics.write(summary)
        trainer.metrics.close()
        if trainer.rank == 0:
            summary["report"] = str(write_report(trainer.out))
        return summary


def _days_or_refuse(data: str) -> tuple[Day, ...]:
    try:
        return read_days(data)
    except ValueError as e:
        raise ValueError(f"--follow needs a dataset that records its days: {e}") from None


def logged_days(out: Path) -> dict[int, dict[str, Any]]:
    """The ``day`` lines of the run's metrics log, by day (the first of each)."""
    days: dict[int, dict[str, Any]] = {}
    path = out / "metrics.jsonl"
    if not path.is_file():
        return days
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if f'"event": "{DAY_EVENT}"' not in line:
                continue
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a line cut by a kill
            if isinstance(record, dict) and record.get("event") == DAY_EVENT:  # the summary
                days.setdefault(int(record["day"]), record)  # line holds day lines too
    return dict(sorted(days.items()))


EXPORT_ENV_DROPPED = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                     "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "ROLE_RANK",
                     "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE")
"""torchrun's variables, which the export process must not see (it is not a rank)."""


EXPORT_STOP_S = 10.0
"""How long a stopped export may take to remove its partial files before it is killed."""


def export_command(run: Path, out: str, checkpoint: Path) -> list[str]:
    """``dlrm-app export`` of ``checkpoint`` to ``out``, as a command line."""
    return [sys.executable, "-m", "dlrm_app", "export", str(run), "--out", out,
            "--checkpoint", str(checkpoint)]


def _export_apart(run: Path, out: str, checkpoint: Path, rank: int, device: torch.device,
                  guard: PreemptionGuard) -> int:
    """``dlrm-app export`` in a process of its own, started by rank 0, while every rank polls
    it together every ``TICK_S`` (one small all-reduce a tick): in a rank, loading the
    checkpoint would run collectives that the other ranks never join (the run hung at its first
    publish), and the other ranks waiting at a barrier would time out (``--timeout``) when a
    first export's compile takes longer. A failed export raises ValueError on every rank (its
    last stderr line on rank 0); SIGTERM or Ctrl-C on any rank stops the export (the served
    file stays the previous one: the export renames its file into place only when complete)
    and returns the signal, else 0."""
    env = {k: v for k, v in os.environ.items() if k not in EXPORT_ENV_DROPPED}
    child = subprocess.Popen(export_command(run, out, checkpoint), env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) \
        if rank == 0 else None
    err: list[str] = []
    if child is not None:  # read as it comes: a full pipe would stall the export
        reader = threading.Thread(target=lambda: err.extend(child.stderr or ()), daemon=True)
        reader.start()
    try:
        while True:
            code = child.poll() if child is not None else None
            # [signal, export ended, export failed] as rank 0 (and any rank's signal) sees it
            t = torch.tensor([float(guard.signalled or 0), float(code is not None),
                              float(code not in (None, 0))], dtype=torch.float64, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            signalled, ended, failed = (int(v) for v in t.tolist())
            if signalled:
                return signalled
            if ended:
                break
            time.sleep(TICK_S)
    finally:
        if child is not None and child.poll() is None:
            child.terminate()  # SIGTERM: the export removes its partial files and ends
            try:
                child.wait(timeout=EXPORT_STOP_S)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
    if failed:
        if child is not None:
            reader.join(timeout=5)
            raise ValueError(([line.strip() for line in err if line.strip()]
                              or ["no message"])[-1])
        raise ValueError("rank 0's export process failed (its message is on rank 0)")
    return 0
