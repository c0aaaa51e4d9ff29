"""ROC / calibration curves and gathering rows for them."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dlrm_app.metrics import BinaryClassificationMetrics, calibration_curve, roc_curve
from recsys_core.testing import run_gloo


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def exact_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    metrics = BinaryClassificationMetrics()
    metrics.update(torch.as_tensor(scores, dtype=torch.float64), torch.as_tensor(labels))
    return metrics.compute()["auc"]


# ---- curves -------------------------------------------------------------------------------------
@pytest.mark.parametrize(("scores", "labels", "fpr", "tpr"), [
    # distinct scores: one threshold per row
    ([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1], [0, 0, 0.5, 0.5, 1], [0, 0.5, 0.5, 1, 1]),
    # 0.5 is shared by a positive and a negative: one diagonal step
    ([0.5, 0.5, 0.2, 0.9], [1, 0, 0, 1], [0, 0, 0.5, 1], [0, 0.5, 1, 1]),
    # every score tied: the diagonal
    ([3.0, 3.0, 3.0], [1, 0, 0], [0, 1], [0, 1]),
])
def test_roc_curve_by_hand(scores: list[float], labels: list[int], fpr: list[float],
                           tpr: list[float]) -> None:
    got_fpr, got_tpr = roc_curve(np.array(scores), np.array(labels))
    np.testing.assert_array_equal(got_fpr, fpr)
    np.testing.assert_array_equal(got_tpr, tpr)
    assert np.trapezoid(got_tpr, got_fpr) == pytest.approx(exact_auc(np.array(scores),
                                                                     np.array(labels)), abs=1e-15)


@pytest.mark.parametrize("distinct", [3, 50, 10_000, None])
def test_roc_area_is_the_exact_auc(distinct: int | None) -> None:
    rng = np.random.default_rng(distinct or 1)
    n = 20_000
    scores = (rng.integers(0, distinct, n).astype(np.float64) if distinct
              else rng.standard_normal(n))
    labels = (rng.random(n) < 0.2 + 0.3 * (scores > np.median(scores))).astype(np.uint8)
    fpr, tpr = roc_curve(torch.tensor(scores), torch.tensor(labels))  # tensors work too
    assert np.all(np.diff(fpr) >= 0) and np.all(np.diff(tpr) >= 0)
    assert (fpr[0], tpr[0], fpr[-1], tpr[-1]) == (0, 0, 1, 1)
    assert fpr.size == np.unique(scores).size + 1
    assert np.trapezoid(tpr, fpr) == pytest.approx(exact_auc(scores, labels), abs=1e-12)


def test_roc_curve_refuses_bad_input() -> None:
    with pytest.raises(ValueError, match="needs both classes"):
        roc_curve(np.array([0.1, 0.2]), np.array([1, 1]))
    with pytest.raises(ValueError, match="NaN or infinite"):
        roc_curve(np.array([0.1, math.nan]), np.array([0, 1]))
    with pytest.raises(ValueError, match="must be 0 or 1"):
        roc_curve(np.array([0.1, 0.2]), np.array([0, 2]))
    with pytest.raises(ValueError, match="same length"):
        roc_curve(np.array([0.1, 0.2]), np.array([0, 1, 1]))


def test_calibration_curve_by_hand() -> None:
    # bins of 0.1: 0.05 -> 0; 0.15, 0.12 -> 1; 0.5 -> 5; 0.95 and 1.0 (last bin closed) -> 9
    probabilities = np.array([0.05, 0.15, 0.12, 0.95, 1.0, 0.5])
    labels = np.array([0, 1, 0, 1, 1, 0])
    predicted, observed, counts = calibration_curve(probabilities, labels, bins=10)
    np.testing.assert_allclose(predicted, [0.05, 0.135, 0.5, 0.975], rtol=0, atol=1e-15)
    np.testing.assert_array_equal(observed, [0, 0.5, 0, 1])
    np.testing.assert_array_equal(counts, [1, 2, 1, 2])
    predicted, observed, counts = calibration_curve([0.1, 0.2, 0.7, 0.9], [0, 1, 1, 1], bins=2)
    np.testing.assert_allclose(predicted, [0.15, 0.8])
    np.testing.assert_array_equal(observed, [0.5, 1])
    np.testing.assert_array_equal(counts, [2, 2])


def test_calibration_curve_refuses_bad_input() -> None:
    with pytest.raises(ValueError, match=r"in \[0, 1\].*sigmoid"):
        calibration_curve(np.array([0.5, 1.5]), np.array([0, 1]))
    with pytest.raises(ValueError, match="bins must be a positive int"):
        calibration_curve(np.array([0.5]), np.array([1]), bins=0)


def _gather_worker(rank: int, world_size: int) -> tuple[list[float], list[int]] | None:
    metrics = BinaryClassificationMetrics()
    if rank != 1:  # rank 1 sees no rows at all
        metrics.update(torch.tensor([rank + 0.5, rank + 0.25]), torch.tensor([rank % 2, 1]))
    rows = metrics.gather_rows()
    return None if rows is None else (rows[0].tolist(), rows[1].tolist())


def test_gather_rows_brings_every_rank_to_rank_0() -> None:
    results = run_gloo(3, _gather_worker)
    assert results[1] is None and results[2] is None
    assert results[0] == ([0.5, 0.25, 2.5, 2.25], [0, 1, 0, 1])
