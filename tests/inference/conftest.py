"""Shared pieces of the quantized-inference tests: tables that mix dtypes, poolings and shared
tables, and a random-batch maker."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch

from recsys_core import EmbeddingBagConfig, KeyedJaggedTensor, PoolingType

MakeKJT = Callable[..., KeyedJaggedTensor]


@pytest.fixture
def mixed_tables() -> list[EmbeddingBagConfig]:
    """Four tables: a shared SUM table (two features), a MEAN table, odd and wide dims."""
    return [
        EmbeddingBagConfig(name="t_shared", num_embeddings=60, embedding_dim=16,
                           feature_names=["f_a", "f_b"], pooling=PoolingType.SUM),
        EmbeddingBagConfig(name="t_mean", num_embeddings=35, embedding_dim=8,
                           feature_names=["f_mean"], pooling=PoolingType.MEAN),
        EmbeddingBagConfig(name="t_wide", num_embeddings=20, embedding_dim=36,
                           feature_names=["f_wide"], pooling=PoolingType.SUM),
        EmbeddingBagConfig(name="t_small", num_embeddings=7, embedding_dim=4,
                           feature_names=["f_small"], pooling=PoolingType.MEAN),
    ]


@pytest.fixture
def make_kjt() -> MakeKJT:
    """``make_kjt(tables, batch, seed, weighted=False, keys=None, max_len=5)``: a random KJT over
    the tables' features (``keys`` reorders them), with empty bags and repeated ids."""

    def make(
        tables: Sequence[EmbeddingBagConfig],
        batch: int,
        seed: int,
        weighted: bool = False,
        keys: Sequence[str] | None = None,
        max_len: int = 5,
    ) -> KeyedJaggedTensor:
        gen = torch.Generator().manual_seed(seed)
        rows = {f: c.num_embeddings for c in tables for f in c.feature_names}
        keys = list(keys or rows)
        lengths = torch.randint(0, max_len + 1, (len(keys) * batch,), generator=gen)
        if batch:
            lengths[0] = 0  # an empty bag for sure
        values = torch.cat([
            torch.randint(0, rows[k], (int(lengths[i * batch : (i + 1) * batch].sum()),),
                          generator=gen)
            for i, k in enumerate(keys)
        ])
        weights = torch.rand(values.numel(), generator=gen) * 2 - 0.5 if weighted else None
        return KeyedJaggedTensor(keys=keys, values=values, lengths=lengths, weights=weights)

    return make
