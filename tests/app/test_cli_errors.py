"""Every subcommand ends a failure with one line naming the command, what failed (with its path)
and the fix: no traceback (``DLRM_APP_TRACEBACK=1`` brings it back)."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from app_setup import two_feature_data

from dlrm_app.cli import describe_error, main
from dlrm_app.data import synthetic
from dlrm_app.data.schema import DatasetSpec

REPO = Path(__file__).resolve().parents[2]
TINY_MODEL = ["--embedding-dim", "4", "--dense-arch-layer-sizes", "8-4",
              "--over-arch-layer-sizes", "8-1", "--quiet", "--patience", "0"]


def _error(argv: list[str]) -> str:
    with pytest.raises(SystemExit) as info:
        main(argv)
    message = str(info.value.code)
    assert "\n" not in message and "Traceback" not in message
    return message


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return two_feature_data(tmp_path_factory.mktemp("cli") / "data", rows=4_000,
                            rows_per_shard=1_000, row_group_size=250)


def test_output_folder_is_a_file(tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    for argv in (["generate", "--out", str(blocker), "--rows", "100"],
                 ["generate", "--out", str(blocker / "sub"), "--rows", "100"]):
        message = _error(argv)
        assert message.startswith("dlrm-app generate: a file is in the way")
        assert str(blocker) in message and "choose another --out" in message


def test_train_output_under_a_file(dataset: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    message = _error(["train", "--data", str(dataset), "--out", str(blocker / "run"),
                      "--max-steps", "1", *TINY_MODEL])
    assert message.startswith("dlrm-app train: a file is in the way")
    assert str(blocker / "run") in message


def test_no_write_permission(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "locked"
    target.mkdir()
    if os.geteuid() == 0:  # root writes anywhere: simulate what the OS tells other users
        def refuse(*args: object, **kwargs: object) -> None:
            raise PermissionError(errno.EACCES, "Permission denied", str(target / "data"))
        monkeypatch.setattr(synthetic, "generate", refuse)
    else:
        target.chmod(0o555)
    message = _error(["generate", "--out", str(target / "data"), "--rows", "100"])
    assert message.startswith("dlrm-app generate: no permission to write or read")
    assert str(target / "data") in message and "choose another --out" in message


def test_disk_full(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shard = tmp_path / "out" / "train-00000.parquet"

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(shard))

    monkeypatch.setattr(synthetic, "generate", full)
    message = _error(["generate", "--out", str(tmp_path / "out"), "--rows", "100"])
    assert message == (f"dlrm-app generate: the disk is full ({shard}) (No space left on "
                       f"device): free space, or choose an --out on another disk; finished "
                       f"files are kept and a rerun continues")


def test_missing_shard(dataset: Path, tmp_path: Path) -> None:
    copy = tmp_path / "data"
    shutil.copytree(dataset, copy)
    shard = copy / DatasetSpec.load(copy).split("train").shards[1].file
    shard.unlink()
    message = _error(["train", "--data", str(copy), "--out", str(tmp_path / "run"),
                      "--max-steps", "1", *TINY_MODEL])
    assert message.startswith(f"dlrm-app train: {shard}: shard of split 'train'")
    assert "is missing" in message and "--out" in message


@pytest.mark.slow
def test_bad_checkpoint(dataset: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert main(["train", "--data", str(dataset), "--out", str(run), "--max-steps", "3",
                 *TINY_MODEL]) == 0
    message = _error(["export", str(run), "--out", str(tmp_path / "model.pt")])
    assert message == (f"dlrm-app export: --out {tmp_path / 'model.pt'}: a .pt2 artifact's name "
                       f"must end in .pt2 (for a TorchScript file add --format torchscript)")
    newest = sorted((run / "checkpoints").glob("step_*"))[-1]
    shard = next(newest.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:10])
    for command in ("evaluate", "export"):
        argv = [command, str(run), "--checkpoint", str(newest)]
        if command == "export":
            argv += ["--out", str(tmp_path / "model.pt2")]
        message = _error(argv)
        assert message.startswith(f"dlrm-app {command}: damaged checkpoint: {shard} has 10 bytes")
        assert "--checkpoint step_N" in message


def test_missing_preprocess_input(tmp_path: Path) -> None:
    message = _error(["preprocess", "criteo", str(tmp_path / "nope.tsv"), "--out",
                      str(tmp_path / "o")])
    assert message.startswith("dlrm-app preprocess criteo: ") and "nope.tsv" in message


def test_timeouts_and_unknown_errors_are_one_line() -> None:
    gloo = RuntimeError("[gloo/transport/tcp/pair.cc:534] Application timeout caused pair "
                        "closure\n(more detail)")
    assert describe_error(gloo).startswith("a collective operation timed out waiting for the "
                                           "other ranks")
    assert "raise --timeout" in describe_error(gloo)
    peer = RuntimeError("[gloo/transport/tcp/pair.cc:598] Connection closed by peer "
                        "[127.0.0.1]:4711")
    assert describe_error(peer).startswith("another rank stopped (its own error is above)")
    odd = KeyError("x" * 1000 + "\nline two")
    text = describe_error(odd)
    assert text.startswith("KeyError: ") and "DLRM_APP_TRACEBACK=1" in text
    assert "\n" not in text and len(text) < 400


def test_traceback_on_request(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    monkeypatch.setenv("DLRM_APP_TRACEBACK", "1")
    with pytest.raises(FileExistsError):
        main(["generate", "--out", str(blocker), "--rows", "100"])


def test_process_exit_code_and_stderr(tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    proc = subprocess.run([sys.executable, "-m", "dlrm_app", "generate", "--out", str(blocker),
                           "--rows", "100"], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        f"dlrm-app generate: a file is in the way ({blocker}): the output path or one of its "
        f"parent folders is a file, not a folder; choose another --out"]


def test_a_mistyped_data_path_names_the_dataset_beside_it(dataset: Path, tmp_path: Path) -> None:
    typo = dataset.parent / (dataset.name[:-1] + "x")  # data -> datx
    message = _error(["train", "--data", str(typo), "--out", str(tmp_path / "run"), *TINY_MODEL])
    assert message == (f"dlrm-app train: {typo}: no such directory; did you mean {dataset}? "
                       "(it holds a dataset)")
    far = tmp_path / "nowhere" / "data"
    assert _error(["train", "--data", str(far), "--out", str(tmp_path / "run")]) == (
        f"dlrm-app train: {far}: no such directory; pass the --out of `dlrm-app preprocess` or "
        "`dlrm-app generate`")
    assert not (tmp_path / "nowhere").exists()  # no advice to generate into the typo


def test_a_movielens_folder_given_to_preprocess_criteo_names_the_command(tmp_path: Path) -> None:
    folder = tmp_path / "ml-100k"
    folder.mkdir()
    (folder / "u.data").write_text("1\t2\t5\t881250949\n")
    assert _error(["preprocess", "criteo", str(folder), "--out", str(tmp_path / "o")]) == (
        f"dlrm-app preprocess criteo: {folder}: a directory, not a Criteo file; it holds "
        "MovieLens files: use `dlrm-app preprocess movielens`")


def test_an_argument_error_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["train", "--data", "d", "--threads", "abc"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err == ("dlrm-app train: error: argument --threads: invalid int value: 'abc' "
                   "(`dlrm-app train --help` lists the flags)\n")


def test_train_out_in_the_dataset_folder_is_refused(dataset: Path) -> None:
    shards = sorted(p.name for p in dataset.iterdir())
    message = _error(["train", "--data", str(dataset), "--out", str(dataset), *TINY_MODEL])
    assert message == (f"dlrm-app train: --out {dataset} is a dataset (it holds dataset.json): "
                       "checkpoints and logs would land among its shards; pass another "
                       "directory for the run")
    assert sorted(p.name for p in dataset.iterdir()) == shards  # nothing written there


def test_preprocess_says_a_file_is_cut_and_how_many_rows_it_skipped(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from test_criteo_workers import write_rows

    whole = tmp_path / "rows.tsv"
    write_rows(whole, 200, seed=3, bad=(5, 17))
    cut = tmp_path / "cut.tsv"
    cut.write_bytes(whole.read_bytes()[:-7])  # `head -c`: the last row loses its end
    assert main(["preprocess", "criteo", str(cut), "--out", str(tmp_path / "a"),
                 "--on-bad-row", "skip"]) == 0
    err = capsys.readouterr().err
    assert (f"warning: {cut} does not end with a line end (cut short?): its last line is read "
            "as a row, missing fields empty; if the file was cut, drop that line") in err
    assert (f"skipped 2 bad rows (--on-bad-row skip); {tmp_path / 'a'}/dataset.json records "
            "the count") in err
    assert main(["preprocess", "criteo", str(whole), "--out", str(tmp_path / "b"),
                 "--on-bad-row", "skip"]) == 0
    assert "does not end with a line end" not in capsys.readouterr().err  # a whole file


def test_serve_on_a_busy_port_fails_at_once_naming_it(tmp_path: Path) -> None:
    import socket
    import time

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        started = time.monotonic()
        message = _error(["serve", str(REPO / "README.md"), "--port", str(port)])
        assert message == (f"dlrm-app serve: port {port} on 127.0.0.1 is in use (another "
                           "server?); pass another --port, or --port 0 for a free one")
        assert time.monotonic() - started < 5  # before any model is read


def test_serve_of_a_file_that_is_no_model_says_so(tmp_path: Path) -> None:
    readme = REPO / "README.md"
    message = _error(["serve", str(readme), "--port", "0"])
    assert message == (f"dlrm-app serve: {readme}: not a model exported by `dlrm-app export` (a "
                       ".pt2 or TorchScript file is a zip archive); pass the --out of an export")
