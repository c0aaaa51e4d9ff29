"""Recommendation metrics (TorchRec's ``torchrec.metrics`` essentials) behind a
``RecMetricModule``: TorchRec's streaming NE / log loss, window AUC and calibration, and the
exact, rank-invariant AUC / NE / logloss / accuracy / calibration over every row
(``BinaryClassificationMetrics``, and ``ExactBinaryMetric`` for a ``RecMetricList``)."""

from recsys_core.metrics.auc import AUCMetric
from recsys_core.metrics.calibration import CalibrationMetric
from recsys_core.metrics.exact import BinaryClassificationMetrics, ExactBinaryMetric
from recsys_core.metrics.metric_module import RecMetricModule
from recsys_core.metrics.ne import NEMetric
from recsys_core.metrics.rec_metric import RecMetric, RecMetricList, RecTaskInfo

__all__ = [
    "AUCMetric",
    "BinaryClassificationMetrics",
    "CalibrationMetric",
    "ExactBinaryMetric",
    "NEMetric",
    "RecMetric",
    "RecMetricList",
    "RecMetricModule",
    "RecTaskInfo",
]
