"""What the command line says (issue 43 item 8): the planner's refusal in a few readable lines
with sizes in units that show them, Ctrl-C in ``train`` naming where it stopped in every phase,
and path errors answered before the heavy imports."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from dlrm_app.cli import main
from dlrm_app.data.criteo import preprocess_criteo
from tests.shared_data import KAGGLE_10K

needs_kaggle = pytest.mark.shared_data(KAGGLE_10K)


@pytest.fixture(scope="module")
def kaggle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled Kaggle sample (10,000 rows, 26 vocabulary tables), preprocessed."""
    if not KAGGLE_10K.is_file():
        pytest.skip(f"{KAGGLE_10K} is absent")
    out = tmp_path_factory.mktemp("messages") / "kaggle"
    preprocess_criteo([KAGGLE_10K], out)
    return out


def _failure(argv: list[str]) -> str:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert isinstance(info.value.code, str), info.value.code
    return info.value.code


@needs_kaggle
@pytest.mark.parametrize("case", ["memory", "offload_dir"])
def test_the_planners_refusal_is_a_short_first_line_then_a_few(
        case: str, kaggle: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny --memory-per-rank (and with it a tiny --offload-dir) was one line of 1,641
    (1,742) characters; now the first line says what does not fit and the flag to change, and
    a few lines follow, each size in the unit that shows it."""
    argv = ["train", "--data", str(kaggle), "--out", str(tmp_path / "run"), "--max-steps", "1",
            "--quiet", "--memory-per-rank", "0.001"]
    if case == "offload_dir":
        disk = tmp_path / "small_disk"
        disk.mkdir()
        real = shutil.disk_usage
        monkeypatch.setattr(shutil, "disk_usage", lambda path: real(path)._replace(
            total=64 << 10, free=64 << 10) if Path(path) == disk else real(path))
        argv += ["--offload-dir", str(disk)]
    lines = _failure(argv).replace(str(tmp_path), "TMP").splitlines()
    need = r"its tables need at least \d+\.\d\d MiB of "
    if case == "memory":
        assert re.fullmatch(
            rf"dlrm-app train: the model does not fit: {need}host memory, 0 B usable on 1 rank; "
            r"raise --memory-per-rank \(0\.001 GiB given\)", lines[0])
        assert len(lines[0]) <= 160
        assert lines[1] == ("  Usable: 0 B per rank = 1.02 MiB of host memory per rank less the "
                            "100% storage_reservation kept for dense parameters and activations.")
    else:
        assert re.fullmatch(
            rf"dlrm-app train: the model does not fit: {need}memory \(host \+ disk\), 64\.00 KiB "
            r"usable on 1 rank; raise --memory-per-rank \(0\.001 GiB given\) or use an "
            r"--offload-dir with more free space", lines[0])
        assert lines[1].startswith("  Usable: 64.00 KiB per rank = host memory 1.02 MiB per rank")
        assert lines[2].endswith("disk for offloaded tables: 64.00 KiB free of 64.00 KiB on the "
                                 "filesystem of TMP/small_disk (shutil.disk_usage).")
        assert any(re.fullmatch(r"  - `dlrm-app train \.\.\. --offload-dir DIR` on a local disk "
                                r"with more free space: the tables kept on disk need at most "
                                r"about \d+\.\d\d MiB per rank .*", line) for line in lines)
    assert lines[2].startswith("  Source of these figures: memory_per_rank 1.02 MiB given "
                               "explicitly (not read from the machine)")
    assert any(re.fullmatch(r"  Largest tables: 't_cat_2' 4809 x 16 FP32: \d+\.\d\d KiB, .+\.",
                            line) for line in lines)
    assert "To fix, any one of:" in lines
    assert len(lines) <= 11 and max(map(len, lines)) <= 220, [len(line) for line in lines]
    assert "0.00 GiB" not in "\n".join(lines)
