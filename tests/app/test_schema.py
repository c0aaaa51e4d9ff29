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


PARAMETERS = {
    "teacher_auc": {"train": 0.77, "validation": 0.76, "test": 0.75},
    "teacher": {"dim": 8, "temperature": 1.0},
    "tables": {"total_rows": 10, "tables": []},
    "skipped_rows": 2,
    "encoding": {"mode": "hash", "num_embeddings": [7, 3]},
    "id_map_sha256": "ab" * 32,
    "days": [{"index": 0, "name": "day_0", "rows": 10, "pieces": []}],
    "release": "ml-100k",
    "seed": 3,
}
"""One of each known key of ``parameters``, as the preprocessors and the generator write them."""


def test_known_parameters_are_typed_and_stay_where_dataset_json_keeps_them(
        tmp_path: Path) -> None:
    spec = dataclasses.replace(_spec(tmp_path), parameters=PARAMETERS)
    spec.save(tmp_path)
    on_disk = json.loads((tmp_path / "dataset.json").read_text())["parameters"]
    assert on_disk == PARAMETERS  # the file's format is unchanged: one plain mapping
    loaded = DatasetSpec.load(tmp_path)
    assert loaded.teacher_auc == {"train": 0.77, "validation": 0.76, "test": 0.75}
    assert loaded.teacher == {"dim": 8, "temperature": 1.0}
    assert loaded.tables == {"total_rows": 10, "tables": []}
    assert loaded.skipped_rows == 2
    assert loaded.encoding == {"mode": "hash", "num_embeddings": [7, 3]}
    assert loaded.id_map_sha256 == "ab" * 32
    assert loaded.day_records == ({"index": 0, "name": "day_0", "rows": 10, "pieces": []},)
    assert loaded.release == "ml-100k"
    # a dataset that records none of them (an older one, or another kind)
    bare = _spec(tmp_path)
    assert (bare.teacher_auc, bare.teacher, bare.tables, bare.encoding, bare.id_map_sha256,
            bare.release) == (None,) * 6
    assert bare.skipped_rows == 0 and bare.day_records == ()


@pytest.mark.parametrize("key, value", [("teacher_auc", 0.75), ("skipped_rows", "2"),
                                        ("skipped_rows", True), ("days", {"index": 0}),
                                        ("release", 100)])
def test_a_known_parameter_of_the_wrong_type_is_a_clear_error(
        tmp_path: Path, key: str, value: object) -> None:
    spec = dataclasses.replace(_spec(tmp_path), parameters={**PARAMETERS, key: value})
    attribute = {"days": "day_records"}.get(key, key)
    with pytest.raises(ValueError, match=rf"dataset 'tiny': key 'parameters\.{key}' must be "
                                         r".*; preprocess the dataset again"):
        getattr(spec, attribute)
