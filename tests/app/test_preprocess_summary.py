"""dataset.json's table summary without torch: ``table_memory_bytes`` is plain arithmetic that
must agree with the planner's estimate, and preprocessing must not import torch for it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dlrm_app.training.config import EmbeddingOptimizer
from dlrm_app.training.resources import table_memory_bytes


@pytest.mark.parametrize("optimizer", list(EmbeddingOptimizer))
@pytest.mark.parametrize("dim", [1, 16, 64, 128, 1000])
def test_table_memory_bytes_is_the_planners_estimate(optimizer: EmbeddingOptimizer,
                                                      dim: int) -> None:
    from recsys_core import DataType, EmbOptimType
    from recsys_core.planner.estimators import weights_and_state_bytes

    sizes = [1, 3, 1461, 40_000_000, 10_000_000, 33_762_577]
    planner = int(sum(float(weights_and_state_bytes(
        rows, dim, DataType.FP32, EmbOptimType[optimizer.kernel])) for rows in sizes))
    assert table_memory_bytes(sizes, dim, optimizer) == planner
    assert table_memory_bytes(sizes, dim, optimizer.value) == planner


def test_table_memory_bytes_by_hand() -> None:
    # fp32 weights (4 bytes an element) + row-wise Adagrad (4 bytes a row) / Adagrad (4 an
    # element) / SGD (none)
    assert table_memory_bytes([10, 5], 16, "rowwise_adagrad") == 15 * (16 * 4 + 4)
    assert table_memory_bytes([10, 5], 16, "adagrad") == 15 * 16 * 8
    assert table_memory_bytes([10, 5], 16, "sgd") == 15 * 16 * 4


def test_table_summary_does_not_import_torch() -> None:
    code = ("import sys\n"
            "from dlrm_app.data.schema import SparseFeature\n"
            "from dlrm_app.data.tables import table_summary\n"
            "s = table_summary([SparseFeature(name='c', num_embeddings=1000, multi_hot=False)])\n"
            "assert s['train_memory_bytes']['16'] == 1000 * 68, s\n"
            "print('torch' in sys.modules, 'recsys_core' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.split() == ["False", "False"]
