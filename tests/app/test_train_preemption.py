"""SIGTERM (a scheduler's preemption) in ``dlrm-app train``: the step in progress ends, its
checkpoint is saved, the run exits 143 with one line naming the step and ``--resume``, and the
resumed run trains exactly as the uninterrupted one; a torchrun restart resumes by itself."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from app_setup import stopped_step, two_feature_data

SMALL = ["--embedding-dim", "4", "--dense-arch-layer-sizes", "8-4", "--over-arch-layer-sizes",
         "8-1", "--batch-size", "32", "--log-every", "1", "--save-every", "1000", "--quiet",
         "--max-steps", "400", "--patience", "0", "--no-amp"]


def _events(run: Path) -> list[dict]:
    return [json.loads(s) for s in (run / "metrics.jsonl").read_text().splitlines()]


def _losses(run: Path) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in _events(run) if e["event"] == "train"}


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return two_feature_data(tmp_path_factory.mktemp("preempt") / "data", rows=40_000,
                            rows_per_shard=20_000, row_group_size=1_000)


@pytest.mark.slow
def test_sigterm_saves_the_step_and_resume_equals_the_uninterrupted_run(data: Path,
                                                                        tmp_path: Path) -> None:
    run, full = tmp_path / "run", tmp_path / "full"
    cmd = [sys.executable, "-m", "dlrm_app", "train", "--data", str(data), *SMALL]
    proc = subprocess.Popen([*cmd, "--out", str(run)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    log = run / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline and (
            not log.exists() or len(_losses(run)) < 10):
        time.sleep(0.05)
    step = stopped_step(proc, signal.SIGTERM, run, exit_code=143)
    assert 10 <= step < 400 and max(_losses(run)) == step  # the newest checkpoint: the last step
    assert [e["step"] for e in _events(run) if e["event"] == "preempted"] == [step]
    resumed = subprocess.run([*cmd, "--out", str(run), "--resume"], capture_output=True,
                             text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    uninterrupted = subprocess.run([*cmd, "--out", str(full)], capture_output=True, text=True,
                                   timeout=300)
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-2000:]
    cut, whole = _losses(run), _losses(full)
    assert sorted(cut) == sorted(whole) == list(range(1, 401))
    for s in range(step + 1, 401):
        assert cut[s] == whole[s], s  # bitwise: weights, optimizers, RNG and data position


@pytest.mark.slow
def test_a_torchrun_restart_resumes_without_being_told(data: Path, tmp_path: Path) -> None:
    """torchrun sets TORCHELASTIC_RESTART_COUNT in the workers of a restarted group: the same
    command (no --resume, even with --overwrite) continues the run instead of refusing it."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "dlrm_app", "train", "--data", str(data), "--out", str(run),
           *SMALL]
    first = subprocess.run([*cmd, "--max-steps", "20", "--save-every", "10"],
                           capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    env = {**os.environ, "TORCHELASTIC_RESTART_COUNT": "1"}
    again = subprocess.run([*cmd, "--max-steps", "30", "--overwrite"], capture_output=True,
                           text=True, timeout=300, env=env)
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"torchrun restart 1: resuming the run in {run}" in again.stderr
    start = [e for e in _events(run) if e["event"] == "start"][-1]
    assert start["start_step"] == 20 and start["resumed_from"].endswith("step_00000020")
    assert sorted(_losses(run)) == list(range(1, 31))  # steps 1-20 kept, 21-30 added


def test_a_second_sigterm_ends_the_process_at_once() -> None:
    """The first SIGTERM is noted (training stops after its step, with a checkpoint); a second
    one (a scheduler out of patience) ends the process at once, by the signal."""
    program = (
        "import os, signal, time\n"
        "from dlrm_app.training.components.preemption import PreemptionGuard\n"
        "with PreemptionGuard(1) as guard:\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    os.kill(os.getpid(), signal.SIGTERM)  # a launcher's relay: the same stop\n"
        "    print('noted', guard.signalled == signal.SIGTERM, guard.agreed(), flush=True)\n"
        "    time.sleep(1.2)\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    print('still running', flush=True)\n")
    proc = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          timeout=60)
    assert proc.stdout.splitlines() == ["noted True True"]
    assert proc.returncode == -signal.SIGTERM
