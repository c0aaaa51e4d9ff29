"""dataset.json round-trips exactly, loads strictly, and verify() catches modified shards."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from dlrm_app.data import (
    DatasetKind,
    DatasetSpec,
    ShardFile,
    SparseFeature,
    SplitSpec,
    verify,
)
from dlrm_app.data.schema import sha256_file


def _spec(tmp_path: Path) -> DatasetSpec:
    splits = []
    for name in ("train", "validation", "test"):
        file = f"{name}-00000.parquet"
        (tmp_path / file).write_bytes(name.encode() * 10)
        shard = ShardFile(file=file, rows=10, sha256=sha256_file(tmp_path / file),
                          row_group_size=4)
        splits.append(SplitSpec(name=name, label_rate=0.25, shards=(shard,)))
    return DatasetSpec(
        name="tiny", kind=DatasetKind.SYNTHETIC, dense_features=("int_0", "int_1"),
        sparse_features=(SparseFeature(name="cat_0", num_embeddings=7, multi_hot=False),
                         SparseFeature(name="cat_1", num_embeddings=3, multi_hot=True)),
        label="label", label_dtype="float32", splits=tuple(splits),
        parameters={"seed": 3, "nested": {"a": [1, 2.5]}}, created_by="dlrm_app test",
    )


def _edit(tmp_path: Path, change) -> None:
    path = tmp_path / "dataset.json"
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def test_round_trip_is_equal(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    spec.save(tmp_path)
    loaded = DatasetSpec.load(tmp_path)
    assert loaded == spec
    assert loaded.split("train").rows == 10
    assert json.loads((tmp_path / "dataset.json").read_text())["format_version"] == 1


@pytest.mark.parametrize(
    ("change", "key"),
    [
        (lambda d: d.update(extra=1), "$.extra"),
        (lambda d: d["splits"]["train"]["shards"][0].update(bogus=True),
         "$.splits.train.shards[0].bogus"),
        (lambda d: d.pop("label"), "$.label"),
        (lambda d: d["sparse_features"][1].pop("num_embeddings"),
         "$.sparse_features[1].num_embeddings"),
        (lambda d: d["splits"]["test"]["shards"][0].update(rows="10"), "rows"),
        (lambda d: d["sparse_features"][0].update(num_embeddings=True), "num_embeddings"),
        (lambda d: d.update(format_version=2), "format_version"),
        (lambda d: d.update(kind="imagenet"), "$.kind"),
    ],
    ids=["unknown-top", "unknown-nested", "missing-top", "missing-nested", "wrong-type-rows",
         "bool-as-int", "future-version", "bad-kind"],
)
def test_strict_load_names_key_and_file(tmp_path: Path, change, key: str) -> None:
    _spec(tmp_path).save(tmp_path)
    _edit(tmp_path, change)
    with pytest.raises(ValueError) as info:
        DatasetSpec.load(tmp_path)
    message = str(info.value)
    assert str(tmp_path / "dataset.json") in message
    assert key in message


def test_missing_file_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="dlrm-app generate"):
        DatasetSpec.load(tmp_path)


def test_verify_detects_modified_and_missing_shard(tmp_path: Path) -> None:
    _spec(tmp_path).save(tmp_path)
    assert verify(tmp_path).name == "tiny"
    (tmp_path / "validation-00000.parquet").write_bytes(b"tampered")
    with pytest.raises(ValueError, match="validation-00000.parquet: checksum mismatch"):
        verify(tmp_path)
    (tmp_path / "validation-00000.parquet").unlink()
    with pytest.raises(ValueError, match="validation-00000.parquet: shard .* missing"):
        verify(tmp_path)


def test_post_init_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="num_embeddings"):
        SparseFeature(name="c", num_embeddings=0, multi_hot=False)
    with pytest.raises(ValueError, match="label_rate"):
        SplitSpec(name="train", label_rate=1.5, shards=())
    with pytest.raises(ValueError, match="sha256"):
        ShardFile(file="a.parquet", rows=1, sha256="xyz", row_group_size=1)


def test_empty_splits_round_trip(tmp_path: Path) -> None:
    """A held-out file encoded as one split: the other splits have no shards."""
    spec = _spec(tmp_path)
    train, validation, test = spec.splits
    empty = dataclasses.replace(
        spec, splits=(SplitSpec(name="train", label_rate=0.0, shards=()),
                      SplitSpec(name="validation", label_rate=0.0, shards=()), test))
    empty.save(tmp_path)
    loaded = verify(tmp_path)
    assert loaded == empty
    assert [s.rows for s in loaded.splits] == [0, 0, 10]
    assert json.loads((tmp_path / "dataset.json").read_text())["splits"]["train"] == {
        "label_rate": 0.0, "shards": []}
