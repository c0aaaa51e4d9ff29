"""The report's curves: ROC and reliability (calibration) points from rows already gathered
(``recsys_core.metrics.BinaryClassificationMetrics.gather_rows``); host-side numpy."""

from __future__ import annotations

import numpy as np
import torch


def roc_curve(scores: np.ndarray | torch.Tensor,
              labels: np.ndarray | torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """The ROC curve ``(fpr, tpr)``: one point per distinct score, from (0, 0) to (1, 1).

    Thresholds run from the highest score down; rows with equal scores enter together, so a tie
    group is one diagonal segment and the trapezoid area under the curve equals the
    Mann-Whitney AUC with ties counting 1/2 (``BinaryClassificationMetrics``' ``auc``)::

        scores [0.1, 0.4, 0.35, 0.8], labels [0, 0, 1, 1]
        threshold >= 0.8: tp 1 fp 0 -> (0, 0.5);  >= 0.4: (0.5, 0.5);  >= 0.35: (0.5, 1)
        >= 0.1: (1, 1);  fpr [0, 0, .5, .5, 1], tpr [0, .5, .5, 1, 1];  area 0.75

    Any monotone transform of the scores (logits or probabilities) gives the same curve.
    Raises ValueError when the labels are not all 0/1, hold only one class (no curve exists),
    or the scores are not finite.
    """
    s, y = _curve_inputs(scores, labels, "roc_curve", "scores")
    positives = int(y.sum())
    negatives = y.size - positives
    if positives == 0 or negatives == 0:
        raise ValueError(f"roc_curve: {positives} positive and {negatives} negative labels; a "
                         "ROC curve needs both classes")
    order = np.argsort(-s, kind="stable")
    s, y = s[order], y[order]
    # the last row of each run of equal scores closes one threshold
    last = np.flatnonzero(np.r_[s[1:] != s[:-1], True])
    tp = np.cumsum(y, dtype=np.int64)[last]
    fp = (last + 1) - tp
    fpr = np.r_[0.0, fp / negatives]
    tpr = np.r_[0.0, tp / positives]
    return fpr, tpr


def calibration_curve(probabilities: np.ndarray | torch.Tensor,
                      labels: np.ndarray | torch.Tensor,
                      bins: int = 10) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A reliability diagram's points ``(mean_predicted, observed_rate, counts)``.

    ``[0, 1]`` is cut into ``bins`` equal bins (the last includes 1.0); for each bin holding
    rows: the mean predicted probability, the fraction of positive labels, and the row count.
    Empty bins are left out (as scikit-learn does), so the arrays can be shorter than ``bins``.
    A calibrated model has ``observed_rate == mean_predicted``::

        probabilities [0.1, 0.2, 0.7, 0.9], labels [0, 1, 1, 1], bins=2
        -> mean_predicted [0.15, 0.8], observed_rate [0.5, 1.0], counts [2, 2]

    Raises ValueError for probabilities outside [0, 1], labels other than 0/1, or bins < 1.
    """
    if isinstance(bins, bool) or not isinstance(bins, int) or bins < 1:
        raise ValueError(f"calibration_curve: bins must be a positive int, got {bins!r}")
    p, y = _curve_inputs(probabilities, labels, "calibration_curve", "probabilities")
    if p.size and (p.min() < 0 or p.max() > 1):
        raise ValueError(f"calibration_curve: probabilities must lie in [0, 1], got values in "
                         f"[{p.min()}, {p.max()}]; apply a sigmoid to logits first")
    index = np.minimum((p * bins).astype(np.int64), bins - 1)
    counts = np.bincount(index, minlength=bins)
    predicted = np.bincount(index, weights=p, minlength=bins)
    positives = np.bincount(index, weights=y, minlength=bins)
    kept = counts > 0
    return predicted[kept] / counts[kept], positives[kept] / counts[kept], counts[kept]


def _curve_inputs(values: np.ndarray | torch.Tensor, labels: np.ndarray | torch.Tensor,
                  where: str, name: str) -> tuple[np.ndarray, np.ndarray]:
    """float64 values and int64 0/1 labels as 1-D numpy arrays of one length (or raise)."""
    v = np.asarray(values.detach().cpu() if isinstance(values, torch.Tensor) else values,
                   dtype=np.float64)
    y = np.asarray(labels.detach().cpu() if isinstance(labels, torch.Tensor) else labels)
    if v.ndim != 1 or y.shape != v.shape:
        raise ValueError(f"{where}: {name} {v.shape} and labels {y.shape} must both be 1-D of "
                         "the same length")
    if not np.isfinite(v).all():
        raise ValueError(f"{where}: {int((~np.isfinite(v)).sum())} {name} are NaN or infinite; "
                         "check the model's outputs")
    if not np.isin(y, (0, 1)).all():
        raise ValueError(f"{where}: labels must be 0 or 1, got {np.unique(y)[:5].tolist()}...")
    return v, y.astype(np.int64)
