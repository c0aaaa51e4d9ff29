"""bench/quant_ebc.py runs on a tiny configuration and prints what it promises."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from recsys_core.kernels import fbgemm_available

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_quant_bench_smoke() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "quant_ebc.py"), "--tables", "2", "--rows", "100",
         "--dim", "8", "--pooling", "2", "--batch-sizes", "1,4", "--iters", "2", "--warmup", "1",
         "--torch-kernel"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    timed = {(d["impl"], d["batch_size"]) for d in lines if "latency_ms" in d}
    impls = {"fused_fp32"} | {f"{k}_{d}" for k in ("quant", "torch") for d in ("int8", "int4", "fp16")}
    if fbgemm_available():
        impls |= {f"raw_{d}" for d in ("int8", "int4", "fp16")}
    assert timed == {(i, b) for i in impls for b in (1, 4)}
    sizes = {d["dtype"]: d for d in lines if "bytes_per_table" in d}
    # 100 rows: INT8 12-byte rows, INT4 8, FP16 16, each table rounded up to 128 bytes
    assert sizes["int8"]["bytes_per_table"] == {"t0": 1280, "t1": 1280}
    assert sizes["int4"]["bytes_per_table"] == {"t0": 896, "t1": 896}
    assert sizes["fp16"]["bytes_per_table"] == {"t0": 1664, "t1": 1664}
    assert sizes["int8"]["relative_error_pooled"] < 0.02
