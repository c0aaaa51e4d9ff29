"""The synthetic generator's days: drift of popularity and teacher, reproducible by seed."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

from dlrm_app.data import generate, verify
from dlrm_app.data.days import day_table, read_days
from dlrm_app.data.loader import ParquetLoader
from dlrm_app.data.synthetic import _renew

CARDS = [1000, 50, 200]
POOLING = [1.0, 2.0, 1.0]


def make(out: Path, *, seed: int = 1, days: int = 5, drift: float = 0.1, rows: int = 20_000):
    return generate(out, rows=rows, num_dense=4, cardinalities=CARDS, pooling_factors=POOLING,
                    rows_per_shard=3000, row_group_size=1024, seed=seed, days=days,
                    drift=drift)


def hashes(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in directory.iterdir()
            if p.is_file()}


def unseen_shares(out: Path, feature: str = "cat_0") -> list[float]:
    """Per day, the share of the day's ids that day 0 never had."""
    days = read_days(out)
    first = set(np.concatenate(day_table(out, 0)[feature].to_pylist()).tolist())
    shares = []
    for day in days:
        ids = np.concatenate(day_table(out, day.index)[feature].to_pylist())
        shares.append(float(np.mean([i not in first for i in ids.tolist()])))
    return shares


def teacher_vector(record: dict) -> np.ndarray:
    t = record["teacher"]
    return np.concatenate([np.ravel(t["w_dense"]), t["u"], t["v"]])


@pytest.fixture(scope="module")
def drifting(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("days")
    make(out)
    return out


def test_days_are_the_splits_the_record_and_the_loader_says(drifting: Path) -> None:
    spec = verify(drifting)
    days = read_days(spec)
    assert [d.rows for d in days] == [4000] * 5
    # all but the last day train, the last day's halves validation and test
    assert [s.rows for s in spec.splits] == [16_000, 2000, 2000]
    assert {p.file.split("-")[0] for p in days[4].pieces} == {"validation", "test"}
    assert days[1].pieces[0].first_row == 1000  # day 1 starts inside train-00001
    loader = ParquetLoader(drifting, days=range(1, 3), batch_size=512, drop_last=False,
                           prefetch=0)
    np.testing.assert_array_equal(np.concatenate([b.labels.numpy() for b in loader]),
                                  day_table(drifting, range(1, 3))["label"].to_numpy())


def test_ids_unseen_on_day_0_grow_day_by_day(drifting: Path, tmp_path: Path) -> None:
    shares = unseen_shares(drifting)
    assert shares[0] == 0.0
    assert all(a < b for a, b in zip(shares[1:], shares[2:], strict=False)), shares
    make(tmp_path / "still", drift=0.0)
    still = unseen_shares(tmp_path / "still")
    # without drift, a later day's ids unseen on day 0 are the tail's noise, flat over days
    assert max(still) < shares[2] and still[4] < 2 * max(still[1], 1e-3), (still, shares)
    assert shares[4] > 3 * still[4]


def test_teacher_moves_by_the_drift_each_day(drifting: Path, tmp_path: Path) -> None:
    records = read_days_records(drifting)
    first = teacher_vector(records[0])
    for prev, day in zip(records, records[1:], strict=False):
        step = np.linalg.norm(teacher_vector(day) - teacher_vector(prev))
        assert step == pytest.approx(0.1 * np.linalg.norm(first), rel=1e-9)
    # day 0's teacher is the one-day dataset's of the same seed
    one = generate(tmp_path / "one", rows=2000, num_dense=4, cardinalities=CARDS,
                   pooling_factors=POOLING, seed=1)
    np.testing.assert_array_equal(teacher_vector(one.parameters["days"][0]), first)
    assert records[4]["renewed"] == pytest.approx(0.4)


def test_each_day_renews_the_drift_share_of_ranks() -> None:
    # over all ranks of a large feature: the ranks whose id is new by day d are d x drift of
    # them, the renewed ones stay renewed, and a renewed rank's id is a tail rank's
    c = 100_000
    ranks = np.arange(c)
    before = np.zeros(c, bool)
    for day in range(1, 6):
        moved = _renew(ranks, c, salt=12345, renewed=day * 0.1)
        now = moved != ranks
        assert now.mean() == pytest.approx(day * 0.1, abs=0.005)
        assert (now >= before).all()
        assert (moved[now] == c - 1 - ranks[now]).all()  # generation 1: from the tail
        before = now
    assert (_renew(ranks, c, salt=12345, renewed=0.0) == ranks).all()


def read_days_records(out: Path) -> list[dict]:
    from dlrm_app.data.schema import DatasetSpec
    return list(DatasetSpec.load(out).parameters["days"])


def test_days_are_reproducible_by_seed(drifting: Path, tmp_path: Path) -> None:
    make(tmp_path / "again")
    assert hashes(tmp_path / "again") == hashes(drifting)
    make(tmp_path / "other", seed=2)
    other = hashes(tmp_path / "other")
    assert all(other[f] != h for f, h in hashes(drifting).items() if f.endswith(".parquet"))


def test_days_arguments_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="splits follow the days.*leave splits at its default"):
        generate(tmp_path, rows=1000, cardinalities=[10], pooling_factors=[1], days=2,
                 splits=(0.5, 0.25, 0.25))
    with pytest.raises(ValueError, match="leaves a day without rows.*pass more rows"):
        generate(tmp_path, rows=3, cardinalities=[10], pooling_factors=[1], days=4)
    with pytest.raises(ValueError, match=r"drift \(--drift\) must be in \[0, 1\]"):
        generate(tmp_path, rows=1000, cardinalities=[10], pooling_factors=[1], days=2,
                 drift=-0.1)
    with pytest.raises(ValueError, match=r"days \(--days\) must be a positive int"):
        generate(tmp_path, rows=1000, cardinalities=[10], pooling_factors=[1], days=0)
