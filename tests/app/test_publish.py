"""Publishing weights alone (``dlrm_app.serving.weights``, ``export_model``) and a server taking
them without a restart or a failed request (``dlrm_app.serving.reload``).

One tiny run is trained 3 steps, exported in full (the only AOTInductor compile of the module),
trained 3 more, and published again: weights alone, no compile. The server answers with the
second checkpoint's weights as that checkpoint's eager serving program computes them, and
switches between the two sets of weights under a client's load, never mixing them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from test_serve import _health_when, _probing, _serve, _which, artifact, get, post  # noqa: F401 (fixture)

from dlrm_app.config import ServeConfig
from dlrm_app.data.synthetic import generate
from dlrm_app.model import ModelConfig
from dlrm_app.serving import export
from dlrm_app.serving.artifact import digest_path, load_artifact, write_digest
from dlrm_app.serving.server import PredictionServer
from dlrm_app.serving.weights import read_weights, weights_path, write_weights
from dlrm_app.training.config import TrainConfig
from dlrm_app.training.trainer import train

pytestmark = [
    pytest.mark.filterwarnings("ignore:`torch\\.jit\\.:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
]

TINY = ModelConfig(embedding_dim=4, dense_arch_layer_sizes=(8, 4), over_arch_layer_sizes=(8, 1))
SIZES = [50, 200, 30]
PROBE = {"instances": [{"dense": [0.1 * i, 0.5, 1.0 - 0.2 * i, 0.3],
                        "sparse": {"cat_0": 3 * i, "cat_1": 7 * i + 1, "cat_2": [i, 2 * i + 1]}}
                       for i in range(4)]}


def _probe_tensors() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PROBE as the model program's inputs (key-major bags)."""
    rows = PROBE["instances"]
    dense = torch.tensor([r["dense"] for r in rows], dtype=torch.float32)
    bags = [[r["sparse"][f]] if not isinstance(r["sparse"][f], list) else r["sparse"][f]
            for f in ("cat_0", "cat_1", "cat_2") for r in rows]
    offsets = torch.tensor([0, *np.cumsum([len(b) for b in bags])], dtype=torch.int64)
    return dense, torch.tensor([v for b in bags for v in b], dtype=torch.int64), offsets


def _eager(run: Path, checkpoint: str) -> np.ndarray:
    """The checkpoint's serving program, quantized as export does, run eagerly (not compiled)
    on PROBE: what a full export of that checkpoint computes, within float tolerance."""
    model, config, spec, _ = export.load_unsharded(run, checkpoint)
    model, id_map = export.freeze_raw_ids(model, spec, config.model)
    export.serving_form(model, spec)
    export.quantize_inference_model(model, export.DTYPES["int8"])
    prep = export.dataset_preprocessing(spec, Path(config.data))
    lookup = "fbgemm" if model.sparse_arch.embedding_bag_collection.kernel_backend().value == \
        "fbgemm" else "torch"
    module = export.serving_programs(model, spec, prep, lookup, id_map)["model"][0]
    with torch.no_grad():
        return module(*_probe_tensors()).numpy()


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A run's step-3 checkpoint exported in full to ``m.pt2``; after 3 more steps, weights of
    step 6 and (again) of step 3 published beside it, kept under other names."""
    root = tmp_path_factory.mktemp("publish")
    generate(root / "data", rows=2000, num_dense=4, cardinalities=SIZES,
             pooling_factors=[1.0, 1.0, 2.0], zipf_alpha=1.05, seed=0, rows_per_shard=2000,
             row_group_size=512)
    config = dict(data=str(root / "data"), out=str(root / "run"), model=TINY, batch_size=128,
                  embedding_learning_rate=0.5)
    train(TrainConfig.from_flags(**config, max_steps=3), progress=False)
    stages: list[str] = []
    first = export.export_model(root / "run", root / "m.pt2", checkpoint="latest",
                                progress=stages.append)
    train(TrainConfig.from_flags(**config, max_steps=6, resume=True), progress=False)
    return {"root": root, "run": root / "run", "program": root / "m.pt2", "first": first,
            "stages": stages}


@pytest.fixture
def no_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("AOTInductor compiled: the program had not changed")

    monkeypatch.setattr(torch._inductor, "aot_compile", refuse)


def _weights_of(published: dict[str, Any], checkpoint: str, name: str) -> tuple[Path, dict]:
    """Publish ``checkpoint``'s weights for ``m.pt2`` and move them to ``name`` (+ .sha256)."""
    result = export.export_model(published["run"], published["program"], checkpoint=checkpoint)
    target = published["root"] / name
    os.replace(result["path"], target)
    os.replace(digest_path(result["path"]), digest_path(target))
    return target, result


@pytest.mark.slow
def test_more_training_publishes_weights_alone(published: dict[str, Any], no_compile: None
                                              ) -> None:
    """The first export compiles (the program is new); the second, of a checkpoint 3 steps
    later, writes weights alone (no compile: compiling fails in this test), byte-identical
    when repeated; the program with those weights answers as the later checkpoint's eager
    serving program, which differs from the first checkpoint's answers."""
    first, stages = published["first"], published["stages"]
    assert first["published"] == "program" and "AOTInductor: compiling 'model' for CPU" in stages
    stages = []
    result = export.export_model(published["run"], published["program"],
                                 checkpoint="step_00000006", progress=stages.append)
    assert result["published"] == "weights", result
    assert result["path"] == str(weights_path(published["program"]))
    assert not any("AOTInductor" in s for s in stages), stages
    assert re.fullmatch(r"the program in .*m\.pt2 is unchanged \(fingerprint [0-9a-f]{16}\): "
                        r"writing the weights alone to .*m\.weights", stages[-2]), stages
    assert result["program_fingerprint"] == first["program_fingerprint"]
    digest = digest_path(result["path"]).read_text().split()[0]
    assert result["sha256"] == digest == read_weights(result["path"]).sha256
    again = export.export_model(published["run"], published["program"],
                                checkpoint="step_00000006")
    assert again["sha256"] == digest  # one checkpoint, one set of bytes
    # the run's log records what was published
    events = [json.loads(line) for line in (published["run"] / "metrics.jsonl").read_text()
              .splitlines() if '"export"' in line]
    assert [e["published"] for e in events[-3:]] == ["program", "weights", "weights"]

    dense, values, offsets = _probe_tensors()
    with PredictionServer.from_file(published["program"], ServeConfig(port=0)) as server:
        assert server.weights["sha256"] == digest and server.weights["step"] == 6
        health = get(server.port, "/health")[1]
        status, body = post(server.port, PROBE)
    assert health["weights"]["sha256"] == digest and status == 200, body
    later, earlier = _eager(published["run"], "step_00000006"), _eager(published["run"],
                                                                        "step_00000003")
    np.testing.assert_allclose(body["probabilities"], later, rtol=1e-5, atol=1e-6)
    assert np.abs(later - earlier).max() > 1e-3  # the weights did change
    program_alone, _ = load_artifact(published["program"])  # its own (step 3) constants
    np.testing.assert_allclose(program_alone(dense, values, offsets).numpy(), earlier,
                               rtol=1e-5, atol=1e-6)
    os.remove(result["path"])
    os.remove(digest_path(result["path"]))


@pytest.mark.slow
def test_server_takes_weights_renamed_over_and_on_sighup(
        published: dict[str, Any], tmp_path: Path, no_compile: None) -> None:
    """``dlrm-app serve m.pt2`` under a client posting every 5 ms: step-6 weights renamed over
    ``m.weights`` (then their .sha256) are taken without a signal, step-3 weights renamed over
    them are taken on SIGHUP; every answer is 200 and wholly one set's (old, new, old), the
    new ones within 20 s of the rename; /health shows the weights' digest and load time."""
    new_file, _ = _weights_of(published, "step_00000006", "w6.weights")
    old_file, _ = _weights_of(published, "step_00000003", "w3.weights")
    served = tmp_path / "m.pt2"
    shutil.copy(published["program"], served)
    write_digest(served)
    for name in ("w6.weights", "w3.weights"):
        for f in (published["root"] / name, digest_path(published["root"] / name)):
            shutil.copy(f, tmp_path / f.name)
    old, new = _eager(published["run"], "step_00000003"), _eager(published["run"],
                                                                  "step_00000006")
    proc, port = _serve(served)
    try:
        with _probing(port, PROBE) as answers:
            renamed = time.monotonic()
            os.replace(tmp_path / "w6.weights", weights_path(served))
            os.replace(tmp_path / "w6.weights.sha256", digest_path(weights_path(served)))
            taken = _health_when(port, lambda h: h["reloads"] == 1)
            count = len(answers)
            while len(answers) < count + 20:
                time.sleep(0.01)
            os.replace(tmp_path / "w3.weights", weights_path(served))
            os.replace(tmp_path / "w3.weights.sha256", digest_path(weights_path(served)))
            proc.send_signal(signal.SIGHUP)
            back = _health_when(port, lambda h: h["reloads"] == 2)
            count = len(answers)
            while len(answers) < count + 20:
                time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err[-2000:]
        lines = [json.loads(line) for line in out.splitlines()][:-1]
    finally:
        proc.kill()
        proc.wait()
    assert [(line["kind"], line["on"]) for line in lines] == [
        ("weights", "file changed"), ("weights", "SIGHUP")], (lines, err[-3000:], [
            digest_path(f).read_text() for f in (new_file, old_file)])
    assert taken["weights"]["sha256"] == digest_path(new_file).read_text().split()[0]
    assert back["weights"]["sha256"] == digest_path(old_file).read_text().split()[0]
    assert taken["weights"]["step"] == 6 and 0 <= taken["weights"]["load_seconds"] < 20
    assert taken["last_reload"]["ok"] and taken["last_reload"]["kind"] == "weights"
    assert taken["sha256"] == back["sha256"]  # the program stayed
    which = _which(answers, old, new, atol=1e-6)
    runs = [k for i, k in enumerate(which) if i == 0 or which[i - 1] != k]
    assert runs == ["old", "new", "old"], runs
    first_new = which.index("new")
    assert answers[first_new][0] - renamed < 20


@pytest.mark.slow
def test_weights_are_refused_when_tampered_or_for_another_program(
        published: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A weights file changed after its .sha256 was written (its first bytes zeroed, so that
    reading it would fail otherwise) is refused on its digest; weights of another program
    (int4 tables: another fingerprint) on their fingerprint; /health says why, and the
    program's own weights answer every request meanwhile."""
    served = tmp_path / "m.pt2"
    shutil.copy(published["program"], served)
    write_digest(served)
    target = weights_path(served)
    result = export.export_model(published["run"], served, checkpoint="step_00000006")
    assert result["published"] == "weights"
    data = bytearray(target.read_bytes())
    data[:16] = bytes(16)
    target.write_bytes(bytes(data))
    old = _eager(published["run"], "step_00000003")
    server = PredictionServer.from_file(served, ServeConfig(port=0))
    assert server.weights is None and "sha256" in server.weights_refused  # at start too
    with server, _probing(server.port, PROBE) as answers:
        with pytest.raises(ValueError, match=f"{re.escape(str(target))}: sha256 [0-9a-f]{{64}} "
                                             "differs from [0-9a-f]{64}"):
            server.swap_weights(target)
        tampered = get(server.port, "/health")[1]
        # int4 weights, written as if the program beside them were theirs
        seen: list[str] = []
        fingerprint = export.program_fingerprint
        monkeypatch.setattr(export, "program_fingerprint",
                            lambda *args: seen.append(fingerprint(*args)) or seen[-1])
        monkeypatch.setattr(export, "_fingerprint_at", lambda out: seen[-1])
        assert export.export_model(published["run"], served, "int4",
                                   checkpoint="step_00000006")["published"] == "weights"
        with pytest.raises(ValueError, match="weights for program .* the program being served "
                                             "is .*another model config"):
            server.swap_weights(target)
        foreign = get(server.port, "/health")[1]
        count = len(answers)
        while len(answers) < count + 10:
            time.sleep(0.01)
    assert tampered["last_reload"]["ok"] is False and tampered["weights"] is None
    assert "sha256" in tampered["last_reload"]["reason"]
    assert foreign["last_reload"]["kind"] == "weights" and foreign["reloads"] == 0
    assert "weights for program" in foreign["last_reload"]["reason"]
    assert set(_which(answers, old, old, atol=1e-6)) == {"old"}


def test_a_torchscript_model_takes_weights_only_in_full(artifact: Path,  # noqa: F811
                                                         tmp_path: Path) -> None:
    """Weights published alone load into a .pt2 program; a TorchScript model refuses them (a
    full export is reloaded as a program instead) and serves on."""
    server = PredictionServer.from_file(artifact, ServeConfig(port=0))
    path = tmp_path / "model.weights"
    write_weights(path, {"model/w": torch.zeros(2)}, {"program_fingerprint": "0" * 64})
    with pytest.raises(ValueError, match="TorchScript: export it in full"):
        server.swap_weights(path)
    assert server.reloads == 0 and server.last_reload["kind"] == "weights"


@pytest.fixture
def tensors() -> Iterator[dict[str, torch.Tensor]]:
    yield {"model/a.weight": torch.arange(6, dtype=torch.float32).view(2, 3),
           "model/b": torch.tensor([True, False]), "encode/keys": torch.arange(5),
           "model/q": torch.arange(7, dtype=torch.uint8), "model/s": torch.tensor(2.5)}


def test_weights_file_round_trip_and_bytes(tmp_path: Path,
                                           tensors: dict[str, torch.Tensor]) -> None:
    """What is written reads back equal (dtype, shape, values), 64-byte aligned, its digest in
    its .sha256; the same tensors give the same bytes under any name; no partial file stays."""
    digest = write_weights(tmp_path / "a.weights", tensors, {"program_fingerprint": "f" * 64})
    write_weights(tmp_path / "b.weights", dict(reversed(tensors.items())),
                  {"program_fingerprint": "f" * 64})
    assert (tmp_path / "a.weights").read_bytes() == (tmp_path / "b.weights").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "a.weights", "a.weights.sha256", "b.weights", "b.weights.sha256"]
    got = read_weights(tmp_path / "a.weights")
    assert got.sha256 == digest and got.header["program_fingerprint"] == "f" * 64
    assert got.tensors.keys() == tensors.keys()
    for key, t in tensors.items():
        assert got.tensors[key].dtype == t.dtype and torch.equal(got.tensors[key], t)
        assert got.tensors[key].data_ptr() % 64 == 0
    assert set(got.of("model")) == {"a.weight", "b", "q", "s"}
    assert weights_path("dir/model.pt2") == Path("dir/model.weights")


@pytest.mark.parametrize("damage", ["truncated", "header", "offset", "digest"])
def test_damaged_weights_files_are_refused(tmp_path: Path, tensors: dict[str, torch.Tensor],
                                           damage: str) -> None:
    """Every damaged file is a ValueError naming the file, never a crash or garbage."""
    path = tmp_path / "w.weights"
    write_weights(path, tensors, {"program_fingerprint": "f" * 64})
    data = path.read_bytes()
    if damage == "truncated":
        data = data[:40]
    elif damage == "header":
        data = data[:16] + b"\xff" + data[17:]
    elif damage == "offset":
        data = data.replace(b'"offset": 0', b'"offset": 9', 1)
    if damage != "digest":
        path.write_bytes(data)
        os.remove(digest_path(path))  # unverified: the layout checks alone
        message = {"truncated": "header length", "header": "not JSON",
                   "offset": "lies outside"}[damage]
    else:
        path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
        message = "sha256 .* differs from"
    with pytest.raises(ValueError, match=f"{re.escape(str(path))}: .*{message}"):
        read_weights(path)
