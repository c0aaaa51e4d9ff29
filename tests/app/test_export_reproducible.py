"""One checkpoint exported twice is the same bytes, so a pinned digest stays valid (issue 43,
item 7): whether inductor's cache was cold or warm, whatever ``--out`` is named, and whatever
torch's thread count when exporting. Before,
each export differed in the archive's folder (named after the file), the sources' compile
comments (one more per compile the cache had seen) and torch's random serialization id."""

from __future__ import annotations

import re
import zipfile
from pathlib import Path

import pytest
import torch

from dlrm_app.data.loader import ParquetLoader
from dlrm_app.data.synthetic import generate
from dlrm_app.model import ModelConfig
from dlrm_app.serving.artifact import load_artifact
from dlrm_app.serving.export import export_model
from dlrm_app.training.config import TrainConfig
from dlrm_app.training.evaluate import load_trained_model
from dlrm_app.training.trainer import train

TINY = ModelConfig(embedding_dim=4, dense_arch_layer_sizes=(8, 4), over_arch_layer_sizes=(8, 1))


@pytest.mark.slow
def test_one_checkpoint_exports_to_the_same_bytes_cold_or_warm_under_any_name(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a multi-hot feature: one program (no raw-row encoder) keeps the test to two compiles
    generate(tmp_path / "data", rows=1000, num_dense=2, cardinalities=[30, 20],
             pooling_factors=[1.0, 2.0], rows_per_shard=1000, row_group_size=256)
    run = tmp_path / "run"
    train(TrainConfig.from_flags(data=str(tmp_path / "data"), out=str(run), model=TINY,
                                 batch_size=64, max_steps=2), progress=False)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # empty: cold
    threads = torch.get_num_threads()
    try:
        # and whatever torch's thread count in the exporting process (train sets 1: the demo
        # exports right after it; a bare `dlrm-app export` runs with torch's default)
        torch.set_num_threads(1)
        first = export_model(run, tmp_path / "a" / "model.pt2", "fp32")
        torch.set_num_threads(3)
        second = export_model(run, tmp_path / "b" / "other.pt2", "fp32")  # the cache is warm
    finally:
        torch.set_num_threads(threads)
    assert first["sha256"] == second["sha256"]
    assert Path(first["path"]).read_bytes() == Path(second["path"]).read_bytes()

    artifact = Path(second["path"])
    with zipfile.ZipFile(artifact) as z:
        assert z.testzip() is None  # every record's CRC, the rewritten id's included
        assert {n.split("/", 1)[0] for n in z.namelist()} == {"archive"}
        assert re.fullmatch(rb"\d{40}", z.read("archive/.data/serialization_id"))
        sources = [n for n in z.namelist() if n.endswith(".cpp")]
        assert sources and not any(b"// Compile cmd" in z.read(n) for n in sources)
        assert any(n.endswith(".so") for n in z.namelist())

    # torch's own loader (AOTIModelPackageLoader) and ours load it and predict alike
    model, config, _, _ = load_trained_model(run)
    (batch,) = list(ParquetLoader(config.data, "test", batch_size=10**6, drop_last=False))
    with torch.no_grad():
        expected = torch.sigmoid(model(batch.dense, batch.sparse).squeeze(1))
    inputs = (batch.dense, batch.sparse.values(), batch.sparse.offsets().to(torch.int64))
    ours, _ = load_artifact(artifact)
    torchs = torch._inductor.aoti_load_package(str(artifact))
    torch.testing.assert_close(ours(*inputs), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torchs(*inputs), ours(*inputs), rtol=0, atol=0)
