"""bench/torchrec_program.py: the TorchRec-style program runs on recsys_core under torchrun and
reports consistent lines; without a TorchRec interpreter no ratio is claimed, and a wrong one
fails naming the library. No timing thresholds."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "torchrec_program.py"

pytestmark = pytest.mark.slow


def _run(*extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH), "--quick", "--precisions", "fp32",
                           "--repeats", "1", *extra], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)


def test_recsys_core_lines_at_one_and_two_ranks() -> None:
    proc = _run("--world-sizes", "1,2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    assert [(x["bench"], x["lib"], x["world_size"]) for x in lines] == [
        ("torchrec_program", "recsys_core", 1), ("torchrec_program", "recsys_core", 2)]
    for line in lines:
        # samples/s and the step time describe the same timed steps (both from the slowest rank)
        assert line["samples_per_s"] == pytest.approx(
            line["batch_size_per_rank"] * line["world_size"] / (line["step_ms"] / 1e3), rel=0.01)
        assert line["cpu_ms_per_rank_step"] > 0 and line["cpu"]
        # a binary cross-entropy of a fresh model on random labels: near log 2, and training moves it
        assert abs(line["first_step_loss"] - math.log(2)) < 0.1
        assert line["last_step_loss"] != line["first_step_loss"]


def test_an_interpreter_without_torchrec_fails_naming_it() -> None:
    proc = _run("--world-sizes", "1", "--torchrec-python", sys.executable)
    assert proc.returncode != 0
    assert "torchrec at world size 1 (fp32): the torchrun job failed" in proc.stderr
    assert "No module named 'torchrec'" in proc.stderr
