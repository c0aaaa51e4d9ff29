"""The heartbeat thread (``dlrm_app.training.runtime.Heartbeat``) that names a stalled rank.

Its beats reach the store and stop when asked; and a process that beats exits cleanly: a
daemon thread caught inside the store's C++ write at interpreter exit used to abort the
process ("terminate called without an active exception", exit -6) after its work was done,
which failed torchrun jobs at random (about 1 exit in 2 with beats back to back here).
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch.distributed as dist

from dlrm_app.training import runtime
from recsys_core.testing import find_free_port


def test_beats_reach_the_store_and_stop(monkeypatch) -> None:
    port = find_free_port()
    master = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setattr(runtime.Heartbeat, "INTERVAL_S", 0.01)
    key = "dlrm_app_heartbeat/0/3"
    runtime.Heartbeat.start()
    try:
        master.wait([key], datetime.timedelta(seconds=10))
        first = float(master.get(key).decode())
        assert abs(first - time.time()) < 10
        time.sleep(0.1)
        assert float(master.get(key).decode()) > first  # it keeps beating
        # a reader sees rank 3 alive and ranks 0-2 (never beat) as silent
        assert runtime.Heartbeat.stalled(4) == [(0, None), (1, None), (2, None)]
    finally:
        runtime.Heartbeat.stop()
    assert runtime.Heartbeat._thread is None
    last = master.get(key)
    time.sleep(0.1)
    assert master.get(key) == last  # stopped: no beat after stop()
    runtime.Heartbeat._store = None


@pytest.mark.slow  # 16 interpreter exits, about 1 s each
def test_a_beating_process_exits_cleanly() -> None:
    # 16 processes forked from one interpreter, each beating back to back (no pause between
    # writes) until it exits the normal way: every one must exit 0
    program = textwrap.dedent("""
        import os, sys
        import torch.distributed as dist
        from dlrm_app.training import runtime
        from recsys_core.testing import find_free_port
        statuses = []
        for _ in range(16):
            port = find_free_port()
            pid = os.fork()
            if pid == 0:
                store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
                os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0")
                runtime.Heartbeat.INTERVAL_S = 0.0
                runtime.Heartbeat.start()
                sum(range(200_000))
                sys.exit(0)
            statuses.append(os.waitpid(pid, 0)[1])
        print(statuses)
        sys.exit(any(statuses))
    """)
    proc = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONFAULTHANDLER": ""})
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]


def test_a_timed_out_collective_is_named_with_its_caller(monkeypatch) -> None:
    """The one line of a timeout names the collective, the project function that called it and
    the application step it ran in (here: the metrics' all-reduce in ``global_mean``)."""
    from dlrm_app.cli import describe_error

    def all_reduce(tensor, *args, **kwargs):  # gloo's words when a peer does not answer
        raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Timed out "
                           "waiting 5000ms for recv operation to complete")

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    try:
        runtime.global_mean([1.0], __import__("torch").device("cpu"))
    except RuntimeError as exc:
        caught = exc
    text = describe_error(caught)
    assert text.startswith("a collective operation in `all_reduce`, called by `global_mean` "
                           "(dlrm_app/training/runtime.py:"), text
    assert "timed out waiting for the other ranks" in text and "--timeout" in text
    assert runtime.collective_site(RuntimeError("no traceback")) == ""
