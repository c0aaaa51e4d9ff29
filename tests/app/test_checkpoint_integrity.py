"""Checkpoints are verified before anything reads them: every file's size and sha256 is recorded
at save time; a damaged checkpoint fails naming the file, and ``--resume`` falls back to the
newest intact one, saying so. Pointer files never lead out of the run; extras load with
``weights_only=True``."""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path

import pytest
import torch
from app_setup import SMALL_MODEL

from dlrm_app.data.synthetic import generate
from dlrm_app.serving.export import load_unsharded
from dlrm_app.training.checkpoint import (
    MANIFEST,
    CheckpointError,
    latest_checkpoint,
    resolve_run,
    verify_checkpoint,
)
from dlrm_app.training.config import TrainConfig
from dlrm_app.training.evaluate import evaluate_checkpoint
from dlrm_app.training.trainer import train
from recsys_core.distributed import checkpoint as dcp_checkpoint


def _config(data: Path, out: Path, **kw: object) -> TrainConfig:
    base = dict(data=str(data), out=str(out), model=SMALL_MODEL, batch_size=256, log_every=1,
                validate_every=0, patience=0, max_steps=40, save_every=20)
    base.update(kw)
    return TrainConfig.from_flags(**base)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(dataset, a run with complete checkpoints at steps 20 and 40)."""
    root = tmp_path_factory.mktemp("ckpt")
    generate(root / "data", rows=12_000, num_dense=4, cardinalities=[300, 50, 1000],
             pooling_factors=[1.0, 2.0, 1.0], zipf_alpha=1.05, seed=0,
             rows_per_shard=6_000, row_group_size=256)
    train(_config(root / "data", root / "run"), progress=False)
    return root / "data", root / "run"


@pytest.fixture
def run(trained: tuple[Path, Path], tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(trained[1], copy)
    return copy


def _checkpoints(run: Path) -> list[Path]:
    """Complete checkpoints, oldest first (two are kept)."""
    return sorted(p for p in (run / "checkpoints").glob("step_*") if (p / ".metadata").exists())


def _newest(run: Path) -> Path:
    return _checkpoints(run)[-1]


def _shard(path: Path) -> Path:
    return max(path.glob("*.distcp"), key=lambda p: p.stat().st_size)


def _steps_logged(run: Path) -> list[int]:
    lines = [json.loads(s) for s in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in lines if r["event"] == "train"]


@pytest.mark.slow
def test_manifest_records_every_file(run: Path) -> None:
    assert len(_checkpoints(run)) == 2
    path = _newest(run)
    manifest = json.loads((path / MANIFEST).read_text())["files"]
    on_disk = sorted(p.name for p in path.iterdir() if p.name != MANIFEST)
    assert sorted(manifest) == on_disk and ".metadata" in on_disk
    for name, entry in manifest.items():
        data = (path / name).read_bytes()
        assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    verify_checkpoint(path)  # intact: no error


@pytest.mark.slow
def test_resume_skips_a_damaged_checkpoint_and_says_so(
    trained: tuple[Path, Path], run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shard = _shard(_newest(run))
    data = bytearray(shard.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 4096] = bytes(b ^ 0xFF for b in data[middle:middle + 4096])
    shard.write_bytes(bytes(data))  # same size, 4 KB flipped
    older = _checkpoints(run)[0]
    train(_config(trained[0], run, max_steps=45, epochs=2, resume=True), progress=False)
    err = capsys.readouterr().err
    assert f"{shard} does not match its checksum" in err
    assert f"resuming from {older}" in err
    restored = int(older.name.removeprefix("step_"))
    assert restored < 40
    assert _steps_logged(run)[-(45 - restored):] == list(range(restored + 1, 46))


@pytest.mark.parametrize("damage", ["truncate", "empty", "delete"])
def test_damaged_file_fails_evaluate_and_export_naming_it(run: Path, damage: str) -> None:
    checkpoint = _newest(run)
    shard = _shard(checkpoint)
    if damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:100])
        expected = f"{shard} has 100 bytes"
    elif damage == "empty":
        shard.write_bytes(b"")
        expected = f"{shard} has 0 bytes"
    else:
        shard.unlink()
        expected = f"{shard} is missing"
    with pytest.raises(CheckpointError, match=expected.replace(".", r"\.")):
        evaluate_checkpoint(run, split="test", checkpoint=checkpoint)
    with pytest.raises(CheckpointError, match=r"--checkpoint step_N"):
        load_unsharded(run, checkpoint)


def test_every_checkpoint_damaged_is_an_error(trained: tuple[Path, Path], run: Path) -> None:
    for path in _checkpoints(run):
        (path / ".metadata").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="every checkpoint in .* is damaged"):
        train(_config(trained[0], run, max_steps=45, resume=True), progress=False)


@pytest.mark.parametrize("name", ["../../elsewhere", "/tmp/step_00000037", "step_37",
                                  "step_00000037/../../x"])
def test_pointer_outside_the_run_is_refused(run: Path, name: str) -> None:
    (run / "checkpoints" / "latest").write_text(name + "\n")
    with pytest.raises(CheckpointError, match="not a step_NNNNNNNN checkpoint directory"):
        latest_checkpoint(run / "checkpoints")
    with pytest.raises(CheckpointError, match="not a step_NNNNNNNN"):
        resolve_run(run, "latest")


def test_checkpoint_name_of_the_run_resolves(run: Path) -> None:
    older = _checkpoints(run)[0]
    assert resolve_run(run, older.name)[1] == older


def test_checkpoint_without_manifest_loads_with_a_warning(
    run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (_newest(run) / MANIFEST).unlink()  # as written by an older version
    metrics = evaluate_checkpoint(run, split="test", checkpoint=_newest(run))
    assert metrics["num_examples"] > 0
    assert f"{_newest(run)} has no {MANIFEST}" in capsys.readouterr().err


class _Payload:
    """Unpickling this would run code: it must never be unpickled."""

    def __reduce__(self) -> tuple:
        return (Path.touch, (Path("PAYLOAD_RAN"),))


def test_extras_load_weights_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    model = torch.nn.Linear(2, 1)
    dcp_checkpoint.save(str(tmp_path / "c"), model=model,
                        extra={"step": 3, "rng": torch.arange(4), "payload": _Payload()})
    back = dcp_checkpoint.load(str(tmp_path / "c"), model=model,
                               extra={"step": 0, "rng": torch.zeros(4, dtype=torch.long)})
    assert back["step"] == 3 and torch.equal(back["rng"], torch.arange(4))
    with pytest.raises(dcp_checkpoint.CheckpointLoadError,
                       match=r"cannot load checkpoint .*c \(rank 0\): UnpicklingError: Weights only"):
        dcp_checkpoint.load(str(tmp_path / "c"), model=model, extra={"payload": None})
    assert not (tmp_path / "PAYLOAD_RAN").exists()


def test_save_every_duration_checkpoints_during_training(tmp_path: Path) -> None:
    """``--save-every 0.3s``: checkpoints come while training goes on (on top of the last
    step's), no more of them than 0.3 s apart would give, each complete."""
    data = tmp_path / "data"
    generate(data, rows=30_000, num_dense=2, cardinalities=[50, 20], pooling_factors=[1.0, 1.0],
             seed=0, rows_per_shard=30_000, row_group_size=1_000)
    run = tmp_path / "run"
    start = time.monotonic()
    summary = train(TrainConfig.from_flags(data=str(data), out=str(run), model=SMALL_MODEL, batch_size=32,
                                           validate_every=0, patience=0, max_steps=400, save_every="0.3s",
                                           keep_checkpoints=100, log_every=1), progress=False)
    wall = time.monotonic() - start
    steps = sorted(int(p.name[5:]) for p in (run / "checkpoints").glob("step_*"))
    assert steps[-1] == summary["steps"] == 400
    during = steps[:-1]
    assert len(during) >= 2, steps  # 400 steps take well over 0.6 s
    for step in steps:
        verify_checkpoint(run / "checkpoints" / f"step_{step:08d}")
    assert len(during) <= wall / 0.3, (steps, wall)  # never sooner than 0.3 s apart
