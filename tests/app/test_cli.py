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


def test_worker_processes_reimport_the_entry_point_without_torch(tmp_path) -> None:
    """Preprocessing workers (multiprocessing forkserver/spawn) re-run the program's main
    script as ``__mp_main__`` when they start. Through ``dlrm_app.launcher`` that imports no
    torch (1.5 s per worker here before); the console script and ``python -m dlrm_app`` both
    enter there."""
    from pathlib import Path

    import tomllib

    root = Path(__file__).resolve().parents[2]
    scripts = tomllib.loads((root / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["dlrm-app"] == "dlrm_app.launcher:main"
    assert "from dlrm_app.launcher import main" in (root / "dlrm_app" / "__main__.py").read_text()
    # what pip writes for a console script
    script = tmp_path / "dlrm-app"
    script.write_text("import re\nimport sys\nfrom dlrm_app.launcher import main\n"
                      "if __name__ == '__main__':\n    sys.exit(main())\n")
    heavy = ("torch", "numpy", "pyarrow", "dlrm_app.cli", "recsys_core")
    code = (f"import runpy, sys; runpy.run_path({str(script)!r}, run_name='__mp_main__'); "
            f"print([m for m in {heavy!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True).stdout
    assert out.strip() == "[]"
