"""``dlrm_app.serving.server``: the HTTP endpoint answers concurrent clients exactly as direct calls of
the model do, refuses every malformed request with a 4xx and a message, and keeps serving.

The model is a tiny stand-in with the exported artifact's three methods (``artifact.py``): a
logistic model over hashed Criteo ids, scripted and saved with its ``metadata.json``.
"""

from __future__ import annotations

import contextlib
import datetime
import http.client
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from dlrm_app.serving import artifact as artifact_module
from dlrm_app.serving.artifact import (
    ARTIFACT_FORMAT_VERSION,
    METADATA_FILE,
    load_artifact,
    write_digest,
)
from dlrm_app.serving.server import (
    PredictionServer,
    Reloader,
    RequestError,
    RequestParser,
    ServeConfig,
)

pytestmark = [
    pytest.mark.filterwarnings("ignore:`torch\\.jit\\.:DeprecationWarning"),  # torch 2.13's notice
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),  # training
]

DENSE = [f"int_{i}" for i in range(13)]
SPARSE = [f"cat_{i}" for i in range(26)]
SIZES = [97 + 13 * i for i in range(26)]
FAIL = -777.0
"""A dense raw value that makes the stand-in model raise (a model failure at serving time)."""


class HashedLogistic(nn.Module):
    """sigmoid(w . log1p(dense) + sum of one weight per (feature, id)); ids hashed mod size."""

    def __init__(self, sizes: list[int]) -> None:
        super().__init__()
        self.register_buffer("sizes", torch.tensor(sizes))
        self.register_buffer("table_start", torch.tensor([0, *np.cumsum(sizes)[:-1].tolist()]))
        self.weights = nn.EmbeddingBag(sum(sizes), 1, mode="sum", include_last_offset=True)
        self.linear = nn.Linear(13, 1)
        self.fail = FAIL
        torch.manual_seed(0)
        nn.init.normal_(self.weights.weight, std=0.5)

    def forward(self, dense: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor
                ) -> torch.Tensor:
        b, f = dense.shape[0], self.sizes.shape[0]
        lengths = offsets[1:] - offsets[:-1]
        feature = torch.arange(f * b) // max(b, 1)
        ids = values + self.table_start[feature].repeat_interleave(lengths)
        pooled = self.weights(ids, offsets).view(f, b).sum(0)
        return torch.sigmoid(pooled + self.linear(dense).squeeze(1))

    @torch.jit.export
    def encode(self, dense_raw: torch.Tensor, cat_raw: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if bool((dense_raw == self.fail).any()):
            raise RuntimeError("stand-in failure on the marked row")
        dense = torch.log1p(torch.nan_to_num(dense_raw, nan=0.0).clamp(min=0.0))
        values = (cat_raw % self.sizes).t().reshape(-1)
        offsets = torch.arange(values.numel() + 1)
        return dense, values, offsets

    @torch.jit.export
    def predict_raw(self, dense_raw: torch.Tensor, cat_raw: torch.Tensor) -> torch.Tensor:
        dense, values, offsets = self.encode(dense_raw, cat_raw)
        return self.forward(dense, values, offsets)


def metadata(raw_input: bool = True) -> dict:
    return {"format_version": ARTIFACT_FORMAT_VERSION, "dataset": "criteo-standin",
            "kind": "criteo", "dense_features": DENSE,
            "sparse_features": [{"name": n, "num_embeddings": s, "multi_hot": i == 0}
                                for i, (n, s) in enumerate(zip(SPARSE, SIZES, strict=True))],
            "raw_input": raw_input, "raw_format": "criteo_tsv" if raw_input else None,
            "embedding_dtype": "fp32", "needs_fbgemm": False, "preprocessing": {},
            "checkpoint": None, "created_by": "tests/app/test_serve.py"}


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("serve") / "model.pt"
    scripted = torch.jit.script(HashedLogistic(SIZES))
    torch.jit.save(scripted, str(path), _extra_files={METADATA_FILE: json.dumps(metadata())})
    return path


@pytest.fixture(scope="module")
def server(artifact: Path) -> Iterator[PredictionServer]:
    config = ServeConfig(port=0, max_batch_rows=64, max_wait_ms=5, max_body_bytes=64 << 10,
                         max_rows=100)
    with PredictionServer.from_file(artifact, config) as s:
        yield s


def random_rows(rng: np.random.Generator, n: int) -> list[str]:
    rows = []
    for _ in range(n):
        dense = [str(v) if rng.random() > 0.2 else "" for v in rng.integers(-3, 5000, 13)]
        cats = [format(int(v), "x") if rng.random() > 0.1 else ""
                for v in rng.integers(0, 2**32, 26)]
        fields = dense + cats
        rows.append("\t".join(fields[:int(rng.integers(30, 40))]))  # some short rows
    return rows


def direct(model: torch.jit.ScriptModule, rows: list[str]) -> np.ndarray:
    """The model's own answer: rows parsed in plain Python, per the raw row format."""
    dense = np.full((len(rows), 13), np.nan, np.float32)
    cats = np.zeros((len(rows), 26), np.int64)
    for i, row in enumerate(rows):
        fields = row.split("\t")
        for j, f in enumerate(fields[:13]):
            dense[i, j] = float(f) if f else np.nan
        for j, f in enumerate(fields[13:]):
            cats[i, j] = int(f, 16) if f else 0
    with torch.inference_mode():
        return model.predict_raw(torch.from_numpy(dense), torch.from_numpy(cats)).numpy()


def assert_probabilities(got: list[float], want: np.ndarray) -> None:
    # a request merged into a batch with others is summed in another order than alone:
    # float32 rounding, amplified in the relative error of probabilities near 0
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def post(port: int, body: bytes | dict, path: str = "/predict") -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                     headers={"Content-Type": "application/json"})
    return _open(request)


def get(port: int, path: str) -> tuple[int, dict]:
    return _open(urllib.request.Request(f"http://127.0.0.1:{port}{path}"))


def _open(request: urllib.request.Request) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


# ---- correctness under concurrency ---------------------------------------------------------
def test_concurrent_clients_get_the_models_answers(server: PredictionServer) -> None:
    model, port = server.model, server.port
    before = server.batcher.batches
    results: dict[int, tuple[list[str], int, dict]] = {}

    def client(k: int) -> None:
        rng = np.random.default_rng(k)
        for r in range(3):
            rows = random_rows(rng, int(rng.integers(1, 20)))
            results[k * 10 + r] = (rows, *post(port, {"rows": rows}))

    threads = [threading.Thread(target=client, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 24
    for rows, status, body in results.values():
        assert status == 200, body
        assert_probabilities(body["probabilities"], direct(model, rows))
    # concurrent requests were merged: fewer model calls than requests
    assert server.batcher.batches - before < 24


def test_labeled_rows_and_instances(server: PredictionServer) -> None:
    rows = random_rows(np.random.default_rng(1), 5)
    expected = direct(server.model, rows)
    status, body = post(server.port, {"rows": ["1\t" + r for r in rows], "labeled": True})
    assert status == 200
    assert_probabilities(body["probabilities"], expected)
    # the same rows, encoded by the model, as instances (cat_0 is multi-hot: a bag of two)
    instances, dense_rows, bags = [], [], []
    for i, row in enumerate(rows):
        dense_raw = [float(f) if f else float("nan") for f in (row.split("\t") + [""] * 39)[:13]]
        cats = [int(f, 16) if f else 0 for f in (row.split("\t") + [""] * 39)[13:39]]
        ids = [c % s for c, s in zip(cats, SIZES, strict=True)]
        dense = torch.log1p(torch.nan_to_num(torch.tensor(dense_raw)).clamp(min=0)).tolist()
        sparse = dict(zip(SPARSE, ids, strict=True))
        sparse["cat_0"] = [ids[0], i]
        instances.append({"dense": dense, "sparse": sparse})
        dense_rows.append(dense)
        bags.append([[ids[0], i], *([x] for x in ids[1:])])
    values = torch.tensor([v for f in range(26) for row in bags for v in row[f]])
    lengths = torch.tensor([len(row[f]) for f in range(26) for row in bags])
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    with torch.inference_mode():
        want = server.model.forward(torch.tensor(dense_rows), values, offsets).numpy()
    status, body = post(server.port, {"instances": instances})
    assert status == 200, body
    assert_probabilities(body["probabilities"], want)
    assert post(server.port, {"rows": []}) == (200, {"probabilities": []})


def test_parser_matches_python_parsing() -> None:
    parser = RequestParser(metadata(), max_rows=10)
    rows = ["\t".join(["-5", "", "123456789012"] + [""] * 10 + ["0", "ffffffff", "A", "0001",
                                                                "dEaDbEeF"])]
    parsed = parser.parse_rows(rows)
    assert parsed.dense_raw[0, :3].tolist()[0] == -5 and np.isnan(parsed.dense_raw[0, 1])
    assert parsed.dense_raw[0, 2] == np.float32(123456789012)
    assert parsed.cat_raw[0, :6].tolist() == [0, 0xFFFFFFFF, 10, 1, 0xDEADBEEF, 0]


# ---- refusals ------------------------------------------------------------------------------
ROW = "\t".join(["1"] * 13 + ["a1"] * 26)
BAD_REQUESTS = [
    (b"{not json", 400, "not valid JSON"),
    (b"\xff\xfe", 400, "not valid JSON"),
    (b"[1, 2]", 400, '"rows"'),
    ({"rows": [ROW], "instances": []}, 400, "exactly one of"),
    ({}, 400, "exactly one of"),
    (b"[" * 60_000, 400, "nested too deeply"),
    ({"rows": [ROW], "extra": 1}, 400, "unknown keys ['extra']"),
    ({"rows": ROW}, 400, "must be a list"),
    ({"rows": [ROW, 7]}, 400, "rows[1] is a int"),
    ({"rows": [ROW, ROW + "\t1\t2"]}, 400, "rows[1] has 41 tab-separated fields"),
    ({"rows": ["0\t" + ROW]}, 400, '"labeled": true'),
    ({"rows": [ROW.replace("a1", "xyz", 1)]}, 400, "rows[0] field 14 (cat_0) = 'xyz' is not 1-8"),
    ({"rows": [ROW.replace("a1", "123456789", 1)]}, 400, "(cat_0) = '123456789'"),
    ({"rows": [ROW.replace("1", "1.5", 1)]}, 400, "field 1 (int_0) = '1.5' is not a decimal"),
    ({"rows": ["1\t" + ROW.replace("1", "x", 1)], "labeled": True}, 400, "field 2 (int_0)"),
    ({"rows": [ROW], "labeled": "yes"}, 400, '"labeled" must be true or false'),
    ({"rows": ["9" * 30]}, 400, "outside the 64-bit integer range"),
    ({"rows": [ROW] * 101}, 413, "101 rows, at most 100"),
    ({"instances": [{"dense": [0.0] * 12, "sparse": {}}]}, 400, "instances[0].dense"),
    ({"instances": [{"dense": [1e39] * 13, "sparse": {}}]}, 400, "finite float32"),
    ({"instances": [{"dense": [0.0] * 13, "sparse": {"cat_0": 1, "bogus": 2}}]}, 400,
     "unknown ['bogus']"),
    ({"instances": [{"dense": [0.0] * 13,
                     "sparse": {**dict.fromkeys(SPARSE, 0), "cat_25": SIZES[-1]}}]}, 400,
     f"instances[0].sparse.cat_25 must be an id or a list of ids in [0, {SIZES[-1]})"),
    ({"instances": [{"dense": [0.0] * 13, "sparse": dict.fromkeys(SPARSE, [1, 2])}]}, 400,
     "cat_1 is one-hot"),
    ({"instances": [{"dense": [0.0] * 13}]}, 400, 'exactly "dense" and "sparse"'),
]


@pytest.mark.parametrize(("body", "status", "message"), BAD_REQUESTS,
                         ids=[f"{i}-{m[:24]}" for i, (_, _, m) in enumerate(BAD_REQUESTS)])
def test_malformed_requests_are_refused_and_serving_goes_on(
        server: PredictionServer, body: bytes | dict, status: int, message: str) -> None:
    got, answer = post(server.port, body)
    assert got == status and message in answer["error"], answer
    assert post(server.port, {"rows": [ROW]})[0] == 200


def test_rows_need_a_raw_input_model(artifact: Path) -> None:
    model, _ = load_artifact(artifact)
    with PredictionServer(model, metadata(raw_input=False), ServeConfig(port=0)) as s:
        status, body = post(s.port, {"rows": [ROW]})
        assert status == 400 and 'send "instances"' in body["error"]
        assert get(s.port, "/health")[1]["accepts"] == ["instances"]


def test_model_failure_is_a_500_for_its_request_only(server: PredictionServer) -> None:
    bad = ROW.replace("1", str(int(FAIL)), 1)
    answers: dict[str, tuple[int, dict]] = {}
    threads = [threading.Thread(target=lambda k=k, r=r: answers.__setitem__(k, post(
        server.port, {"rows": [r]}))) for k, r in (("bad", bad), ("good1", ROW), ("good2", ROW))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert answers["bad"][0] == 500 and "stand-in failure" in answers["bad"][1]["error"]
    assert answers["good1"][0] == answers["good2"][0] == 200


def test_oversized_body_is_refused_from_its_headers(server: PredictionServer) -> None:
    limit = server.config.max_body_bytes
    # only the headers and a few bytes are sent: the answer must not wait for the rest
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n{\"rows\": [" % (limit + 1))
        response = sock.makefile("rb").read()
    head, _, body = response.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413") and b"--max-body-bytes" in body
    # a client sending the whole oversized body still reads the 413
    status, body = post(server.port, b"x" * (4 * limit))
    assert status == 413 and "over the limit" in body["error"]
    assert post(server.port, {"rows": [ROW]})[0] == 200


def test_other_paths_methods_and_framing(server: PredictionServer) -> None:
    port = server.port
    assert get(port, "/nope")[0] == 404
    assert get(port, "/predict")[0] == 405
    assert post(port, {}, path="/health")[0] == 405
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.putrequest("POST", "/predict")
    conn.endheaders()  # no Content-Length
    response = conn.getresponse()
    assert response.status == 411 and "Content-Length" in json.loads(response.read())["error"]
    conn.close()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("DELETE", "/predict")
    assert conn.getresponse().status == 405
    conn.close()
    # keep-alive: several requests on one connection, refused ones (body read) included
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    for rows, status in (([ROW], 200), ([ROW] * 101, 413), (["x"], 400), ([ROW, ROW], 200)):
        conn.request("POST", "/predict", json.dumps({"rows": rows}),
                     {"Content-Type": "application/json"})
        response = conn.getresponse()
        body = json.loads(response.read())
        assert response.status == status and len(body.get("probabilities", rows)) == len(rows)
    conn.close()


# ---- hostile HTTP ----------------------------------------------------------------------------
def _exchange(port: int, raw: bytes) -> list[tuple[int, bytes]]:
    """Send raw bytes on one connection; every (status, body) answered until the server closes
    it (the last request carries ``Connection: close``)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(raw)
        reader = sock.makefile("rb")
        answers = []
        while line := reader.readline():
            status = int(line.split()[1])
            headers = {}
            while (header := reader.readline()) not in (b"\r\n", b""):
                name, _, value = header.decode("latin-1").partition(":")
                headers[name.strip().lower()] = value.strip()
            body = reader.read(int(headers.get("content-length", 0)))
            answers.append((status, body))
    return answers


def _request(method: str, path: str, body: bytes = b"", close: bool = False,
             length: bytes | None = None) -> bytes:
    length = str(len(body)).encode() if length is None else length
    return (f"{method} {path} HTTP/1.1\r\nHost: x\r\n".encode() + b"Content-Length: " + length
            + b"\r\n" + (b"Connection: close\r\n" if close else b"") + b"\r\n" + body)


def test_refused_request_body_is_not_read_as_a_request(server: PredictionServer) -> None:
    smuggled = _request("GET", "/health")
    for method, path, status in (("POST", "/nope", 404), ("POST", "/health", 405),
                                 ("PUT", "/predict", 405)):
        answers = _exchange(server.port, _request(method, path, smuggled)
                            + _request("GET", "/metrics", close=True))
        assert [a[0] for a in answers] == [status, 200], answers
        assert "requests" in json.loads(answers[1][1]) or json.loads(answers[1][1])


@pytest.mark.parametrize("length", ["²".encode("latin-1"), b"9" * 5000, b"-5", b"0x10"])
def test_bad_content_length_is_a_400(server: PredictionServer, length: bytes) -> None:
    answers = _exchange(server.port, _request("POST", "/predict", b"{}", close=True,
                                              length=length))
    assert answers[0][0] == 400 and b"is not a byte count" in answers[0][1]


def test_huge_json_integer_is_a_400(server: PredictionServer) -> None:
    body = b'{"instances": [{"dense": [1], "sparse": {"cat_0": ' + b"7" * 5000 + b"}}]}"
    status, answer = post(server.port, body)
    assert status == 400 and "not usable JSON" in answer["error"]


def test_head_and_options(server: PredictionServer) -> None:
    # HEAD: the headers of GET (its Content-Length) and no body; OPTIONS: 204 and Allow; all
    # on one kept-alive connection
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    conn.request("HEAD", "/health")
    response = conn.getresponse()
    assert response.status == 200 and int(response.getheader("Content-Length")) > 0
    assert response.read() == b""
    conn.request("OPTIONS", "/predict")
    response = conn.getresponse()
    assert response.status == 204 and response.getheader("Allow") == "POST, OPTIONS"
    assert response.read() == b""
    conn.request("POST", "/metrics", b"{}")
    response = conn.getresponse()
    response.read()
    assert response.status == 405 and response.getheader("Allow") == "GET, HEAD, OPTIONS"
    conn.close()


class NonFinite(nn.Module):
    """The stand-in, but its output is NaN where the first dense value is over 1e38 (what a
    DLRM gives for dense inputs of 3e38)."""

    def __init__(self, sizes: list[int]) -> None:
        super().__init__()
        self.inner = HashedLogistic(sizes)

    def forward(self, dense: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor
                ) -> torch.Tensor:
        out = self.inner(dense, values, offsets)
        return torch.where(dense[:, 0] > 1e38, torch.full_like(out, float("nan")), out)

    @torch.jit.export
    def encode(self, dense_raw: torch.Tensor, cat_raw: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.inner.encode(dense_raw, cat_raw)

    @torch.jit.export
    def predict_raw(self, dense_raw: torch.Tensor, cat_raw: torch.Tensor) -> torch.Tensor:
        dense, values, offsets = self.encode(dense_raw, cat_raw)
        return self.forward(dense, values, offsets)


def test_non_finite_output_is_a_400_never_nan_on_the_wire(tmp_path: Path) -> None:
    path = tmp_path / "nan.pt"
    torch.jit.save(torch.jit.script(NonFinite(SIZES)), str(path),
                   _extra_files={METADATA_FILE: json.dumps(metadata(raw_input=False))})
    sparse = {name: [1] if i == 0 else 1 for i, name in enumerate(SPARSE)}
    with PredictionServer.from_file(path, ServeConfig(port=0, max_wait_ms=0)) as s:
        ok = {"dense": [0.5] * 13, "sparse": sparse}
        huge = {"dense": [3e38] + [0.5] * 12, "sparse": sparse}
        raw = urllib.request.Request(f"http://127.0.0.1:{s.port}/predict",
                                     data=json.dumps({"instances": [ok, huge]}).encode())
        try:
            urllib.request.urlopen(raw, timeout=30)
        except urllib.error.HTTPError as e:
            status, text = e.code, e.read().decode()
        def no_constants(name: str) -> None:
            raise AssertionError(f"{name} on the wire")
        answer = json.loads(text, parse_constant=no_constants)
        assert status == 400 and "not finite for row(s) [1]" in answer["error"]
        status, answer = post(s.port, {"instances": [ok]})
        assert status == 200 and 0 < answer["probabilities"][0] < 1


# ---- health and metrics --------------------------------------------------------------------
def test_health_and_metrics_count_what_was_sent(artifact: Path) -> None:
    config = ServeConfig(port=0, max_batch_rows=8, max_wait_ms=0)
    with PredictionServer.from_file(artifact, config) as s:
        status, health = get(s.port, "/health")
        assert status == 200 and health["status"] == "ok" and health["model"] == "model.pt"
        assert health["embedding_dtype"] == "fp32" and health["format"] == "torchscript"
        assert health["accepts"] == ["rows", "instances"]
        rows = random_rows(np.random.default_rng(3), 5)
        for n in (1, 2, 5):
            assert post(s.port, {"rows": rows[:n]})[0] == 200
        assert post(s.port, b"{")[0] == 400
        assert get(s.port, "/missing")[0] == 404
        status, m = get(s.port, "/metrics")
        assert status == 200
        assert m["requests"] == {"/health": {"200": 1}, "/predict": {"200": 3, "400": 1},
                                 "other": {"404": 1}}
        assert m["responses_by_status"] == {"200": 4, "400": 1, "404": 1}
        assert m["rows_served"] == 8 and m["batches"] == 3
        assert m["mean_batch_rows"] == pytest.approx(8 / 3, abs=1e-3)
        lat = m["latency_ms"]
        assert lat["window"] == 3 and 0 < lat["p50"] <= lat["p90"] <= lat["p99"]
        assert get(s.port, "/metrics")[1]["requests"]["/metrics"] == {"200": 1}


# ---- a real exported DLRM ------------------------------------------------------------------
@pytest.mark.slow
def test_serves_an_exported_dlrm(tmp_path: Path) -> None:
    from dlrm_app.data.criteo import preprocess_criteo
    from dlrm_app.model import ModelConfig
    from dlrm_app.serving import export
    from dlrm_app.training.config import TrainConfig
    from dlrm_app.training.trainer import train

    rng = np.random.default_rng(0)
    rows = random_rows(rng, 1500)
    tsv = tmp_path / "day.tsv"
    tsv.write_text("".join(f"{rng.integers(0, 2)}\t{r}\n" for r in rows))
    preprocess_criteo([tsv], tmp_path / "data", num_embeddings_per_feature=[50] * 26,
                      row_group_size=128)
    model_config = ModelConfig(embedding_dim=4, dense_arch_layer_sizes=(8, 4),
                               over_arch_layer_sizes=(8, 1))
    train(TrainConfig.from_flags(data=str(tmp_path / "data"), out=str(tmp_path / "run"),
                                 model=model_config, batch_size=128, max_steps=4), progress=False)
    export.export_model(tmp_path / "run", tmp_path / "model.pt2", "int8")
    export.export_model(tmp_path / "run", tmp_path / "model.pt", "int8", fmt="torchscript")
    scripted, _ = load_artifact(tmp_path / "model.pt")
    with PredictionServer.from_file(tmp_path / "model.pt2", ServeConfig(port=0)) as s:
        health = get(s.port, "/health")[1]
        assert health["embedding_dtype"] == "int8" and health["format"] == "pt2"
        answers = [post(s.port, {"rows": rows[k:k + 40]}) for k in range(0, 200, 40)]
        for k, (status, body) in zip(range(0, 200, 40), answers, strict=True):
            assert status == 200, body
            # the .pt2 server answers as the same checkpoint's TorchScript export computes
            assert_probabilities(body["probabilities"], direct(scripted, rows[k:k + 40]))
        status, body = post(s.port, {"rows": [rows[0].replace("\t", "\tzz", 1)]})
        assert status == 400 and "rows[0] field 2 (int_1) = 'zz" in body["error"]
        assert health["sha256"] == (tmp_path / "model.pt2.sha256").read_text().split()[0]
    # 256 bytes flipped inside the package's compiled library: its export's digest refuses it
    pt2 = tmp_path / "model.pt2"
    with zipfile.ZipFile(pt2) as z:
        library = next(i for i in z.infolist() if i.filename.endswith(".so"))
    data = bytearray(pt2.read_bytes())
    name_bytes, extra_bytes = struct.unpack("<HH", data[library.header_offset + 26:
                                                         library.header_offset + 30])
    at = library.header_offset + 30 + name_bytes + extra_bytes + library.compress_size // 2
    data[at:at + 256] = bytes(b ^ 0xFF for b in data[at:at + 256])
    pt2.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="sha256 [0-9a-f]{64} differs from [0-9a-f]{64} "
                                         ".*model.pt2.sha256.*export it again"):
        PredictionServer.from_file(pt2, ServeConfig(port=0))


@pytest.mark.slow
def test_command_line(artifact: Path) -> None:
    """``dlrm-app serve`` prints where it listens, serves,
    and exits 0 on SIGTERM."""
    proc = subprocess.Popen([sys.executable, "-m", "dlrm_app", "serve", str(artifact), "--port", "0",
                             "--max-rows", "2", "--threads", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = json.loads(proc.stdout.readline())
        assert line["listening"] == f"http://127.0.0.1:{line['port']}"
        assert line["verified"] == ("not verified: no .sha256 beside it and no "
                                    "--expect-sha256")
        assert get(line["port"], "/health")[1]["model"] == "model.pt"
        assert post(line["port"], {"rows": [ROW] * 3})[0] == 413
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
        proc.wait()
    bad = subprocess.run([sys.executable, "-m", "dlrm_app", "serve", str(artifact) + ".missing"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "no such model file" in bad.stderr


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


MALFORMED = [
    (b'{"rows": [', 400),                                        # bad JSON
    (json.dumps({"rows": ["1\t2"] * 2, "x": 1}).encode(), 400),  # unknown key
    (json.dumps({"rows": ["zz\t" * 38 + "zz"]}).encode(), 400),  # not a row
    (json.dumps({"rows": [ROW] * 101}).encode(), 413),            # too many rows
]


def _load(port: int, clients: int, requests: int, seed: int, stop: threading.Event | None = None
          ) -> dict[str, int]:
    """``clients`` keep-alive connections, each sending ``requests`` (a fifth malformed, some to
    unknown paths with a body); every good answer is checked against the model. With ``stop``,
    clients go on until it is set and the server refuses them."""
    outcome = {"ok": 0, "refused_as_expected": 0, "connection_refused": 0, "wrong": 0,
               "cut_short": 0, "closed_between_requests": 0}
    lock = threading.Lock()
    model = torch.jit.load(str(_ARTIFACT[0]))

    def client(k: int) -> None:
        rng = np.random.default_rng([seed, k])
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        i = 0
        while (stop is None and i < requests) or (stop is not None and i < 10_000):
            i += 1
            kind = rng.integers(10)
            if kind < 2:
                body, want, path = *MALFORMED[int(rng.integers(len(MALFORMED)))], "/predict"
            elif kind == 2:
                body, want, path = b'{"rows": []}' * 3, 404, "/nope"
            else:
                rows = random_rows(rng, int(rng.integers(1, 4)))
                body, want, path = json.dumps({"rows": rows}).encode(), 200, "/predict"
            try:
                conn.request("POST", path, body, {"Content-Type": "application/json"})
                response = conn.getresponse()
                answer = response.read()
                will_close = response.getheader("Connection", "").lower() == "close"
            except ConnectionRefusedError:
                key = "connection_refused"
            except http.client.IncompleteRead:
                key = "cut_short"
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                # no byte of an answer: the server closed the connection before reading this
                # request (what HTTP clients retry on a reused connection)
                key = "closed_between_requests"
            else:
                parsed = json.loads(answer)
                if response.status != want:
                    key = "wrong" if not (stop is not None and response.status == 503) else "ok"
                elif want == 200:
                    try:
                        assert_probabilities(parsed["probabilities"], direct(model, rows))
                        key = "ok"
                    except AssertionError:
                        key = "wrong"
                else:
                    key = "refused_as_expected"
                if will_close:
                    conn.close()
            with lock:
                outcome[key] += 1
            if key in ("connection_refused", "cut_short", "closed_between_requests"):
                conn.close()
                if stop is not None and stop.is_set():
                    return
        conn.close()

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outcome


_ARTIFACT: list[Path] = []


@pytest.mark.slow
def test_loopback_load_with_malformed_share_and_graceful_sigterm(artifact: Path) -> None:
    _ARTIFACT[:] = [artifact]
    proc = subprocess.Popen([sys.executable, "-m", "dlrm_app", "serve", str(artifact), "--port",
                             "0", "--threads", "1", "--max-rows", "100",
                             "--drain-timeout-s", "10"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        port = json.loads(proc.stdout.readline())["port"]
        warm = _load(port, clients=16, requests=60, seed=1)
        rss_warm = _rss_mb(proc.pid)
        steady = _load(port, clients=16, requests=120, seed=2)
        rss_after = _rss_mb(proc.pid)
        for outcome, sent in ((warm, 16 * 60), (steady, 16 * 120)):
            assert outcome["wrong"] == outcome["cut_short"] == 0, outcome
            assert outcome["ok"] + outcome["refused_as_expected"] == sent, outcome
        # 1,920 more requests after warm-up: memory stays flat (no per-request growth)
        assert rss_after - rss_warm < 20, (rss_warm, rss_after)
        # SIGTERM under load: what was received is answered in full, then the server exits 0
        stop = threading.Event()
        results: dict[str, int] = {}
        runner = threading.Thread(target=lambda: results.update(
            _load(port, clients=16, requests=0, seed=3, stop=stop)))
        runner.start()
        time.sleep(1.0)
        stop.set()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        runner.join(timeout=60)
        assert results["wrong"] == results["cut_short"] == 0, results
        assert results["ok"] > 0 and results["connection_refused"] > 0, results
        # the server read no request it left unanswered
        assert json.loads(proc.stdout.readline()) == {"stopped": True, "unanswered": 0}
        # a kept-alive client whose next request comes after the drain went quiet (a starved
        # thread on a loaded machine) finds its connection closed with no byte of an answer, a
        # request the server never read; each client meets that at most once, then is refused
        assert results["closed_between_requests"] <= 16, results
        assert results["connection_refused"] + results["closed_between_requests"] >= 16, results
    finally:
        proc.kill()
        proc.wait()


def test_config_is_checked() -> None:
    with pytest.raises(ValueError, match="max_batch_rows must be >= 1"):
        ServeConfig(max_batch_rows=0)
    with pytest.raises(ValueError, match="port must be in"):
        ServeConfig(port=70000)
    with pytest.raises(ValueError, match="watch_interval_s must be >= 0"):
        ServeConfig(watch_interval_s=-1)


def test_request_error_carries_status() -> None:
    with pytest.raises(RequestError) as e:
        RequestParser(metadata(), max_rows=1).parse(b'{"rows": ["", ""]}')
    assert e.value.status == 413


def test_sighup_swaps_the_model_under_load_without_a_failed_request(artifact: Path,
                                                                     tmp_path: Path) -> None:
    """``kill -HUP``: the file now at the model's path is loaded, checked and warmed up while
    the old model serves; every request is answered (200), by the old model until the swap and
    by the new one after it, never a mix; a model taking other inputs is refused and the
    current one goes on serving."""
    served = tmp_path / "model.pt"
    shutil.copy(artifact, served)
    other = torch.jit.script(HashedLogistic(SIZES))
    with torch.no_grad():
        other.weights.weight.mul_(-1.0)  # another model: other answers on the same rows
    torch.jit.save(other, str(tmp_path / "b.pt"),
                   _extra_files={METADATA_FILE: json.dumps(metadata())})
    rows = random_rows(np.random.default_rng(5), 3)
    old, new = direct(load_artifact(artifact)[0], rows), direct(other, rows)
    assert np.abs(old - new).max() > 0.05
    proc = subprocess.Popen([sys.executable, "-m", "dlrm_app", "serve", str(served), "--port",
                             "0", "--threads", "1"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    answers: list[tuple[int, list[float]]] = []
    done = threading.Event()
    try:
        port = json.loads(proc.stdout.readline())["port"]

        def client() -> None:
            while not done.is_set():
                status, body = post(port, {"rows": rows})
                answers.append((status, body.get("probabilities", [])))
                time.sleep(0.005)

        thread = threading.Thread(target=client)
        thread.start()
        while len(answers) < 40:
            time.sleep(0.01)
        os.replace(tmp_path / "b.pt", served)
        proc.send_signal(signal.SIGHUP)
        reloaded = json.loads(proc.stdout.readline())
        assert reloaded["reloaded"] == str(served) and reloaded["seconds"] < 30
        count = len(answers)
        while len(answers) < count + 40:
            time.sleep(0.01)
        # a model with other features: refused, the new model goes on serving
        wrong = torch.jit.script(HashedLogistic(SIZES))
        torch.jit.save(wrong, str(tmp_path / "c.pt"), _extra_files={METADATA_FILE: json.dumps(
            {**metadata(), "dense_features": DENSE[:12]})})
        os.replace(tmp_path / "c.pt", served)
        proc.send_signal(signal.SIGHUP)
        failed = json.loads(proc.stdout.readline())
        assert "takes other inputs" in failed["reload_failed"]
        count = len(answers)
        while len(answers) < count + 10:
            time.sleep(0.01)
        health = get(port, "/health")[1]
        done.set()
        thread.join(timeout=30)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        done.set()
        proc.kill()
        proc.wait()
    assert health["reloads"] == 1
    assert [status for status, _ in answers] == [200] * len(answers)
    which = []
    for _, got in answers:
        if np.abs(np.array(got) - old).max() < 1e-5:
            which.append("old")
        else:
            assert np.abs(np.array(got) - new).max() < 1e-5, got  # never a mix of the two
            which.append("new")
    switch = which.index("new")
    assert which[:switch] == ["old"] * switch and set(which[switch:]) == {"new"}
    assert switch >= 40 and len(which) - switch >= 50


def _serve(model: Path) -> tuple[subprocess.Popen, int]:
    """``dlrm-app serve model`` on a free port (default watching), and that port."""
    proc = subprocess.Popen([sys.executable, "-m", "dlrm_app", "serve", str(model), "--port",
                             "0", "--threads", "1"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    return proc, json.loads(proc.stdout.readline())["port"]


@contextlib.contextmanager
def _probing(port: int, body: dict) -> Iterator[list[tuple[float, int, list[float]]]]:
    """A client posting the same request ``body`` every ~5 ms while the block runs (20
    answers in before it starts): (monotonic time, status, probabilities) per answer."""
    answers: list[tuple[float, int, list[float]]] = []
    done = threading.Event()

    def client() -> None:
        while not done.is_set():
            status, got = post(port, body)
            answers.append((time.monotonic(), status, got.get("probabilities", [])))
            time.sleep(0.005)

    thread = threading.Thread(target=client)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while len(answers) < 20 and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(answers) >= 20, "the client got no answers"
        yield answers
    finally:
        done.set()
        thread.join(timeout=30)


def _health_when(port: int, ready: Any, timeout_s: float = 20.0) -> dict:
    """``/health`` once ``ready(health)`` holds (within ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while not ready(health := get(port, "/health")[1]):
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {health}"
        time.sleep(0.05)
    return health


def _which(answers: list[tuple[float, int, list[float]]], old: np.ndarray,
           new: np.ndarray, atol: float = 1e-5) -> list[str]:
    """Which model gave each answer (each a 200); an answer of neither (a mix) fails."""
    which = []
    for _, status, got in answers:
        assert status == 200
        if np.abs(np.array(got) - old).max() < atol:
            which.append("old")
        else:
            assert np.abs(np.array(got) - new).max() < atol, got
            which.append("new")
    return which


def _negated(path: Path) -> torch.jit.ScriptModule:
    """Another stand-in (other answers on the same rows) saved at ``path`` with its .sha256."""
    model = torch.jit.script(HashedLogistic(SIZES))
    with torch.no_grad():
        model.weights.weight.mul_(-1.0)
    torch.jit.save(model, str(path), _extra_files={METADATA_FILE: json.dumps(metadata())})
    write_digest(path)
    return model


@pytest.mark.slow
def test_a_model_renamed_over_the_served_path_is_taken_without_a_signal(
        artifact: Path, tmp_path: Path) -> None:
    """A publisher renames a new model over the served path, then (0.3 s later) its .sha256:
    no SIGHUP, and no failed attempt on the half-published pair; every request is answered
    200, by the old model then the new one, never a mix; /health shows the new digest, when
    and how fast it was loaded."""
    served = tmp_path / "model.pt"
    shutil.copy(artifact, served)
    write_digest(served)
    new_model = _negated(tmp_path / "b.pt")
    rows = random_rows(np.random.default_rng(5), 3)
    old, new = direct(load_artifact(artifact)[0], rows), direct(new_model, rows)
    assert np.abs(old - new).max() > 0.05
    proc, port = _serve(served)
    try:
        with _probing(port, {"rows": rows}) as answers:
            replaced, before = time.monotonic(), datetime.datetime.now(datetime.timezone.utc)
            os.replace(tmp_path / "b.pt", served)
            time.sleep(0.3)  # the new model beside the old digest meanwhile
            os.replace(tmp_path / "b.pt.sha256", tmp_path / "model.pt.sha256")
            health = _health_when(port, lambda h: h.get("reloads") or h.get("last_reload"))
            count = len(answers)
            while len(answers) < count + 20:
                time.sleep(0.01)
        line = json.loads(proc.stdout.readline())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
        proc.wait()
    assert line["reloaded"] == str(served) and line["on"] == "file changed", line
    assert health["last_reload"]["ok"] is True, health["last_reload"]
    assert health["reloads"] == 1
    assert health["sha256"] == (tmp_path / "model.pt.sha256").read_text().split()[0]
    assert datetime.datetime.fromisoformat(health["loaded_at"]) >= before
    assert 0 < health["load_seconds"] < 20
    assert [status for _, status, _ in answers] == [200] * len(answers)
    which = _which(answers, old, new)
    switch = which.index("new")
    assert which[:switch] == ["old"] * switch and set(which[switch:]) == {"new"}
    assert answers[switch][0] - replaced < 20 and len(which) - switch >= 20


@pytest.mark.slow
def test_a_tampered_replacement_is_refused_and_the_old_model_serves_on(
        artifact: Path, tmp_path: Path) -> None:
    """A replacement changed after its .sha256 was written (its zip directory zeroed, so that
    reading it would fail otherwise) is refused on its digest, before anything in it is read:
    /health says why and keeps the old digest, the old model answers every request, and the
    file is not tried again until one changes; a good file published then is taken."""
    served = tmp_path / "model.pt"
    shutil.copy(artifact, served)
    old_digest = write_digest(served)
    _negated(tmp_path / "b.pt")
    data = bytearray((tmp_path / "b.pt").read_bytes())
    data[-64:] = bytes(64)
    (tmp_path / "b.pt").write_bytes(bytes(data))
    rows = random_rows(np.random.default_rng(6), 3)
    old = direct(load_artifact(artifact)[0], rows)
    proc, port = _serve(served)
    try:
        with _probing(port, {"rows": rows}) as answers:
            os.replace(tmp_path / "b.pt", served)
            os.replace(tmp_path / "b.pt.sha256", tmp_path / "model.pt.sha256")
            refused = _health_when(port, lambda h: h.get("last_reload") or h.get("reloads"))
            time.sleep(1.6)  # three polls and more than the settle time: no second attempt
            later = get(port, "/health")[1]
            count = len(answers)
            while len(answers) < count + 20:
                time.sleep(0.01)
            good = _negated(tmp_path / "c.pt")
            os.replace(tmp_path / "c.pt", served)
            os.replace(tmp_path / "c.pt.sha256", tmp_path / "model.pt.sha256")
            fixed = _health_when(port, lambda h: h["reloads"] == 1)
        lines = [json.loads(proc.stdout.readline()) for _ in range(2)]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
        proc.wait()
    reason = refused["last_reload"]["reason"]
    assert refused["last_reload"]["ok"] is False and refused["reloads"] == 0
    assert re.fullmatch(f"{re.escape(str(served))}: sha256 [0-9a-f]{{64}} differs from "
                        f"[0-9a-f]{{64}} \\({re.escape(str(served))}.sha256\\), so it was not "
                        "loaded .*", reason), reason  # the digest refused it, not the zip reader
    assert refused["sha256"] == old_digest == later["sha256"]
    assert later["last_reload"] == refused["last_reload"]  # not tried again
    assert "reload_failed" in lines[0] and lines[1]["on"] == "file changed", lines
    assert fixed["last_reload"]["ok"] is True and fixed["sha256"] != old_digest
    statuses = [status for _, status, _ in answers]
    assert statuses == [200] * len(answers)
    which = _which(answers, old, direct(good, rows))
    assert which[:count] == ["old"] * count


def test_a_half_published_pair_is_not_tried(artifact: Path, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """The new model renamed over the served path 0.3 s before its .sha256 (six polls see it
    beside the old digest): nothing is tried until both have been still for 1 s, then the pair
    is taken at the first attempt."""
    served = tmp_path / "model.pt"
    shutil.copy(artifact, served)
    write_digest(served)
    server = PredictionServer.from_file(served, ServeConfig(port=0))
    _negated(tmp_path / "b.pt")
    reloader = Reloader(server, served, interval_s=0.05)
    reloader.start()
    try:
        os.replace(tmp_path / "b.pt", served)
        time.sleep(0.3)
        os.replace(tmp_path / "b.pt.sha256", tmp_path / "model.pt.sha256")
        deadline = time.monotonic() + 20
        while server.last_reload is None and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        reloader.stop()
    assert server.last_reload is not None and server.last_reload["ok"] is True, \
        server.last_reload
    assert server.reloads == 1
    assert "reload_failed" not in capsys.readouterr().out


def test_watch_interval_zero_reloads_on_request_only(artifact: Path, tmp_path: Path) -> None:
    """``--watch-interval-s 0``: a model renamed over the served path is not taken by itself
    (no polling), only when a reload is requested (what SIGHUP does)."""
    served = tmp_path / "model.pt"
    shutil.copy(artifact, served)
    write_digest(served)
    server = PredictionServer.from_file(served, ServeConfig(port=0, watch_interval_s=0))
    _negated(tmp_path / "b.pt")
    reloader = Reloader(server, served, interval_s=0, settle_s=0.0)
    reloader.start()
    try:
        os.replace(tmp_path / "b.pt", served)
        os.replace(tmp_path / "b.pt.sha256", tmp_path / "model.pt.sha256")
        time.sleep(1.0)
        assert server.reloads == 0 and server.last_reload is None
        reloader.request()
        deadline = time.monotonic() + 20
        while server.last_reload is None and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        reloader.stop()
    assert server.reloads == 1 and server.last_reload["ok"] is True, server.last_reload


def test_a_file_replaced_while_it_loads_is_refused(artifact: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The digest check and the load each open the path: a model renamed over it between the
    two (here: right after the check) would be loaded unverified; the swap refuses it and
    the current model serves on."""
    served = tmp_path / "model.pt"
    shutil.copy(artifact, served)
    write_digest(served)
    server = PredictionServer.from_file(served, ServeConfig(port=0))
    first = server.model
    _negated(tmp_path / "b.pt")
    os.replace(tmp_path / "b.pt", served)
    os.replace(tmp_path / "b.pt.sha256", tmp_path / "model.pt.sha256")
    shutil.copy(artifact, tmp_path / "unverified.pt")  # any file but the one checked
    verify = artifact_module.verify_artifact

    def verify_then_replace(path: Path, expect_sha256: str | None = None
                            ) -> artifact_module.ArtifactCheck:
        check = verify(path, expect_sha256)
        os.replace(tmp_path / "unverified.pt", path)
        return check

    monkeypatch.setattr(artifact_module, "verify_artifact", verify_then_replace)
    with pytest.raises(ValueError, match="was replaced or rewritten while its digest was "
                                         "checked and it was loaded, so it was not taken"):
        server.swap(served)
    assert server.model is first and server.reloads == 0
    assert server.health()["last_reload"]["ok"] is False
