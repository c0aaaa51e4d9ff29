"""Processes a test started, found through Linux ``/proc`` (torchrun ranks, preprocessing
workers): they may sit in other sessions, so process groups do not reach them."""

from __future__ import annotations

import os
import signal
from pathlib import Path


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid``, parents before children (``pid`` itself excluded)."""
    pids, i = [pid], 0
    while i < len(pids):
        try:
            for task in Path(f"/proc/{pids[i]}/task").iterdir():
                pids += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
        i += 1
    return pids[1:]


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and all its descendants, children first."""
    for p in reversed([pid, *descendants(pid)]):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
