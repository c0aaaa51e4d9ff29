"""bench/zch.py --quick prints one consistent JSON line per case (no timing thresholds)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_zch_bench_quick_lines() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "zch.py"), "--quick", "--threads", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    cases = [(line["case"], line.get("eviction_interval")) for line in lines]
    assert cases == [
        ("ebc_in_range", None), ("ebc_modulo", None),
        ("mc_ebc", 1), ("remap", 1), ("mc_ebc", 3), ("remap", 3), ("remap_eval", 3),
    ]
    in_range = lines[0]["ms_per_batch"]
    for line in lines:
        assert line["bench"] == "zch" and line["threads"] == 1
        assert (line["features"], line["batch_size"], line["zch_size"], line["dim"]) == (3, 64, 50, 8)
        assert line["cpu"] and line["simd"] in {"avx512", "avx2", "none"}
        assert line["ms_per_batch"] > 0
        if line["case"] in ("ebc_modulo", "mc_ebc"):
            assert abs(line["vs_in_range_ms"] - (line["ms_per_batch"] - in_range)) < 1e-2
