"""Datasets: the dataset.json contract and the preprocessors that write it."""

from dlrm_app.data.days import Day, DayPiece, day_table, read_days
from dlrm_app.data.schema import (
    FORMAT_VERSION,
    DatasetKind,
    DatasetSpec,
    ShardFile,
    SparseFeature,
    SplitSpec,
    verify,
)
from dlrm_app.data.synthetic import generate

__all__ = [
    "FORMAT_VERSION",
    "DatasetKind",
    "Day",
    "DayPiece",
    "DatasetSpec",
    "ShardFile",
    "SparseFeature",
    "SplitSpec",
    "day_table",
    "generate",
    "read_days",
    "verify",
]
