"""The README's quick start, `dlrm-app demo`, end to end (small row count to stay fast)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dlrm_app.data.loader import ParquetLoader
from dlrm_app.data.synthetic import binary_auc
from dlrm_app.serving.artifact import load_artifact


@pytest.mark.slow
def test_demo_generates_trains_evaluates_exports(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "dlrm_app", "demo", "--out", str(tmp_path / "demo"),
         "--rows", "60000", "--quiet"],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert 0.5 < result["best_achievable_test_auc"] <= 1.0
    # it learned something real, and cannot beat the generator's own teacher
    assert 0.6 < result["test_auc"] < result["best_achievable_test_auc"], result
    assert result["test_ne"] < 1.0  # better than predicting the base rate
    artifact = Path(result["exported"])
    assert artifact.suffix == ".pt2" and artifact.stat().st_size == result["exported_bytes"]
    model, meta = load_artifact(artifact)
    assert meta["format"] == "pt2" and meta["embedding_dtype"] == "int8" and meta["raw_input"]
    # the served artifact scores the test split as the evaluated checkpoint did (int8 tables)
    (batch,) = ParquetLoader(result["data"], "test", batch_size=1 << 20, drop_last=False,
                             shuffle=False, prefetch=0)
    with torch.inference_mode():
        probabilities = model(batch.dense, batch.sparse.values(), batch.sparse.offsets())
    auc = binary_auc(probabilities.numpy(), batch.labels.numpy())
    assert abs(auc - result["test_auc"]) < 1e-3, (auc, result["test_auc"])
    assert meta["training"]["validation"]["auc"] == pytest.approx(result["validation_auc"])


def test_demo_data_is_generated_again_for_other_rows(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """A rerun with the same --rows reuses the generated data; another --rows generates it
    again (and says so) instead of silently training on the old rows."""
    from dlrm_app.demo import demo_data

    data = tmp_path / "data"
    first = demo_data(data, 1_000)
    stamp = (data / "dataset.json").stat().st_mtime_ns
    again = demo_data(data, 1_000)
    assert again.splits == first.splits and (data / "dataset.json").stat().st_mtime_ns == stamp
    other = demo_data(data, 1_500)
    assert sum(s.rows for s in other.splits) == 1_500 and other.parameters["rows"] == 1_500
    assert "holds 1,000 generated rows, not 1,500; generating them again" in capsys.readouterr().err
