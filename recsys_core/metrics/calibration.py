"""Calibration (TorchRec's ``torchrec.metrics.calibration``): sum of weighted predictions over
sum of weighted labels; 1.0 means the model predicts as many positives as there are (0 when
there are no positive labels)."""

import torch

from recsys_core.metrics.metrics_namespace import MetricName, MetricNamespace
from recsys_core.metrics.rec_metric import RecMetric


def compute_calibration(calibration_num: torch.Tensor, calibration_denom: torch.Tensor) -> torch.Tensor:
    return torch.where(
        calibration_denom <= 0.0, 0.0, calibration_num / calibration_denom
    ).double()


class CalibrationMetric(RecMetric):
    _namespace = MetricNamespace.CALIBRATION

    def _batch_states(
        self, predictions: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        return {
            "calibration_num": (weights * predictions).sum(),
            "calibration_denom": (weights * labels).sum(),
        }

    def _values(self, s: dict[str, torch.Tensor]) -> dict[MetricName, torch.Tensor]:
        return {
            MetricName.CALIBRATION: compute_calibration(s["calibration_num"], s["calibration_denom"])
        }


__all__ = ["CalibrationMetric", "compute_calibration"]
