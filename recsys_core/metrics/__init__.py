"""Streaming recommendation metrics (TorchRec's ``torchrec.metrics`` essentials): NE / log loss,
AUC and calibration behind a ``RecMetricModule``."""

from recsys_core.metrics.auc import AUCMetric
from recsys_core.metrics.calibration import CalibrationMetric
from recsys_core.metrics.metric_module import RecMetricModule
from recsys_core.metrics.ne import NEMetric
from recsys_core.metrics.rec_metric import RecMetric, RecMetricList, RecTaskInfo

__all__ = [
    "AUCMetric",
    "CalibrationMetric",
    "NEMetric",
    "RecMetric",
    "RecMetricList",
    "RecMetricModule",
    "RecTaskInfo",
]
