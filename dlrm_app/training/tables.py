"""The table sizes of a run's model, which may differ from its dataset's.

A ``--follow`` run keeps the table sizes of its start while ``preprocess criteo --add-day``
grows the dataset's vocabulary: they are recorded in ``OUT/tables.json`` when it starts
(:func:`dlrm_app.training.follow.model_tables`), and whatever rebuilds its model from a
checkpoint (export) reads them here. Other runs' tables are their dataset's.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from dlrm_app.data.schema import DatasetSpec

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
