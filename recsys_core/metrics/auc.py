"""ROC AUC (TorchRec's ``torchrec.metrics.auc``), over the window of recent samples.

Equal predictions are one threshold (tie-aware, as ``torchmetrics``/scikit-learn); TorchRec
sorts without grouping ties, so its value for tied scores depends on their order. No positive
or no negative weight gives 0.5 (TorchRec's no-signal default).
"""

import torch
import torch.distributed as dist

from recsys_core.metrics.metrics_namespace import MetricName, MetricNamespace
from recsys_core.metrics.rec_metric import RecMetric


def compute_auc_one(
    predictions: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """Weighted ROC AUC of one task (trapezoids over distinct thresholds)."""
    if predictions.numel() == 0:
        return torch.tensor(0.5, dtype=torch.double)
    order = torch.argsort(predictions, descending=True)
    p, y, w = predictions[order], labels[order].double(), weights[order].double()
    tp = torch.cumsum(w * y, 0)
    fp = torch.cumsum(w * (1.0 - y), 0)
    # keep the last index of each run of equal predictions: one ROC point per threshold
    last = torch.ones_like(p, dtype=torch.bool)
    last[:-1] = p[1:] != p[:-1]
    tp = torch.cat([tp.new_zeros(1), tp[last]])
    fp = torch.cat([fp.new_zeros(1), fp[last]])
    if tp[-1] * fp[-1] == 0:
        return torch.tensor(0.5, dtype=torch.double)
    return torch.trapz(tp, fp) / (tp[-1] * fp[-1])


def compute_auc(
    n_tasks: int,
    predictions: list[torch.Tensor],
    labels: list[torch.Tensor],
    weights: list[torch.Tensor],
) -> torch.Tensor:
    """AUC per task (``[n_tasks]``) for per-task rows of predictions, labels and weights."""
    return torch.stack(
        [compute_auc_one(predictions[t], labels[t], weights[t]) for t in range(n_tasks)]
    )


class AUCMetric(RecMetric):
    """Window AUC (``auc-<task>|window_auc``); the samples of the window are kept."""

    _namespace = MetricNamespace.AUC
    _has_lifetime = False

    def _batch_states(
        self, predictions: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        return {"predictions": predictions, "labels": labels, "weights": weights}

    def _merge(
        self, a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        return {k: torch.cat([a[k], b[k]]) for k in b} if a else dict(b)

    def _sync(self, states: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return states
        gathered: list[dict[str, torch.Tensor] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, {k: v.cpu() for k, v in states.items()})
        return {k: torch.cat([g[k] for g in gathered if g is not None]) for k in states}

    def _values(self, s: dict[str, torch.Tensor]) -> dict[MetricName, torch.Tensor]:
        return {MetricName.AUC: compute_auc_one(s["predictions"], s["labels"], s["weights"])}


__all__ = ["AUCMetric", "compute_auc", "compute_auc_one"]
