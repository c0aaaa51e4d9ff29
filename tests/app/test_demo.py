"""The README's quick start, `dlrm-app demo`, end to end (small row count to stay fast)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch


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
    assert artifact.stat().st_size == result["exported_bytes"]
    extra = {"metadata.json": ""}
    model = torch.jit.load(str(artifact), _extra_files=extra)
    assert json.loads(extra["metadata.json"])["embedding_dtype"] == "int8"
    assert hasattr(model, "predict_raw")
