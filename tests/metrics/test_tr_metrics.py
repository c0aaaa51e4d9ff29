"""NE, AUC and calibration against hand formulas and torchmetrics."""

import math

import pytest
import torch
from torchmetrics.functional.classification import binary_auroc

from recsys_core.metrics import (
    AUCMetric,
    CalibrationMetric,
    NEMetric,
    RecMetricList,
    RecMetricModule,
    RecTaskInfo,
)

TASKS = [RecTaskInfo(name="t")]


def _module(window: int = 1000) -> RecMetricModule:
    metrics = [m(1, 0, 4, TASKS, window_size=window) for m in (NEMetric, AUCMetric, CalibrationMetric)]
    return RecMetricModule(batch_size=4, world_size=1, rec_tasks=TASKS, rec_metrics=RecMetricList(metrics))


def test_ne_logloss_calibration_by_hand() -> None:
    p = torch.tensor([0.9, 0.2, 0.6, 0.4])
    y = torch.tensor([1.0, 0.0, 1.0, 1.0])
    w = torch.tensor([1.0, 2.0, 1.0, 0.5])
    module = _module()
    module.update({"prediction": p, "label": y, "weight": w})
    out = module.compute()
    ce = sum(
        -wi * (yi * math.log2(pi) + (1 - yi) * math.log2(1 - pi))
        for pi, yi, wi in zip(p.tolist(), y.tolist(), w.tolist(), strict=True)
    )
    pos, neg = 2.5, 2.0
    base = -(pos * math.log2(pos / 4.5) + neg * math.log2(neg / 4.5))
    assert out["ne-t|lifetime_ne"].item() == pytest.approx(ce / base)
    assert out["ne-t|lifetime_logloss"].item() == pytest.approx(ce / 4.5)
    cal = (0.9 + 0.4 + 0.6 + 0.2) / 2.5
    assert out["calibration-t|lifetime_calibration"].item() == pytest.approx(cal)
    assert "auc-t|lifetime_auc" not in out  # AUC is a window metric


def test_auc_matches_torchmetrics_with_ties_and_batches() -> None:
    torch.manual_seed(0)
    module = _module()
    preds, labels = [], []
    for _ in range(3):
        p = torch.randint(0, 5, (4,)).float() / 4  # many ties
        y = torch.randint(0, 2, (4,)).float()
        module.update({"prediction": p, "label": y})
        preds.append(p)
        labels.append(y)
    expected = binary_auroc(torch.cat(preds), torch.cat(labels).long())
    assert module.compute()["auc-t|window_auc"].item() == pytest.approx(expected.item())


def test_window_keeps_recent_batches_only() -> None:
    module = _module(window=4)
    module.update({"prediction": torch.full((4,), 0.9), "label": torch.zeros(4)})
    module.update({"prediction": torch.full((4,), 0.5), "label": torch.ones(4)})
    out = module.compute()
    assert out["calibration-t|window_calibration"].item() == pytest.approx(0.5)
    assert out["calibration-t|lifetime_calibration"].item() == pytest.approx((3.6 + 2.0) / 4)
    with pytest.raises(KeyError, match="label"):
        module.update({"prediction": torch.ones(2)})
