"""The serving benchmark runs end to end and reports well-formed, consistent lines.

No timing thresholds: only structure, positive times, and counts and ratios that must hold by
construction (every request answered, the HTTP answers equal to in-process calls).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import serve as bench  # noqa: E402  (bench/ is a folder of scripts, not a package)

from dlrm_app.serving.server import RequestParser  # noqa: E402

MODELS = ["standin", "dlrm"]
BATCHES = (1, 64, 512)
CONCURRENCY = (1, 16)


def run_bench(model: str) -> list[dict]:
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "serve.py"), "--quick",
                           "--model", model], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module", params=MODELS)
def lines(request: pytest.FixtureRequest) -> tuple[str, list[dict]]:
    return request.param, run_bench(request.param)


@pytest.mark.slow
def test_sizes(lines: tuple[str, list[dict]]) -> None:
    model, parsed = lines
    sizes = {(line["format"], line["embedding_dtype"]): line for line in parsed
             if line["bench"] == "serve_size"}
    if model == "standin":
        assert not sizes  # sizes need the exporter
        return
    assert set(sizes) == {("pt2", "int8"), ("torchscript", "int8")}  # --quick: int8 only
    for line in sizes.values():
        assert line["ratio_to_fp32"] is None  # no fp32 file to compare with
        # 26 tables of 1000 int8 rows of dim 8 (4 + 8 bytes each), and the code
        assert line["bytes"] > 26_000 * 12 and line["mb"] == round(line["bytes"] / 2**20, 2)


@pytest.mark.slow
def test_latency(lines: tuple[str, list[dict]]) -> None:
    model, parsed = lines
    latency = [line for line in parsed if line["bench"] == "serve_latency"]
    if model == "standin":
        expected = [("torchscript", "fp32", b) for b in BATCHES]
    else:  # per dtype: TorchScript first (the reference), then the others
        expected = [(f, "int8", b) for f in ("torchscript", "pt2", "eager") for b in BATCHES]
    assert [(x["format"], x["embedding_dtype"], x["batch"]) for x in latency] == expected
    for line in latency:
        assert line["model"] == model and line["iters"] == bench.QUICK["iters"]
        assert 0 < line["p50_ms"] <= line["p99_ms"] and line["rows_per_s"] > 0
        assert line["parse_p50_ms"] > 0 and line["tables"] == 26
        assert line["rows_per_table"] == bench.QUICK["rows_per_table"]
        if line["format"] != "torchscript":  # the same computation, compiled or eager
            assert line["max_abs_diff_vs_torchscript"] < 1e-6


@pytest.mark.slow
def test_http(lines: tuple[str, list[dict]]) -> None:
    model, parsed = lines
    http = [line for line in parsed if line["bench"] == "serve_http"]
    assert [line["concurrency"] for line in http] == list(CONCURRENCY)
    for line in http:
        requests = bench.QUICK["requests"]
        assert line["embedding_dtype"] == ("fp32" if model == "standin" else "int8")
        assert line["format"] == ("torchscript" if model == "standin" else "pt2")
        assert line["requests"] == requests and line["errors"] == 0
        assert line["server_rows"] == requests * line["rows_per_request"]
        assert 1 <= line["server_batches"] <= requests
        assert line["server_mean_batch_rows"] == pytest.approx(
            line["server_rows"] / line["server_batches"], abs=0.01)
        assert line["requests_per_s"] == pytest.approx(requests / line["seconds"], rel=0.01)
        assert 0 < line["p50_ms"] <= line["p99_ms"]
        assert line["max_abs_diff_vs_in_process"] == 0.0


def test_random_rows_are_valid_criteo_rows() -> None:
    meta = {"dense_features": [f"int_{i}" for i in range(13)],
            "sparse_features": [{"name": f"cat_{i}", "num_embeddings": 10} for i in range(26)],
            "raw_input": True, "raw_format": "criteo_tsv"}
    rows = bench.random_rows(np.random.default_rng(0), 50)
    parsed = RequestParser(meta, max_rows=50).parse_rows(rows)
    assert parsed.dense_raw.shape == (50, 13) and parsed.cat_raw.shape == (50, 26)
    assert np.isnan(parsed.dense_raw).any() and (parsed.cat_raw >= 0).all()
    assert parsed.cat_raw.tolist() == [[int(f, 16) for f in r.split("\t")[13:]] for r in rows]
