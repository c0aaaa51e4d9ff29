"""``dlrm-app train``: DLRM training as one process or under ``torchrun``.

    torchrun --nproc-per-node 2 -m dlrm_app train --data data/synthetic --out runs/a

Process setup is in ``dlrm_app.runtime``, the sharded model and optimizers are built by
``dlrm_app.build``, batches are staged by ``dlrm_app.pipeline``, validation is
``dlrm_app.evaluate.evaluate_model``, the run directory is prepared by ``dlrm_app.run_dir``.

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

import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from dlrm_app.build import (
    build_model,
    build_optimizer,
    comm_precision,
    plan_summary,
    set_learning_rates,
    world_hosts,
)
from dlrm_app.checkpoint import (
    best_checkpoint,
    latest_checkpoint,
    load_checkpoint,
    newest_intact_checkpoint,
    save_checkpoint,
)
from dlrm_app.config import TrainConfig, lr_scale
from dlrm_app.data.loader import ParquetLoader
from dlrm_app.data.schema import DatasetSpec
from dlrm_app.evaluate import evaluate_model
from dlrm_app.pipeline import device_batches
from dlrm_app.report import write_report
from dlrm_app.run_dir import prepare_run_dir
from dlrm_app.runtime import (
    amp_enabled,
    amp_warning,
    autocast,
    gather,
    global_mean,
    init_distributed,
    peak_memory_mb,
    world,
)
from dlrm_app.threads import configure_threads

PHASES = ("data", "forward", "backward", "optimizer")


class TrainingDiverged(ValueError):
    """The loss or the model's output stopped being finite."""


class _Log:
    """Appends JSON lines to ``metrics.jsonl`` (rank 0 only)."""

    def __init__(self, path: Path, enabled: bool) -> None:
        self._file = path.open("a") if enabled else None

    def write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


@dataclasses.dataclass
class _State:
    """Where training is; saved in every checkpoint and restored by ``--resume``."""

    step: int = 0
    epoch: int = 0
    epoch_batches: int = 0
    """Batches of the current epoch trained so far (the pipelined loop pulls one batch ahead,
    so the loader's own count can be one higher)."""
    best_auc: float = -1.0
    best_step: int = -1
    stale_validations: int = 0
    """Validations since the best one."""
    stop_reason: str | None = None


def _diverged(what: str, state: _State, config: TrainConfig) -> TrainingDiverged:
    kept = (f"the best checkpoint (step {state.best_step}, validation AUC {state.best_auc:.4f}) "
            f"is kept in {config.out}/checkpoints" if state.best_step >= 0 else
            "no checkpoint was kept")
    return TrainingDiverged(
        f"{what} at step {state.step} (epoch {state.epoch}): training diverged; lower "
        f"--learning-rate (now {config.learning_rate}) and --embedding-learning-rate (now "
        f"{config.embedding_learning_rate}), or add --lr-warmup-steps; {kept}")


def train(config: TrainConfig, progress: bool = True) -> dict[str, Any]:
    """Train (and validate, checkpoint) as configured; returns the summary rank 0 prints."""
    threads = configure_threads(config.threads)
    device = init_distributed(config.timeout)
    rank, world_size = world()
    if rank == 0 and progress:
        print(threads.describe(), file=sys.stderr)
    spec = DatasetSpec.load(config.data)
    previous_data = resumed_data(config)
    new_data = previous_data is not None and not same_path(previous_data, config.data)
    if new_data:
        check_continuation(previous_data, spec, config.data)
    config = prepare_run_dir(config.with_batch_size(spec.split("train").rows, world_size), rank)
    out, ckpt_dir = Path(config.out), Path(config.out) / "checkpoints"
    torch.manual_seed(config.seed)

    dmp = build_model(config, spec, device)
    optimizer = build_optimizer(config, dmp)
    base_lrs = [float(g["lr"]) for g in optimizer.param_groups]
    if rank == 0:
        (out / "plan.json").write_text(dmp.plan.to_json() + "\n")
        if progress:  # the per-table tables: plan.json and the report's "Sharding plan"
            print(f"{plan_summary(dmp.plan, world_size)}; per table: {out / 'plan.json'}",
                  file=sys.stderr)

    train_loader = ParquetLoader(config.data, "train", batch_size=config.batch_size, rank=rank,
                                 world_size=world_size, shuffle=config.shuffle, seed=config.seed,
                                 drop_last=True)
    val_loader = ParquetLoader(config.data, "validation", batch_size=config.batch_size,
                               rank=rank, world_size=world_size, drop_last=False, pad_last=True)
    steps_per_epoch = len(train_loader)
    if steps_per_epoch == 0:
        raise ValueError(f"the train split of {config.data} has fewer than --batch-size "
                         f"({config.batch_size}) rows per rank; use a smaller batch size")
    total_steps = steps_per_epoch * config.epochs
    if config.max_steps is not None:
        total_steps = min(total_steps, config.max_steps)
    validate_every = config.validation_interval(steps_per_epoch)

    state, resumed_from = _State(), None
    if config.resume and (path := newest_intact_checkpoint(ckpt_dir)) is not None:
        state, resumed_from = _restore(path, dmp, optimizer, train_loader, config, world_size,
                                       steps_per_epoch), str(path)
        if new_data:
            # continue on other data: its epochs from the start, the model, optimizer and step
            # (learning-rate schedule) as they were; its validation split is another yardstick
            train_loader.load_state_dict({"epoch": 0, "batches_yielded": 0})
            state = _State(step=state.step)
            total_steps += state.step

    log = _Log(out / "metrics.jsonl", rank == 0)
    log.write({"event": "start", "world_size": world_size, "device": str(device),
               "amp": amp_enabled(device, config.amp),
               "comm_precision": comm_precision(config, device, world_hosts()).value,
               "steps_per_epoch": steps_per_epoch, "total_steps": total_steps,
               "validate_every": validate_every, "resumed_from": resumed_from,
               "continued_on_new_data": previous_data if new_data and resumed_from else None,
               "start_step": state.step, "threads": threads.intra_op,
               "interop_threads": threads.inter_op, "threads_reason": threads.reason})
    if rank == 0 and (message := amp_warning(device, config.amp)) is not None:
        print(message, file=sys.stderr)
    phase_s = dict.fromkeys(PHASES, 0.0)
    bar = tqdm(total=total_steps, initial=state.step, disable=not (progress and rank == 0),
               unit="step", dynamic_ncols=True)
    context = autocast(device, config.amp)
    global_batch = config.batch_size * world_size
    start_step, started = state.step, time.perf_counter()
    window_loss: torch.Tensor | float = 0.0
    window_start, window_steps = time.perf_counter(), 0
    saved_at = -1

    def checkpoint(best: bool = False) -> None:
        nonlocal saved_at
        save_checkpoint(ckpt_dir, state.step, model=dmp, optimizer=optimizer, best=best,
                        keep=config.keep_checkpoints, extra=_extra(state, world_size, config))
        saved_at = state.step

    def validate() -> None:
        try:
            metrics = evaluate_model(dmp, val_loader, device, config.val_batches, config.amp)
        except ValueError as e:
            if "non-finite" not in str(e):
                raise
            raise _diverged("the model's validation output is not finite", state, config) from None
        log.write({"event": "validation", "step": state.step, "epoch": state.epoch, **metrics})
        if metrics["auc"] > state.best_auc:  # NaN (one class only) never improves
            state.best_auc, state.best_step, state.stale_validations = metrics["auc"], state.step, 0
            checkpoint(best=True)
            log.write({"event": "best", "step": state.step, "auc": state.best_auc})
        else:
            state.stale_validations += 1
        if config.target_auc is not None and metrics["auc"] >= config.target_auc:
            state.stop_reason = f"validation AUC reached --target-auc {config.target_auc}"
        elif config.patience and state.stale_validations >= config.patience:
            state.stop_reason = (f"no better validation AUC in {config.patience} validations "
                                 f"(--patience); best {state.best_auc:.4f} at step "
                                 f"{state.best_step}")

    dmp.train()
    while state.step < total_steps and state.epoch < config.epochs and not state.stop_reason:
        if state.epoch_batches >= steps_per_epoch:  # resumed exactly at an epoch's end
            state.epoch, state.epoch_batches = state.epoch + 1, 0
            train_loader.set_epoch(state.epoch)
            continue
        batches = device_batches(train_loader, device, dmp, config.pipelined)
        validated_at = -1
        t0 = time.perf_counter()
        for batch in batches:
            t1 = time.perf_counter()
            set_learning_rates(dmp, optimizer, base_lrs, lr_scale(
                state.step, config.lr_warmup_steps, config.lr_decay_start, config.lr_decay_steps))
            with context:
                logits = dmp(batch.dense, batch.sparse).squeeze(1)
            loss_sum = F.binary_cross_entropy_with_logits(logits.float(), batch.labels,
                                                          reduction="sum")
            t2 = time.perf_counter()
            optimizer.zero_grad()
            (loss_sum / global_batch).backward()
            t3 = time.perf_counter()
            optimizer.step()
            t4 = time.perf_counter()
            for name, seconds in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
                phase_s[name] += seconds
            state.step += 1
            state.epoch_batches += 1
            # a device tensor: no host sync per step, only at log steps
            window_loss = window_loss + loss_sum.detach() / len(batch.labels)
            window_steps += 1
            bar.update(1)
            if state.step % config.log_every == 0 or state.step == total_steps:
                (loss,) = global_mean([float(window_loss) / window_steps], device)
                if not math.isfinite(loss):
                    raise _diverged(f"the train loss is {loss}", state, config)
                rate = window_steps * global_batch / (time.perf_counter() - window_start)
                log.write({"event": "train", "step": state.step, "epoch": state.epoch,
                           "loss": loss, "lr": optimizer.param_groups[-1]["lr"],
                           "samples_per_s": rate})
                bar.set_postfix(loss=f"{loss:.4f}", samples_per_s=f"{rate:,.0f}")
                window_loss, window_start, window_steps = 0.0, time.perf_counter(), 0
            if validate_every and state.step % validate_every == 0:
                validate()
                validated_at = state.step
            if config.save_every and state.step % config.save_every == 0 and saved_at != state.step:
                checkpoint()
            if state.stop_reason or state.step >= total_steps:
                break
            t0 = time.perf_counter()
        batches.close()  # type: ignore[attr-defined]
        if state.epoch_batches >= steps_per_epoch or state.step >= total_steps:
            if validated_at != state.step:
                validate()
            if state.step < total_steps and not state.stop_reason:
                state.epoch, state.epoch_batches = state.epoch + 1, 0
                train_loader.set_epoch(state.epoch)
    bar.close()
    elapsed = time.perf_counter() - started
    if state.stop_reason is None:
        state.stop_reason = ("max steps reached" if config.max_steps is not None
                             and state.step >= config.max_steps else "epochs done")
    if state.step > start_step and saved_at != state.step:
        checkpoint()  # the last state, for --resume
    # no best where no validation could rank the model (one class only): keep the last
    best, latest = best_checkpoint(ckpt_dir), latest_checkpoint(ckpt_dir)
    if best is not None and best != latest:
        load_checkpoint(best, model=dmp, optimizer=None, extra={})
    best = best or latest
    final = evaluate_model(dmp, val_loader, device, config.val_batches, config.amp,
                           save_to=(out, "validation"))
    busy = sum(phase_s.values()) or 1.0
    summary = {
        "event": "summary",
        "steps": state.step,
        "trained_steps": state.step - start_step,
        "epochs": state.epoch + state.epoch_batches / steps_per_epoch,
        "world_size": world_size,
        "amp": amp_enabled(device, config.amp),
        "comm_precision": comm_precision(config, device, world_hosts()).value,
        "global_batch": global_batch,
        "samples_per_s": (state.step - start_step) * global_batch / elapsed if elapsed > 0 else 0.0,
        "seconds": elapsed,
        "phase_fraction": {k: v / busy for k, v in phase_s.items()},
        "peak_memory_mb_per_rank": gather(round(peak_memory_mb(device), 1)),
        "stopped": state.stop_reason,
        "stopped_early": state.stop_reason not in ("epochs done", "max steps reached"),
        "best_step": state.best_step,
        "validation": final,
        "teacher_auc": spec.parameters.get("teacher_auc"),
        "checkpoint": str(best) if rank == 0 else None,
    }
    log.write(summary)
    log.close()
    if rank == 0:
        summary["report"] = str(write_report(out))
    return summary


def _extra(state: _State, world_size: int, config: TrainConfig) -> dict[str, Any]:
    return {"step": state.step, "epoch": state.epoch, "batches_yielded": state.epoch_batches,
            "world_size": world_size, "batch_size": config.batch_size,
            "best_auc": state.best_auc, "best_step": state.best_step,
            "stale_validations": state.stale_validations, "rng": torch.get_rng_state()}


def resumed_data(config: TrainConfig) -> str | None:
    """The data of the run ``--resume`` continues (its saved config's), or None."""
    saved = Path(config.out) / "config.json"
    if not (config.resume and saved.is_file()):
        return None
    return TrainConfig.load(saved).data


def same_path(a: str, b: str) -> bool:
    return Path(a).resolve() == Path(b).resolve()


def check_continuation(previous: str, spec: DatasetSpec, data: str) -> None:
    """``--resume --data NEW`` continues a run on other data only where the model reads it the
    same way: the same features and table sizes, and ids that mean the same rows (raw ids, whose
    rows the model's zero-collision hashing assigns, or the same encoding / id map)."""
    try:
        before = DatasetSpec.load(previous)
    except ValueError:
        before = None  # gone: the checkpoint's shapes are the remaining check
    if before is None:
        return

    def shape(s: DatasetSpec) -> list[Any]:
        return [list(s.dense_features), [(f.name, f.num_embeddings, f.raw_ids, f.multi_hot)
                                         for f in s.sparse_features]]

    fix = (f"resume with the run's data ({previous}), or preprocess the new files with "
           f"--id-mapping zch (raw ids) or --like {previous}")
    if shape(before) != shape(spec):
        raise ValueError(f"--data {data}: its features or table sizes differ from those of the "
                         f"run's data {previous}, so the model cannot continue on it; {fix}")
    encoded = [f.name for f in spec.sparse_features if not f.raw_ids]
    for key in ("encoding", "id_map_sha256"):
        if encoded and before.parameters.get(key) != spec.parameters.get(key):
            raise ValueError(f"--data {data}: the ids of {encoded[:3]}... were encoded with "
                             f"another {key.replace('_', ' ')} than the run's data {previous}, "
                             f"so the same id would mean another row; {fix}")


def _restore(path: Path, dmp: Any, optimizer: Any, loader: ParquetLoader, config: TrainConfig,
             world_size: int, steps_per_epoch: int) -> _State:
    """Load a checkpoint for ``--resume``: weights, optimizer, RNG, data position, best AUC."""
    extra = load_checkpoint(path, model=dmp, optimizer=optimizer,
                            extra=_extra(_State(), 0, config), verified=True)
    torch.set_rng_state(extra["rng"])
    batches = int(extra["batches_yielded"])
    if (int(extra["world_size"]), int(extra["batch_size"])) != (world_size, config.batch_size):
        # another world size: resume at the same number of global rows into the epoch
        rows = batches * int(extra["batch_size"]) * int(extra["world_size"])
        batches = rows // (config.batch_size * world_size)
    batches = min(batches, steps_per_epoch)
    loader.load_state_dict({"epoch": int(extra["epoch"]), "batches_yielded": batches})
    return _State(step=int(extra["step"]), epoch=int(extra["epoch"]), epoch_batches=batches,
                  best_auc=float(extra["best_auc"]), best_step=int(extra["best_step"]),
                  stale_validations=int(extra["stale_validations"]))
