"""Metric names and the key format of TorchRec's ``torchrec.metrics.metrics_namespace``:
``"{namespace}-{task}|{prefix}{name}"``, e.g. ``"ne-DefaultTask|lifetime_ne"``."""

from enum import Enum


class MetricName(Enum):
    NE = "ne"
    LOG_LOSS = "logloss"
    AUC = "auc"
    CALIBRATION = "calibration"
    ACCURACY = "accuracy"
    CTR = "ctr"
    PREDICTION_AVERAGE = "prediction_average"
    TOTAL_EXAMPLES = "total_examples"


class MetricNamespace(Enum):
    NE = "ne"
    AUC = "auc"
    CALIBRATION = "calibration"
    EXACT = "exact"
    """Ours, not TorchRec's: ``ExactBinaryMetric`` (every row of the group, rank-invariant)."""


class MetricPrefix(Enum):
    DEFAULT = ""
    LIFETIME = "lifetime_"
    WINDOW = "window_"


def compose_metric_key(
    namespace: MetricNamespace, task_name: str, metric_name: MetricName, prefix: MetricPrefix
) -> str:
    return f"{namespace.value}-{task_name}|{prefix.value}{metric_name.value}"


__all__ = ["MetricName", "MetricNamespace", "MetricPrefix", "compose_metric_key"]
