"""Shared fixtures (the tutorial's two tables and their printed plan) and the ``gpu`` / ``shared_data`` markers."""

from __future__ import annotations

import os
from pathlib import Path

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


# The tutorial's plan as TorchRec 1.8 prints it (its str of the same plan, written by hand): a
# blank line before each table, headers centered in the column width, cells left-justified.
_TUTORIAL_PLAN_KERNELS = [
    "",
    "    param     | sharding type | compute kernel | ranks",
    "------------- | ------------- | -------------- | -----",
    "product_table | table_wise    | fused          | [0]  ",
    "user_table    | table_wise    | fused          | [0]  ",
]
_TUTORIAL_PLAN_PLACEMENTS = {
    "cpu": ["", "    param     | shard offsets | shard sizes | placement ",
            "------------- | ------------- | ----------- | ----------",
            "product_table | [0, 0]        | [4096, 64]  | rank:0/cpu",
            "user_table    | [0, 0]        | [4096, 64]  | rank:0/cpu"],
    "cuda": ["", "    param     | shard offsets | shard sizes |   placement  ",
             "------------- | ------------- | ----------- | -------------",
             "product_table | [0, 0]        | [4096, 64]  | rank:0/cuda:0",
             "user_table    | [0, 0]        | [4096, 64]  | rank:0/cuda:0"],
}


@pytest.fixture
def tutorial_plan_lines() -> dict[str, list[str]]:
    """Device type -> the lines of one module's table in the printed plan of the tutorial's two
    tables, both table-wise on rank 0 with the fused kernel (``str(ShardingPlan)`` puts a
    ``module: <path>`` line before each module's lines)."""
    return {device: _TUTORIAL_PLAN_KERNELS + placement
            for device, placement in _TUTORIAL_PLAN_PLACEMENTS.items()}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` need CUDA; without it they are reported as skipped, with the reason."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """``@pytest.mark.shared_data(path, ...)``: the test reads these real-data samples (see
    ``tests/shared_data.py``). Missing ones skip the test, except under ``CI=true``, where a
    missing sample is a failure."""
    for marker in item.iter_markers("shared_data"):
        missing = [str(p) for p in marker.args if not Path(p).exists()]
        if not missing:
            continue
        message = (f"shared data sample(s) {missing} not found; they are expected in "
                   f"../shared/data beside the repository root")
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
