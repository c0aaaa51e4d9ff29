"""The export benchmark runs end to end and reports well-formed, consistent lines; its stage
clock maps every progress message of ``export_model`` to a stage.

No timing thresholds: only structure, and what holds by construction (the stages lie within
the export's total, one export has one digest).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import export as bench  # noqa: E402  (bench/ is a folder of scripts, not a package)

STAGES = [("load", None), ("quantize", None), ("torch_export", "model"),
          ("torch_export", "encode"), ("aot_compile", "model"), ("aot_compile", "encode"),
          ("package", None), ("total", None)]


@pytest.mark.slow
def test_the_tiniest_run_reports_each_stage_within_the_total() -> None:
    # the demo's model on a few generated rows: no shared data needed; one export (~20 s)
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "export.py"), "--models", "demo",
                           "--demo-rows", "2000", "--steps", "2", "--repeats", "1",
                           "--warmup", "0", "--no-cold"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    head, *stages, artifact = [json.loads(line) for line in proc.stdout.splitlines()]
    assert head["bench"] == "export_header" and head["models"] == ["demo"]
    assert head["cpu"] and head["torch"] and head["compiler"] and head["repeats"] == 1
    assert head["torch_threads"] >= 1
    assert [(s["stage"], s["program"]) for s in stages] == STAGES
    for s in stages:
        assert (s["bench"], s["model"], s["cache"]) == ("export", "demo", "warm")
        assert len(s["runs_s"]) == len(s["load_avg_1m"]) == 1
        assert s["median_s"] == s["runs_s"][0] >= 0
    *parts, total = stages
    # each figure is rounded to the millisecond: the sum may exceed the total by half a
    # millisecond per rounded figure
    slack = 0.0005 * (len(parts) + 1) + 1e-9
    assert sum(s["runs_s"][0] for s in parts) <= total["runs_s"][0] + slack
    assert artifact["bench"] == "export_artifact" and artifact["model"] == "demo"
    assert artifact["bytes"] > 0 and artifact["exports"] == 1 and artifact["same_sha256"]
    assert len(artifact["sha256"]) == 1


def test_stage_clock_sums_each_stage_until_the_next() -> None:
    clock = bench.StageClock()
    messages = ["loading the best checkpoint of runs/a (unsharded, CPU)",
                "quantizing the tables of step_2 to int8", "torch.export: program 'model'",
                "AOTInductor: compiling 'model' for CPU", "packaging the programs and the manifest",
                "wrote m.pt2 (sha256 ab, also in m.pt2.sha256)"]
    for message in messages:
        clock(message)
    # replace the real timestamps by known ones, one second apart
    clock.marks = [(float(t), stage, program) for t, (_, stage, program)
                   in enumerate(clock.marks)]
    assert clock.stages(end=7.5) == {"load": 1.0, "quantize": 1.0, "torch_export:model": 1.0,
                                     "aot_compile:model": 1.0, "package": 3.5}
    with pytest.raises(ValueError, match="STAGE_MESSAGES"):
        clock("linking the universe")
