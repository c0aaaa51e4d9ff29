"""bench/ranks.py: its two command lines train at the same global batch, and a tiny run prints a
header, one line per (dataset, load, ranks) and a summary whose ratio is that of the medians.

No timing thresholds: only structure and what must hold by construction.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from shared_data import KAGGLE_10K

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import ranks as bench  # noqa: E402  (bench/ is a folder of scripts, not a package)


@pytest.mark.parametrize("ranks", bench.RANKS)
def test_command_splits_the_global_batch(ranks: int) -> None:
    cmd = bench.command(ranks, Path("data"), Path("run"), 128, 10, 5)
    launcher = cmd[1:cmd.index("train")]
    assert launcher == (["-m", "dlrm_app"] if ranks == 1 else [
        "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
        "-m", "dlrm_app"])
    assert cmd[cmd.index("--batch-size") + 1] == str(128 // ranks)


def test_rate_is_the_logged_global_rate(tmp_path: Path) -> None:
    # rank 0's log at 2 ranks, global batch 128: windows of 5 steps at 6,400 and 3,200 samples/s
    # after the first (warm-up) window: 640 rows in 0.1 s + 640 rows in 0.2 s
    events = [{"event": "start", "threads": 1},
              {"event": "train", "step": 5, "samples_per_s": 100.0},
              {"event": "train", "step": 10, "samples_per_s": 6400.0},
              {"event": "train", "step": 15, "samples_per_s": 3200.0},
              {"event": "summary", "world_size": 2, "global_batch": 128}]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    rate, threads = bench.rate_after_warmup(path)
    assert rate == pytest.approx(1280 / 0.3) and threads == 1


@pytest.mark.slow  # two short training runs, one under torchrun (about 25 s on 2 busy cores)
@pytest.mark.shared_data(KAGGLE_10K)
def test_tiny_run_lines() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "ranks.py"), "--datasets", "criteo_kaggle_10k",
         "--loads", "0", "--repeats", "1", "--steps", "10", "--log-every", "5",
         "--warmup-steps", "0"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    header, *lines = map(json.loads, proc.stdout.splitlines())
    assert header["bench"] == "ranks" and header["ranks"] == [1, 2] and header["loads"] == [0]
    assert header["cpus_usable"] >= 1
    runs = {line["ranks"]: line for line in lines if line["bench"] == "ranks"}
    (summary,) = [line for line in lines if line["bench"] == "ranks_summary"]
    assert len(lines) == 3 and set(runs) == {1, 2}
    for ranks, line in runs.items():
        assert line["dataset"] == "criteo_kaggle_10k" and line["busy_loops"] == 0
        # the 1-rank default batch of the 8.6k train rows, which 2 ranks' default splits alike
        assert line["global_batch"] == 128 and line["batch_per_rank"] == 128 // ranks
        assert line["threads_per_rank"] >= 1 and line["loadavg_1m_median"] >= 0
        assert len(line["runs"]) == 1 and line["samples_per_s"] > 0
        assert line["samples_per_s"] == round(statistics.median(line["runs"]))
    assert summary["dataset"] == "criteo_kaggle_10k" and summary["busy_loops"] == 0
    ratio = runs[2]["samples_per_s"] / runs[1]["samples_per_s"]
    assert summary["two_over_one"] == pytest.approx(ratio, abs=2e-3)
