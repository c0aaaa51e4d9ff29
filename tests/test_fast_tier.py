"""The fast tier, ``python -m pytest -m "not slow"``, still reaches every test folder: at least one
test of each folder under tests/ (and of tests/ itself) is not marked ``slow``.

Checked by collecting the way that command does, in a subprocess. Assertion rewriting is off
there: collecting only imports the modules, and rewriting every assert of the suite would take
longer than everything else the collection does.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def folders_with_tests() -> set[str]:
    """Every folder (relative to tests/, "." for tests/ itself) that holds a test module."""
    return {str(p.parent.relative_to(TESTS)) for p in TESTS.rglob("test_*.py")}


def test_every_test_folder_keeps_a_test_in_the_fast_tier() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "not slow",
         "--assert=plain", "-p", "no:cacheprovider", str(TESTS)],
        capture_output=True, text=True, cwd=TESTS.parent, timeout=120,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    fast: dict[str, int] = {}
    for line in out.stdout.splitlines():
        if "::" in line:
            folder = str(Path(line.split("::")[0]).parent.relative_to("tests"))
            fast[folder] = fast.get(folder, 0) + 1
    missing = sorted(folders_with_tests() - set(fast))
    assert not missing, (
        f"no test of {missing} runs under -m 'not slow'; leave at least one quick test of each "
        f"folder unmarked (fast tests per folder: {fast})"
    )
