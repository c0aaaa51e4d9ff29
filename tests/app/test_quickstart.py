"""The README's quick-start command runs and the click model learns."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_quickstart_trains() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "quickstart.py"), "--steps", "200"],
        check=True, capture_output=True, text=True, cwd=ROOT,
    ).stdout
    assert '"product": [[1, 2, 1], [5]]' in out
    first, second = (float(x) for x in re.findall(r"iteration \d loss: ([\d.]+)", out))
    assert second < first  # the fused optimizer updated the tables inside backward
    losses = [float(x) for x in re.findall(r"train loss ([\d.]+)", out)]
    assert len(losses) == 4
    # chance level is ln 2 = 0.693; the noise floor is 0.325
    assert losses[-1] < 0.45, losses
