"""The console script runs as installed and reports what the kernels layer decides."""

from __future__ import annotations

import json
import subprocess
import sys

from recsys_core.kernels import fbgemm_available


def test_info_json_reports_kernel_choices() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "dlrm_app", "info", "--json"],
        check=True, capture_output=True, text=True,
    ).stdout
    report = json.loads(out)
    kernels = report["fused_kernels"]
    assert kernels["ADAM"].startswith("torch (FBGEMM has no ADAM kernel on cpu")
    if fbgemm_available():
        assert kernels["EXACT_ROWWISE_ADAGRAD"] == "fbgemm"
        assert report["fbgemm_status"] == "ok"
    else:
        assert kernels["EXACT_ROWWISE_ADAGRAD"].startswith("torch")


def test_info_with_fbgemm_disabled_uses_torch_everywhere() -> None:
    import os

    env = {**os.environ, "RECSYS_CORE_DISABLE_FBGEMM": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "dlrm_app", "info", "--json"],
        check=True, capture_output=True, text=True, env=env,
    ).stdout
    report = json.loads(out)
    assert report["fbgemm_gpu"] is None
    assert "disabled by RECSYS_CORE_DISABLE_FBGEMM" in report["fbgemm_status"]
    assert all(v.startswith("torch") for v in report["fused_kernels"].values())
