"""BinaryClassificationMetrics (and ExactBinaryMetric behind RecMetricModule) against a
pairwise count, numpy references and the values of the implementation it was moved from
(dlrm_app/metrics.py), and exactness over 1, 2 and 3 ranks."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torchmetrics.functional.classification import binary_auroc

from recsys_core.metrics import (
    BinaryClassificationMetrics,
    ExactBinaryMetric,
    NEMetric,
    RecMetricList,
    RecMetricModule,
    RecTaskInfo,
)
from recsys_core.testing import run_gloo

FLOAT_KEYS = ("auc", "ne", "logloss", "accuracy", "calibration", "label_rate", "mean_prediction")


def ref_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Mann-Whitney: U = (sum of positives' average ranks) - P (P + 1) / 2; AUC = U / (P N)."""
    values, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    last = np.cumsum(counts)  # 1-based rank of the last row of each tie group
    avg_rank = (last - counts + 1 + last) / 2.0
    ranks = avg_rank[inverse]
    pos = labels == 1
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    return (ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


def pairwise_auc(scores: np.ndarray, labels: np.ndarray) -> Fraction:
    """Mann-Whitney by its definition: over every (positive, negative) pair, 1 if the positive
    scores higher, 1/2 on a tie; the exact fraction of pairs."""
    pos, neg = scores[labels == 1].tolist(), scores[labels == 0].tolist()
    twice = sum(2 * (p > n) + (p == n) for p in pos for n in neg)
    return Fraction(twice, 2 * len(pos) * len(neg))


def ref_metrics(logits: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """The metrics by their textbook formulas (moderate logits only: log(sigmoid) directly)."""
    z, y = logits.astype(np.float64), labels.astype(np.float64)
    prob = 1.0 / (1.0 + np.exp(-z))
    logloss = float(np.mean(-(y * np.log(prob) + (1 - y) * np.log(1 - prob))))
    p = float(y.mean())
    entropy = -(p * math.log(p) + (1 - p) * math.log(1 - p))
    return {
        "auc": ref_auc(z, y), "ne": logloss / entropy, "logloss": logloss,
        "accuracy": float(np.mean((prob > 0.5) == (y == 1))),
        "calibration": float(prob.mean()) / p, "label_rate": p,
        "mean_prediction": float(prob.mean()), "num_examples": len(z),
    }


def evaluate(logits: np.ndarray, labels: np.ndarray, batch_size: int = 1000) -> dict[str, float]:
    metrics = BinaryClassificationMetrics()
    for start in range(0, len(logits), batch_size):
        metrics.update(torch.from_numpy(logits[start:start + batch_size]),
                       torch.from_numpy(labels[start:start + batch_size]))
    return metrics.compute()


def ctr_data(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """float32 logits rounded to 0.1 (many ties) and 0/1 float32 labels drawn from them."""
    rng = np.random.default_rng(seed)
    logits = np.round(rng.normal(-1.0, 2.0, n), 1).astype(np.float32)
    labels = (rng.random(n) < 1.0 / (1.0 + np.exp(-logits))).astype(np.float32)
    return logits, labels


def test_hand_checked_auc() -> None:
    # Sorted: 0.1(-) 0.35(+) 0.4(-) 0.8(+): positives' ranks 2 + 4, U = 6 - 3 = 3, AUC = 3/4.
    scores, labels = np.array([0.1, 0.4, 0.35, 0.8]), np.array([0.0, 0.0, 1.0, 1.0])
    assert ref_auc(scores, labels) == 0.75
    assert evaluate(scores, labels)["auc"] == 0.75


def test_auc_is_the_correctly_rounded_pairwise_count() -> None:
    # Ties within and across the classes: 0.5 holds 2 positives and 1 negative, 0.2 one of each.
    scores = np.array([0.2, 0.5, 0.5, 0.9, 0.2, 0.5, 0.1, 0.7, 0.3])
    labels = np.array([1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0])
    # positives 0.2 0.5 0.9 0.5 0.3 over negatives 0.5 0.2 0.1 0.7:
    # 0.2: 1/2 + 1 = 1.5;  0.5: 1/2 + 2 = 2.5 (twice);  0.9: 4;  0.3: 2   -> 12.5 / 20
    assert pairwise_auc(scores, labels) == Fraction(5, 8)
    assert evaluate(scores, labels, batch_size=4)["auc"] == 0.625
    # On random tied data the one division of exact integers is the fraction, rounded once.
    logits, labels = ctr_data(600, seed=7)
    assert len(np.unique(logits)) < 100
    assert evaluate(logits, labels, batch_size=97)["auc"] == float(pairwise_auc(logits, labels))


def test_values_of_the_implementation_it_replaces() -> None:
    # dlrm_app/metrics.py's BinaryClassificationMetrics (commit 770e9dd) on ctr_data(5000),
    # batches of 777. The integer-based values are bitwise; the float64 sums within rounding
    # (torch's sum may split its work by thread count).
    got = evaluate(*ctr_data(5000), batch_size=777)
    assert got["num_examples"] == 5000
    assert got["auc"].hex() == "0x1.bafcc7d94039ep-1"
    assert (got["accuracy"], got["label_rate"]) == (0.802, 0.3524)
    assert got["logloss"] == pytest.approx(float.fromhex("0x1.b929a07f7d989p-2"), rel=1e-14)
    assert got["ne"] == pytest.approx(float.fromhex("0x1.53ebb9e5fc375p-1"), rel=1e-14)
    assert got["mean_prediction"] == pytest.approx(float.fromhex("0x1.66ad218da439fp-2"), rel=1e-14)
    assert got["calibration"] == pytest.approx(float.fromhex("0x1.fce7b2a86c0ffp-1"), rel=1e-14)


def test_matches_numpy_references_with_ties() -> None:
    logits, labels = ctr_data(5000)
    assert len(np.unique(logits)) < 200  # the AUC's tie handling is exercised
    got, want = evaluate(logits, labels, batch_size=777), ref_metrics(logits, labels)
    assert got["num_examples"] == want["num_examples"]
    for key in FLOAT_KEYS:
        assert got[key] == pytest.approx(want[key], rel=1e-12, abs=1e-12), key
    # A second, independent implementation (float32 trapezoid): agrees to float32 precision.
    tm_auc = binary_auroc(torch.from_numpy(logits).sigmoid().double(),
                          torch.from_numpy(labels).long(), thresholds=None)
    assert got["auc"] == pytest.approx(float(tm_auc), abs=1e-6)


def test_hand_checked_ne() -> None:
    # Constant logit 0 predicts 0.5: logloss ln 2. Base rate 3/4: H = -(3/4 ln 3/4 + 1/4 ln 1/4).
    got = evaluate(np.zeros(4), np.array([0.0, 1.0, 1.0, 1.0]))
    entropy = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    assert got["logloss"] == pytest.approx(math.log(2), rel=1e-15)
    assert got["ne"] == pytest.approx(math.log(2) / entropy, rel=1e-15)
    assert got["ne"] == pytest.approx(1.2326229068, rel=1e-10)
    assert (got["accuracy"], got["calibration"], got["auc"]) == (0.25, 0.5 / 0.75, 0.5)


def test_all_ties_give_half() -> None:
    got = evaluate(np.full(6, 0.3), np.array([0.0, 1.0, 1.0, 0.0, 1.0, 0.0]))
    assert got["auc"] == 0.5


def test_large_logits_are_stable() -> None:
    logits = np.array([100.0, -100.0, 100.0, -100.0], dtype=np.float32)
    labels = np.array([1.0, 0.0, 0.0, 1.0], dtype=np.float32)
    got = evaluate(logits, labels)
    # Two rows right (loss ~e^-100), two wrong (loss 100 each).
    assert math.isfinite(got["logloss"]) and got["logloss"] == pytest.approx(50.0, rel=1e-15)
    assert (got["auc"], got["accuracy"], got["mean_prediction"]) == (0.5, 0.5, 0.5)
    # Logits that a sigmoid saturates to 1.0 still rank: 40 < 50 < 60.
    assert evaluate(np.array([40.0, 50.0, 60.0]), np.array([0.0, 1.0, 1.0]))["auc"] == 1.0


def test_degenerate_label_rates() -> None:
    ones = evaluate(np.array([0.5, -1.0]), np.array([1.0, 1.0]))
    assert math.isnan(ones["auc"]) and math.isnan(ones["ne"])  # H(1) = 0: no baseline
    assert ones["label_rate"] == 1.0 and math.isfinite(ones["calibration"])
    zeros = evaluate(np.array([0.5, -1.0]), np.array([0.0, 0.0]))
    assert math.isnan(zeros["ne"]) and math.isnan(zeros["calibration"])
    empty = BinaryClassificationMetrics().compute()
    assert empty["num_examples"] == 0
    assert all(math.isnan(empty[key]) for key in FLOAT_KEYS)


def test_independent_of_batching_and_order_and_reset() -> None:
    logits, labels = ctr_data(3000, seed=1)
    perm = np.random.default_rng(2).permutation(len(logits))
    once = evaluate(logits, labels, batch_size=3000)
    assert evaluate(logits[perm], labels[perm], batch_size=101) == once
    metrics = BinaryClassificationMetrics()
    metrics.update(torch.tensor([5.0]), torch.tensor([0.0]))
    metrics.reset()
    metrics.update(torch.from_numpy(logits), torch.from_numpy(labels).bool())  # any label dtype
    assert metrics.compute() == once


def test_bad_inputs_are_reported() -> None:
    metrics = BinaryClassificationMetrics()
    with pytest.raises(ValueError, match=r"squeeze"):
        metrics.update(torch.zeros(4, 1), torch.zeros(4))
    with pytest.raises(TypeError, match="floating point"):
        metrics.update(torch.zeros(4, dtype=torch.int64), torch.zeros(4))
    with pytest.raises(ValueError, match=r"weights \(3,\) must all be 1-D of the same length"):
        metrics.update(torch.zeros(4), torch.zeros(4), torch.ones(3))
    metrics.update(torch.tensor([0.0, float("nan")]), torch.tensor([0.0, 2.0]))
    with pytest.raises(ValueError, match="1 non-finite logits and 1 labels other than 0/1"):
        metrics.compute()


def test_unit_weights_only() -> None:
    logits, labels = ctr_data(300, seed=8)
    weighted = BinaryClassificationMetrics()
    weighted.update(torch.from_numpy(logits), torch.from_numpy(labels), torch.ones(300))
    assert weighted.compute() == evaluate(logits, labels)
    weighted.update(torch.zeros(2), torch.ones(2), torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="1 weights other than 1"):
        weighted.compute()


TASK = RecTaskInfo(name="ctr", prediction_name="logit")
KEYS = {"auc": "auc", "ne": "ne", "logloss": "logloss", "accuracy": "accuracy",
        "calibration": "calibration", "label_rate": "ctr", "mean_prediction": "prediction_average",
        "num_examples": "total_examples"}
"""BinaryClassificationMetrics' keys -> ExactBinaryMetric's names (TorchRec's MetricName)."""


def module_values(logits: np.ndarray, labels: np.ndarray,
                  batch_size: int = 1000) -> dict[str, float]:
    """ExactBinaryMetric through RecMetricModule, its keys read back as evaluate()'s."""
    module = RecMetricModule(batch_size=batch_size, world_size=1, rec_tasks=[TASK],
                             rec_metrics=RecMetricList([ExactBinaryMetric(1, 0, batch_size, [TASK])]))
    for start in range(0, len(logits), batch_size):
        module.update({"logit": torch.from_numpy(logits[start:start + batch_size]),
                       "label": torch.from_numpy(labels[start:start + batch_size])})
    out = module.compute()
    assert all(v.shape == (1,) for v in out.values())
    return {key: out[f"exact-ctr|lifetime_{name}"].item() for key, name in KEYS.items()}


def test_rec_metric_module_gives_the_same_numbers() -> None:
    logits, labels = ctr_data(3000, seed=9)
    assert module_values(logits, labels, batch_size=128) == evaluate(logits, labels)
    # Next to TorchRec's streaming NE (probabilities, log2 sums): the same NE, another route.
    prob_task = RecTaskInfo(name="p")
    module = RecMetricModule(
        batch_size=3000, world_size=1, rec_tasks=[TASK, prob_task],
        rec_metrics=RecMetricList([ExactBinaryMetric(1, 0, 3000, [TASK]),
                                   NEMetric(1, 0, 3000, [prob_task])]))
    z, y = torch.from_numpy(logits), torch.from_numpy(labels)
    module.update({"logit": z, "prediction": z.sigmoid(), "label": y})
    out = module.compute()
    assert out["exact-ctr|lifetime_ne"].item() == pytest.approx(
        out["ne-p|lifetime_ne"].item(), rel=1e-6)
    module.reset()
    assert module.compute() == {}  # no rows: no keys, as for the streaming metrics


def ranks_worker(
    rank: int, world: int, logits: np.ndarray, labels: np.ndarray, sizes: list[int]
) -> dict:
    """This rank's share of a shuffled split (``sizes`` rows per rank), fed in 2 batches."""
    order = np.random.default_rng(3).permutation(len(logits))
    mine = order[sum(sizes[:rank]):sum(sizes[:rank + 1])]
    half = max(1, len(mine) // 2 + 1)
    out: dict = {"world": evaluate(logits[mine], labels[mine], batch_size=half),
                 "module": module_values(logits[mine], labels[mine], batch_size=half)}
    if world == 3:
        # A subgroup whose rank 0 is global rank 1: ranks 1 and 2 evaluate their rows together.
        sub = dist.new_group([1, 2])
        if rank in (1, 2):
            metrics = BinaryClassificationMetrics(process_group=sub)
            metrics.update(torch.from_numpy(logits[mine]), torch.from_numpy(labels[mine]))
            out["sub"] = metrics.compute()
        # One rank's NaN: every rank raises the same error instead of hanging in a collective.
        metrics = BinaryClassificationMetrics()
        metrics.update(torch.tensor([float("nan") if rank == 2 else 0.0]), torch.tensor([1.0]))
        with pytest.raises(ValueError, match="group rank 2 passed 1 non-finite"):
            metrics.compute()
    return out


@pytest.mark.parametrize(
    "sizes", [[4100, 900], [0, 2300, 2700]], ids=["2ranks", "3ranks_rank0_empty"]
)
@pytest.mark.slow
def test_ranks_match_one_rank(sizes: list[int]) -> None:
    logits, labels = ctr_data(sum(sizes), seed=4)
    single = evaluate(logits, labels)
    assert single["auc"] == pytest.approx(ref_auc(logits, labels), rel=1e-12)
    results = run_gloo(len(sizes), ranks_worker, logits, labels, sizes)
    for result in results:
        got = result["world"]
        assert got == results[0]["world"]  # every rank returns the same numbers
        assert result["module"] == got  # the same through RecMetricModule
        assert got["auc"] == single["auc"]  # bitwise: int64 rank sums, one division
        assert got["num_examples"] == single["num_examples"]
        for key in FLOAT_KEYS:
            assert got[key] == pytest.approx(single[key], rel=0, abs=1e-12), key
    if len(sizes) == 3:
        order = np.random.default_rng(3).permutation(len(logits))
        sub_rows = order[sizes[0]:]  # ranks 1 and 2
        want = evaluate(logits[sub_rows], labels[sub_rows])
        assert results[1]["sub"]["auc"] == results[2]["sub"]["auc"] == want["auc"]
        assert results[1]["sub"]["num_examples"] == want["num_examples"]
        assert results[1]["sub"]["logloss"] == pytest.approx(want["logloss"], rel=0, abs=1e-12)
