"""The base of the streaming metrics (TorchRec's ``torchrec.metrics.rec_metric`` shape).

A metric keeps, per task, a few running sums ("states"). ``update`` adds one batch's sums;
``compute`` reduces them (across ranks when a process group is initialized) and returns
``{key: value}``. Lifetime values use every sample since the last ``reset``; window values
use the most recent batches holding ``window_size`` samples (per rank).
"""

import abc
import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from recsys_core.metrics.metrics_namespace import (
    MetricName,
    MetricNamespace,
    MetricPrefix,
    compose_metric_key,
)

if TYPE_CHECKING:
    from recsys_core.metrics.exact import ExactBinaryMetric

logger: logging.Logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RecTaskInfo:
    """One prediction task: where its predictions, labels and weights are in a model output."""

    name: str = "DefaultTask"
    label_name: str = "label"
    prediction_name: str = "prediction"
    weight_name: str = "weight"


class RecMetric(nn.Module, abc.ABC):
    """Streaming metric over one or more tasks.

    Subclasses define ``_namespace``, ``_batch_states`` (one batch's states: a dict of 1-D
    tensors, one entry per state, each summed across batches and ranks) and ``_values``
    (states -> ``{MetricName: value}``).
    """

    _namespace: MetricNamespace
    # False for metrics whose states grow with the data (AUC keeps the samples): window only
    _has_lifetime: bool = True

    def __init__(
        self,
        world_size: int,
        my_rank: int,
        batch_size: int,
        tasks: list[RecTaskInfo],
        window_size: int = 100,
    ) -> None:
        super().__init__()
        if not tasks:
            raise ValueError(f"{type(self).__name__}: at least one RecTaskInfo is required")
        self._world_size = world_size
        self._my_rank = my_rank
        self._batch_size = batch_size
        self._tasks = list(tasks)
        self._window_size = window_size
        self._lifetime: list[dict[str, torch.Tensor]] = [{} for _ in self._tasks]
        self._window: list[deque[tuple[int, dict[str, torch.Tensor]]]] = [
            deque() for _ in self._tasks
        ]

    @abc.abstractmethod
    def _batch_states(
        self, predictions: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        pass

    @abc.abstractmethod
    def _values(self, states: dict[str, torch.Tensor]) -> dict[MetricName, torch.Tensor]:
        pass

    def _merge(self, a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: a[k] + b[k] for k in b} if a else dict(b)

    def _sync(self, states: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return states
        out = {}
        for k, v in states.items():
            v = v.clone()
            dist.all_reduce(v)
            out[k] = v
        return out

    def update(
        self,
        *,
        predictions: dict[str, torch.Tensor],
        labels: dict[str, torch.Tensor],
        weights: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """Add one batch: per task name, predictions (probabilities in [0, 1]), labels and
        optional weights (default 1), each of shape ``[B]``."""
        for i, task in enumerate(self._tasks):
            p = predictions[task.name].detach().reshape(-1).double()
            y = labels[task.name].detach().reshape(-1).double()
            w = (
                weights[task.name].detach().reshape(-1).double()
                if weights is not None and task.name in weights
                else torch.ones_like(p)
            )
            if not (p.shape == y.shape == w.shape):
                raise ValueError(
                    f"{type(self).__name__} task {task.name!r}: predictions {list(p.shape)}, "
                    f"labels {list(y.shape)} and weights {list(w.shape)} must have one shape"
                )
            batch = self._batch_states(p, y, w)
            if self._has_lifetime:
                self._lifetime[i] = self._merge(self._lifetime[i], batch)
            window = self._window[i]
            window.append((p.numel(), batch))
            while sum(n for n, _ in window) - window[0][0] >= self._window_size:
                window.popleft()

    def compute(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for i, task in enumerate(self._tasks):
            if not self._window[i]:
                continue
            spans = [(MetricPrefix.LIFETIME, self._lifetime[i])] if self._has_lifetime else []
            window: dict[str, torch.Tensor] = {}
            for _, states in self._window[i]:
                window = self._merge(window, states)
            spans.append((MetricPrefix.WINDOW, window))
            for prefix, states in spans:
                for name, value in self._values(self._sync(states)).items():
                    key = compose_metric_key(self._namespace, task.name, name, prefix)
                    out[key] = value.reshape(-1)
        return out

    def reset(self) -> None:
        self._lifetime = [{} for _ in self._tasks]
        self._window = [deque() for _ in self._tasks]


class RecMetricList(nn.Module):
    """Several metrics updated and computed together: TorchRec's streaming ``RecMetric``s and
    this library's ``ExactBinaryMetric`` (same ``update`` / ``compute`` / ``reset``)."""

    def __init__(self, rec_metrics: Sequence["RecMetric | ExactBinaryMetric"]) -> None:
        super().__init__()
        self.rec_metrics = nn.ModuleList(rec_metrics)

    def update(self, **kwargs: dict[str, torch.Tensor]) -> None:
        for m in self.rec_metrics:
            m.update(**kwargs)

    def compute(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for m in self.rec_metrics:
            out.update(m.compute())
        return out

    def reset(self) -> None:
        for m in self.rec_metrics:
            m.reset()


__all__ = ["RecMetric", "RecMetricList", "RecTaskInfo"]
