"""ROC / calibration curves, saved evaluations, report.md + plots, TensorBoard, `report` command."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dlrm_app.cli import build_parser, parsed_config
from dlrm_app.data.synthetic import generate
from dlrm_app.model import ModelConfig
from dlrm_app.reporting.curves import calibration_curve, roc_curve
from dlrm_app.reporting.report import (
    ROC_POINTS,
    human_summary,
    read_run,
    save_evaluation,
    write_report,
    write_tensorboard,
)
from dlrm_app.training.config import TrainConfig
from recsys_core.metrics import BinaryClassificationMetrics
from recsys_core.testing import run_gloo

HAS_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def exact_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    metrics = BinaryClassificationMetrics()
    metrics.update(torch.as_tensor(scores, dtype=torch.float64), torch.as_tensor(labels))
    return metrics.compute()["auc"]


# ---- curves -------------------------------------------------------------------------------------
@pytest.mark.parametrize(("scores", "labels", "fpr", "tpr"), [
    # distinct scores: one threshold per row
    ([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1], [0, 0, 0.5, 0.5, 1], [0, 0.5, 0.5, 1, 1]),
    # 0.5 is shared by a positive and a negative: one diagonal step
    ([0.5, 0.5, 0.2, 0.9], [1, 0, 0, 1], [0, 0, 0.5, 1], [0, 0.5, 1, 1]),
    # every score tied: the diagonal
    ([3.0, 3.0, 3.0], [1, 0, 0], [0, 1], [0, 1]),
])
def test_roc_curve_by_hand(scores: list[float], labels: list[int], fpr: list[float],
                           tpr: list[float]) -> None:
    got_fpr, got_tpr = roc_curve(np.array(scores), np.array(labels))
    np.testing.assert_array_equal(got_fpr, fpr)
    np.testing.assert_array_equal(got_tpr, tpr)
    assert np.trapezoid(got_tpr, got_fpr) == pytest.approx(exact_auc(np.array(scores),
                                                                     np.array(labels)), abs=1e-15)


@pytest.mark.parametrize("distinct", [3, 50, 10_000, None])
def test_roc_area_is_the_exact_auc(distinct: int | None) -> None:
    rng = np.random.default_rng(distinct or 1)
    n = 20_000
    scores = (rng.integers(0, distinct, n).astype(np.float64) if distinct
              else rng.standard_normal(n))
    labels = (rng.random(n) < 0.2 + 0.3 * (scores > np.median(scores))).astype(np.uint8)
    fpr, tpr = roc_curve(torch.tensor(scores), torch.tensor(labels))  # tensors work too
    assert np.all(np.diff(fpr) >= 0) and np.all(np.diff(tpr) >= 0)
    assert (fpr[0], tpr[0], fpr[-1], tpr[-1]) == (0, 0, 1, 1)
    assert fpr.size == np.unique(scores).size + 1
    assert np.trapezoid(tpr, fpr) == pytest.approx(exact_auc(scores, labels), abs=1e-12)


def test_roc_curve_refuses_bad_input() -> None:
    with pytest.raises(ValueError, match="needs both classes"):
        roc_curve(np.array([0.1, 0.2]), np.array([1, 1]))
    with pytest.raises(ValueError, match="NaN or infinite"):
        roc_curve(np.array([0.1, math.nan]), np.array([0, 1]))
    with pytest.raises(ValueError, match="must be 0 or 1"):
        roc_curve(np.array([0.1, 0.2]), np.array([0, 2]))
    with pytest.raises(ValueError, match="same length"):
        roc_curve(np.array([0.1, 0.2]), np.array([0, 1, 1]))


def test_calibration_curve_by_hand() -> None:
    # bins of 0.1: 0.05 -> 0; 0.15, 0.12 -> 1; 0.5 -> 5; 0.95 and 1.0 (last bin closed) -> 9
    probabilities = np.array([0.05, 0.15, 0.12, 0.95, 1.0, 0.5])
    labels = np.array([0, 1, 0, 1, 1, 0])
    predicted, observed, counts = calibration_curve(probabilities, labels, bins=10)
    np.testing.assert_allclose(predicted, [0.05, 0.135, 0.5, 0.975], rtol=0, atol=1e-15)
    np.testing.assert_array_equal(observed, [0, 0.5, 0, 1])
    np.testing.assert_array_equal(counts, [1, 2, 1, 2])
    predicted, observed, counts = calibration_curve([0.1, 0.2, 0.7, 0.9], [0, 1, 1, 1], bins=2)
    np.testing.assert_allclose(predicted, [0.15, 0.8])
    np.testing.assert_array_equal(observed, [0.5, 1])
    np.testing.assert_array_equal(counts, [2, 2])


def test_calibration_curve_refuses_bad_input() -> None:
    with pytest.raises(ValueError, match=r"in \[0, 1\].*sigmoid"):
        calibration_curve(np.array([0.5, 1.5]), np.array([0, 1]))
    with pytest.raises(ValueError, match="bins must be a positive int"):
        calibration_curve(np.array([0.5]), np.array([1]), bins=0)


def _gather_worker(rank: int, world_size: int) -> tuple[list[float], list[int]] | None:
    metrics = BinaryClassificationMetrics()
    if rank != 1:  # rank 1 sees no rows at all
        metrics.update(torch.tensor([rank + 0.5, rank + 0.25]), torch.tensor([rank % 2, 1]))
    rows = metrics.gather_rows()
    return None if rows is None else (rows[0].tolist(), rows[1].tolist())


def test_gather_rows_brings_every_rank_to_rank_0() -> None:
    results = run_gloo(3, _gather_worker)
    assert results[1] is None and results[2] is None
    assert results[0] == ([0.5, 0.25, 2.5, 2.25], [0, 1, 0, 1])


# ---- a fake run ---------------------------------------------------------------------------------
VAL_AUC = {50: 0.70, 100: 0.74, 150: 0.73, 200: 0.72}
# a test split's logits and labels with a hand-computable ROC and calibration
TEST_LOGITS = [-2.0, -1.0, 0.0, 0.0, 1.0, 2.0]
TEST_LABELS = [0, 0, 0, 1, 1, 1]


def write_log(run: Path, records: list[dict]) -> None:
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def train_records(steps: int, every: int = 10) -> list[dict]:
    return [{"event": "train", "step": s, "epoch": 0, "loss": 0.7 - s / 1000, "lr": 0.01,
             "samples_per_s": 1000.0 + s} for s in range(every, steps + 1, every)]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("report") / "data"
    generate(out, rows=3000, num_dense=2, cardinalities=[20, 30], pooling_factors=[1.0, 1.0],
             seed=0, row_group_size=500)
    return out


@pytest.fixture
def run(tmp_path: Path, dataset: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    TrainConfig.from_flags(data=str(dataset), out=str(run), batch_size=64, validate_every=50,
                           model=ModelConfig(embedding_dim=8, dense_arch_layer_sizes=(16, 8))).save(
        run / "config.json")
    (run / "plan.json").write_text(json.dumps({"": {"t_cat_0": {
        "sharding_type": "table_wise", "compute_kernel": "fused", "ranks": [1],
        "sharding_spec": [{"shard_offsets": [0, 0], "shard_sizes": [20, 8],
                           "placement": "rank:1/cpu"}], "cache_params": None}}}))
    records = [{"event": "start", "world_size": 2, "device": "cpu", "steps_per_epoch": 100,
                "total_steps": 200, "resumed_from": None, "start_step": 0}]
    records += train_records(200)
    records += [{"event": "validation", "step": s, "auc": auc, "ne": 0.9, "logloss": 0.5,
                 "num_examples": 300} for s, auc in VAL_AUC.items()]
    records.append({"event": "summary", "steps": 200, "world_size": 2, "samples_per_s": 1234.5,
                    "seconds": 10.0, "peak_memory_mb_per_rank": [100.0, 120.0],
                    "stopped_early": False, "validation": {"auc": 0.72}})
    write_log(run, records)
    return run


def save_test_evaluation(run: Path) -> Path:
    metrics = BinaryClassificationMetrics()
    metrics.update(torch.tensor(TEST_LOGITS), torch.tensor(TEST_LABELS))
    result = {"split": "test", "checkpoint": str(run / "checkpoints" / "step_200"),
              **metrics.compute()}
    logits, labels = metrics.gather_rows()
    return save_evaluation(run, "test", result, logits, labels)


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR", path
    assert len(data) > 5000, f"{path} is only {len(data)} bytes"
    return struct.unpack(">II", data[16:24])


# ---- save_evaluation ----------------------------------------------------------------------------
def test_saved_evaluation_holds_hand_computed_curves(run: Path) -> None:
    record = json.loads(save_test_evaluation(run).read_text())
    assert record["metrics"]["auc"] == 8.5 / 9  # Mann-Whitney: 8.5 of 9 pairs
    assert record["num_rows"] == 6
    # thresholds 2, 1, 0 (a positive and a negative tied), -1, -2
    assert record["roc"]["fpr"] == [0, 0, 0, 1 / 3, 2 / 3, 1]
    assert record["roc"]["tpr"] == [0, 1 / 3, 2 / 3, 1, 1, 1]
    calibration = record["calibration"]
    assert calibration["bins"] == 10
    np.testing.assert_allclose(calibration["mean_predicted"],
                               [sigmoid(-2), sigmoid(-1), 0.5, sigmoid(1), sigmoid(2)])
    assert calibration["observed_rate"] == [0, 0, 0.5, 1, 1]
    assert calibration["counts"] == [1, 1, 2, 1, 1]


def test_saved_roc_is_bounded_and_on_the_exact_curve(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(100_000)
    labels = (rng.random(100_000) < 1 / (1 + np.exp(-2 * logits))).astype(np.uint8)
    path = save_evaluation(tmp_path, "big", {"auc": math.nan, "ne": math.inf}, logits, labels)
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text and len(text) < 50_000
    record = json.loads(text)
    assert record["metrics"] == {"auc": None, "ne": None}  # strict JSON
    fpr, tpr = np.array(record["roc"]["fpr"]), np.array(record["roc"]["tpr"])
    assert 100 < fpr.size <= ROC_POINTS and record["roc"]["vertices"] == 100_001
    assert (fpr[0], tpr[0], fpr[-1], tpr[-1]) == (0, 0, 1, 1)
    full_fpr, full_tpr = roc_curve(logits, labels)
    at = np.searchsorted(full_fpr + full_tpr, fpr + tpr)
    np.testing.assert_array_equal(full_fpr[at], fpr)  # vertices of the exact curve
    assert np.trapezoid(tpr, fpr) == pytest.approx(exact_auc(logits, labels), abs=2e-3)


def test_save_evaluation_one_class_and_bad_name(tmp_path: Path) -> None:
    record = json.loads(save_evaluation(tmp_path, "val.1", {}, [0.0, 1.0], [1, 1]).read_text())
    assert record["roc"] is None and record["calibration"]["counts"] == [1, 1]
    with pytest.raises(ValueError, match="becomes a file name"):
        save_evaluation(tmp_path, "../x", {}, [0.0], [1])


# ---- write_report -------------------------------------------------------------------------------
def test_report_has_the_numbers_and_valid_plots(run: Path, dataset: Path) -> None:
    save_test_evaluation(run)
    path = write_report(run)
    assert path == run / "report.md"
    text = path.read_text()
    assert "**Best validation AUC**: 0.7400 at step 100" in text
    assert f"AUC {8.5 / 9:.4f}" in text  # test metrics
    teacher = json.loads((dataset / "dataset.json").read_text())["parameters"]["teacher_auc"]
    assert f"test {teacher['test']:.4f}" in text
    assert "2 rank(s) on cpu, global batch 128" in text
    assert "200 of 200 = 2.00 epochs" in text
    assert "1,234 samples/s" in text and "120 MB" in text
    assert "finished (all epochs)" in text
    assert "| batch_size | 64 |" in text and "| model.embedding_dim | 8 |" in text
    assert "| learning_rate |" not in text  # at its default
    assert "| (top) | t_cat_0 | table_wise | fused | [1] | 1 |" in text
    plots = ["train_loss", "validation", "throughput", "roc_test", "calibration_test"]
    for name in plots:
        assert f"](plots/{name}.png)" in text
        width, height = png_size(run / "plots" / f"{name}.png")
        assert width > 100 and height > 100
    assert "## Notes" not in text


def test_best_event_and_stopped_event_win(run: Path) -> None:
    with (run / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"event": "best", "step": 150, "auc": 0.73}) + "\n")
        f.write(json.dumps({"event": "stopped", "reason": "no improvement in 2 validations"})
                + "\n")
    text = write_report(run).read_text()
    assert "**Best validation AUC**: 0.7300 at step 150 (NE 0.9000; best event)" in text
    assert "**Stopped**: no improvement in 2 validations" in text


def test_summary_fields_of_the_early_stopping_loop(run: Path) -> None:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    summary = json.loads(lines[-1])
    lines[-1] = json.dumps({**summary, "stopped": "patience: 3 validations without a better AUC",
                            "epochs": 1.62})
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    text = write_report(run).read_text()
    assert "**Stopped**: patience: 3 validations without a better AUC" in text
    assert "200 of 200 = 1.62 epochs" in text


def test_report_of_an_empty_log_and_no_evaluation(run: Path) -> None:
    write_log(run, [])
    text = write_report(run).read_text()
    assert "no validation logged yet" in text and "in progress" in text
    assert "Nothing logged to plot yet." in text and "## Evaluations" not in text
    assert not list((run / "plots").glob("*.png"))
    summary = human_summary(run)
    assert "no saved 'test' evaluation" in summary and "no validation yet" in summary


def test_report_of_a_run_in_progress(run: Path) -> None:
    records = [{"event": "start", "world_size": 1, "steps_per_epoch": 100},
               {"event": "someday_new", "payload": [1, 2]},
               {"event": "train", "step": 10},  # no loss yet
               *train_records(60),
               {"event": "train", "step": "bad"},
               {"event": "validation", "step": 50, "auc": None}]
    text = "".join(json.dumps(r) + "\n" for r in records) + "\n[1, 2]\n"
    (run / "metrics.jsonl").write_text(text + '{"event": "train", "st')  # being written
    text = write_report(run).read_text()
    assert "**Steps**: 60 of ?" in text and "in progress" in text
    assert "no validation logged yet" in text
    assert "2 line(s) were not JSON events" in text
    assert png_size(run / "plots" / "train_loss.png")[0] > 100
    assert not (run / "plots" / "validation.png").exists()


def test_resumed_run_keeps_the_last_record_of_a_step(run: Path) -> None:
    records = [{"event": "start", "world_size": 1}, *train_records(40),
               {"event": "start", "world_size": 1, "resumed_from": "step_20"},
               *[{**r, "loss": 0.1} for r in train_records(40) if r["step"] > 20]]
    write_log(run, records)
    loaded = read_run(run)
    assert [r["step"] for r in loaded.train] == [10, 20, 30, 40]
    assert [r["loss"] for r in loaded.train][2:] == [0.1, 0.1]
    assert "(resumed 1x)" in write_report(run).read_text()


def test_report_without_the_dataset_or_a_run(tmp_path: Path, run: Path) -> None:
    config = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**config, "data": str(tmp_path / "gone"),
                                                 "added_later": 3}))
    text = write_report(run).read_text()
    assert "not readable from here" in text and "| added_later | 3 |" in text
    with pytest.raises(ValueError, match="no such run directory"):
        write_report(tmp_path / "nothing")
    with pytest.raises(ValueError, match="neither config.json nor metrics.jsonl"):
        write_report(tmp_path)


def test_report_of_5000_log_lines(run: Path) -> None:
    """A long log (timed by hand, not here: about 2-3 s on a 2-core machine)."""
    records = train_records(50_000)  # 5,000 train lines
    records += [{"event": "validation", "step": s, "auc": 0.7 + s / 1e6, "ne": 0.9}
                for s in range(1000, 50_001, 1000)]
    write_log(run, records)
    save_test_evaluation(run)
    text = write_report(run).read_text()
    assert "0.7500" in text and "50,000" in text.replace("50000", "50,000")


def test_human_summary(run: Path) -> None:
    save_test_evaluation(run)
    write_report(run)
    summary = human_summary(run)
    assert f"test AUC {8.5 / 9:.4f}" in summary and "the teacher's (best achievable) AUC" in summary
    assert "best validation AUC 0.7400 at step 100" in summary
    assert f"report: {run / 'report.md'}" in summary


# ---- the command and TensorBoard ----------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
    return build_parser()


def test_report_command(run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = parser().parse_args(["report", str(run)])
    assert args.func(parsed_config(args)) == 0
    assert capsys.readouterr().out.strip() == str(run / "report.md")
    args = parser().parse_args(["report", str(tmp_path / "missing")])
    with pytest.raises(SystemExit, match="dlrm-app report: .*no such run directory"):
        args.func(parsed_config(args))


@pytest.mark.skipif(not HAS_TENSORBOARD and os.environ.get("CI") != "true",
                    reason='needs pip install -e ".[tensorboard]" (the test extra has it)')
def test_tensorboard_scalars(run: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    args = parser().parse_args(["report", str(run), "--tensorboard"])
    assert args.func(parsed_config(args)) == 0
    logdir = run / "tensorboard"
    assert len(list(logdir.glob("events.out.tfevents.*"))) == 1
    events = EventAccumulator(str(logdir))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/samples_per_s", "validation/auc", "validation/ne",
            "validation/logloss", "validation/num_examples"} <= tags
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == list(range(10, 201, 10))
    np.testing.assert_allclose([e.value for e in loss], [0.7 - s / 1000 for s in range(10, 201, 10)],
                               rtol=1e-6)
    assert [e.value for e in events.Scalars("validation/auc")] == pytest.approx(
        list(VAL_AUC.values()), rel=1e-6)
    write_tensorboard(run)  # again: replaces, does not duplicate
    assert len(list(logdir.glob("events.out.tfevents.*"))) == 1


def test_tensorboard_missing_says_how_to_install(run: Path) -> None:
    # A process where the tensorboard package cannot be imported (installed here or not).
    code = ("import sys; sys.modules['tensorboard'] = None\n"
            "from dlrm_app.reporting.report import write_tensorboard\n"
            "try:\n    write_tensorboard(sys.argv[1])\n"
            "except ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code, str(run)], capture_output=True, text=True,
                         check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=120)
    assert 'pip install -e ".[tensorboard]"' in out.stdout, out.stderr
    assert not (run / "tensorboard").exists()


def test_learning_curve_is_plotted_when_the_bench_stored_one(run: Path) -> None:
    (run / "learning_curve.json").write_text(json.dumps([
        {"rows": 1000, "test_auc": 0.7, "teacher_auc": 0.8},
        {"rows": 4000, "test_auc": 0.76, "teacher_auc": 0.8}]))
    text = write_report(run).read_text()
    assert "![Learning curve](plots/learning_curve.png)" in text
    assert (run / "plots" / "learning_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| 1,000 | ? | ? | 0.7000 | 0.8000 | 0.1000 |" in text
    assert "teacher's form" not in text  # the bench's older lines carry no fitted form


def test_learning_curve_table_and_plot_show_the_fitted_teacher_form(
        run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from matplotlib.figure import Figure

    (run / "learning_curve.json").write_text(json.dumps([
        {"rows": 500_000, "train_rows": 400_000, "epochs": 3, "test_auc": 0.7656,
         "teacher_auc": 0.8207, "teacher_form_auc": 0.7697},
        {"rows": 4_000_000, "train_rows": 3_200_000, "epochs": 1, "test_auc": 0.7994,
         "teacher_auc": 0.8218, "teacher_form_auc": 0.7961}]))
    figures: dict[str, Figure] = {}
    savefig = Figure.savefig

    def keep(fig: Figure, path: Path, **kwargs: object) -> None:
        figures[Path(path).name] = fig
        savefig(fig, path, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    text = write_report(run).read_text()
    section = text.split("## Learning curve")[1].split("## Plots")[0]
    assert ("| generated rows | train rows | epochs | default DLRM | teacher's form, fitted | "
            "teacher | gap |") in section
    assert "| 500,000 | 400,000 | 3 | 0.7656 | 0.7697 | 0.8207 | 0.0551 |" in section
    assert "| 4,000,000 | 3,200,000 | 1 | 0.7994 | 0.7961 | 0.8218 | 0.0224 |" in section
    ax = figures[".learning_curve.png.tmp"].axes[0]
    lines = {line.get_label(): list(line.get_ydata()) for line in ax.get_lines()}
    assert lines["default DLRM"] == [0.7656, 0.7994]
    assert lines["teacher's form, fitted to the same rows"] == [0.7697, 0.7961]
