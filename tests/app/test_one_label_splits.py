"""A split whose rows all carry one label (the bundled Criteo 1TB day sample: its 21 positives
are all in the first 857 rows, so validation and test get none): preprocessing says so, train
refuses it before writing anything, ``evaluate`` prints valid JSON with ``null`` and the reason,
and ``export`` ships no unchosen checkpoint unless asked."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from shared_data import CRITEO, KAGGLE_10K

from dlrm_app import jsonline
from dlrm_app.cli import main
from dlrm_app.serving.export import export_model
from dlrm_app.training.checkpoint import latest_checkpoint

DAY = CRITEO / "terabyte_day_sample_1k.tsv"
TINY = ["--embedding-dim", "4", "--dense-arch-layer-sizes", "8-4", "--over-arch-layer-sizes",
        "8-1", "--batch-size", "64", "--max-steps", "3"]


def test_undefined_metrics_are_null_with_the_reason() -> None:
    metrics = {"auc": math.nan, "ne": math.nan, "logloss": 0.1, "calibration": math.nan,
               "label_rate": 0.0, "num_examples": 72}
    line = jsonline.dumps({"split": "test", **metrics})
    out = json.loads(line)  # strict JSON: no NaN token
    assert "NaN" not in line
    assert out["auc"] is None and out["logloss"] == 0.1
    assert out["undefined"]["auc"] == "all 72 rows carry label 0: auc needs both labels"
    assert "positive label" in out["undefined"]["calibration"]
    assert jsonline.dumps({"auc": math.nan, "label_rate": math.nan, "num_examples": 0}) == (
        '{"auc": null, "label_rate": null, "num_examples": 0, '
        '"undefined": {"auc": "no rows", "label_rate": "no rows"}}')


@pytest.mark.shared_data(DAY)
def test_day_sample_is_refused_by_train_with_the_reason(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data, run = tmp_path / "day", tmp_path / "run"
    assert main(["preprocess", "criteo", str(DAY), "--out", str(data)]) == 0
    err = capsys.readouterr().err
    assert ("warning: the validation split (71 rows) holds only negative (0) labels: no AUC "
            "can be computed on it (`dlrm-app train` refuses it)") in err
    assert "warning: the test split (72 rows) holds only negative (0) labels" in err
    with pytest.raises(SystemExit) as refused:
        main(["train", "--data", str(data), "--out", str(run), *TINY])
    message = str(refused.value.code)
    assert message.startswith(f"dlrm-app train: --data {data}: the validation split (71 rows) "
                              "holds only negative (0) labels")
    assert "preprocess more rows" in message and "\n" not in message
    assert not run.exists()  # nothing written: the retry needs no --overwrite


@pytest.mark.slow
@pytest.mark.shared_data(KAGGLE_10K, DAY)
def test_evaluate_on_one_label_rows_prints_null_and_export_needs_asking(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data, run = tmp_path / "kaggle", tmp_path / "run"
    assert main(["preprocess", "criteo", str(KAGGLE_10K), "--out", str(data)]) == 0
    assert main(["train", "--data", str(data), "--out", str(run), *TINY]) == 0
    # the day sample's last 143 rows carry no positive label
    tail = tmp_path / "tail.tsv"
    tail.write_text("".join(DAY.read_text().splitlines(keepends=True)[-143:]))
    held = tmp_path / "held"
    assert main(["preprocess", "criteo", str(tail), "--out", str(held), "--like", str(data),
                 "--one-split", "test"]) == 0
    capsys.readouterr()
    assert main(["evaluate", str(run), "--data", str(held), "--split", "test"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["num_examples"] == 143 and out["auc"] is None and out["ne"] is None
    assert out["undefined"]["auc"] == "all 143 rows carry label 0: auc needs both labels"
    assert math.isfinite(out["logloss"])
    # a run whose validations chose no checkpoint: export refuses its default, not an explicit one
    shutil.rmtree(run / "checkpoints" / "best", ignore_errors=True)
    (run / "checkpoints" / "best").unlink(missing_ok=True)
    assert latest_checkpoint(run / "checkpoints") is not None
    with pytest.raises(ValueError, match="no checkpoint was chosen as the best; to export the "
                                         "newest one anyway pass --checkpoint latest"):
        export_model(run, tmp_path / "m.pt", fmt="torchscript")
    meta = export_model(run, tmp_path / "m.pt", fmt="torchscript", checkpoint="latest")
    assert Path(meta["path"]).is_file()


def test_evaluate_prints_a_readable_line_beside_the_json() -> None:
    from dlrm_app.cli import evaluate_summary

    ok = {"split": "test", "num_examples": 2000, "checkpoint": "/r/checkpoints/step_00000132",
          "auc": 0.7481234567, "ne": 0.87123, "logloss": 0.4654, "accuracy": 0.781,
          "calibration": 1.02, "label_rate": 0.25, "teacher_auc": 0.8}
    assert evaluate_summary(ok) == (
        "test split, 2,000 rows, step_00000132: AUC 0.7481, NE 0.8712, logloss 0.4654, "
        "accuracy 0.7810, calibration 1.0200 (the teacher's AUC 0.8000)")
    one_label = {**ok, "num_examples": 143, "auc": math.nan, "ne": math.nan,
                 "calibration": math.nan, "label_rate": 0.0, "teacher_auc": None}
    line = evaluate_summary(one_label)
    assert line.startswith("test split, 143 rows, step_00000132: AUC n/a, NE n/a, ")
    assert "n/a: all 143 rows carry label 0: auc needs both labels" in line
