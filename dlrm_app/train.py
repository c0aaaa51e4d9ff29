"""``dlrm-app train``: DLRM training as one process or under ``torchrun``.

    torchrun --nproc-per-node 2 -m dlrm_app train --data data/synthetic --out runs/a

Process setup is in ``dlrm_app.runtime``, the sharded model and optimizers are built by
``dlrm_app.build``, batches are staged by ``dlrm_app.pipeline``, validation is
``dlrm_app.evaluate.evaluate_model``.

Gradients: each rank's loss is its rows' summed log loss divided by the *global* batch
(``batch_size * world_size``), and both the embedding gradients (through the sharded
collections' output dist) and the dense gradients (DDP, with a summing comm hook) are summed over
ranks. Every step therefore applies exactly the gradient of the global batch's mean loss, so N
ranks with ``batch_size`` rows each follow the same trajectory as one rank with
``N * batch_size`` rows (up to float summation order). With row groups of exactly
``batch_size`` rows (the loader deals row groups round-robin) the global batches even hold the
same rows.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from dlrm_app.build import build_model, build_optimizer, set_learning_rates
from dlrm_app.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from dlrm_app.config import TrainConfig, lr_scale
from dlrm_app.data.loader import ParquetLoader
from dlrm_app.data.schema import DatasetSpec
from dlrm_app.evaluate import evaluate_model
from dlrm_app.pipeline import device_batches
from dlrm_app.runtime import autocast, gather, global_mean, init_distributed, peak_memory_mb, world

PHASES = ("data", "forward", "backward", "optimizer")


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


def train(config: TrainConfig, progress: bool = True) -> dict[str, Any]:
    """Train (and validate, checkpoint) as configured; returns the summary rank 0 prints."""
    device = init_distributed()
    rank, world_size = world()
    spec = DatasetSpec.load(config.data)
    out = Path(config.out)
    ckpt_dir = out / "checkpoints"
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        config.save(out / "config.json")
    torch.manual_seed(config.seed)

    dmp = build_model(config, spec, device)
    optimizer = build_optimizer(config, dmp)
    base_lrs = [float(g["lr"]) for g in optimizer.param_groups]
    if rank == 0:
        (out / "plan.json").write_text(dmp.plan.to_json() + "\n")
        if progress:
            print(dmp.plan, file=sys.stderr)

    train_loader = ParquetLoader(config.data, "train", batch_size=config.batch_size, rank=rank,
                                 world_size=world_size, shuffle=config.shuffle, seed=config.seed,
                                 drop_last=True)
    val_loader = ParquetLoader(config.data, "validation", batch_size=config.batch_size,
                               rank=rank, world_size=world_size, drop_last=False,
                               pad_last=True)
    steps_per_epoch = len(train_loader)
    if steps_per_epoch == 0:
        raise ValueError(f"the train split of {config.data} has fewer than --batch-size "
                         f"({config.batch_size}) rows per rank; use a smaller batch size")
    total_steps = steps_per_epoch * config.epochs
    if config.max_steps is not None:
        total_steps = min(total_steps, config.max_steps)

    step = 0
    resumed_from = None
    if config.resume:
        path = latest_checkpoint(ckpt_dir)
        if path is not None:
            extra = load_checkpoint(path, model=dmp, optimizer=optimizer, extra={
                "step": 0, "epoch": 0, "batches_yielded": 0, "world_size": 0, "batch_size": 0,
                "rng": torch.get_rng_state()})
            step = int(extra["step"])
            torch.set_rng_state(extra["rng"])
            batches = int(extra["batches_yielded"])
            if (int(extra["world_size"]), int(extra["batch_size"])) != (world_size, config.batch_size):
                # another world size: resume at the same number of global rows into the epoch
                rows = batches * int(extra["batch_size"]) * int(extra["world_size"])
                batches = rows // (config.batch_size * world_size)
            train_loader.load_state_dict({"epoch": int(extra["epoch"]),
                                          "batches_yielded": min(batches, steps_per_epoch)})
            resumed_from = str(path)

    log = _Log(out / "metrics.jsonl", rank == 0)
    log.write({"event": "start", "world_size": world_size, "device": str(device),
               "steps_per_epoch": steps_per_epoch, "total_steps": total_steps,
               "resumed_from": resumed_from, "start_step": step})
    phase_s = dict.fromkeys(PHASES, 0.0)
    bar = tqdm(total=total_steps, initial=step, disable=not (progress and rank == 0),
               unit="step", dynamic_ncols=True)
    context = autocast(device, config.amp)
    global_batch = config.batch_size * world_size
    start_step, started = step, time.perf_counter()
    window_loss: torch.Tensor | float = 0.0
    window_start, window_steps = time.perf_counter(), 0
    val_metrics: dict[str, float] | None = None
    stopped_early = False

    def validate() -> dict[str, float]:
        metrics = evaluate_model(dmp, val_loader, device, config.val_batches, config.amp)
        log.write({"event": "validation", "step": step, **metrics})
        return metrics

    # batches of the current epoch trained so far (the pipelined loop pulls one batch ahead,
    # so the loader's own count can be one higher)
    epoch_batches = train_loader.state_dict()["batches_yielded"]

    def checkpoint() -> None:
        save_checkpoint(ckpt_dir, step, model=dmp, optimizer=optimizer,
                        keep=config.keep_checkpoints, extra={
                            "step": step, "epoch": train_loader.epoch,
                            "batches_yielded": epoch_batches,
                            "world_size": world_size, "batch_size": config.batch_size,
                            "rng": torch.get_rng_state()})

    dmp.train()
    epoch = train_loader.epoch
    while step < total_steps and epoch < config.epochs and not stopped_early:
        if epoch_batches >= steps_per_epoch:
            epoch += 1  # resumed exactly at an epoch's end
            train_loader.set_epoch(epoch)
            epoch_batches = 0
            continue
        batches = device_batches(train_loader, device, dmp, config.pipelined)
        t0 = time.perf_counter()
        for batch in batches:
            t1 = time.perf_counter()
            set_learning_rates(dmp, optimizer, base_lrs, lr_scale(
                step, config.lr_warmup_steps, config.lr_decay_start, config.lr_decay_steps))
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
            step += 1
            epoch_batches += 1
            # a device tensor: no host sync per step, only at log steps
            window_loss = window_loss + loss_sum.detach() / len(batch.labels)
            window_steps += 1
            bar.update(1)
            if step % config.log_every == 0 or step == total_steps:
                (loss,) = global_mean([float(window_loss) / window_steps], device)
                rate = window_steps * global_batch / (time.perf_counter() - window_start)
                log.write({"event": "train", "step": step, "epoch": epoch, "loss": loss,
                           "lr": optimizer.param_groups[-1]["lr"], "samples_per_s": rate})
                bar.set_postfix(loss=f"{loss:.4f}", samples_per_s=f"{rate:,.0f}")
                window_loss, window_start, window_steps = 0.0, time.perf_counter(), 0
            if config.validate_every and step % config.validate_every == 0:
                val_metrics = validate()
                if config.target_auc is not None and val_metrics["auc"] >= config.target_auc:
                    stopped_early = True
            if config.save_every and step % config.save_every == 0:
                checkpoint()
            if stopped_early or step >= total_steps:
                break
            t0 = time.perf_counter()
        batches.close()  # type: ignore[attr-defined]
        if epoch_batches >= steps_per_epoch or step >= total_steps:
            if not (config.validate_every and step % config.validate_every == 0):
                val_metrics = validate()
                if config.target_auc is not None and val_metrics["auc"] >= config.target_auc:
                    stopped_early = True
            if step < total_steps and not stopped_early:
                epoch += 1
                train_loader.set_epoch(epoch)
                epoch_batches = 0
    bar.close()
    elapsed = time.perf_counter() - started
    if step > start_step and not (config.save_every and step % config.save_every == 0):
        checkpoint()
    if val_metrics is None:
        val_metrics = validate()
    busy = sum(phase_s.values()) or 1.0
    summary = {
        "event": "summary",
        "steps": step,
        "trained_steps": step - start_step,
        "world_size": world_size,
        "global_batch": global_batch,
        "samples_per_s": (step - start_step) * global_batch / elapsed if elapsed > 0 else 0.0,
        "seconds": elapsed,
        "phase_fraction": {k: v / busy for k, v in phase_s.items()},
        "peak_memory_mb_per_rank": gather(round(peak_memory_mb(device), 1)),
        "stopped_early": stopped_early,
        "validation": val_metrics,
        "teacher_auc": spec.parameters.get("teacher_auc"),
        "checkpoint": str(latest_checkpoint(ckpt_dir)) if rank == 0 else None,
    }
    log.write(summary)
    log.close()
    return summary
