"""The ``shared_data`` marker: a missing sample skips locally and fails under ``CI=true``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from shared_data import CRITEO, ML100K, REPO_ROOT

CASE = '''
import pytest

@pytest.mark.shared_data("{path}")
def test_reads_sample():
    assert True
'''


@pytest.mark.parametrize(("ci", "outcome"), [("", "1 skipped"), ("true", "1 error")])
@pytest.mark.slow
def test_missing_sample(tmp_path: Path, ci: str, outcome: str) -> None:
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "conftest.py").write_text((REPO_ROOT / "tests" / "conftest.py").read_text())
    (tests / "test_case.py").write_text(CASE.format(path=tmp_path / "absent.tsv"))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-W", "ignore::pytest.PytestUnknownMarkWarning", str(tests)],
                          capture_output=True, text=True, cwd=tmp_path,
                          env={"PATH": "", "CI": ci})
    assert outcome in proc.stdout, proc.stdout + proc.stderr
    assert (proc.returncode != 0) == bool(ci)  # under CI the run fails
    if ci:
        assert "not found; they are expected in ../shared/data" in proc.stdout


def test_samples_are_found_beside_the_repository() -> None:
    assert CRITEO == REPO_ROOT.parent / "shared" / "data" / "criteo"
    assert ML100K.parent.parent == CRITEO.parent
