"""Criteo constants and TSV readers (TorchRec's ``torchrec.datasets.criteo``).

A Criteo row is ``label, int_0..int_12, cat_0..cat_25`` separated by tabs (the Kaggle test
file has no label column). The readers here stream raw TSV rows as TorchRec's do; for
preprocessing at scale (vocabularies, Parquet shards, resumable runs) use ``dlrm_app``'s
Criteo pipeline. TorchRec's ``.npy`` tooling (``BinaryCriteoUtils``,
``InMemoryBinaryCriteoIterDataPipe``) is not provided.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import IterDataPipe

from recsys_core.datasets.utils import LoadFiles, ReadLinesFromCSV, safe_cast

FREQUENCY_THRESHOLD = 3
INT_FEATURE_COUNT = 13
CAT_FEATURE_COUNT = 26
DAYS = 24
DEFAULT_LABEL_NAME = "label"
DEFAULT_INT_NAMES: list[str] = [f"int_{idx}" for idx in range(INT_FEATURE_COUNT)]
DEFAULT_CAT_NAMES: list[str] = [f"cat_{idx}" for idx in range(CAT_FEATURE_COUNT)]
DEFAULT_COLUMN_NAMES: list[str] = [DEFAULT_LABEL_NAME, *DEFAULT_INT_NAMES, *DEFAULT_CAT_NAMES]
# rows across days 0-22 of Criteo 1TB (day 23 is for validation and test)
TOTAL_TRAINING_SAMPLES = 4195197692


def _to_int(val: str) -> int:
    return safe_cast(val, int, 0)


def _to_str(val: str) -> str:
    return safe_cast(val, str, "")


COLUMN_TYPE_CASTERS: list[Callable[[Any], Any]] = [
    _to_int,
    *([_to_int] * INT_FEATURE_COUNT),
    *([_to_str] * CAT_FEATURE_COUNT),
]


def _default_row_mapper(example: list[str]) -> dict[str, int | str]:
    """Columns are matched from the right, so a row without the label column (the Kaggle
    test file) maps to the int and cat columns only. Empty or bad ints become 0."""
    names = DEFAULT_COLUMN_NAMES[len(DEFAULT_COLUMN_NAMES) - len(example) :]
    casters = COLUMN_TYPE_CASTERS[len(COLUMN_TYPE_CASTERS) - len(example) :]
    if len(example) > len(DEFAULT_COLUMN_NAMES):
        raise ValueError(
            f"Criteo row has {len(example)} columns, at most {len(DEFAULT_COLUMN_NAMES)} expected"
        )
    # TorchRec builds this dict from the last column backwards: keep its key order
    return {n: c(v) for n, c, v in reversed(list(zip(names, casters, example, strict=True)))}


class CriteoIterDataPipe(IterDataPipe):
    """Rows of Criteo TSV files, mapped by ``row_mapper`` (None: raw lists of strings).

    In DataLoader workers, worker ``i`` of ``n`` reads files ``i, i + n, ...``.
    """

    def __init__(
        self,
        paths: Iterable[str],
        *,
        row_mapper: Callable[[list[str]], Any] | None = _default_row_mapper,
        **open_kw: Any,
    ) -> None:
        self.paths = paths
        self.row_mapper = row_mapper
        self.open_kw: Any = open_kw

    def __iter__(self) -> Iterator[Any]:
        info = torch.utils.data.get_worker_info()
        paths: Iterable[str] = self.paths
        if info is not None:
            paths = [p for i, p in enumerate(paths) if i % info.num_workers == info.id]
        rows = ReadLinesFromCSV(LoadFiles(paths, mode="r", **self.open_kw), delimiter="\t")
        for row in rows:
            yield self.row_mapper(row) if self.row_mapper else row


def criteo_terabyte(
    paths: Iterable[str],
    *,
    row_mapper: Callable[[list[str]], Any] | None = _default_row_mapper,
    **open_kw: Any,
) -> IterDataPipe:
    """Criteo 1TB click logs from their day TSV files."""
    return CriteoIterDataPipe(paths, row_mapper=row_mapper, **open_kw)


def criteo_kaggle(
    path: str,
    *,
    row_mapper: Callable[[list[str]], Any] | None = _default_row_mapper,
    **open_kw: Any,
) -> IterDataPipe:
    """Kaggle Criteo display advertising, one ``train.txt`` or ``test.txt``."""
    return CriteoIterDataPipe((path,), row_mapper=row_mapper, **open_kw)


__all__ = [
    "CAT_FEATURE_COUNT",
    "COLUMN_TYPE_CASTERS",
    "CriteoIterDataPipe",
    "DAYS",
    "DEFAULT_CAT_NAMES",
    "DEFAULT_COLUMN_NAMES",
    "DEFAULT_INT_NAMES",
    "DEFAULT_LABEL_NAME",
    "FREQUENCY_THRESHOLD",
    "INT_FEATURE_COUNT",
    "TOTAL_TRAINING_SAMPLES",
    "criteo_kaggle",
    "criteo_terabyte",
]
