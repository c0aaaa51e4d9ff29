"""bench/quality.py's logistic-regression baseline is a real model: on generated data whose
labels come from a teacher it learns (AUC well above chance, below the teacher's), the base rate
scores exactly 0.5, and the regularization is chosen on validation, not test."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import quality  # noqa: E402  (bench/ is a folder of scripts, not a package)

from dlrm_app.data.schema import DatasetSpec  # noqa: E402
from dlrm_app.data.synthetic import generate  # noqa: E402


def test_logistic_regression_learns_the_teacher_part_it_can(tmp_path: Path) -> None:
    generate(tmp_path, rows=6000, num_dense=3, cardinalities=[50, 20, 200],
             pooling_factors=[1.0, 1.0, 2.0], zipf_alpha=1.05, seed=3)
    teacher = DatasetSpec.load(tmp_path).parameters["teacher_auc"]["test"]
    result = quality.logistic_regression(tmp_path)
    lr = result["logistic_regression"]
    assert result["rows"] == {"train": 4800, "validation": 600, "test": 600}
    assert 0.6 < lr["auc"] < teacher + 0.02, (lr, teacher)
    assert lr["l2"] in quality.L2_GRID
    assert lr["ne"] < 1.0  # better than predicting the base rate
    assert result["base_rate"]["auc"] == pytest.approx(0.5)


def test_kfold_rows_partition_the_file_and_never_leak() -> None:
    lines = [f"row{i}\n" for i in range(23)]
    held = []
    for k in range(5):
        rest, fold = quality.fold_rows(lines, 5, k)
        assert not set(rest) & set(fold)  # training never reads a held-out row
        assert sorted(rest + fold) == sorted(lines)
        assert fold == [f"row{i}\n" for i in range(k, 23, 5)]
        held += fold
    assert sorted(held) == sorted(lines)  # every row held out exactly once


def test_logistic_regression_scores_the_held_out_dataset(tmp_path: Path) -> None:
    generate(tmp_path, rows=3000, num_dense=3, cardinalities=[50, 20, 200],
             pooling_factors=[1.0, 1.0, 2.0], zipf_alpha=1.05, seed=4)
    own = quality.logistic_regression(tmp_path)
    # the dataset itself as the held-out one: the same fit scored on the same rows
    same = quality.logistic_regression(tmp_path, held_out=tmp_path)
    assert same["logistic_regression"]["auc"] == own["logistic_regression"]["auc"]
    assert same["logistic_regression"]["l2"] == own["logistic_regression"]["l2"]
