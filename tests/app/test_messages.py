"""What the command line says (issue 43 item 8): the planner's refusal in a few readable lines
with sizes in units that show them, and Ctrl-C in ``train`` naming where it stopped in every
phase. (Path errors answered before the heavy imports, and ``--version``: tests/app/test_cli.py;
a Ctrl-C during the steps and the resumed run's line: tests/app/test_train_interrupt.py.)"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
from pathlib import Path

import pytest
from app_setup import two_feature_data

from dlrm_app.cli import main
from dlrm_app.data.criteo import preprocess_criteo
from dlrm_app.training import trainer as train_module
from dlrm_app.training.components.checkpointer import Checkpointer
from tests.shared_data import KAGGLE_10K

needs_kaggle = pytest.mark.shared_data(KAGGLE_10K)


@pytest.fixture(scope="module")
def kaggle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled Kaggle sample (10,000 rows, 26 vocabulary tables), preprocessed (its tests
    carry ``needs_kaggle``: skipped without it, a failure under ``CI=true``)."""
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


# ---- Ctrl-C in train: where it stopped and how to go on, in every phase ----------------------
TINY = ["--embedding-dim", "4", "--dense-arch-layer-sizes", "8-4", "--over-arch-layer-sizes",
        "8-1", "--batch-size", "64", "--max-steps", "4", "--save-every", "2", "--quiet"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return two_feature_data(tmp_path_factory.mktemp("messages") / "tiny", rows=4_000,
                            rows_per_shard=2_000, row_group_size=250)


def _interrupted(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The last stderr line of a ``train`` that a Ctrl-C ended (exit code 130: the shell's)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 130
    return capsys.readouterr().err.strip().splitlines()[-1]


def _ctrl_c_in(function: str, argv: list[str], monkeypatch: pytest.MonkeyPatch,
               capsys: pytest.CaptureFixture[str]) -> str:
    """``_interrupted`` with the Ctrl-C raised inside the trainer module's ``function``."""

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(train_module, function, interrupted)
        return _interrupted(argv, capsys)


def _summary(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict:
    capsys.readouterr()
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_ctrl_c_while_starting_says_nothing_was_trained(
        tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Before the first step (imports, planning, building the model) it said 'interrupted'."""
    argv = ["train", "--data", str(tiny), "--out", str(tmp_path / "run"), *TINY]
    assert _ctrl_c_in("build_model", argv, monkeypatch, capsys) == (
        "dlrm-app train: interrupted while starting, before its first step (this start "
        "trained nothing): rerun the same command")
    assert _summary(argv, capsys)["steps"] == 4  # the same command does start again


def test_ctrl_c_while_finishing_names_the_last_step_and_resume_finishes(
        tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """After the last step (its checkpoint, the kept model's validation, the report) it said
    'interrupted'; now the step and the command that finishes the run."""
    run = tmp_path / "run"
    argv = ["train", "--data", str(tiny), "--out", str(run), *TINY]
    assert _ctrl_c_in("write_report", argv, monkeypatch, capsys) == (
        "dlrm-app train: interrupted after the last step (4), while finishing the run (its "
        "last checkpoint, the kept model's validation, the report); the newest checkpoint "
        f"is step_00000004: `dlrm-app train --out {run} --resume` continues from it")
    summary = _summary(["train", "--out", str(run), "--resume", "--quiet"], capsys)
    assert (summary["steps"], summary["trained_steps"]) == (4, 0)
    assert (run / "report.md").is_file()


def test_a_second_ctrl_c_while_saving_the_stop_says_it_was_not_saved(
        tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Ctrl-C at step 3 stops the run after it and saves it; a second Ctrl-C during that save
    (simulated: the save raises KeyboardInterrupt) leaves step 2's checkpoint the newest."""
    run = tmp_path / "run"
    step = train_module.Trainer.step

    def step_then_ctrl_c(self: train_module.Trainer, batch: object) -> object:
        if self.state.step == 2:  # the third step
            os.kill(os.getpid(), signal.SIGINT)  # noted by the preemption guard
        return step(self, batch)

    def second_ctrl_c(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(train_module.Trainer, "step", step_then_ctrl_c)
    monkeypatch.setattr(Checkpointer, "at_end", second_ctrl_c)
    assert _interrupted(["train", "--data", str(tiny), "--out", str(run), *TINY], capsys) == (
        "dlrm-app train: interrupted after step 3, while saving its checkpoint (not saved); the "
        f"newest checkpoint is step_00000002: `dlrm-app train --out {run} --resume` continues "
        "from it")
