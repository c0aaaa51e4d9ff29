"""The README is a door: its library example prints what its comment says, its links lead to
pages that exist, and its setup and test commands are the ones CI runs."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_library_example_prints_its_comment() -> None:
    block = README.split("## Using the library", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    expected = re.search(r"# (torch\.Size\(\[.*?\]\))", block).group(1)
    out = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout.strip()
    assert out == expected


def test_links_lead_to_existing_pages() -> None:
    links = re.findall(r"\]\(([^)#]+)\)", README)
    assert "docs/porting.md" in links
    for link in links:
        assert (ROOT / link).is_file(), link
    for page in (ROOT / "docs").glob("*.md"):
        for link in re.findall(r"\]\(([^)#:]+\.md)\)", page.read_text()):
            assert (page.parent / link).is_file(), f"{page.name}: {link}"


def test_setup_and_test_commands_are_what_ci_runs() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    setup = README.split("## Setup", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    one_command = 'pip install -e ".[cpu,test]"'
    assert setup.strip().splitlines()[-1] == one_command
    assert f"\n{one_command}\n" in ci  # alone: no torch installed before it
    tests = README.split("## Tests", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0].strip()
    assert tests in ci
    without_fbgemm = ('pip uninstall -y fbgemm-gpu-cpu && python -m pytest -q -m "not slow" '
                      '--ignore=tests/app --ignore=tests/integration --ignore=tests/bench')
    assert without_fbgemm in README.split("## Tests", 1)[1] and without_fbgemm in ci
    library = ('python -m pytest -q -m "not slow" --ignore=tests/app --ignore=tests/integration '
               '--ignore=tests/bench')
    assert f"\n{library}\n" in ci and f"`{library}`" in README.split("## Tests", 1)[1]
    torch213 = 'pip install torch==2.13.0 && pip install -e ".[cpu-torch213,test]"'
    assert torch213 in README.split("## Setup", 1)[1] and torch213 in ci


def test_readme_stays_a_door() -> None:
    assert len(README.splitlines()) <= 200
