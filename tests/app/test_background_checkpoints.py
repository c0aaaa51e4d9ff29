"""--background-checkpoints: checkpoints written by a thread while training goes on hold what a
foreground save holds at the same step (the state is copied first, so the steps after it do
not leak in), the run's losses do not change, and --resume from them continues exactly."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dlrm_app.data.synthetic import generate
from dlrm_app.training.checkpoint import verify_checkpoint
from recsys_core.distributed import checkpoint as dcp_checkpoint

ARGS = ["--embedding-dim", "4", "--dense-arch-layer-sizes", "8-4", "--over-arch-layer-sizes",
        "8-1", "--batch-size", "64", "--log-every", "1", "--save-every", "7", "--quiet",
        "--max-steps", "60", "--patience", "0", "--no-amp", "--keep-checkpoints", "20"]


def _losses(run: Path) -> dict[int, float]:
    events = [json.loads(s) for s in (run / "metrics.jsonl").read_text().splitlines()]
    return {e["step"]: e["loss"] for e in events if e["event"] == "train"}


def _train(data: Path, run: Path, *extra: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "dlrm_app", "train", "--data", str(data),
                           "--out", str(run), *ARGS, *extra], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a 1-process checkpoint, by its flattened DCP key."""
    reader = torch.distributed.checkpoint.FileSystemReader(str(path))
    keys = [k for k, m in reader.read_metadata().state_dict_metadata.items()
            if hasattr(m, "size")]
    state = {k: torch.empty(reader.read_metadata().state_dict_metadata[k].size,
                            dtype=reader.read_metadata().state_dict_metadata[k].properties.dtype)
             for k in keys}
    torch.distributed.checkpoint.load(state, checkpoint_id=str(path))
    return state


@pytest.mark.slow
def test_background_checkpoints_equal_foreground_ones_and_resume_exactly(tmp_path: Path) -> None:
    data = tmp_path / "data"
    generate(data, rows=20_000, num_dense=2, cardinalities=[50, 20], pooling_factors=[1.0, 1.0],
             zipf_alpha=1.05, seed=0, rows_per_shard=10_000, row_group_size=1_000)
    fg, bg = tmp_path / "fg", tmp_path / "bg"
    _train(data, fg)
    _train(data, bg, "--background-checkpoints")
    assert _losses(bg) == _losses(fg)  # bitwise: the saves change nothing of the training
    steps = sorted(p.name for p in (fg / "checkpoints").glob("step_*"))
    assert steps == sorted(p.name for p in (bg / "checkpoints").glob("step_*"))
    assert "step_00000007" in steps and "step_00000056" in steps
    for name in steps:
        verify_checkpoint(bg / "checkpoints" / name)
        ours, theirs = _tensors(bg / "checkpoints" / name), _tensors(fg / "checkpoints" / name)
        assert ours.keys() == theirs.keys() and ours
        for key in ours:
            assert torch.equal(ours[key], theirs[key]), (name, key)
    # resume from a background checkpoint: steps 50-60 again, as uninterrupted
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    (resumed / "checkpoints" / "step_00000049").symlink_to(bg / "checkpoints" / "step_00000049")
    _train(data, resumed, "--resume", "--background-checkpoints")
    full, cut = _losses(fg), _losses(resumed)
    assert sorted(cut) == list(range(50, 61))
    for step in cut:
        assert cut[step] == full[step], step


def test_staged_state_is_a_copy_the_model_can_change_under() -> None:
    model = torch.nn.Linear(3, 2)
    staged = dcp_checkpoint.staged_state(model, None, {"step": 4, "rng": torch.arange(3)})
    before = staged["model"]["weight"].clone()
    with torch.no_grad():
        model.weight.add_(1.0)
    assert torch.equal(staged["model"]["weight"], before)
    assert staged["extra"]["step"] == 4 and torch.equal(staged["extra"]["rng"], torch.arange(3))


def test_the_writer_thread_runs_at_its_nice_value(tmp_path: Path, monkeypatch) -> None:
    """The writer yields to the training ranks (``WRITER_NICE``), the training thread not."""
    import os
    import threading

    from dlrm_app.training import checkpoint

    seen = {}

    def write_checkpoint(*args, **kwargs):  # records the thread's priority as the OS has it
        seen["writer"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    monkeypatch.setattr(checkpoint, "write_checkpoint", write_checkpoint)
    saver = checkpoint.BackgroundSaver()
    model = torch.nn.Linear(2, 1)
    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    saver.save(tmp_path / "c", 1, model=model, optimizer=None, extra={"step": 1})
    saver.wait()
    assert seen["writer"] == min(before + checkpoint.WRITER_NICE, 19) and checkpoint.WRITER_NICE
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before
