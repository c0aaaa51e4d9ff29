"""Ctrl-C in ``dlrm-app train``: the step in progress ends and its checkpoint is saved (as on
SIGTERM), exit code 130 (the shell's for an interrupted command) and one line saying the step,
the checkpoint and the command that continues from it; the resumed run says where it resumed.
A second Ctrl-C does not wait for the save (``tests/app/test_preemption_guard.py``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from app_setup import stopped_step

from dlrm_app.data.synthetic import generate
from dlrm_app.training.checkpoint import latest_checkpoint

SMALL = ["--embedding-dim", "4", "--dense-arch-layer-sizes", "8-4", "--over-arch-layer-sizes",
         "8-1", "--batch-size", "32", "--save-every", "5", "--log-every", "5", "--quiet"]


@pytest.mark.slow
def test_ctrl_c_saves_the_step_and_exits_130_naming_it_and_resume(tmp_path: Path) -> None:
    data, run = tmp_path / "data", tmp_path / "run"
    generate(data, rows=200_000, num_dense=2, cardinalities=[50, 20], pooling_factors=[1.0, 1.0],
             zipf_alpha=1.05, seed=0, rows_per_shard=100_000, row_group_size=1_000)
    cmd = [sys.executable, "-m", "dlrm_app", "train", "--data", str(data), "--out", str(run),
           *SMALL]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    latest = run / "checkpoints" / "latest"
    deadline = time.monotonic() + 120
    while not latest.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    saved = stopped_step(proc, signal.SIGINT, run, exit_code=130)  # SIGINT: what Ctrl-C sends
    assert saved > 0
    assert latest_checkpoint(run / "checkpoints").name == f"step_{saved:08d}"
    # the resumed run says where it resumed
    resumed = subprocess.run([*cmd, "--resume", "--max-steps", str(saved + 2)],
                             capture_output=True, text=True, timeout=300,
                             env={**os.environ, "DLRM_APP_TRACEBACK": "1"})
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resumed from {run / 'checkpoints' / f'step_{saved:08d}'} at step {saved}" \
        in resumed.stderr
