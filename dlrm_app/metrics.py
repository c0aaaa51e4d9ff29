"""CTR evaluation metrics (AUC, normalized entropy, logloss, ...) that are exact across ranks.

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

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

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
        # Per batch: [non-finite logits, labels not 0/1]; checked in compute() so that update()
        # never waits for the device.
        self._invalid: list[torch.Tensor] = []

    def update(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        """Add a batch: ``logits`` [B] (before the sigmoid), ``labels`` [B] of 0/1 (any dtype)."""
        if logits.ndim != 1 or labels.shape != logits.shape:
            raise ValueError(
                f"BinaryClassificationMetrics.update: logits {tuple(logits.shape)} and labels "
                f"{tuple(labels.shape)} must both be 1-D of the same length; squeeze a [B, 1] "
                "model output with .squeeze(1)"
            )
        if not logits.is_floating_point():
            raise TypeError(
                f"BinaryClassificationMetrics.update: logits must be floating point, got "
                f"{logits.dtype}; pass the model's pre-sigmoid output"
            )
        logits, labels = logits.detach(), labels.detach()
        self._invalid.append(torch.stack([
            (~torch.isfinite(logits)).sum(), ((labels != 0) & (labels != 1)).sum(),
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
            invalid = torch.zeros(2, dtype=torch.int64)
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
    for rank, (bad_logits, bad_labels) in enumerate(invalid):
        if bad_logits or bad_labels:
            raise ValueError(
                f"BinaryClassificationMetrics.compute: group rank {rank} passed {bad_logits} "
                f"non-finite logits and {bad_labels} labels other than 0/1 to update(); check "
                "the model for NaN/inf outputs and the dataset's label column"
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


# ---- curves (for reports; host-side numpy on rows already gathered) ----------------------------
def roc_curve(scores: np.ndarray | torch.Tensor,
              labels: np.ndarray | torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """The ROC curve ``(fpr, tpr)``: one point per distinct score, from (0, 0) to (1, 1).

    Thresholds run from the highest score down; rows with equal scores enter together, so a tie
    group is one diagonal segment and the trapezoid area under the curve equals the
    Mann-Whitney AUC with ties counting 1/2 (``BinaryClassificationMetrics``' ``auc``)::

        scores [0.1, 0.4, 0.35, 0.8], labels [0, 0, 1, 1]
        threshold >= 0.8: tp 1 fp 0 -> (0, 0.5);  >= 0.4: (0.5, 0.5);  >= 0.35: (0.5, 1)
        >= 0.1: (1, 1);  fpr [0, 0, .5, .5, 1], tpr [0, .5, .5, 1, 1];  area 0.75

    Any monotone transform of the scores (logits or probabilities) gives the same curve.
    Raises ValueError when the labels are not all 0/1, hold only one class (no curve exists),
    or the scores are not finite.
    """
    s, y = _curve_inputs(scores, labels, "roc_curve", "scores")
    positives = int(y.sum())
    negatives = y.size - positives
    if positives == 0 or negatives == 0:
        raise ValueError(f"roc_curve: {positives} positive and {negatives} negative labels; a "
                         "ROC curve needs both classes")
    order = np.argsort(-s, kind="stable")
    s, y = s[order], y[order]
    # the last row of each run of equal scores closes one threshold
    last = np.flatnonzero(np.r_[s[1:] != s[:-1], True])
    tp = np.cumsum(y, dtype=np.int64)[last]
    fp = (last + 1) - tp
    fpr = np.r_[0.0, fp / negatives]
    tpr = np.r_[0.0, tp / positives]
    return fpr, tpr


def calibration_curve(probabilities: np.ndarray | torch.Tensor,
                      labels: np.ndarray | torch.Tensor,
                      bins: int = 10) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A reliability diagram's points ``(mean_predicted, observed_rate, counts)``.

    ``[0, 1]`` is cut into ``bins`` equal bins (the last includes 1.0); for each bin holding
    rows: the mean predicted probability, the fraction of positive labels, and the row count.
    Empty bins are left out (as scikit-learn does), so the arrays can be shorter than ``bins``.
    A calibrated model has ``observed_rate == mean_predicted``::

        probabilities [0.1, 0.2, 0.7, 0.9], labels [0, 1, 1, 1], bins=2
        -> mean_predicted [0.15, 0.8], observed_rate [0.5, 1.0], counts [2, 2]

    Raises ValueError for probabilities outside [0, 1], labels other than 0/1, or bins < 1.
    """
    if isinstance(bins, bool) or not isinstance(bins, int) or bins < 1:
        raise ValueError(f"calibration_curve: bins must be a positive int, got {bins!r}")
    p, y = _curve_inputs(probabilities, labels, "calibration_curve", "probabilities")
    if p.size and (p.min() < 0 or p.max() > 1):
        raise ValueError(f"calibration_curve: probabilities must lie in [0, 1], got values in "
                         f"[{p.min()}, {p.max()}]; apply a sigmoid to logits first")
    index = np.minimum((p * bins).astype(np.int64), bins - 1)
    counts = np.bincount(index, minlength=bins)
    predicted = np.bincount(index, weights=p, minlength=bins)
    positives = np.bincount(index, weights=y, minlength=bins)
    kept = counts > 0
    return predicted[kept] / counts[kept], positives[kept] / counts[kept], counts[kept]


def _curve_inputs(values: np.ndarray | torch.Tensor, labels: np.ndarray | torch.Tensor,
                  where: str, name: str) -> tuple[np.ndarray, np.ndarray]:
    """float64 values and int64 0/1 labels as 1-D numpy arrays of one length (or raise)."""
    v = np.asarray(values.detach().cpu() if isinstance(values, torch.Tensor) else values,
                   dtype=np.float64)
    y = np.asarray(labels.detach().cpu() if isinstance(labels, torch.Tensor) else labels)
    if v.ndim != 1 or y.shape != v.shape:
        raise ValueError(f"{where}: {name} {v.shape} and labels {y.shape} must both be 1-D of "
                         "the same length")
    if not np.isfinite(v).all():
        raise ValueError(f"{where}: {int((~np.isfinite(v)).sum())} {name} are NaN or infinite; "
                         "check the model's outputs")
    if not np.isin(y, (0, 1)).all():
        raise ValueError(f"{where}: labels must be 0 or 1, got {np.unique(y)[:5].tolist()}...")
    return v, y.astype(np.int64)
