"""bench/checkpoint.py on tiny tables: both implementations' lines, and checkpoints that hold the
same data and DCP metadata (no timing thresholds)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("sharding, world", [("table_wise", 2), ("row_wise", 3)])
@pytest.mark.slow
def test_checkpoint_bench_lines(sharding: str, world: int) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "checkpoint.py"), "--tables", "4", "--rows", "100",
         "--rounds", "1", "--sharding", sharding, "--world", str(world)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [(x["timing"], x["impl"]) for x in lines] == [
        ("state_dict_ms", "layouts"), ("state_dict_ms", "per_tensor"),
        ("save_ms", "layouts"), ("save_ms", "per_tensor")]
    for line in lines:
        assert line["bench"] == "sharded_checkpoint" and line["same_checkpoint"] is True
        assert (line["world"], line["tables"], line["sharding"]) == (world, 4, sharding)
        assert len(line["ms_rounds"]) == 1 and line["ms"] > 0
        assert (line["ratio_to_baseline"] is None) == (line["impl"] == "per_tensor")
