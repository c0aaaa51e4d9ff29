"""Hypothesis fuzz of the KJT ops and the EBC / fused EBC (FBGEMM and pure torch) / int8 EBC
forwards (``sparse_fuzz_child.py``), in a child process so that a crash is a failing test.

The child's property: a ``ValueError`` exactly when the drawn input is malformed (a negative or
oversized length, offsets past the values, weights not one per value, an id outside its
table), and otherwise outputs equal to sum pooling by hand over the module's own tables. Fixed
seed (``derandomize``), 400 examples. Before the layout check, the same child aborted the
process (``free(): invalid pointer``) within its first examples.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).with_name("sparse_fuzz_child.py")


@pytest.mark.slow
def test_fuzz_finds_no_crash_and_no_wrong_output() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(CHILD), "400"], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=600)
    assert proc.returncode == 0, (
        f"fuzz child exited {proc.returncode} (negative: killed by a signal):\n"
        f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    assert "fuzz: 400 examples, no crash, no wrong output" in proc.stdout
