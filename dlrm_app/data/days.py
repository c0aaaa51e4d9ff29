"""Datasets that know their days: which rows each day holds, for day-by-day training.

Recommendation data arrives in days (Criteo 1TB is ``day_0`` .. ``day_23``). A preprocessor
that knows the days records them in ``dataset.json`` under ``parameters["days"]``, one entry
per day in order::

    {"index": 0, "name": "day_0", "rows": 1000,
     "pieces": [{"file": "train-00000.parquet", "first_row": 0, "rows": 700},
                {"file": "train-00001.parquet", "first_row": 0, "rows": 300}],
     ...provenance (input, lines, skipped_rows, num_embeddings, teacher_auc, ...)}

A day's rows are ``pieces``: runs of consecutive rows of shard files, in order. The days
preprocessed together live in the train / validation / test shards (a day may start inside a
shard and span splits: the splits are cut by the release's rule, the days by their inputs); a
day added later (``preprocess criteo --add-day``) has shards of its own, listed in its entry's
``shards`` (name, rows, sha256, row group size, as a split's) and in no split: the train /
validation / test splits stay those of the first preprocessing.

Reading: :func:`read_days` gives the typed entries, :func:`day_table` a day's (or a range's)
rows as one Arrow table, and ``ParquetLoader(dir, days=range(a, b), batch_size=...)`` batches of
them (dealt across ranks and shuffled as a split is).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from dlrm_app.data.schema import DATASET_JSON, DatasetSpec, ShardFile, SplitSpec

DAYS = "days"
"""The key of ``parameters`` that lists the days."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class DayPiece:
    """Rows ``[first_row, first_row + rows)`` of one shard file."""

    file: str
    first_row: int
    rows: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class Day:
    """One day of a dataset."""

    index: int
    """Position in the dataset's days, from 0."""
    name: str
    """The day's name (Criteo: its input file's name without ``.gz``, e.g. ``day_3``)."""
    rows: int
    """Rows the day holds."""
    pieces: tuple[DayPiece, ...]
    """Where the rows are, in order."""
    shards: tuple[ShardFile, ...] = ()
    """The day's own shards (a day added later); empty for days in the splits' shards."""
    num_embeddings: tuple[int, ...] | None = None
    """Table sizes once this day was encoded (a vocabulary grows with added days); None where
    the preprocessor records none (the sizes are the dataset's)."""


def _piece(record: Mapping[str, Any]) -> DayPiece:
    return DayPiece(file=str(record["file"]), first_row=int(record["first_row"]),
                    rows=int(record["rows"]))


def read_days(dataset: str | os.PathLike[str] | DatasetSpec) -> tuple[Day, ...]:
    """The days of a dataset (its directory or loaded spec), in order.

    Raises ValueError when the dataset records no days (made before days were recorded, or by
    a preprocessor that does not know them) or its record is malformed."""
    spec = dataset if isinstance(dataset, DatasetSpec) else DatasetSpec.load(dataset)
    where = "" if isinstance(dataset, DatasetSpec) else f"{Path(dataset) / DATASET_JSON}: "
    records = spec.day_records
    if not records:
        raise ValueError(f"{where}dataset '{spec.name}' records no days; preprocess it again "
                         f"with this version (preprocess criteo records each input as a day, "
                         f"generate --days N generates days)")
    days = []
    try:
        for i, r in enumerate(records):
            day = Day(index=int(r["index"]), name=str(r["name"]), rows=int(r["rows"]),
                      pieces=tuple(_piece(p) for p in r["pieces"]),
                      shards=tuple(ShardFile(**s) for s in r.get("shards", ())),
                      num_embeddings=None if r.get("num_embeddings") is None
                      else tuple(int(n) for n in r["num_embeddings"]))
            if day.index != i or sum(p.rows for p in day.pieces) != day.rows:
                raise ValueError(f"day {i}: index {day.index} or its pieces' rows do not add "
                                 f"up to its {day.rows} rows")
            days.append(day)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{where}malformed 'parameters.days' ({e}); preprocess the dataset "
                         f"again") from None
    return tuple(days)


def select_days(days: Sequence[Day], which: int | range | Sequence[int]) -> list[Day]:
    """The days ``which`` names (one index, a range, or indices), checked to exist."""
    wanted = [which] if isinstance(which, int) else list(which)
    if not wanted:
        raise ValueError("no days selected: pass a day index or a non-empty range")
    bad = [d for d in wanted if isinstance(d, bool) or not 0 <= d < len(days)]
    if bad:
        raise ValueError(f"day {bad[0]} does not exist: the dataset has days 0..{len(days) - 1}")
    return [days[d] for d in wanted]


def shard_files(spec: DatasetSpec, days: Iterable[Day] = ()) -> dict[str, ShardFile]:
    """Every shard of the splits and of ``days``' own, by file name."""
    files = {s.file: s for split in spec.splits for s in split.shards}
    for day in days:
        files.update((s.file, s) for s in day.shards)
    return files


def day_table(dataset_dir: str | os.PathLike[str],
              which: int | range | Sequence[int]) -> pa.Table:
    """The rows of the selected days, in day order, as one table (the shards' columns); for
    tests and inspection: it holds every row in memory (train through ``ParquetLoader``)."""
    directory = Path(dataset_dir)
    days = read_days(directory)
    tables = [pq.read_table(directory / p.file).slice(p.first_row, p.rows)
              for day in select_days(days, which) for p in day.pieces]
    return pa.concat_tables(tables)


def locate_days(splits: Sequence[SplitSpec], edges: Sequence[int]) -> list[list[dict]]:
    """Per day, its pieces, where the splits' shards (train, then validation, then test) hold
    the dataset's rows in order and day ``d`` is rows ``[edges[d], edges[d + 1])`` of them."""
    files = [(s.file, s.rows) for split in splits for s in split.shards]
    out: list[list[dict]] = []
    for a, b in zip(edges[:-1], edges[1:], strict=True):
        pieces, start = [], 0
        for file, rows in files:
            lo, hi = max(a, start), min(b, start + rows)
            if lo < hi:
                pieces.append({"file": file, "first_row": lo - start, "rows": hi - lo})
            start += rows
        out.append(pieces)
    return out
