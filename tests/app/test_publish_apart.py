"""``train --follow --publish`` on more than one rank: rank 0 starts the export in a process of
its own and every rank polls it together, so that an export longer than the ranks' collective
timeout (``--timeout``; a first publish compiles its program) does not time the others out at a
barrier; a failed export stops every rank with its message; a signal stops the export."""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from dlrm_app.training import follow
from recsys_core.testing import run_gloo

SHORT_TIMEOUT_S = 2.0
"""The ranks' collective timeout in these tests; the stand-in exports take longer."""


class _Guard:
    """A PreemptionGuard's flag: ``signalled`` after ``after_s`` seconds on this rank."""

    def __init__(self, signum: int | None, after_s: float) -> None:
        self._signum, self._at = signum, time.monotonic() + after_s

    @property
    def signalled(self) -> int | None:
        return self._signum if time.monotonic() >= self._at else None


def _short_timeout_group(rank: int, world_size: int) -> None:
    """The default group again, with a collective timeout of ``SHORT_TIMEOUT_S``."""
    dist.destroy_process_group()
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          world_size, False, datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=dist.PrefixStore("short", store), rank=rank,
                            world_size=world_size,
                            timeout=datetime.timedelta(seconds=SHORT_TIMEOUT_S))


def _publish(rank: int, world_size: int, program: str, signum: int | None,
             tmp: str) -> tuple[str, float]:
    """``_export_apart`` with ``program`` standing in for ``dlrm-app export`` (rank 1 signalled
    after 1 s where ``signum``): ("ok" | "signal N" | "error: MESSAGE", seconds)."""
    _short_timeout_group(rank, world_size)
    follow.export_command = lambda run, out, checkpoint: [sys.executable, "-c", program]
    guard = _Guard(signum if rank == 1 else None, 1.0)
    start = time.monotonic()
    try:
        got = follow._export_apart(Path(tmp), str(Path(tmp) / "model.pt2"),
                                   Path(tmp) / "step_1", rank, torch.device("cpu"), guard)
        outcome = "ok" if got == 0 else f"signal {got}"
    except ValueError as e:
        outcome = f"error: {e}"
    return outcome, time.monotonic() - start


def test_an_export_longer_than_the_collective_timeout_is_waited_for(tmp_path: Path) -> None:
    done = tmp_path / "exported"
    program = f"import time; time.sleep(3.5); open({str(done)!r}, 'w').write('1')"
    ranks = run_gloo(2, _publish, program, None, str(tmp_path), timeout_s=60)
    assert [outcome for outcome, _ in ranks] == ["ok", "ok"]
    assert done.read_text() == "1"
    assert all(seconds >= 3.5 for _, seconds in ranks)  # > SHORT_TIMEOUT_S: polled, not a barrier


def test_a_failed_export_stops_every_rank_with_its_message(tmp_path: Path) -> None:
    program = ("import sys, time; time.sleep(2.5); print('compiling', file=sys.stderr); "
               "sys.exit('model.pt2: no space left on device')")
    ranks = run_gloo(2, _publish, program, None, str(tmp_path), timeout_s=60)
    assert ranks[0][0] == "error: model.pt2: no space left on device"
    assert ranks[1][0] == "error: rank 0's export process failed (its message is on rank 0)"


def test_a_signal_on_any_rank_stops_the_export(tmp_path: Path) -> None:
    signum = 15  # SIGTERM (SIGINT, Ctrl-C, takes the same path)
    done = tmp_path / "exported"
    program = f"import time; time.sleep(20); open({str(done)!r}, 'w').write('1')"
    ranks = run_gloo(2, _publish, program, signum, str(tmp_path), timeout_s=60)
    assert [outcome for outcome, _ in ranks] == [f"signal {signum}"] * 2
    assert all(seconds < 15 for _, seconds in ranks)  # the export was stopped, not waited for
    assert not done.exists()


STAGING_STUB = """
import shutil, sys, time
from pathlib import Path
import dlrm_app.serving.export as export
from dlrm_app import cli

def export_model(run, out, *args, **kwargs):  # stands in for the compile: staging, then waits
    staging = Path(out).parent / f".{Path(out).name}.partial"
    staging.mkdir()
    try:
        print("staged", flush=True)
        time.sleep(60)
    finally:
        shutil.rmtree(staging)

export.export_model = export_model
sys.exit(cli.main(["export", sys.argv[1], "--out", sys.argv[2]]))
"""


def test_sigterm_ends_an_export_as_ctrl_c_does(tmp_path: Path) -> None:
    """``dlrm-app export`` turns SIGTERM (a scheduler; torchrun stopping a --publish run's
    process group; the run stopping its export) into Ctrl-C's unwinding: the export's partial
    files are removed (SIGTERM's default killed it with them left behind) and it exits 130."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text("{}")
    out = tmp_path / "serve" / "model.pt2"
    out.parent.mkdir()
    child = subprocess.Popen([sys.executable, "-c", STAGING_STUB, str(tmp_path / "run"),
                              str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "staged"
        child.send_signal(signal.SIGTERM)
        _, err = child.communicate(timeout=30)
    finally:
        child.kill()
    assert child.returncode == 130, err
    assert "dlrm-app export: interrupted" in err
    assert list(out.parent.iterdir()) == []  # no partial folder left
