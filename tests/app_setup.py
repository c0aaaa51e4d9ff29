"""What the app's tests share: the two shapes of generated dataset they train on (sized per
test) and the small model they train.

``two_feature_data``: 2 dense features, categoricals of 50 and 20 ids, one id a row (the CLI,
message and preemption tests: a few steps each). ``four_feature_data``: 4 dense features,
categoricals of 500, 2000, 50 and 1000 ids, the third 3 ids a row (the training and export
tests: enough signal to learn). Both Zipf 1.05, seed 0 unless a test asks otherwise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dlrm_app.data.synthetic import generate
from dlrm_app.model import ModelConfig

SMALL_MODEL = ModelConfig(embedding_dim=8, dense_arch_layer_sizes=(16, 8),
                          over_arch_layer_sizes=(16, 1))


def two_feature_data(out: Path, *, rows: int, seed: int = 0, **sizes: Any) -> Path:
    """``rows`` rows of the 2-feature shape written to ``out``; ``sizes``: row_group_size,
    rows_per_shard, days, drift (``generate``'s)."""
    generate(out, rows=rows, num_dense=2, cardinalities=[50, 20], pooling_factors=[1.0, 1.0],
             zipf_alpha=1.05, seed=seed, **sizes)
    return out


def four_feature_data(out: Path, *, rows: int, seed: int = 0, **sizes: Any) -> Path:
    """``rows`` rows of the 4-feature shape written to ``out``; ``sizes`` as above."""
    generate(out, rows=rows, num_dense=4, cardinalities=[500, 2000, 50, 1000],
             pooling_factors=[1.0, 1.0, 3.0, 1.0], zipf_alpha=1.05, seed=seed, **sizes)
    return out
