"""Exact binary-classification metrics (AUC, normalized entropy, logloss, accuracy,
calibration) over every row of a process group, the same for any number of ranks.

``BinaryClassificationMetrics`` is the computation (what ``dlrm-app evaluate`` reports);
``ExactBinaryMetric`` puts it in a ``RecMetricList`` behind ``RecMetricModule``, next to
TorchRec's streaming metrics (``NEMetric``, ``AUCMetric``, ``CalibrationMetric``), which sum
per-batch states or keep a window of recent rows and are not exact across ranks.

Every rank feeds its own rows with ``update(logits, labels)``; ``compute()`` is a collective:
it gathers all rows of the process group onto group rank 0, which computes every metric once
from the concatenated rows and broadcasts the numbers, so all ranks return the same dict. The
rows are first put in a canonical order (sorted by logit, negatives before positives on ties),
which makes the result independent of how the rows were split over ranks and batches::

    1 rank:   update([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1])
    2 ranks:  rank 0 update([0.8, 0.1], [1, 0]);  rank 1 update([0.4, 0.35], [0, 1])
    both:     canonical rows  (0.1, 0)  (0.35, 1)  (0.4, 0)  (0.8, 1)  ->  auc 0.75

AUC is the Mann-Whitney statistic with average ranks for ties, computed in int64 from the
sorted rows and divided once (a correctly rounded float): it is bitwise equal for any split.
The float64 sums (logloss, predictions) run over the rows in the canonical order; they are
equal to within a few ulps for any split, and bitwise equal where torch's sum uses the same
number of threads.

Why not ``torchmetrics.classification.BinaryAUROC`` (torchmetrics 1.9): (1) when a rank saw no
rows its sync sends a float32 placeholder while the others send int64 targets, and gloo aborts
with a size mismatch; (2) it applies the sigmoid per batch, only when some value lies outside
[0, 1]: logits [0.5, 0.8] then [0.1, 5.0] with labels [0, 1] then [1, 0] give 0.5, not 0.25;
(3) its trapezoid runs in float32, and even a float64 sigmoid ties logits above ~37. Sorting the
logits themselves needs no sigmoid.

Memory: the metric keeps every row it saw until ``reset()``, 9 bytes a row (a float64 logit and
a uint8 label) on the device of the inputs. ``compute()`` holds all rows of the group on group
rank 0, on the device the backend communicates on (CPU for gloo, the GPU for NCCL): about
``world_size * max rows per rank * 9`` bytes gathered, plus ~55 bytes a row while sorting
(measured on CPU, 10M distinct logits), e.g. ~6.5 GB for 100M evaluation rows, transiently.
There is no ``max_examples`` cap: AUC over a sample would not be exact.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from recsys_core.metrics.metrics_namespace import (
    MetricName,
    MetricNamespace,
    MetricPrefix,
    compose_metric_key,
)
from recsys_core.metrics.rec_metric import RecTaskInfo

# compute() packs the float metrics into one tensor in this order to broadcast them.
_FLOAT_KEYS = ("auc", "ne", "logloss", "accuracy", "calibration", "label_rate", "mean_prediction")
# Twice the sum of ranks of the positives is at most 2 n^2, which must fit in int64.
_MAX_ROWS = 2**31


class BinaryClassificationMetrics:
    """Exact AUC, NE, logloss, accuracy and calibration of a binary classifier over all ranks.

    ``compute()`` returns (``n`` rows in the whole group, ``p`` = fraction of positive labels):

    - ``auc``: probability that a random positive row has a higher logit than a random
      negative one, ties counting 1/2 (Mann-Whitney U / (positives * negatives)); NaN if
      there are no positives or no negatives.
    - ``logloss``: mean binary cross-entropy, computed from the logits in float64 (finite for
      any finite logit, e.g. +-100).
    - ``ne``: normalized entropy, ``logloss / H(p)`` with ``H(p) = -p ln p - (1-p) ln(1-p)``,
      the logloss of always predicting the base rate: below 1 beats that baseline. NaN when
      ``p`` is 0 or 1: then ``H(p) = 0``, a constant prediction is already perfect and there is
      no baseline to normalize by.
    - ``accuracy``: fraction of rows with ``(sigmoid(logit) > 0.5) == label``, i.e. ``logit > 0``
      (a logit of exactly 0 predicts negative).
    - ``calibration``: ``mean_prediction / label_rate`` (1 is calibrated); NaN when ``p == 0``.
    - ``num_examples`` (int) ``n``; ``label_rate`` ``p``; ``mean_prediction`` the mean of
      ``sigmoid(logit)``.

    With no rows at all every value is NaN except ``num_examples == 0``.

    Args:
        process_group: the ranks whose rows are evaluated together; ``None`` means the default
            (world) group when ``torch.distributed`` is initialized when ``compute()`` runs,
            else this process alone. Every rank of the group must call ``compute()``.

    Example (each rank of a data-parallel validation)::

        metrics = BinaryClassificationMetrics()
        for batch in val_loader:
            metrics.update(model(batch).squeeze(1), batch.labels)
        print(metrics.compute()["auc"])
        metrics.reset()
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        self.process_group = process_group
        self._logits: list[torch.Tensor] = []
        self._labels: list[torch.Tensor] = []
        # Per batch: [non-finite logits, labels not 0/1, weights not 1]; checked in compute() so
        # that update() never waits for the device.
        self._invalid: list[torch.Tensor] = []

    def update(
        self, logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None = None
    ) -> None:
        """Add a batch: ``logits`` [B] (before the sigmoid), ``labels`` [B] of 0/1 (any dtype).

        Every row counts once: ``weights`` [B], if given, must be all 1 (``compute()`` raises
        otherwise); it is accepted so that a ``RecMetricModule`` output with unit weights can
        be fed unchanged.
        """
        shapes = [logits.shape, labels.shape] + ([] if weights is None else [weights.shape])
        if logits.ndim != 1 or any(shape != logits.shape for shape in shapes):
            raise ValueError(
                f"BinaryClassificationMetrics.update: logits {tuple(logits.shape)}, labels "
                f"{tuple(labels.shape)}"
                + ("" if weights is None else f" and weights {tuple(weights.shape)}")
                + " must all be 1-D of the same length; squeeze a [B, 1] model output with "
                ".squeeze(1)"
            )
        if not logits.is_floating_point():
            raise TypeError(
                f"BinaryClassificationMetrics.update: logits must be floating point, got "
                f"{logits.dtype}; pass the model's pre-sigmoid output"
            )
        logits, labels = logits.detach(), labels.detach()
        non_unit_weights = (
            logits.new_zeros((), dtype=torch.int64) if weights is None
            else (weights.detach() != 1).sum()
        )
        self._invalid.append(torch.stack([
            (~torch.isfinite(logits)).sum(), ((labels != 0) & (labels != 1)).sum(),
            non_unit_weights,
        ]))
        self._logits.append(logits.to(torch.float64))
        self._labels.append(labels.to(torch.uint8))

    def reset(self) -> None:
        """Forget all rows (call between evaluations)."""
        self._logits, self._labels, self._invalid = [], [], []

    def compute(self) -> dict[str, float]:
        """The metrics over every row that any rank of the group has seen; a collective."""
        group = self._group()
        if self._logits:
            logits, labels = torch.cat(self._logits), torch.cat(self._labels)
            invalid = torch.stack(self._invalid).sum(0)
        else:
            logits = torch.empty(0, dtype=torch.float64)
            labels = torch.empty(0, dtype=torch.uint8)
            invalid = torch.zeros(3, dtype=torch.int64)
        if group is None:
            _check_rows([logits.numel()], [invalid.tolist()])
            return _as_dict(logits.numel(), _metrics(logits, labels))

        world = dist.get_world_size(group)
        device = _collective_device(group)
        meta = torch.cat([torch.tensor([logits.numel()]), invalid.cpu()]).to(device)
        metas = [torch.empty_like(meta) for _ in range(world)]
        dist.all_gather(metas, meta, group=group)
        rows = torch.stack(metas).tolist()
        sizes = [r[0] for r in rows]
        _check_rows(sizes, [r[1:] for r in rows])  # every rank raises alike: nobody hangs
        if sum(sizes) == 0:
            return _as_dict(0, _metrics(logits, labels))
        all_logits = _gather_to_first(logits.to(device), sizes, group)
        all_labels = _gather_to_first(labels.to(device), sizes, group)
        values = torch.empty(len(_FLOAT_KEYS), dtype=torch.float64, device=device)
        if all_logits is not None and all_labels is not None:  # group rank 0
            found = _metrics(all_logits, all_labels)
            values.copy_(torch.tensor(found, dtype=torch.float64))
        dist.broadcast(values, group=group, group_src=0)
        return _as_dict(sum(sizes), values.tolist())

    def gather_rows(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Every row the group has seen as CPU ``(float64 logits, uint8 labels)`` on group
        rank 0, ``None`` on the other ranks; a collective, like ``compute()``.

        For curves (``roc_curve``, ``calibration_curve``, ``dlrm_app.reporting.report.save_evaluation``),
        which need all rows. The row order is by rank, then by ``update()`` call; it is not
        canonical (curves do not depend on it). Memory on group rank 0 as in ``compute()``.
        """
        group = self._group()
        logits = torch.cat(self._logits) if self._logits else torch.empty(0, dtype=torch.float64)
        labels = torch.cat(self._labels) if self._labels else torch.empty(0, dtype=torch.uint8)
        if group is None:
            return logits.cpu(), labels.cpu()
        device = _collective_device(group)
        size = torch.tensor([logits.numel()], device=device)
        sizes_t = [torch.empty_like(size) for _ in range(dist.get_world_size(group))]
        dist.all_gather(sizes_t, size, group=group)
        sizes = [int(s) for s in sizes_t]
        first = dist.get_rank(group) == 0
        if sum(sizes) == 0:
            return (logits.cpu(), labels.cpu()) if first else None
        all_logits = _gather_to_first(logits.to(device), sizes, group)
        all_labels = _gather_to_first(labels.to(device), sizes, group)
        if all_logits is None or all_labels is None:
            return None
        return all_logits.cpu(), all_labels.cpu()

    def _group(self) -> dist.ProcessGroup | None:
        """The group to gather over, or None to compute from this process's rows alone."""
        group = self.process_group
        if group is None and dist.is_available() and dist.is_initialized():
            group = dist.group.WORLD
        if group is None or dist.get_world_size(group) == 1:
            return None
        return group


def _collective_device(group: dist.ProcessGroup) -> torch.device:
    # NCCL only moves CUDA tensors; gloo (and a "cpu:gloo,cuda:nccl" group) moves CPU ones.
    if dist.get_backend(group) == dist.Backend.NCCL:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _check_rows(sizes: list[int], invalid: list[list[int]]) -> None:
    """Raise (on every rank alike) for bad logits or labels, or too many rows for int64 AUC."""
    for rank, (bad_logits, bad_labels, bad_weights) in enumerate(invalid):
        if bad_logits or bad_labels:
            raise ValueError(
                f"BinaryClassificationMetrics.compute: group rank {rank} passed {bad_logits} "
                f"non-finite logits and {bad_labels} labels other than 0/1 to update(); check "
                "the model for NaN/inf outputs and the dataset's label column"
            )
        if bad_weights:
            raise ValueError(
                f"BinaryClassificationMetrics.compute: group rank {rank} passed {bad_weights} "
                "weights other than 1 to update(); the exact metrics count every row once: "
                "leave the weights out, or use the weighted NEMetric / AUCMetric"
            )
    if sum(sizes) >= _MAX_ROWS:
        raise ValueError(
            f"BinaryClassificationMetrics.compute: {sum(sizes)} rows exceed the {_MAX_ROWS} "
            "that the exact int64 AUC supports; evaluate on fewer rows or in several parts"
        )


def _gather_to_first(
    local: torch.Tensor, sizes: list[int], group: dist.ProcessGroup
) -> torch.Tensor | None:
    """All ranks' ``local`` (``sizes[r]`` rows, any may be 0) concatenated on group rank 0."""
    # dist.gather needs equal shapes: pad to the longest rank, trim after.
    padded = local.new_zeros(max(sizes))
    padded[: local.numel()] = local
    first = dist.get_rank(group) == 0
    out = [torch.empty_like(padded) for _ in sizes] if first else None
    dist.gather(padded, out, group=group, group_dst=0)
    if out is None:  # not group rank 0
        return None
    return torch.cat([t[:n] for t, n in zip(out, sizes, strict=True)])


def _metrics(logits: torch.Tensor, labels: torch.Tensor) -> list[float]:
    """The values of ``_FLOAT_KEYS`` for these rows (float64 logits, uint8 0/1 labels)."""
    n = logits.numel()
    if n == 0:
        return [math.nan] * len(_FLOAT_KEYS)
    # Canonical order: by logit, negatives first among equal logits (two stable sorts). Sums
    # then run over the same sequence however the rows were split.
    # (The dels keep the peak memory of a large evaluation down.)
    by_label = torch.sort(labels, stable=True).indices
    order = by_label[torch.sort(logits[by_label], stable=True).indices]
    del by_label
    z, y = logits[order], labels[order]
    del order

    positives = int(y.sum())
    auc = _mann_whitney_auc(z, y, positives)
    logloss = float(F.binary_cross_entropy_with_logits(z, y.double(), reduction="sum")) / n
    mean_prediction = float(torch.sigmoid(z).sum()) / n
    accuracy = int(((z > 0) == y.bool()).sum()) / n
    p = positives / n
    if 0 < p < 1:
        entropy = -(p * math.log(p) + (1 - p) * math.log1p(-p))
        ne = logloss / entropy
    else:
        ne = math.nan
    calibration = mean_prediction / p if positives else math.nan
    return [auc, ne, logloss, accuracy, calibration, p, mean_prediction]


def _mann_whitney_auc(z: torch.Tensor, y: torch.Tensor, positives: int) -> float:
    """AUC of rows sorted by logit ``z`` with 0/1 labels ``y``, ties by average rank.

    AUC = U / (P * N) with U = (sum of the positives' 1-based ranks) - P (P + 1) / 2. Ranks of
    a tie group covering sorted positions [s, e) average (s + 1 + e) / 2, so twice the rank sum
    is an exact int64 and the only rounding is the final division.
    """
    negatives = z.numel() - positives
    if positives == 0 or negatives == 0:
        return math.nan
    counts = torch.unique_consecutive(z, return_counts=True)[1]
    ends = counts.cumsum(0)
    twice_avg_rank = 2 * ends - counts + 1  # s + 1 + e with s = e - count
    pos_cum = y.cumsum(0, dtype=torch.int64)[ends - 1]
    pos_per_group = torch.diff(pos_cum, prepend=pos_cum.new_zeros(1))
    twice_rank_sum = int((pos_per_group * twice_avg_rank).sum())
    # Python int / int is correctly rounded, so the result depends only on the two integers.
    return (twice_rank_sum - positives * (positives + 1)) / (2 * positives * negatives)


def _as_dict(num_examples: int, values: list[float]) -> dict[str, float]:
    return {**dict(zip(_FLOAT_KEYS, values, strict=True)), "num_examples": num_examples}




# BinaryClassificationMetrics' keys -> TorchRec's metric names, for RecMetricModule's keys.
_REC_NAMES = {
    "auc": MetricName.AUC, "ne": MetricName.NE, "logloss": MetricName.LOG_LOSS,
    "accuracy": MetricName.ACCURACY, "calibration": MetricName.CALIBRATION,
    "label_rate": MetricName.CTR, "mean_prediction": MetricName.PREDICTION_AVERAGE,
    "num_examples": MetricName.TOTAL_EXAMPLES,
}


class ExactBinaryMetric(nn.Module):
    """``BinaryClassificationMetrics`` per task, as a member of a ``RecMetricList``.

    The task's predictions are the model's **logits** (before the sigmoid), unlike TorchRec's
    metrics, which take probabilities: name the logits output in the task's
    ``prediction_name``. Values cover every row since ``reset()`` on every rank of
    ``process_group`` (``lifetime_`` keys, namespace ``exact``); ``compute()`` is a collective
    that every rank calls, and it returns the same numbers on every rank::

        exact-DefaultTask|lifetime_auc, _ne, _logloss, _accuracy, _calibration,
        _ctr (label rate), _prediction_average (mean sigmoid), _total_examples (int64)

    A task whose group has seen no rows has no keys (like the streaming metrics).

    Args:
        world_size, my_rank, batch_size: TorchRec's ``RecMetric`` arguments (unused: the group
            and its ranks come from ``process_group``).
        tasks: the tasks to evaluate.
        process_group: the ranks evaluated together; ``None`` means the default group when
            ``torch.distributed`` is initialized, else this process alone.
    """

    def __init__(
        self,
        world_size: int,
        my_rank: int,
        batch_size: int,
        tasks: list[RecTaskInfo],
        *,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        if not tasks:
            raise ValueError("ExactBinaryMetric: at least one RecTaskInfo is required")
        self._tasks = list(tasks)
        self._metrics = [BinaryClassificationMetrics(process_group) for _ in self._tasks]

    def update(
        self,
        *,
        predictions: dict[str, torch.Tensor],
        labels: dict[str, torch.Tensor],
        weights: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """Add one batch: per task name, logits, 0/1 labels and optional weights (all 1)."""
        for task, metric in zip(self._tasks, self._metrics, strict=True):
            weight = None if weights is None else weights.get(task.name)
            metric.update(
                predictions[task.name].reshape(-1), labels[task.name].reshape(-1),
                None if weight is None else weight.reshape(-1),
            )

    def compute(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for task, metric in zip(self._tasks, self._metrics, strict=True):
            values = metric.compute()
            if values["num_examples"] == 0:
                continue
            for key, value in values.items():
                name = compose_metric_key(
                    MetricNamespace.EXACT, task.name, _REC_NAMES[key], MetricPrefix.LIFETIME
                )
                dtype = torch.int64 if key == "num_examples" else torch.float64
                out[name] = torch.tensor([value], dtype=dtype)
        return out

    def reset(self) -> None:
        for metric in self._metrics:
            metric.reset()


__all__ = ["BinaryClassificationMetrics", "ExactBinaryMetric"]
