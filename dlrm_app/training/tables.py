"""The table sizes of a run's model, which may differ from its dataset's.

A run keeps the table sizes of its start while ``preprocess criteo --add-day`` grows its
dataset's vocabulary (a ``--follow`` run's days, or a day added after a plain run): they are
recorded in ``OUT/tables.json`` when it starts (:func:`model_tables`), and whatever rebuilds
its model from a checkpoint (``--resume``, ``evaluate``, export) reads them here. Ids at or
past the model's rows (days added since the run started) read row 0 (:class:`OutOfVocabulary`),
in training, in ``evaluate`` and in the published model alike. A run directory from before
``tables.json`` was written for every run builds its dataset's sizes.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from dlrm_app.data.loader import Batch, ParquetLoader
from dlrm_app.data.schema import DatasetSpec
from recsys_core.sparse import KeyedJaggedTensor

TABLES = "tables.json"
"""The model's table sizes, fixed when a run starts, in its run directory."""


def recorded_tables(out: Path) -> dict[str, int] | None:
    """The table sizes recorded when the run in ``out`` started, by feature, or None (none
    recorded)."""
    path = out / TABLES
    if not path.is_file():
        return None
    return {k: int(v) for k, v in json.loads(path.read_text())["num_embeddings"].items()}


def with_tables(spec: DatasetSpec, sizes: dict[str, int], where: Path) -> DatasetSpec:
    """``spec`` with the model's table sizes ``sizes`` (read from ``where``)."""
    names = [f.name for f in spec.sparse_features]
    if sorted(sizes) != sorted(names):
        raise ValueError(f"--data {spec.name}: its sparse features {names} are not those the "
                         f"run's model was built for ({where}: {sorted(sizes)}); use the "
                         "run's own dataset (or one preprocessed --like it), or start a new "
                         "run in another --out")
    features = tuple(dataclasses.replace(f, num_embeddings=int(sizes[f.name]))
                     for f in spec.sparse_features)
    return dataclasses.replace(spec, sparse_features=features)


def run_model_spec(spec: DatasetSpec, out: Path) -> DatasetSpec:
    """``spec`` (the run's dataset) with the table sizes of the run's model: those recorded
    when the run in ``out`` started, else the dataset's own."""
    sizes = recorded_tables(out)
    return spec if sizes is None else with_tables(spec, sizes, out / TABLES)


def model_tables(spec: DatasetSpec, out: Path, rank: int) -> DatasetSpec:
    """``spec`` with the table sizes of the model of the run in ``out``: those recorded when
    it started (``tables.json``), or, at its start, the dataset's now (then recorded by rank
    0; every rank builds rank 0's shapes)."""
    path = out / TABLES
    sizes = recorded_tables(out)
    if sizes is None:
        sizes = {f.name: f.num_embeddings for f in spec.sparse_features}
    if dist.is_initialized():
        shared = [sizes]
        dist.broadcast_object_list(shared, src=0)
        sizes = shared[0]
    spec_for_model = with_tables(spec, sizes, path)
    if rank == 0 and not path.is_file():
        tmp = path.with_name(TABLES + ".tmp")
        tmp.write_text(json.dumps({"num_embeddings": sizes}, indent=2) + "\n")
        tmp.replace(path)
    return spec_for_model


def smaller_tables(model_spec: DatasetSpec, spec: DatasetSpec) -> list[int] | None:
    """The model's rows per table in key order where some table is smaller than the dataset's
    (its vocabulary grew since the run started: ids past the rows must read row 0), else None
    (no per-batch check needed)."""
    rows = [f.num_embeddings for f in model_spec.sparse_features]
    return rows if rows != [f.num_embeddings for f in spec.sparse_features] else None


class OutOfVocabulary:
    """Batches of ``loader`` whose ids at or past the model's rows (``rows``, per feature in
    key order) read row 0 instead; ``counts`` adds up, per feature, such ids of the real rows
    (a padded batch's padding aside)."""

    def __init__(self, loader: ParquetLoader, rows: list[int]) -> None:
        self.loader = loader
        self._rows = torch.tensor(rows, dtype=torch.int64)
        self.counts = torch.zeros(len(rows), dtype=torch.int64)

    def __len__(self) -> int:
        return len(self.loader)

    @property
    def split(self) -> str:
        return self.loader.split

    def __iter__(self) -> Iterator[Batch]:
        for batch in self.loader:
            yield self.remap(batch)

    def remap(self, batch: Batch) -> Batch:
        kjt = batch.sparse
        values, lengths = kjt.values(), kjt.lengths().long()
        keys = torch.repeat_interleave(torch.arange(len(self._rows)),
                                       torch.tensor(kjt.length_per_key()))
        over = values >= self._rows[keys]
        if not bool(over.any()):
            return batch
        if batch.valid_rows is not None:  # only the real rows count
            size = kjt.stride()
            row = torch.repeat_interleave(torch.arange(len(lengths)) % size, lengths)
            counted = over & (row < batch.valid_rows)
        else:
            counted = over
        self.counts += torch.bincount(keys[counted], minlength=len(self._rows))
        sparse = KeyedJaggedTensor(keys=kjt.keys(), values=torch.where(over, 0, values),
                                   lengths=kjt.lengths(), weights=kjt.weights_or_none())
        return dataclasses.replace(batch, sparse=sparse)
