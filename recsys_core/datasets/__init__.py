"""Datasets (TorchRec's ``torchrec.datasets``): the ``Batch`` type, random batches, Criteo and
MovieLens row readers."""

from recsys_core.datasets.random import RandomRecDataset
from recsys_core.datasets.utils import Batch

__all__ = ["Batch", "RandomRecDataset"]
