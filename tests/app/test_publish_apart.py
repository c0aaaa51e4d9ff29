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

import pytest
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


def _publish(rank: int, program: str, signum: int | None, tmp: Path) -> tuple[str, float]:
    """``_export_apart`` with ``program`` standing in for ``dlrm-app export`` (rank 1 signalled
    after 1 s where ``signum``): ("ok" | "signal N" | "error: MESSAGE", seconds)."""
    follow.export_command = lambda run, out, checkpoint: [sys.executable, "-c", program]
    guard = _Guard(signum if rank == 1 else None, 1.0)
    start = time.monotonic()
    try:
        got = follow._export_apart(tmp, str(tmp / "model.pt2"), tmp / "step_1", rank,
                                   torch.device("cpu"), guard)
        outcome = "ok" if got == 0 else f"signal {got}"
    except ValueError as e:
        outcome = f"error: {e}"
    return outcome, time.monotonic() - start


LONG = "import time; time.sleep(3.5); open('{done}', 'w').write('1')"
"""An export longer than ``SHORT_TIMEOUT_S`` that succeeds."""
FAILING = ("import sys, time; time.sleep(2.5); print('compiling', file=sys.stderr); "
           "sys.exit('model.pt2: no space left on device')")
STOPPED = "import time; time.sleep(20); open('{done}', 'w').write('1')"
"""An export the signal stops (rank 1 signalled after 1 s)."""


def _three_publishes(rank: int, world_size: int, tmp: str) -> dict[str, tuple[str, float]]:
    """The three cases one after the other on one process group (one start of the ranks)."""
    _short_timeout_group(rank, world_size)
    cases = {"long": (LONG, None), "failing": (FAILING, None), "stopped": (STOPPED, 15)}
    outcomes = {}
    for name, (program, signum) in cases.items():
        case = Path(tmp) / name
        case.mkdir(exist_ok=True)
        outcomes[name] = _publish(rank, program.format(done=case / "exported"), signum, case)
    return outcomes


@pytest.fixture(scope="module")
def publishes(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    tmp = tmp_path_factory.mktemp("publish")
    return tmp, run_gloo(2, _three_publishes, str(tmp), timeout_s=90)


def test_an_export_longer_than_the_collective_timeout_is_waited_for(publishes) -> None:
    tmp, ranks = publishes
    assert [r["long"][0] for r in ranks] == ["ok", "ok"]
    assert (tmp / "long" / "exported").read_text() == "1"
    # longer than SHORT_TIMEOUT_S: polled together, where a barrier timed out
    assert all(r["long"][1] >= 3.5 for r in ranks)


def test_a_failed_export_stops_every_rank_with_its_message(publishes) -> None:
    _, ranks = publishes
    assert ranks[0]["failing"][0] == "error: model.pt2: no space left on device"
    assert ranks[1]["failing"][0] == ("error: rank 0's export process failed (its message is "
                                      "on rank 0)")


def test_a_signal_on_any_rank_stops_the_export(publishes) -> None:
    tmp, ranks = publishes  # SIGTERM on rank 1 (SIGINT, Ctrl-C, takes the same path)
    assert [r["stopped"][0] for r in ranks] == ["signal 15"] * 2
    assert all(r["stopped"][1] < 15 for r in ranks)  # the export was stopped, not waited for
    assert not (tmp / "stopped" / "exported").exists()


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
