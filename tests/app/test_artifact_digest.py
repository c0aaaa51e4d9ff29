"""An exported model is code (loading a .pt2 runs its compiled library), so its sha256 is
written at export (beside it, on the export's JSON line, in the run's ``metrics.jsonl``) and
checked by ``serve`` before anything inside the file is loaded: a mismatch is refused in one
line, a match serves, a model with no digest anywhere loads with a note saying so.

"Before loading" is shown with a fake .pt2 whose library writes a marker file when it is
loaded (as the fake of issue 29 did): with the flipped bytes refused, no marker appears; the
same file loaded against its own digest does write it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from dlrm_app.cli import main
from dlrm_app.data.synthetic import generate
from dlrm_app.model import ModelConfig
from dlrm_app.serving.artifact import (
    ARTIFACT_FORMAT_VERSION,
    MANIFEST_FILE,
    digest_path,
    write_digest,
)
from dlrm_app.serving.export import export_model
from dlrm_app.serving.server import PredictionServer, ServeConfig
from dlrm_app.training.config import TrainConfig
from dlrm_app.training.trainer import train

pytestmark = [
    pytest.mark.filterwarnings("ignore:`torch\\.jit\\.:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
]

TINY = ModelConfig(embedding_dim=4, dense_arch_layer_sizes=(8, 4), over_arch_layer_sizes=(8, 1))


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict]:
    """(run, model.pt, export_model's result): a 2-step run exported as TorchScript."""
    root = tmp_path_factory.mktemp("digest")
    generate(root / "data", rows=1000, num_dense=2, cardinalities=[30, 20],
             pooling_factors=[1.0, 1.0], rows_per_shard=1000, row_group_size=256)
    train(TrainConfig.from_flags(data=str(root / "data"), out=str(root / "run"), model=TINY,
                                 batch_size=64, max_steps=2), progress=False)
    meta = export_model(root / "run", root / "model.pt", "fp32", fmt="torchscript")
    return root / "run", root / "model.pt", meta


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.slow
def test_export_writes_its_sha256_beside_it_and_in_the_run(
        exported: tuple[Path, Path, dict], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    run, model, meta = exported
    digest = _sha256(model)
    assert digest_path(model).read_text() == f"{digest}  model.pt\n"
    assert meta["sha256"] == digest
    if shutil.which("sha256sum"):
        check = subprocess.run(["sha256sum", "-c", "model.pt.sha256"], cwd=model.parent,
                               capture_output=True, text=True)
        assert check.returncode == 0 and "model.pt: OK" in check.stdout, check.stderr
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    recorded = [e for e in events if e.get("event") == "export"]
    assert recorded[-1]["sha256"] == digest and recorded[-1]["path"] == str(model.resolve())
    # the command's JSON line carries it too
    assert main(["export", str(run), "--out", str(tmp_path / "cli.pt"), "--format",
                 "torchscript", "--dtype", "fp32"]) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["sha256"] == _sha256(tmp_path / "cli.pt")
    assert digest_path(tmp_path / "cli.pt").read_text().split()[0] == line["sha256"]


def test_matching_digest_serves_and_a_changed_file_is_refused(
        exported: tuple[Path, Path, dict], tmp_path: Path) -> None:
    _, model, meta = exported
    config = ServeConfig(port=0)
    with PredictionServer.from_file(model, config) as s:  # model.pt.sha256 beside it
        assert s.health()["sha256"] == meta["sha256"]
        assert s.metadata["verified"] == f"sha256 {meta['sha256']} matches {model}.sha256"
    server = PredictionServer.from_file(model, config, expect_sha256=meta["sha256"].upper())
    assert server.metadata["verified"] == f"sha256 {meta['sha256']} matches --expect-sha256"

    changed = tmp_path / "model.pt"
    data = bytearray(model.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 256] = bytes(b ^ 0xFF for b in data[middle:middle + 256])
    changed.write_bytes(bytes(data))
    shutil.copy(digest_path(model), digest_path(changed))
    with pytest.raises(ValueError) as refused:
        PredictionServer.from_file(changed, config)
    message = str(refused.value)
    assert "\n" not in message and str(changed) in message
    assert _sha256(changed) in message and meta["sha256"] in message
    assert "dlrm-app export" in message and "--expect-sha256" in message
    # --expect-sha256 wins over the file beside the model, either way
    with pytest.raises(ValueError, match="differs from 0{64} \\(--expect-sha256\\)"):
        PredictionServer.from_file(model, config, expect_sha256="0" * 64)
    with pytest.raises(ValueError, match="--expect-sha256 'abc': not a sha256"):
        PredictionServer.from_file(model, config, expect_sha256="abc")
    digest_path(changed).write_text("not a digest\n")
    with pytest.raises(ValueError, match="model.pt.sha256: starts with 'not', not the sha256"):
        PredictionServer.from_file(changed, config)

    digest_path(changed).unlink()
    shutil.copy(model, changed)
    server = PredictionServer.from_file(changed, config)  # no digest anywhere: loads, says so
    assert server.metadata["verified"] == ("not verified: no .sha256 beside it and no "
                                           "--expect-sha256")
    assert server.health()["sha256"] is None


# ---- a .pt2 whose library runs code when loaded -------------------------------------------
MARKER_LIBRARY = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((used)) const char padding[4096] = "dlrm-test-padding";
__attribute__((constructor)) static void leave_marker(void) {
    const char *path = getenv("DLRM_TEST_MARKER");
    FILE *f = path ? fopen(path, "w") : NULL;
    if (f) { fputs("the library ran\n", f); fclose(f); }
}
"""


def _fake_pt2(tmp: Path) -> Path:
    """A .pt2 laid out as torch's loader expects, with a valid manifest, whose library is
    plain C that writes ``$DLRM_TEST_MARKER`` when loaded (and has none of AOTInductor's
    symbols: loading then fails, after the marker is written)."""
    (tmp / "marker.c").write_text(MARKER_LIBRARY)
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(tmp / "marker.so"),
                    str(tmp / "marker.c")], check=True, capture_output=True)
    manifest = {"format_version": ARTIFACT_FORMAT_VERSION, "format": "pt2",
                "needs_fbgemm": False, "raw_input": False}
    path = tmp / "fake.pt2"
    with zipfile.ZipFile(path, "w") as z:
        for name, data in [("archive_format", "pt2"), ("archive_version", "0"),
                           (".data/version", "6\n"), ("byteorder", "little"),
                           (f"extra/{MANIFEST_FILE}", json.dumps(manifest)),
                           ("data/aotinductor/model/m.wrapper_metadata.json",
                            '{"AOTI_DEVICE_KEY": "cpu"}'),
                           ("data/aotinductor/model/m.wrapper.cpp", "// fake\n"),
                           ("data/aotinductor/model/m.wrapper.so",
                            (tmp / "marker.so").read_bytes())]:
            z.writestr(f"fake/{name}", data)
    return path


def _flip_library_bytes(path: Path) -> None:
    """Rewrite the zip with 256 bytes of its .so flipped (in the library's data, so that it
    still loads and runs; the zip's CRCs are recomputed, so the archive itself stays valid)."""
    with zipfile.ZipFile(path) as z:
        members = [(info, z.read(info)) for info in z.infolist()]
    with zipfile.ZipFile(path, "w") as z:
        for info, data in members:
            if info.filename.endswith(".so"):
                at = data.index(b"dlrm-test-padding")
                data = data[:at] + bytes(b ^ 0x5A for b in data[at:at + 256]) + data[at + 256:]
            z.writestr(info, data)


def _serve(model: Path, marker: Path, *flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "DLRM_TEST_MARKER": str(marker)}
    return subprocess.run([sys.executable, "-m", "dlrm_app", "serve", str(model), "--port", "0",
                           *flags], capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler for the fake library")
@pytest.mark.slow
def test_flipped_library_bytes_are_refused_before_the_library_is_loaded(tmp_path: Path) -> None:
    model = _fake_pt2(tmp_path)
    exported_digest = write_digest(model)  # what `dlrm-app export` leaves beside a model
    _flip_library_bytes(model)
    marker = tmp_path / "loaded.txt"

    refused = _serve(model, marker)
    assert refused.returncode != 0
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1, refused.stderr
    assert lines[0].startswith(f"dlrm-app serve: {model}: sha256 {_sha256(model)} differs from "
                               f"{exported_digest} ({model}.sha256)")
    assert "export it again" in lines[0] and "--expect-sha256" in lines[0]
    assert not marker.exists(), "the library was loaded before its digest was checked"

    # the control: vouched for by --expect-sha256, the same file is loaded, and its library
    # runs before the loader can tell that it is no model (what the digest guards against)
    loaded = _serve(model, marker, "--expect-sha256", _sha256(model))
    assert loaded.returncode != 0 and "not a loadable .pt2 model" in loaded.stderr
    assert marker.read_text() == "the library ran\n"
