"""``train --follow`` under ``torchrun --max-restarts 1`` on two ranks: a rank killed inside
day 1 makes torchrun restart the group, which continues from the newest checkpoint (day 0's)
by itself; no day is trained twice and no day's line is written twice."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from process_tree import descendants

from dlrm_app.data.synthetic import generate

DAY_ROWS, BATCH = 12_000, 32
STEPS_A_DAY = DAY_ROWS // (2 * BATCH)  # 2 ranks, each its half of the day, last batch dropped


def _events(run: Path, event: str) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["event"] == event]


@pytest.mark.slow
def test_a_torchrun_restart_continues_with_the_first_day_not_done(tmp_path: Path) -> None:
    data, run = tmp_path / "data", tmp_path / "run"
    generate(data, rows=3 * DAY_ROWS, num_dense=2, cardinalities=[50, 20],
             pooling_factors=[1.0, 1.0], zipf_alpha=1.05, seed=0, rows_per_shard=DAY_ROWS,
             row_group_size=1000, days=3, drift=0.1)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--max-restarts=1",
           "--nproc-per-node", "2", "-m", "dlrm_app", "train", "--data", str(data), "--out",
           str(run), "--follow", "--batch-size", str(BATCH), "--embedding-dim", "4",
           "--dense-arch-layer-sizes", "8-4", "--over-arch-layer-sizes", "8-1", "--quiet"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    metrics, deadline = run / "metrics.jsonl", time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < deadline and not (
            metrics.is_file() and '"event": "day", "day": 1' in metrics.read_text()):
        time.sleep(0.02)
    workers = [p for p in descendants(proc.pid)
               if "dlrm_app" in Path(f"/proc/{p}/cmdline").read_text(errors="ignore")]
    assert proc.poll() is None and workers, "the run ended before a rank could be killed"
    os.kill(workers[-1], signal.SIGKILL)  # inside day 1, after its line
    out, err = proc.communicate(timeout=400)
    assert proc.returncode == 0, err[-4000:]
    starts = _events(run, "start")
    assert len(starts) == 2 and starts[1]["resumed_from"].endswith(f"step_{STEPS_A_DAY:08d}")
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["steps"] == 3 * STEPS_A_DAY
    assert summary["trained_steps"] == 2 * STEPS_A_DAY  # days 1 and 2, once
    assert [d["day"] for d in _events(run, "day")] == [0, 1, 2]
    assert [d["step"] for d in _events(run, "day_done")] == \
        [STEPS_A_DAY, 2 * STEPS_A_DAY, 3 * STEPS_A_DAY]
    assert [d["day"] for d in summary["days"]] == [0, 1, 2]
