"""``dlrm-app evaluate``: metrics of a trained checkpoint on a split, on any number of ranks.

The model is rebuilt from the run's ``config.json``, sharded for the current world (the
checkpoint reshards on load) and evaluated with ``BinaryClassificationMetrics``, which gathers
every prediction: the numbers are the same for 1 and N ranks.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dlrm_app.data.loader import ParquetLoader
from dlrm_app.data.schema import DatasetSpec
from dlrm_app.reporting.report import save_evaluation, write_report
from dlrm_app.training.build import build_model
from dlrm_app.training.checkpoint import load_checkpoint, resolve_run
from dlrm_app.training.config import TrainConfig
from dlrm_app.training.runtime import amp_enabled, autocast, init_distributed, world
from dlrm_app.training.tables import OutOfVocabulary, run_model_spec, smaller_tables
from recsys_core.metrics import BinaryClassificationMetrics


def evaluate_model(dmp: nn.Module, loader: ParquetLoader | OutOfVocabulary, device: torch.device,
                   max_batches: int = 0, amp: bool | None = False,
                   save_to: tuple[str | Path, str] | None = None) -> dict[str, float]:
    """AUC, NE, logloss... of ``dmp`` on ``loader``'s split, exact over all ranks.
    ``save_to=(run_dir, name)``: rank 0 also stores the metrics with the ROC and calibration
    curves for the report (``dlrm_app.reporting.report.save_evaluation``)."""
    metrics = BinaryClassificationMetrics()
    was_training = dmp.training
    dmp.eval()
    context = autocast(device, amp)
    with torch.no_grad():
        for i, batch in enumerate(loader):
            if max_batches and i >= max_batches:
                break
            batch = batch.to(device, non_blocking=True)
            with context:
                logits = dmp(batch.dense, batch.sparse).squeeze(1)
            valid = len(batch.labels) if batch.valid_rows is None else batch.valid_rows
            metrics.update(logits[:valid].float(), batch.labels[:valid])
    dmp.train(was_training)
    result = metrics.compute()
    if save_to is not None:
        rows = metrics.gather_rows()  # a collective: every rank calls it
        if rows is not None:
            save_evaluation(save_to[0], save_to[1], {"split": loader.split, **result}, *rows)
    return result


def load_trained_model(run: str | Path, checkpoint: str | Path | None = None,
                       data: str | None = None, batch_size: int | None = None,
                       ) -> tuple[Any, TrainConfig, DatasetSpec, Path]:
    """(sharded model with the checkpoint's weights, its config, the dataset as the model
    reads it, checkpoint), planned for batches of ``batch_size`` rows per rank (None: the run's
    training batch). The spec's table sizes are the model's: a ``--follow`` run's tables keep
    the sizes of its start while its dataset's vocabulary grows (:mod:`.tables`); feed such a
    model its dataset's batches through :class:`~dlrm_app.training.tables.OutOfVocabulary`."""
    config, path = resolve_run(run, checkpoint)
    device = init_distributed(config.parallel.timeout)
    spec = DatasetSpec.load(data or config.data)
    trained = DatasetSpec.load(config.data) if data else spec
    if [(f.name, f.num_embeddings) for f in spec.sparse_features] != [
            (f.name, f.num_embeddings) for f in trained.sparse_features]:
        raise ValueError(f"dataset {data} has other sparse features or table sizes than the "
                         f"one the model was trained on ({config.data}); encode it with "
                         f"`dlrm-app preprocess ... --like {config.data}`")
    # Planned afresh for this world and this machine: the run's --memory-per-rank budgeted its
    # training world (another number of ranks, another batch per rank), not this one.
    config_for_eval = dataclasses.replace(config, parallel=dataclasses.replace(
        config.parallel, plan=None, memory_per_rank=None))
    spec = run_model_spec(spec, Path(run))
    model = build_model(config_for_eval, spec, device, batch_size=batch_size)
    load_checkpoint(path, model=model, optimizer=None, extra={})
    return model, config, spec, path


def evaluate_checkpoint(run: str | Path, *, split: str = "test",
                        checkpoint: str | Path | None = None, data: str | None = None,
                        batch_size: int = 8192) -> dict[str, Any]:
    """Metrics of the run's best (or the given) checkpoint on ``split`` of the run's dataset
    (or of ``data``: a dataset encoded like it); saved with curves in the run for its report."""
    model, config, spec, path = load_trained_model(run, checkpoint, data, batch_size)
    rank, world_size = world()
    loader = ParquetLoader(data or config.data, split, batch_size=batch_size, rank=rank,
                           world_size=world_size, drop_last=False, pad_last=True)
    # only a model whose tables are smaller than its dataset's (a day added since the run
    # started) needs ids past them read as row 0; other runs skip the per-batch check
    rows = smaller_tables(spec, DatasetSpec.load(data or config.data))
    batches = loader if rows is None else OutOfVocabulary(loader, rows)
    name = split if data is None else f"{split}_{Path(data).resolve().name}"
    # in the precision the run trained and validated in (--amp), so that the best
    # checkpoint's validation AUC here is the one training recorded
    device = init_distributed()  # joined by load_trained_model: this only names the device
    metrics = evaluate_model(model, batches, device, amp=config.parallel.amp, save_to=(run, name))
    if rank == 0:
        write_report(run)
    result = {"split": split, "checkpoint": str(path), "world_size": world_size,
              "amp": amp_enabled(device, config.parallel.amp), **metrics,
              "teacher_auc": (spec.teacher_auc or {}).get(split)}
    if config.days.follow and data is None:
        result["note"] = FOLLOWED_NOTE.format(run=run, split=split)
    return result


FOLLOWED_NOTE = (
    "{run} followed the days of its dataset and trained on every one of them, the {split} "
    "split's rows included: this is not a held-out score. A --follow run's held-out numbers are "
    "each day's progressive AUC (its report.md, the day lines of metrics.jsonl); to score other "
    "rows, pass --data with a dataset preprocessed --like this one")
"""What ``evaluate`` says of a ``--follow`` run's own splits (measured on the Kaggle sample cut
into 4 days, 2 ranks: its test split scored AUC 0.829 against progressive AUCs of 0.71-0.74)."""
