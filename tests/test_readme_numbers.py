"""Every measured number in the README is what its bench recorded (``bench/readme_numbers.py``:
the claims, the commands that measure them, ``bench/results/`` the recorded output), and the
check itself catches a changed number, a dropped claim and a number no claim covers."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("readme_numbers", ROOT / "bench" / "readme_numbers.py")
readme_numbers = importlib.util.module_from_spec(_spec)
sys.modules["readme_numbers"] = readme_numbers  # dataclasses look their module up
_spec.loader.exec_module(readme_numbers)  # type: ignore[union-attr]
README = (ROOT / "README.md").read_text()


def test_readme_numbers_are_what_the_benches_recorded() -> None:
    assert readme_numbers.check() == []


def test_recorded_results_name_their_cpu_and_commands() -> None:
    for claim in readme_numbers.CLAIMS:
        header = readme_numbers.load(claim.source or claim.name)[0]
        assert header["recorded"] and header["cpu"], claim.name


def _sub(pattern: str, new: str, text: str) -> str:
    """``text`` with the first match of ``pattern`` (whitespace: any run of it) replaced."""
    changed = re.sub(pattern.replace(" ", r"\s+"), new, text, count=1)
    assert changed != text, pattern
    return changed


def test_the_check_fails_on_a_changed_number() -> None:
    ours = readme_numbers._checkpoint(readme_numbers.load("checkpoint"))["ours2"]
    changed = _sub(f"saves in {ours} ms", "saves in 1 ms", README)
    problems = readme_numbers.check(changed)
    assert len(problems) == 1 and problems[0].startswith("checkpoint: the README says '1'")


def test_the_check_fails_on_a_number_no_claim_covers_and_a_dropped_claim() -> None:
    extra = README.replace("## Tests", "Training is 3.5x faster now.\n\n## Tests", 1)
    assert any(p.startswith("number '3.5x'") or p.startswith("number '3.5'")
               for p in readme_numbers.check(extra))
    dropped = _sub("a checkpoint of 52 tables saves in", "a checkpoint saves in", README)
    assert any(p.startswith("checkpoint: the README no longer states it")
               for p in readme_numbers.check(dropped))
