"""Normalized entropy (TorchRec's ``torchrec.metrics.ne``): the weighted log loss divided by
the log loss of always predicting the (weighted) mean label. 1.0 = no better than the base
rate; lower is better. Computed in float64 with predictions clamped to ``[eta, 1 - eta]``."""

import torch

from recsys_core.metrics.metrics_namespace import MetricName, MetricNamespace
from recsys_core.metrics.rec_metric import RecMetric

ETA = 1e-12


def compute_cross_entropy(
    labels: torch.Tensor, predictions: torch.Tensor, weights: torch.Tensor, eta: float
) -> torch.Tensor:
    """Per-sample weighted binary cross entropy in bits (log2)."""
    p = predictions.double().clamp(min=eta, max=1 - eta)
    return -weights * labels * torch.log2(p) - weights * (1.0 - labels) * torch.log2(1.0 - p)


def compute_ne(
    ce_sum: torch.Tensor,
    weighted_num_samples: torch.Tensor,
    pos_labels: torch.Tensor,
    neg_labels: torch.Tensor,
    eta: float,
) -> torch.Tensor:
    """``ce_sum / (cross entropy of predicting mean_label for every sample)``."""
    mean_label = (pos_labels / weighted_num_samples.double().clamp(min=eta)).clamp(eta, 1 - eta)
    norm = -pos_labels * torch.log2(mean_label) - neg_labels * torch.log2(1.0 - mean_label)
    return ce_sum / norm


def compute_logloss(
    ce_sum: torch.Tensor, pos_labels: torch.Tensor, neg_labels: torch.Tensor, eta: float
) -> torch.Tensor:
    """Mean cross entropy (bits) per unit of label weight."""
    return ce_sum / (pos_labels + neg_labels).clamp(min=eta)


class NEMetric(RecMetric):
    """Reports ``ne`` and ``logloss`` (lifetime and window)."""

    _namespace = MetricNamespace.NE

    def _batch_states(
        self, predictions: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        return {
            "cross_entropy_sum": compute_cross_entropy(labels, predictions, weights, ETA).sum(),
            "weighted_num_samples": weights.sum(),
            "pos_labels": (weights * labels).sum(),
            "neg_labels": (weights * (1.0 - labels)).sum(),
        }

    def _values(self, s: dict[str, torch.Tensor]) -> dict[MetricName, torch.Tensor]:
        return {
            MetricName.NE: compute_ne(
                s["cross_entropy_sum"], s["weighted_num_samples"], s["pos_labels"],
                s["neg_labels"], ETA,
            ),
            MetricName.LOG_LOSS: compute_logloss(
                s["cross_entropy_sum"], s["pos_labels"], s["neg_labels"], ETA
            ),
        }


__all__ = ["NEMetric", "compute_cross_entropy", "compute_logloss", "compute_ne"]
