"""The synthetic generator's files match its dataset.json and are deterministic."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dlrm_app.data import DatasetSpec, generate, verify
from dlrm_app.data.synthetic import GENERATION_CHUNK, binary_auc

CARDS = [50, 1000, 7, 100_000]
POOLING = [1.0, 3.0, 1.0, 5.0]


def _make(out: Path, seed: int = 1, rows: int = 30_000) -> DatasetSpec:
    return generate(out, rows=rows, num_dense=5, cardinalities=CARDS, pooling_factors=POOLING,
                    rows_per_shard=10_000, row_group_size=4096, seed=seed)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, DatasetSpec]:
    out = tmp_path_factory.mktemp("synth")
    return out, _make(out)


def test_files_match_dataset_json(dataset: tuple[Path, DatasetSpec]) -> None:
    out, spec = dataset
    assert DatasetSpec.load(out) == spec
    verify(out)
    assert [s.rows for s in spec.splits] == [24_000, 3_000, 3_000]
    assert [len(s.shards) for s in spec.splits] == [3, 1, 1]
    assert not list(out.glob(".*tmp"))
    for split in spec.splits:
        tables = []
        for shard in split.shards:
            f = pq.ParquetFile(out / shard.file)
            assert f.metadata.num_rows == shard.rows
            assert max(f.metadata.row_group(i).num_rows
                       for i in range(f.metadata.num_row_groups)) <= shard.row_group_size
            tables.append(f.read())
        table = pa.concat_tables(tables)
        assert table.schema.field("dense").type == pa.list_(pa.float32(), 5)
        labels = table.column("label").to_numpy()
        assert set(np.unique(labels)) <= {0.0, 1.0}
        assert split.label_rate == int(labels.sum()) / len(labels)
        for feature, pf in zip(spec.sparse_features, POOLING, strict=True):
            column = table.column(feature.name).combine_chunks()
            ids = column.flatten().to_numpy()
            lengths = column.value_lengths().to_numpy()
            assert ids.min() >= 0 and ids.max() < feature.num_embeddings
            if pf == 1.0:
                assert not feature.multi_hot and (lengths == 1).all()
            else:
                assert feature.multi_hot and lengths.min() >= 1
                assert abs(lengths.mean() - pf) < 0.1 * pf


def test_teacher_auc_is_recorded_and_high(dataset: tuple[Path, DatasetSpec]) -> None:
    _, spec = dataset
    auc = spec.parameters["teacher_auc"]
    assert set(auc) == {"train", "validation", "test"}
    assert all(0.7 < a < 1.0 for a in auc.values())


def test_same_seed_is_byte_identical_other_seed_differs(
    dataset: tuple[Path, DatasetSpec], tmp_path: Path
) -> None:
    out, spec = dataset
    again = _make(tmp_path / "again")
    assert again == spec
    assert (tmp_path / "again" / "dataset.json").read_bytes() == (out / "dataset.json").read_bytes()
    for split in spec.splits:
        for shard in split.shards:
            assert (tmp_path / "again" / shard.file).read_bytes() == (out / shard.file).read_bytes()
    other = _make(tmp_path / "other", seed=2)
    assert other.split("train").shards[0].sha256 != spec.split("train").shards[0].sha256


@pytest.mark.parametrize(("rows_per_shard", "row_group_size"), [(100_000, 70_000),
                                                                 (25_000, 777)])
def test_rows_do_not_depend_on_file_layout(tmp_path: Path, rows_per_shard: int,
                                           row_group_size: int) -> None:
    """Same seed, other row groups and shards: the same rows (and teacher AUC), only cut
    differently; the train split spans two generation chunks."""
    kw = dict(rows=90_000, num_dense=5, cardinalities=CARDS, pooling_factors=POOLING, seed=6)
    base = generate(tmp_path / "base", rows_per_shard=40_000, row_group_size=4096, **kw)
    other = generate(tmp_path / "other", rows_per_shard=rows_per_shard,
                     row_group_size=row_group_size, **kw)
    assert base.split("train").rows == 72_000 > GENERATION_CHUNK
    assert base.parameters["teacher_auc"] == other.parameters["teacher_auc"]
    for split in base.splits:
        assert other.split(split.name).label_rate == split.label_rate
        tables = []
        for out, spec in ((tmp_path / "base", base), (tmp_path / "other", other)):
            files = [pq.ParquetFile(out / s.file) for s in spec.split(split.name).shards]
            groups = {f.metadata.row_group(i).num_rows for f in files
                      for i in range(f.metadata.num_row_groups)}
            assert max(groups) == min(spec.parameters["row_group_size"], split.rows,
                                      spec.parameters["rows_per_shard"])
            tables.append(pa.concat_tables([f.read() for f in files]).combine_chunks())
        assert tables[0].equals(tables[1]), split.name


def test_binary_auc_matches_pairwise_definition() -> None:
    rng = np.random.default_rng(0)
    scores = rng.integers(0, 5, size=200).astype(float)  # many ties
    labels = rng.random(200) < 0.4
    pos, neg = scores[labels], scores[~labels]
    pairwise = ((pos[:, None] > neg[None, :]) + 0.5 * (pos[:, None] == neg[None, :])).mean()
    assert binary_auc(scores, labels) == pytest.approx(pairwise)
    assert binary_auc(scores, np.zeros(200, dtype=bool)) is None


def test_bad_arguments_raise() -> None:
    with pytest.raises(ValueError, match="pooling factor of feature cat_0"):
        generate("/nonexistent", rows=10, cardinalities=[5], pooling_factors=[0.5])
    with pytest.raises(ValueError, match="empty split"):
        generate("/nonexistent", rows=3, cardinalities=[5], pooling_factors=[1.0])


def test_cli_generate_prints_json_summary(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "dlrm_app", "generate", "--out", str(tmp_path), "--rows", "5000",
         "--num-sparse", "3", "--cardinalities", "10,20,30", "--pooling-factors", "1",
         "--rows-per-shard", "2000", "--row-group-size", "1000", "--seed", "4"],
        check=True, capture_output=True, text=True,
    )
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1
    summary = json.loads(lines[0])
    assert summary["rows"] == 5000 and summary["shards"] == 4  # 4000 train rows -> 2 shards
    assert summary["rows_per_s"] > 0 and summary["seconds"] > 0
    assert set(summary["teacher_auc"]) == {"train", "validation", "test"}
    spec = verify(tmp_path)
    assert [f.num_embeddings for f in spec.sparse_features] == [10, 20, 30]
