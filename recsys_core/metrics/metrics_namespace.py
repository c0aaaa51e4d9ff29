"""Metric names and the key format of TorchRec's ``torchrec.metrics.metrics_namespace``:
``"{namespace}-{task}|{prefix}{name}"``, e.g. ``"ne-DefaultTask|lifetime_ne"``."""

from enum import Enum


class MetricName(Enum):
    NE = "ne"
    LOG_LOSS = "logloss"
    AUC = "auc"
    CALIBRATION = "calibration"


class MetricNamespace(Enum):
    NE = "ne"
    AUC = "auc"
    CALIBRATION = "calibration"


class MetricPrefix(Enum):
    DEFAULT = ""
    LIFETIME = "lifetime_"
    WINDOW = "window_"


def compose_metric_key(
    namespace: MetricNamespace, task_name: str, metric_name: MetricName, prefix: MetricPrefix
) -> str:
    return f"{namespace.value}-{task_name}|{prefix.value}{metric_name.value}"


__all__ = ["MetricName", "MetricNamespace", "MetricPrefix", "compose_metric_key"]
