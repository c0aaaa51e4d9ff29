"""Synthetic recommendation batches (TorchRec's ``torchrec.datasets.random``)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch
from torch.utils.data.dataset import IterableDataset

from recsys_core.datasets.utils import Batch
from recsys_core.sparse import KeyedJaggedTensor


def _per_key(name: str, given: list[int] | None, default: int, keys: list[str]) -> list[int]:
    """``given`` (one value per key, checked), or ``default`` for every key."""
    values = [default] * len(keys) if given is None else given
    if len(values) != len(keys):
        raise ValueError(
            f"length of {name} ({len(values)}) must be equal to the number of keys ({len(keys)})"
        )
    return values


class _RandomRecBatch:
    """Iterator of random :class:`Batch` es.

    Per key, each sample gets a length uniform in ``[min_ids, max_ids]`` and that many ids
    uniform in ``[0, hash_size)``; then ``dense [B, num_dense]`` ~ N(0, 1) and labels in {0, 1}.
    The draws happen in that order from ``torch.Generator().manual_seed(manual_seed)`` (or the
    global RNG), so a seed reproduces TorchRec's batches. ``num_generated_batches >= 0``
    generates that many batches once and cycles them; negative generates every batch anew.
    """

    def __init__(
        self,
        keys: list[str],
        batch_size: int,
        hash_sizes: list[int],
        ids_per_features: list[int],
        num_dense: int,
        manual_seed: int | None = None,
        num_generated_batches: int = 10,
        num_batches: int | None = None,
        *,
        min_ids_per_features: list[int] | None = None,
    ) -> None:
        self.keys = keys
        self.keys_length: int = len(keys)
        self.batch_size = batch_size
        self.hash_sizes = hash_sizes
        self.ids_per_features = ids_per_features
        self.min_ids_per_features: list[int] = min_ids_per_features or [0] * len(ids_per_features)
        self.num_dense = num_dense
        self.num_batches = num_batches
        self.num_generated_batches = num_generated_batches
        self.generator: torch.Generator | None = None
        if manual_seed is not None:
            self.generator = torch.Generator()
            self.generator.manual_seed(manual_seed)
        self._generated_batches: list[Batch] = [
            self._generate_batch() for _ in range(num_generated_batches)
        ]
        self.batch_index = 0

    def __iter__(self) -> _RandomRecBatch:
        self.batch_index = 0
        return self

    def __next__(self) -> Batch:
        if self.batch_index == self.num_batches:
            raise StopIteration
        if self.num_generated_batches >= 0:
            batch = self._generated_batches[self.batch_index % len(self._generated_batches)]
        else:
            batch = self._generate_batch()
        self.batch_index += 1
        return batch

    def _generate_batch(self) -> Batch:
        values, lengths = [], []
        for i in range(self.keys_length):
            length = torch.randint(
                self.min_ids_per_features[i],
                self.ids_per_features[i] + 1,
                (self.batch_size,),
                dtype=torch.int32,
                generator=self.generator,
            )
            ids = torch.randint(
                0, self.hash_sizes[i], (int(length.sum()),), generator=self.generator
            )
            lengths.append(length)
            values.append(ids)
        sparse = KeyedJaggedTensor.from_lengths_sync(
            keys=self.keys, values=torch.cat(values), lengths=torch.cat(lengths)
        )
        dense = torch.randn(self.batch_size, self.num_dense, generator=self.generator)
        labels = torch.randint(low=0, high=2, size=(self.batch_size,), generator=self.generator)
        return Batch(dense_features=dense, sparse_features=sparse, labels=labels)


class RandomRecDataset(IterableDataset[Batch]):
    """Random batches with TorchRec's ``RandomRecDataset`` arguments and draws.

    Args:
        keys: sparse feature names.
        batch_size: samples per batch.
        hash_size / hash_sizes: id range per key (default 100).
        ids_per_feature / ids_per_features: most ids per sample per key (default 2).
        num_dense: dense features per sample.
        manual_seed: seed of a private generator (None: the global RNG).
        num_batches: batches per pass (None: endless).
        num_generated_batches: distinct batches generated up front and cycled (negative:
            a fresh batch every step).
        min_ids_per_feature / min_ids_per_features: fewest ids per sample per key. When not
            given it defaults to ``ids_per_feature`` (so ``ids_per_feature=k`` alone means exactly
            k ids per sample, as in TorchRec), else 0.
    """

    def __init__(
        self,
        keys: list[str],
        batch_size: int,
        hash_size: int | None = None,
        hash_sizes: list[int] | None = None,
        ids_per_feature: int | None = None,
        ids_per_features: list[int] | None = None,
        num_dense: int = 50,
        manual_seed: int | None = None,
        num_batches: int | None = None,
        num_generated_batches: int = 10,
        min_ids_per_feature: int | None = None,
        min_ids_per_features: list[int] | None = None,
    ) -> None:
        super().__init__()
        hash_sizes = _per_key("hash_sizes", hash_sizes, hash_size or 100, keys)
        ids_per_features = _per_key("ids_per_features", ids_per_features, ids_per_feature or 2, keys)
        if min_ids_per_features is None:
            low = min_ids_per_feature if min_ids_per_feature is not None else ids_per_feature
            min_ids_per_features = [low or 0] * len(keys)
        self.batch_generator = _RandomRecBatch(
            keys=keys,
            batch_size=batch_size,
            hash_sizes=hash_sizes,
            ids_per_features=ids_per_features,
            num_dense=num_dense,
            manual_seed=manual_seed,
            num_batches=None,
            num_generated_batches=num_generated_batches,
            min_ids_per_features=min_ids_per_features,
        )
        self.num_batches: int | None = num_batches

    def __iter__(self) -> Iterator[Batch]:
        return itertools.islice(iter(self.batch_generator), self.num_batches)

    def __len__(self) -> int:
        if self.num_batches is None:
            raise TypeError("RandomRecDataset(num_batches=None) is endless and has no length")
        return self.num_batches


__all__ = ["RandomRecDataset"]
