"""bench/dense.py prints one well-formed line per precision; both start from the same model and
batch, so their first losses agree to bf16 rounding."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_dense_bench_lines() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "dense.py"), "--batch-size", "64", "--dim", "8",
         "--features", "4", "--steps", "1", "--repeats", "2", "--no-compile"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = {line["precision"]: line for line in map(json.loads, proc.stdout.splitlines())}
    assert set(lines) == {"fp32", "bf16"}
    for line in lines.values():
        assert line["bench"] == "dlrm_dense" and line["mode"] == "eager"
        assert line["batch_size"] == 64 and line["threads"] == 1 and line["step_ms"] > 0
    fp32, bf16 = lines["fp32"]["first_step_loss"], lines["bf16"]["first_step_loss"]
    assert bf16 == pytest.approx(fp32, rel=0.01)
