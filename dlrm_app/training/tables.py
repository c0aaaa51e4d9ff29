"""The table sizes of a run's model, which may differ from its dataset's.

A ``--follow`` run keeps the table sizes of its start while ``preprocess criteo --add-day``
grows the dataset's vocabulary: they are recorded in ``OUT/tables.json`` when it starts
(:func:`dlrm_app.training.follow.model_tables`), and whatever rebuilds its model from a
checkpoint (export) reads them here. Other runs' tables are their dataset's. Ids at or past the model's rows (days added since the
run started) read row 0 (:class:`OutOfVocabulary`), in training, in ``evaluate`` and in the
published model alike.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import torch

from dlrm_app.data.loader import Batch, ParquetLoader
from dlrm_app.data.schema import DatasetSpec
from recsys_core.sparse import KeyedJaggedTensor

TABLES = "tables.json"
"""The model's table sizes, fixed when a ``--follow`` run starts, in its run directory."""


def recorded_tables(out: Path) -> dict[str, int] | None:
    """The table sizes recorded when the ``--follow`` run in ``out`` started, by feature, or
    None (not a ``--follow`` run)."""
    path = out / TABLES
    if not path.is_file():
        return None
    return {k: int(v) for k, v in json.loads(path.read_text())["num_embeddings"].items()}


def with_tables(spec: DatasetSpec, sizes: dict[str, int], where: Path) -> DatasetSpec:
    """``spec`` with the model's table sizes ``sizes`` (read from ``where``)."""
    names = [f.name for f in spec.sparse_features]
    if sorted(sizes) != sorted(names):
        raise ValueError(f"--data {spec.name}: its sparse features {names} are not those the "
                         f"run's model was built for ({where}: {sorted(sizes)}); follow the "
                         "run's own dataset, or start a new run in another --out")
    features = tuple(dataclasses.replace(f, num_embeddings=int(sizes[f.name]))
                     for f in spec.sparse_features)
    return dataclasses.replace(spec, sparse_features=features)


def run_model_spec(spec: DatasetSpec, out: Path) -> DatasetSpec:
    """``spec`` (the run's dataset) with the table sizes of the run's model: those recorded
    when a ``--follow`` run in ``out`` started, else the dataset's own."""
    sizes = recorded_tables(out)
    return spec if sizes is None else with_tables(spec, sizes, out / TABLES)


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
