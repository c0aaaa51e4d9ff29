"""Shared fixtures: the tutorial's two tables."""

from __future__ import annotations

import pytest

from recsys_core import EmbeddingBagConfig, PoolingType


@pytest.fixture
def tutorial_tables() -> list[EmbeddingBagConfig]:
    """product_table and user_table: 4096 x 64, SUM pooling (the TorchRec tutorial's EBC)."""
    return [
        EmbeddingBagConfig(
            name="product_table", embedding_dim=64, num_embeddings=4096,
            feature_names=["product"], pooling=PoolingType.SUM,
        ),
        EmbeddingBagConfig(
            name="user_table", embedding_dim=64, num_embeddings=4096,
            feature_names=["user"], pooling=PoolingType.SUM,
        ),
    ]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` need CUDA; without it they are reported as skipped, with the reason."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
