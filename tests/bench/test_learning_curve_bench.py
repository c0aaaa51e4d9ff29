"""bench/learning_curve.py's line: the DLRM's test AUC next to the teacher's and next to the
teacher's own form fitted to the same rows, with the epochs it was asked for."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import learning_curve  # noqa: E402  (bench/ is a folder of scripts, not a package)

from dlrm_app.data.schema import DatasetSpec  # noqa: E402


def test_point_compares_the_dlrm_with_the_teacher_and_its_fitted_form(tmp_path: Path) -> None:
    line = learning_curve.point(3_000, tmp_path, epochs=1)
    spec = DatasetSpec.load(tmp_path / "data_3000")
    assert spec.parameters["cardinalities"] == [1_000] * 26  # the demo's generator
    assert line["rows"] == 3_000 and line["train_rows"] == 2_400
    assert line["teacher_auc"] == spec.parameters["teacher_auc"]["test"]
    assert line["gap"] == pytest.approx(line["teacher_auc"] - line["test_auc"], abs=1e-12)
    assert line["dlrm_minus_teacher_form"] == pytest.approx(
        line["test_auc"] - line["teacher_form_auc"], abs=1e-12)
    # one pass asked for: the DLRM's run and the fitted form stop within one epoch
    config = json.loads((tmp_path / "run_3000" / "config.json").read_text())
    assert line["epochs"] == config["schedule"]["epochs"] == 1
    assert line["steps"] <= 2_400 // config["schedule"]["batch_size"]
    assert line["teacher_form_epochs"] == 1
    # they learn: 0.752 and 0.731 measured (the teacher 0.851); untrained, about 0.5 (300 test
    # rows: an AUC's noise is about 0.03)
    assert 0.62 < line["test_auc"] < line["teacher_auc"] + 0.03
    assert 0.62 < line["teacher_form_auc"] < line["teacher_auc"] + 0.03


def test_point_without_the_fitted_form(tmp_path: Path) -> None:
    line = learning_curve.point(2_000, tmp_path, epochs=1, form=False)
    assert "teacher_form_auc" not in line and line["epochs"] == 1
