"""Export: the artifact loads in a process where recsys_core / dlrm_app cannot be imported and
predicts like the training model (fp32 to float tolerance, int8 within the AUC budget), and its
``encode`` reproduces the Criteo preprocessing on raw rows."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from app_setup import SMALL_MODEL, four_feature_data
from shared_data import CRITEO

from dlrm_app.data.criteo import preprocess_criteo
from dlrm_app.data.loader import ParquetLoader
from dlrm_app.data.synthetic import binary_auc
from dlrm_app.serving.artifact import load_artifact
from dlrm_app.serving.export import export_model
from dlrm_app.training.config import TrainConfig
from dlrm_app.training.evaluate import load_trained_model
from dlrm_app.training.trainer import train

# Run in a fresh interpreter in which the project's packages cannot be imported.
ISOLATE = """
import json, sys, zipfile
sys.modules["recsys_core"] = None
sys.modules["dlrm_app"] = None
try:
    import dlrm_app  # noqa: F401
    raise SystemExit("dlrm_app is importable: the test would prove nothing")
except ImportError:
    pass
"""
TORCHSCRIPT_LOADER = ISOLATE + """
import torch
import fbgemm_gpu  # noqa: F401  registers the quantized lookup op
extra = {"metadata.json": ""}
model = torch.jit.load(sys.argv[1], _extra_files=extra)
inputs = torch.load(sys.argv[2])
with torch.inference_mode():
    out = {"forward": model(inputs["dense"], inputs["values"], inputs["offsets"])}
    if "dense_raw" in inputs:
        out["raw"] = model.predict_raw(inputs["dense_raw"], inputs["cat_raw"])
out["meta"] = json.loads(extra["metadata.json"])
torch.save(out, sys.argv[3])
"""

def documented_loader() -> str:
    """The documented .pt2 loader (docs/serving.md), verbatim: the python block after its
    ``pt2-loader`` mark."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "serving.md").read_text()
    block = text.split("<!-- pt2-loader", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    assert 'path = "model.pt2"' in block
    return block


# The documented loader run where the project cannot be imported, fbgemm_gpu blocked unless the
# manifest needs it (to prove a torch-lookup program does not), on the inputs of the test.
PT2_LOADER = ISOLATE + """
manifest = json.loads(next(zipfile.ZipFile(sys.argv[1]).read(name) for name in
                           zipfile.ZipFile(sys.argv[1]).namelist()
                           if name.endswith("extra/manifest.json")))
if not manifest["needs_fbgemm"]:
    sys.modules["fbgemm_gpu"] = None
import torch
inputs = torch.load(sys.argv[2])
dense, values, offsets = inputs["dense"], inputs["values"], inputs["offsets"]
dense_raw, cat_raw = inputs.get("dense_raw"), inputs.get("cat_raw")
if dense_raw is not None:
    dense_raw = dense_raw.float()
""" + documented_loader().replace('path = "model.pt2"', "path = sys.argv[1]") + """
out = {"forward": probabilities, "meta": manifest}
if encode is not None and dense_raw is not None:
    out["raw"] = raw_probabilities
assert sys.modules.get("fbgemm_gpu") is None or manifest["needs_fbgemm"]
torch.save(out, sys.argv[3])
"""


def _predict_isolated(artifact: Path, inputs: dict, tmp: Path) -> dict:
    torch.save(inputs, tmp / "inputs.pt")
    loader = PT2_LOADER if artifact.suffix == ".pt2" else TORCHSCRIPT_LOADER
    done = subprocess.run([sys.executable, "-c", loader, str(artifact), str(tmp / "inputs.pt"),
                           str(tmp / "out.pt")], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(tmp / "out.pt")


def _reference(run: Path, split: str) -> tuple[dict, np.ndarray, np.ndarray]:
    """The training model's probabilities on a split (loader order) and the batch tensors."""
    model, config, _, _ = load_trained_model(run)
    loader = ParquetLoader(config.data, split, batch_size=10**6, drop_last=False)
    (batch,) = list(loader)
    with torch.no_grad():
        probs = torch.sigmoid(model(batch.dense, batch.sparse).squeeze(1))
    inputs = {"dense": batch.dense, "values": batch.sparse.values(),
              "offsets": batch.sparse.offsets().to(torch.int64)}
    return inputs, probs.numpy(), batch.labels.numpy()


@pytest.fixture(scope="module")
def synthetic_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("export")
    four_feature_data(root / "data", rows=20_000, rows_per_shard=10_000, row_group_size=512)
    train(TrainConfig.from_flags(data=str(root / "data"), out=str(root / "run"), model=SMALL_MODEL,
                                 batch_size=256, embedding_learning_rate=0.1, learning_rate=0.05),
          progress=False)
    return root / "run"


@pytest.fixture(scope="module")
def export_stages() -> dict[tuple[str, str], list[str]]:
    """The stages each ``exported`` .pt2 reported to its ``progress``, by (dtype, lookup)."""
    return {}


@pytest.fixture(scope="module")
def exported(synthetic_run: Path, tmp_path_factory: pytest.TempPathFactory,
             export_stages: dict[tuple[str, str], list[str]]) -> Callable[[str, str], Path]:
    """``exported(dtype, lookup)``: the run's .pt2, compiled once per module."""
    root = tmp_path_factory.mktemp("pt2")
    cache: dict[tuple[str, str], Path] = {}

    def get(dtype: str, lookup: str) -> Path:
        if (dtype, lookup) not in cache:
            path = root / f"{dtype}_{lookup}.pt2"
            export_model(synthetic_run, path, dtype, lookup=lookup,
                         progress=export_stages.setdefault((dtype, lookup), []).append)
            cache[dtype, lookup] = path
        return cache[dtype, lookup]

    return get


@pytest.mark.slow
def test_pt2_export_reports_each_stage_as_it_starts(
        synthetic_run: Path, exported: Callable[[str, str], Path],
        export_stages: dict[tuple[str, str], list[str]]) -> None:
    path = exported("int8", "torch")
    stages = export_stages["int8", "torch"]
    assert stages[0] == f"loading the best checkpoint of {synthetic_run} (unsharded, CPU)"
    assert re.fullmatch(r"quantizing the tables of step_\d+ to int8", stages[1]), stages
    programs = ["model", "encode"][:len(stages[2:-2]) // 2]  # encode: one-hot data only
    # every program exported (their fingerprint decides whether to compile), then compiled
    assert programs and stages[2:-2] == [f"torch.export: program {name!r}" for name in programs
                                         ] + [f"AOTInductor: compiling {name!r} for CPU"
                                              for name in programs]
    digest = (path.parent / f"{path.name}.sha256").read_text().split()[0]
    assert stages[-2:] == ["packaging the programs and the manifest",
                           f"wrote {path} (sha256 {digest}, also in {path.name}.sha256)"]


def _assert_matches(got: np.ndarray, expected: np.ndarray, labels: np.ndarray,
                    dtype: str) -> None:
    error = np.abs(got - expected).max()
    auc_gap = abs(binary_auc(got, labels) - binary_auc(expected, labels))
    if dtype == "fp32":
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    elif dtype == "fp16":
        assert error < 1e-3 and auc_gap < 1e-4, (error, auc_gap)
    elif dtype == "int8":
        assert error < 1e-2 and auc_gap < 1e-3, (error, auc_gap)  # the AUC budget
    else:  # int4: 15 levels per row; documented as a size/accuracy trade
        assert error < 0.1 and auc_gap < 1e-2, (error, auc_gap)


@pytest.mark.parametrize(("dtype", "lookup"), [("fp32", "fbgemm"), ("int8", "fbgemm"),
                                               ("int8", "torch")])
@pytest.mark.slow
def test_isolated_pt2_matches_training_model(synthetic_run: Path, exported: Callable,
                                             tmp_path: Path, dtype: str, lookup: str) -> None:
    artifact = exported(dtype, lookup)
    inputs, expected, labels = _reference(synthetic_run, "test")
    out = _predict_isolated(artifact, inputs, tmp_path)
    meta = out["meta"]
    assert meta["format"] == "pt2" and meta["format_version"] == 1
    assert meta["embedding_dtype"] == dtype and meta["lookup"] == lookup
    assert meta["needs_fbgemm"] == (lookup == "fbgemm")
    assert not meta["raw_input"] and list(meta["programs"]) == ["model"]  # multi-hot data
    assert [f["name"] for f in meta["sparse_features"]] == ["cat_0", "cat_1", "cat_2", "cat_3"]
    # the checkpoint it came from, and that checkpoint's validation metrics from the run's log
    events = [json.loads(line) for line in (synthetic_run / "metrics.jsonl").open()]
    best = [e for e in events if e["event"] == "best"][-1]
    assert meta["training"]["step"] == best["step"]
    assert meta["training"]["validation"]["auc"] == pytest.approx(best["auc"])
    _assert_matches(out["forward"].numpy(), expected, labels, dtype)


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "int8", "int4"])
@pytest.mark.slow
def test_isolated_torchscript_matches_training_model(synthetic_run: Path, tmp_path: Path,
                                                     dtype: str) -> None:
    artifact = tmp_path / "model.pt"
    meta = export_model(synthetic_run, artifact, dtype, fmt="torchscript")
    inputs, expected, labels = _reference(synthetic_run, "test")
    out = _predict_isolated(artifact, inputs, tmp_path)
    assert out["meta"]["embedding_dtype"] == dtype and out["meta"]["format_version"] == 1
    assert out["meta"]["format"] == "torchscript"
    assert [f["name"] for f in out["meta"]["sparse_features"]] == [
        f["name"] for f in meta["sparse_features"]]
    _assert_matches(out["forward"].numpy(), expected, labels, dtype)


@pytest.mark.slow
def test_sizes_shrink_with_dtype(synthetic_run: Path, exported: Callable,
                                 tmp_path: Path) -> None:
    tables = {d: export_model(synthetic_run, tmp_path / f"{d}.pt", d, fmt="torchscript")
              for d in ("fp32", "int8", "int4")}
    sizes = {d: meta["bytes"] for d, meta in tables.items()}
    assert sizes["fp32"] > sizes["int8"] > sizes["int4"], sizes
    # rows of dim 8: 32 bytes (fp32), 4 + 8 (int8: scale, bias, codes), 4 + 4 (int4); each
    # table starts on a 128-byte line
    table_rows = [500, 2000, 50, 1000]
    for dtype, row_bytes in (("fp32", 32), ("int8", 12), ("int4", 8)):
        assert list(tables[dtype]["table_bytes"].values()) == [
            -(-n * row_bytes // 128) * 128 for n in table_rows]
    # a .pt2 holds its tables as they are beside ~1.7 MB of compiled code, whose size varies
    # by tens of KB between compiles (bench/serve.py measures sizes at a realistic scale)
    pt2 = {d: exported(d, "fbgemm").stat().st_size for d in ("fp32", "int8")}
    assert pt2["fp32"] > pt2["int8"] > sum(tables["int8"]["table_bytes"].values()) + 2**20, pt2


def _random_bags(batch: int, rng: np.random.Generator) -> tuple[torch.Tensor, ...]:
    """Encoded inputs for the synthetic run's 4 features, cat_2 multi-hot (0-4 ids a bag)."""
    rows = [500, 2000, 50, 1000]
    lengths = np.ones((4, batch), np.int64)
    lengths[2] = rng.integers(0, 5, batch)
    values = np.concatenate([rng.integers(0, rows[f], lengths[f].sum()) for f in range(4)])
    offsets = np.concatenate([[0], np.cumsum(lengths.reshape(-1))])
    return (torch.from_numpy(rng.standard_normal((batch, 4)).astype(np.float32)),
            torch.from_numpy(values), torch.from_numpy(offsets))


@pytest.mark.slow
def test_pt2_batch_is_dynamic_and_bad_inputs_fail(synthetic_run: Path, exported: Callable,
                                                  tmp_path: Path) -> None:
    model, meta = load_artifact(exported("int8", "torch"))
    export_model(synthetic_run, tmp_path / "m.pt", "int8", fmt="torchscript")
    scripted, _ = load_artifact(tmp_path / "m.pt")
    rng = np.random.default_rng(0)
    with torch.inference_mode():
        for batch in (1, 2, 7, 600):  # traced at 3 rows; one program for every batch size
            inputs = _random_bags(batch, rng)
            got, want = model(*inputs), scripted(*inputs)
            assert got.shape == (batch,)
            np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-6)
        dense, values, offsets = _random_bags(5, rng)
        for bad_values, bad_offsets in [
            (values.clone().index_fill_(0, torch.tensor([3]), 500), offsets),  # cat_0 has 500
            (values.clone().index_fill_(0, torch.tensor([6]), 2000), offsets),
            (values.clone().index_fill_(0, torch.tensor([0]), -1), offsets),
        ]:
            with pytest.raises(RuntimeError, match="outside \\[0, num_embeddings\\)"):
                model(dense, bad_values, bad_offsets)
        for bad_offsets in (offsets + 1, offsets.flip(0), torch.cat([offsets[:-1],
                                                                     offsets[-1:] + 5])):
            with pytest.raises(RuntimeError, match="offsets must start at 0, not decrease"):
                model(dense, values, bad_offsets)
        with pytest.raises(ValueError, match="offsets must have num_sparse \\* B \\+ 1 = 21"):
            model(dense, values, offsets[:-1])
        with pytest.raises(ValueError, match="dense must be \\[B, 4\\], got \\[5, 3\\]"):
            model(dense[:, :3], values, offsets)
        with pytest.raises(ValueError, match="no raw-row encoder"):
            model.predict_raw(dense, torch.zeros(5, 4, dtype=torch.int64))
        # still serving after refusing
        np.testing.assert_allclose(model(dense, values, offsets).numpy(),
                                   scripted(dense, values, offsets).numpy(), rtol=1e-5, atol=1e-6)


def _parse_raw(lines: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-Python parse of Criteo rows (label first): dense NaN if missing, hex -> int."""
    dense, cats = [], []
    for line in lines:
        fields = line.rstrip("\n").split("\t")[1:]
        fields += [""] * (39 - len(fields))
        dense.append([float(v) if v else math.nan for v in fields[:13]])
        cats.append([int(v, 16) if v else 0 for v in fields[13:]])
    return torch.tensor(dense, dtype=torch.float64), torch.tensor(cats, dtype=torch.int64)


@pytest.mark.shared_data(CRITEO)
@pytest.mark.parametrize(("encoding", "fmt"), [("hash", "pt2"), ("vocabulary", "pt2"),
                                               ("vocabulary", "torchscript")])
@pytest.mark.slow
def test_raw_rows_encode_like_the_preprocessor(tmp_path: Path, encoding: str, fmt: str) -> None:
    source = CRITEO / "kaggle_head_10k.tsv"
    kwargs = ({"num_embeddings_per_feature": [1000] * 26} if encoding == "hash"
              else {"frequency_threshold": 3})
    preprocess_criteo([source], tmp_path / "data", fmt="kaggle", row_group_size=512, **kwargs)
    train(TrainConfig.from_flags(data=str(tmp_path / "data"), out=str(tmp_path / "run"), model=SMALL_MODEL,
                                 batch_size=256, max_steps=10), progress=False)
    artifact = tmp_path / ("model.pt2" if fmt == "pt2" else "model.pt")
    export_model(tmp_path / "run", artifact, "fp32", fmt=fmt)
    inputs, expected, _ = _reference(tmp_path / "run", "test")
    lines = source.read_text().splitlines()
    n = len(lines)
    first_test = n * 6 // 7 + (n - n * 6 // 7) // 2  # kaggle split: train, half val, rest test
    dense_raw, cat_raw = _parse_raw(lines[first_test:])
    assert len(dense_raw) == len(expected)
    out = _predict_isolated(artifact, {**inputs, "dense_raw": dense_raw, "cat_raw": cat_raw},
                            tmp_path)
    meta = out["meta"]
    assert meta["raw_input"] and meta["raw_format"] == "criteo_tsv" and meta["format"] == fmt
    assert meta["preprocessing"]["encoding"]["mode"] == encoding
    # raw rows through the artifact's encode == the preprocessed shards through forward
    np.testing.assert_allclose(out["raw"].numpy(), out["forward"].numpy(), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(out["raw"].numpy(), expected, rtol=1e-5, atol=1e-6)


def test_export_errors(tmp_path: Path, synthetic_run: Path) -> None:
    with pytest.raises(ValueError, match="not a run directory"):
        export_model(tmp_path, tmp_path / "m.pt2")
    with pytest.raises(ValueError, match="--dtype must be one of"):
        export_model(synthetic_run, tmp_path / "m.pt2", "int3")
    with pytest.raises(ValueError, match="--format must be one of"):
        export_model(synthetic_run, tmp_path / "m.pt2", fmt="onnx")
    with pytest.raises(ValueError, match="--lookup must be one of"):
        export_model(synthetic_run, tmp_path / "m.pt2", lookup="fast")
    with pytest.raises(ValueError, match="must end in .pt2 \\(for a TorchScript file add "
                                         "--format torchscript\\)"):
        export_model(synthetic_run, tmp_path / "m.pt")
    with pytest.raises(ValueError, match="--quantize-dense .* --format torchscript only"):
        export_model(synthetic_run, tmp_path / "m.pt2", quantize_dense=True)
    with pytest.raises(ValueError, match="no complete checkpoint"):
        (tmp_path / "empty").mkdir()
        (tmp_path / "empty" / "config.json").write_text((synthetic_run / "config.json").read_text())
        export_model(tmp_path / "empty", tmp_path / "m.pt2")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]  # nothing half-written
