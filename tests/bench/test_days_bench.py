"""bench/days.py: a view holds exactly its days' train shards; on 3 tiny generated days, the
follow lines are the follow run's own day lines, frozen scores day 1 as the follow run did (the
same day-0 model, scored in this process), each retraining trains its epochs over its days, and
the summary is the lines' means and CPU sums.

No timing thresholds: only structure and what must hold by construction.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
from pathlib import Path

import pytest
from app_setup import two_feature_data

from dlrm_app import cli
from dlrm_app.data.synthetic import generate

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import days as bench  # noqa: E402  (bench/ is a folder of scripts, not a package)

ROWS, DAYS, BATCH, EPOCHS = 400, 3, 64, 2


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return two_feature_data(tmp_path_factory.mktemp("days") / "data", rows=ROWS * DAYS,
                            rows_per_shard=ROWS, row_group_size=100, days=DAYS, drift=0.1)


def test_view_holds_the_first_days_train_shards(data: Path, tmp_path: Path) -> None:
    view = bench.view(data, 2, tmp_path / "view")
    meta = json.loads((view / "dataset.json").read_text())
    assert [s["file"] for s in meta["splits"]["train"]["shards"]] == \
        ["train-00000.parquet", "train-00001.parquet"]
    assert [s["file"] for s in meta["splits"]["validation"]["shards"]] == ["train-00001.parquet"]
    assert [d["index"] for d in meta["parameters"]["days"]] == [0, 1]
    assert (view / "train-00001.parquet").resolve() == (data / "train-00001.parquet").resolve()
    assert not (view / "train-00002.parquet").exists()


def test_view_refuses_days_that_are_not_one_shard_each(tmp_path: Path) -> None:
    data = tmp_path / "data"
    generate(data, rows=ROWS * DAYS, num_dense=1, cardinalities=[10], pooling_factors=[1.0],
             zipf_alpha=1.05, seed=0, rows_per_shard=ROWS * 2, row_group_size=100, days=DAYS,
             drift=0.1)
    with pytest.raises(SystemExit, match="rows-per-shard"):
        bench.view(data, 2, tmp_path / "view")


def in_process(*args: str) -> float:
    """bench.cli without a process per command (the test's time is the training's, not
    4 imports of torch): the command's CPU seconds in this process."""
    before = resource.getrusage(resource.RUSAGE_SELF)
    assert cli.main(list(args)) == 0, args
    after = resource.getrusage(resource.RUSAGE_SELF)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


@pytest.mark.slow  # 4 short training runs (about 10 s on 2 busy cores)
def test_tiny_bench_lines(data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench, "cli", in_process)
    args = argparse.Namespace(days=DAYS, batch_size=BATCH, retrain_epochs=EPOCHS)
    days = json.loads((data / "dataset.json").read_text())["parameters"]["days"]
    teacher = [round(float(r["teacher_auc"]), 4) for r in days]
    lines = bench.bench_seed(data, tmp_path, 0, args, teacher)
    rows = {(x["approach"], x["day"]): x for x in lines if x["bench"] == "days"}
    assert sorted(rows) == sorted((a, d) for a in bench.APPROACHES for d in (1, 2))
    costs = {x["approach"]: x["cpu_s"] for x in lines if x["bench"] == "days_cost"}
    assert sorted(costs) == sorted(bench.APPROACHES) and all(c > 0 for c in costs.values())

    logged = {d["day"]: d for d in bench.log(tmp_path / "follow-0", "day")}
    steps = ROWS // BATCH  # a day's steps, the last partial batch dropped
    for d in (1, 2):
        assert rows["follow", d]["progressive_auc"] == logged[d]["progressive_auc"]
        assert rows["follow", d]["model_step"] == d * steps
        assert rows["frozen", d]["model_step"] == steps
        assert rows["retrain", d]["model_step"] == EPOCHS * d * steps  # pooled: d*ROWS rows
        assert rows["retrain", d]["teacher_auc"] == teacher[d]
    # day 1: frozen is the follow run's model after day 0, scored here instead of in the run
    assert rows["frozen", 1]["progressive_auc"] == pytest.approx(
        rows["follow", 1]["progressive_auc"], abs=1e-9)
    assert rows["frozen", 1]["ne"] == pytest.approx(rows["follow", 1]["ne"], abs=1e-9)
    assert rows["frozen", 2]["progressive_auc"] != rows["follow", 2]["progressive_auc"]

    summary = bench.summarize(lines)
    for a in bench.APPROACHES:
        assert summary["mean_progressive_auc"][a] == pytest.approx(statistics.fmean(
            rows[a, d]["progressive_auc"] for d in (1, 2)), abs=1e-4)
    assert summary["cpu_ratio_to_follow"]["retrain"] == pytest.approx(
        costs["retrain"] / costs["follow"], abs=0.01)
    assert summary["mean_gap_to_follow"]["frozen"] == pytest.approx(statistics.fmean(
        rows["frozen", d]["progressive_auc"] - rows["follow", d]["progressive_auc"]
        for d in (1, 2)), abs=1e-4)

    header = bench.header(argparse.Namespace(
        days=DAYS, rows_per_day=ROWS, drift=0.1, num_dense=2, num_sparse=2, cardinality=50,
        data_seed=0, seeds=[0], batch_size=BATCH, retrain_epochs=EPOCHS), days)
    assert header["bench"] == "days_header" and header["teacher_auc"] == teacher
    assert header["cpu"] and header["torch"] and header["command"].startswith("python bench/")
