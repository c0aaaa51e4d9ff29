"""Criteo datasets that know their days: the days record, adding a day without rewriting the
others (vocabulary growth by hand, atomic on errors, schema refused), reading days."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from shared_data import CRITEO

from dlrm_app.data import verify
from dlrm_app.data.criteo import add_day, preprocess_criteo, shard_tasks
from dlrm_app.data.days import day_table, read_days
from dlrm_app.data.loader import ParquetLoader
from dlrm_app.data.schema import DatasetSpec
from dlrm_app.data.synthetic import generate

TERABYTE = CRITEO / "terabyte_day_sample_1k.tsv"
KAGGLE = CRITEO / "kaggle_1k_trailing_fields_stripped.tsv"
needs_data = pytest.mark.shared_data(TERABYTE, KAGGLE)
SMALL = {"rows_per_shard": 150, "row_group_size": 64}


def cut_days(src: Path, tmp: Path, edges: list[int]) -> list[Path]:
    """The sample's lines cut into day files ``day_0`` ... at line ``edges``."""
    lines = src.read_text().splitlines(keepends=True)
    days = []
    for d, (a, b) in enumerate(zip(edges[:-1], edges[1:], strict=True)):
        days.append(tmp / f"day_{d}")
        days[-1].write_text("".join(lines[a:b]))
    return days


def file_hashes(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.iterdir()) if p.is_file()}


def same_rows(a: pa.Table, b: pa.Table) -> None:
    assert a.num_rows == b.num_rows
    assert a.equals(b)


@needs_data
@pytest.mark.parametrize("mapping", ["hash", "zch"])
def test_added_day_gives_the_rows_of_preprocessing_together(tmp_path: Path,
                                                            mapping: str) -> None:
    days = cut_days(TERABYTE, tmp_path, [0, 400, 700, 1000])
    enc = {"num_embeddings_per_feature": 1000} if mapping == "hash" else {"id_mapping": "zch"}
    together = preprocess_criteo(days, tmp_path / "together", fmt="terabyte", **enc, **SMALL)
    assert [d["rows"] for d in together.parameters["days"]] == [400, 300, 300]
    appended = tmp_path / "appended"
    preprocess_criteo(days[:2], appended, fmt="terabyte", **enc, **SMALL)
    before = file_hashes(appended)
    spec = preprocess_criteo(days[2:], appended, add_day=True)
    after = file_hashes(appended)
    # every file of days 0 and 1 is byte-identical; only dataset.json changed, files were added
    assert {f: h for f, h in after.items() if f in before and f != "dataset.json"} == \
        {f: h for f, h in before.items() if f != "dataset.json"}
    assert sorted(set(after) - set(before)) == ["day-00002-00000.parquet",
                                                "day-00002-00001.parquet"]
    assert [d.name for d in read_days(appended)] == ["day_0", "day_1", "day_2"]
    for d in range(3):
        same_rows(day_table(appended, d), day_table(tmp_path / "together", d))
    # the splits are those of the first preprocessing; the new day is in none of them
    first = DatasetSpec.load(tmp_path / "together")
    assert spec.splits != first.splits
    assert [s.rows for s in spec.splits] == [400, 150, 150]
    verify(appended)


def row(label: int, cats: dict[int, str]) -> str:
    """A labeled Criteo line: dense fields empty, categorical ``k`` = ``cats[k]`` (hex)."""
    return "\t".join([str(label)] + [""] * 13 + [cats.get(k, "") for k in range(26)]) + "\n"


def write(path: Path, rows: list[dict[int, str]]) -> Path:
    path.write_text("".join(row(i % 2, r) for i, r in enumerate(rows)))
    return path


def test_vocabulary_grows_within_budget_by_hand(tmp_path: Path) -> None:
    # day 0 (train): cat_0 has 10 twice and 20 once -> rows 1, 2 (raw-id order); cat_1: 1
    # (row 1); cat_2..25 are empty, id 0 (row 1). Budget: 4 rows per table, row 0 included.
    d0 = write(tmp_path / "day_0", [{0: "10", 1: "1"}, {0: "10", 1: "1"}, {0: "20", 1: "1"}])
    d1 = write(tmp_path / "day_1", [{0: "10", 1: "1"}, {0: "20", 1: "1"}])
    out = tmp_path / "out"
    spec = preprocess_criteo([d0, d1], out, fmt="terabyte", max_embeddings_per_feature=4)
    assert spec.parameters["encoding"]["num_embeddings"][:3] == [3, 2, 2]
    # day 2: cat_0 new ids 5 (twice), 30, 40: one row of room -> 5 (most frequent) gets row 3,
    # 30 and 40 the out-of-vocabulary row 0; cat_1 new ids 9 and 3 (once each), two rows of
    # room -> both, in raw-id order: 3 -> row 2, 9 -> row 3
    d2 = write(tmp_path / "day_2", [{0: "10", 1: "9"}, {0: "5", 1: "3"}, {0: "5", 1: "1"},
                                    {0: "30", 1: "9"}, {0: "40", 1: "1"}])
    old_files = file_hashes(out)
    spec = preprocess_criteo([d2], out, add_day=True)
    day = spec.parameters["days"][2]
    assert day["num_embeddings"][:3] == [4, 4, 2]
    assert [f.num_embeddings for f in spec.sparse_features][:3] == [4, 4, 2]
    assert day["new_ids_with_rows"][:3] == [1, 2, 0]
    assert day["new_ids_out_of_budget"][:3] == [2, 0, 0]
    table = day_table(out, 2)
    assert table["cat_0"].to_pylist() == [[1], [3], [3], [0], [0]]
    assert table["cat_1"].to_pylist() == [[3], [2], [1], [3], [1]]
    assert table["cat_2"].to_pylist() == [[1]] * 5
    # days 0 and 1 keep their files and their rows
    assert {f: h for f, h in file_hashes(out).items() if f in old_files} == \
        {**old_files, "dataset.json": file_hashes(out)["dataset.json"]}
    assert day_table(out, 0)["cat_0"].to_pylist() == [[1], [1], [2]]
    # day 3: cat_1 is full (4 rows): its new id 7 reads row 0; 9 keeps row 3
    d3 = write(tmp_path / "day_3", [{0: "5", 1: "7"}, {0: "30", 1: "9"}])
    spec = preprocess_criteo([d3], out, add_day=True)
    table = day_table(out, 3)
    assert table["cat_0"].to_pylist() == [[3], [0]]
    assert table["cat_1"].to_pylist() == [[0], [3]]
    assert spec.parameters["days"][3]["new_ids_out_of_budget"][:2] == [1, 1]
    # one grown vocabulary at a time; the first preprocessing's stays as it was
    assert sorted(p.name for p in out.glob("vocabulary*")) == [
        "vocabulary-day-00003.parquet", "vocabulary.parquet"]
    assert file_hashes(out)["vocabulary.parquet"] == old_files["vocabulary.parquet"]
    verify(out)
    # the sorted-rows reader refuses the grown vocabulary (a reader of it would map wrongly)
    from dlrm_app.data.criteo import load_vocabulary
    with pytest.raises(ValueError, match="grew when days were added"):
        load_vocabulary(out)


@pytest.mark.parametrize("where", ["encoding", "vocabulary", "dataset.json"])
def test_error_mid_append_leaves_the_dataset_as_it_was(tmp_path: Path, monkeypatch,
                                                       where: str) -> None:
    d0 = write(tmp_path / "day_0", [{0: "10"}, {0: "20"}, {0: "10"}])
    d1 = write(tmp_path / "day_1", [{0: "10"}, {0: "20"}])
    d2 = write(tmp_path / "day_2", [{0: "30"}, {0: "10"}, {0: "40"}])
    out = tmp_path / "out"
    preprocess_criteo([d0, d1], out, fmt="terabyte")
    before = file_hashes(out)
    rows_before = [day_table(out, d) for d in range(2)]

    def boom(*args, **kwargs):
        raise RuntimeError("simulated crash")

    if where == "encoding":  # a shard of the day written, then the run fails
        real_shard = shard_tasks.write_stage_shard

        def shard_then_fail(*args, **kwargs):
            real_shard(*args, **kwargs)
            boom()
        monkeypatch.setattr(shard_tasks, "write_stage_shard", shard_then_fail)
    elif where == "vocabulary":  # after the day's shards were moved into the dataset
        real = add_day.save_grown_vocabulary

        def write_then_fail(*args, **kwargs):
            real(*args, **kwargs)
            boom()
        monkeypatch.setattr(add_day, "save_grown_vocabulary", write_then_fail)
    else:  # every file written, the commit fails
        monkeypatch.setattr(DatasetSpec, "save", boom)
    with pytest.raises(RuntimeError, match="simulated crash"):
        preprocess_criteo([d2], out, add_day=True)
    monkeypatch.undo()
    assert file_hashes(out) == before
    assert sorted(p.name for p in out.iterdir()) == sorted(before)  # no hidden leftovers
    assert [d.name for d in read_days(out)] == ["day_0", "day_1"]
    for d in range(2):
        same_rows(day_table(out, d), rows_before[d])
    # and the append works afterwards
    preprocess_criteo([d2], out, add_day=True)
    assert day_table(out, 2)["cat_0"].to_pylist() == [[3], [1], [4]]


def test_leftovers_of_a_killed_append_are_replaced(tmp_path: Path) -> None:
    d0 = write(tmp_path / "day_0", [{0: "10"}, {0: "20"}])
    d1 = write(tmp_path / "day_1", [{0: "10"}, {0: "20"}])
    out = tmp_path / "out"
    preprocess_criteo([d0, d1], out, fmt="terabyte", num_embeddings_per_feature=100)
    (out / "day-00002-00000.parquet").write_bytes(b"half a shard")
    (out / ".add-day-00002").mkdir()
    spec = preprocess_criteo([write(tmp_path / "day_2", [{0: "30"}])], out, add_day=True)
    assert not (out / ".add-day-00002").exists()
    assert spec.parameters["days"][2]["shards"][0]["file"] == "day-00002-00000.parquet"
    verify(out)


@pytest.mark.parametrize("case", ["unlabeled", "extra field", "not criteo"])
def test_schema_mismatch_is_refused_with_the_fix(tmp_path: Path, case: str) -> None:
    d0 = write(tmp_path / "day_0", [{0: "10"}, {0: "20"}])
    out = tmp_path / "out"
    preprocess_criteo([d0, d0], out, fmt="terabyte", num_embeddings_per_feature=100)
    lines = d0.read_text().splitlines()
    bad = tmp_path / "day_x"
    if case == "unlabeled":  # Criteo's test files: no label column
        bad.write_text("\n".join(line.split("\t", 1)[1] for line in lines) + "\n")
        match = r"day_x:1: first field '' is not a 0/1 label \(39 fields: an unlabeled file"
    elif case == "extra field":
        bad.write_text("\n".join(line + "\t7" for line in lines) + "\n")
        match = r"day_x:1: 41 tab-separated fields, more than the dataset's 40"
    else:  # a MovieLens ratings file
        bad.write_text("196\t242\t3\t881250949\n")
        match = r"first field '196' is not a 0/1 label"
    before = file_hashes(out)
    with pytest.raises(ValueError, match=match) as err:
        preprocess_criteo([bad], out, add_day=True)
    assert "Add a labeled day file of the same Criteo release, or preprocess this file " \
        "into its own --out" in str(err.value)
    assert file_hashes(out) == before


def test_the_same_day_is_not_added_twice(tmp_path: Path) -> None:
    d0 = write(tmp_path / "day_0", [{0: "10"}, {0: "20"}])
    d1 = write(tmp_path / "day_1", [{0: "10"}, {0: "20"}])
    out = tmp_path / "out"
    preprocess_criteo([d0, d1], out, fmt="terabyte", num_embeddings_per_feature=100)
    before = file_hashes(out)
    with pytest.raises(ValueError, match="a day named 'day_1' is in .* already .day 1.; a "
                                         "day is added once. If this file is another day"):
        preprocess_criteo([d1], out, add_day=True)
    d2 = write(tmp_path / "day_2", [{0: "30"}])
    with pytest.raises(ValueError, match="a day named 'day_2' is among the inputs twice"):
        preprocess_criteo([d2, d2], out, add_day=True)
    assert file_hashes(out) == before


def test_adding_to_a_dataset_that_is_not_criteo_or_has_no_days(tmp_path: Path) -> None:
    d0 = write(tmp_path / "day_0", [{0: "10"}, {0: "20"}])
    generate(tmp_path / "synth", rows=300, cardinalities=[10] * 26, pooling_factors=[1] * 26)
    with pytest.raises(ValueError, match="synthetic dataset .* not one made by preprocess "
                                         "criteo.*into its own --out"):
        preprocess_criteo([d0], tmp_path / "synth", add_day=True)
    out = tmp_path / "old"
    preprocess_criteo([d0, d0], out, fmt="terabyte", num_embeddings_per_feature=100)
    data = json.loads((out / "dataset.json").read_text())
    del data["parameters"]["days"]  # as written before days were recorded
    (out / "dataset.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="records no days.*preprocess its inputs again"):
        preprocess_criteo([d0], out, add_day=True)
    with pytest.raises(ValueError, match="drop --num-embeddings-per-feature"):
        preprocess_criteo([d0], out, add_day=True, num_embeddings_per_feature=7)
    with pytest.raises(ValueError, match="records no days"):
        read_days(out)


@needs_data
def test_kaggle_is_one_day_or_n_days_of_consecutive_rows(tmp_path: Path) -> None:
    spec = preprocess_criteo([KAGGLE], tmp_path / "one", num_embeddings_per_feature=1000, **SMALL)
    (day,) = read_days(tmp_path / "one")
    assert day.rows == 1000 and day.name == "day_0"
    everything = day_table(tmp_path / "one", 0)
    spec = preprocess_criteo([KAGGLE], tmp_path / "three", num_embeddings_per_feature=1000,
                             days=3, **SMALL)
    days = read_days(spec)
    assert [d.rows for d in days] == [333, 333, 334]
    # the last day spans train (857 rows), validation and test
    assert {p.file.split("-")[0] for p in days[2].pieces} == {"train", "validation", "test"}
    same_rows(day_table(tmp_path / "three", range(3)), everything)
    same_rows(day_table(tmp_path / "three", 1), everything.slice(333, 333))
    # the loader reads a day that starts and ends inside shards and row groups
    for which in (1, range(1, 3)):
        loader = ParquetLoader(tmp_path / "three", days=which, batch_size=50, drop_last=False,
                               prefetch=0)
        np.testing.assert_array_equal(np.concatenate([b.labels.numpy() for b in loader]),
                                      day_table(tmp_path / "three", which)["label"].to_numpy())
    with pytest.raises(ValueError, match="terabyte inputs are one day each: drop --days"):
        preprocess_criteo([KAGGLE, KAGGLE], tmp_path / "x", fmt="terabyte", days=2)


@needs_data
def test_loader_reads_a_day_or_a_range(tmp_path: Path) -> None:
    days = cut_days(TERABYTE, tmp_path, [0, 400, 700, 1000])
    out = tmp_path / "out"
    preprocess_criteo(days[:2], out, fmt="terabyte", num_embeddings_per_feature=1000, **SMALL)
    preprocess_criteo(days[2:], out, add_day=True)
    for which in (0, 1, 2, range(1, 3)):
        expected = day_table(out, which)
        loader = ParquetLoader(out, days=which, batch_size=64, drop_last=False, prefetch=0)
        got = [b for b in loader]
        labels = np.concatenate([b.labels.numpy() for b in got])
        np.testing.assert_array_equal(labels, expected["label"].to_numpy())
        ids = np.concatenate([b.sparse["cat_3"].values().numpy() for b in got])
        np.testing.assert_array_equal(ids, np.concatenate(expected["cat_3"].to_pylist()))
        # two ranks, shuffled: together every row of the days once
        shares = []
        for r in range(2):
            loader = ParquetLoader(out, days=which, batch_size=16, rank=r, world_size=2,
                                   shuffle=True, seed=3, pad_last=True, drop_last=False,
                                   prefetch=0)
            shares += [b.dense[:b.valid_rows, 0].numpy() for b in loader]
        dense = np.asarray(expected["dense"].combine_chunks().flatten()).reshape(-1, 13)[:, 0]
        np.testing.assert_array_equal(np.sort(np.concatenate(shares)), np.sort(dense))
    with pytest.raises(ValueError, match="day 3 does not exist: the dataset has days 0..2"):
        ParquetLoader(out, days=3, batch_size=4)
    with pytest.raises(ValueError, match="pass a split or days, not both"):
        ParquetLoader(out, "train", days=0, batch_size=4)
    # a damaged day shard is named
    (out / "day-00002-00001.parquet").write_bytes(b"x")
    with pytest.raises(ValueError, match="day-00002-00001.parquet: shard of day 2 is not a readable"):
        ParquetLoader(out, days=2, batch_size=4)


def test_cli_flags_reach_the_days(tmp_path: Path) -> None:
    from dlrm_app.cli import main

    d0 = write(tmp_path / "day_0", [{0: "10"}, {0: "20"}, {0: "10"}])
    d3 = write(tmp_path / "day_3", [{0: "30"}])
    out = str(tmp_path / "out")
    assert main(["preprocess", "criteo", str(d0), "--out", out, "--days", "3"]) == 0
    assert [d.rows for d in read_days(out)] == [1, 1, 1]
    assert main(["preprocess", "criteo", str(d3), "--out", out, "--add-day"]) == 0
    assert [d.name for d in read_days(out)] == ["day_0", "day_1", "day_2", "day_3"]
    with pytest.raises(SystemExit, match="a day named 'day_3' is in .* already .day 3.; a "
                                         "day is added once"):
        main(["preprocess", "criteo", str(d3), "--out", out, "--add-day"])
    synth = str(tmp_path / "synth")
    assert main(["generate", "--out", synth, "--rows", "400", "--num-sparse", "2",
                 "--days", "4", "--drift", "0.2"]) == 0
    spec = DatasetSpec.load(synth)
    assert [d.rows for d in read_days(spec)] == [100] * 4
    assert spec.parameters["drift"] == 0.2


@needs_data
def test_gzip_day_is_added_as_the_plain_one(tmp_path: Path) -> None:
    import gzip
    import shutil

    days = cut_days(TERABYTE, tmp_path, [0, 400, 700, 1000])
    zipped = tmp_path / "gz" / "day_2.gz"
    zipped.parent.mkdir()
    zipped.write_bytes(gzip.compress(days[2].read_bytes()))
    preprocess_criteo(days[:2], tmp_path / "plain", fmt="terabyte",
                      max_embeddings_per_feature=500, **SMALL)
    shutil.copytree(tmp_path / "plain", tmp_path / "gzip")
    plain = preprocess_criteo(days[2:], tmp_path / "plain", add_day=True)
    packed = preprocess_criteo([zipped], tmp_path / "gzip", add_day=True)
    assert sum(plain.parameters["days"][2]["new_ids_with_rows"]) > 100
    same_rows(day_table(tmp_path / "plain", 2), day_table(tmp_path / "gzip", 2))
    assert plain.parameters["encoding"]["grown_vocabulary"] == \
        packed.parameters["encoding"]["grown_vocabulary"]


def test_a_grown_vocabulary_is_served_within_the_models_tables(tmp_path: Path) -> None:
    """The id -> row map export serves from a grown vocabulary: ids whose row lies past the
    model's tables are left out (they read row 0, as in training); rows out of raw-id order
    are kept with their ids, and the encode program maps raw values to them."""
    from dlrm_app.data.criteo.vocabulary import vocabulary_for_tables
    from dlrm_app.serving.program import RawEncoder

    d0 = write(tmp_path / "day_0", [{0: "10", 1: "1"}, {0: "10", 1: "1"}, {0: "20", 1: "1"}])
    d1 = write(tmp_path / "day_1", [{0: "10", 1: "1"}, {0: "20", 1: "1"}])
    out = tmp_path / "out"
    preprocess_criteo([d0, d1], out, fmt="terabyte", max_embeddings_per_feature=4)
    d2 = write(tmp_path / "day_2", [{0: "10", 1: "9"}, {0: "5", 1: "3"}, {0: "5", 1: "1"},
                                    {0: "30", 1: "9"}, {0: "40", 1: "1"}])
    encoding = preprocess_criteo([d2], out, add_day=True).parameters["encoding"]
    # tables after day 2: cat_0 10 -> 1, 20 -> 2, 5 -> 3; cat_1 1 -> 1, 3 -> 2, 9 -> 3
    start = vocabulary_for_tables(out, [3, 2] + [2] * 24, encoding)  # a run's from day 0
    assert [v.tolist() for v in start.ids[:3]] == [[0x10, 0x20], [1], [0]]
    assert start.rows is None  # the rows left are those of the first vocabulary, in order
    assert start.past_tables[:3] == [1, 2, 0] and start.file == "vocabulary-day-00002.parquet"
    later = vocabulary_for_tables(out, [4, 4] + [2] * 24, encoding)  # a run's from day 2
    assert [v.tolist() for v in later.ids[:2]] == [[0x5, 0x10, 0x20], [1, 3, 9]]
    assert later.rows is not None and [r.tolist() for r in later.rows[:2]] == [[3, 1, 2],
                                                                              [1, 2, 3]]
    encoder = RawEncoder(13, torch.zeros(26, dtype=torch.int64),
                         [torch.from_numpy(v) for v in later.ids], True,
                         [torch.from_numpy(r) for r in later.rows])
    cat = torch.zeros(3, 26, dtype=torch.int64)
    cat[:, 0], cat[:, 1] = torch.tensor([0x5, 0x30, 0x10]), torch.tensor([0x9, 0x7, 0x3])
    _, values, _ = encoder(torch.zeros(3, 13), cat)
    assert values.view(26, 3)[:3].tolist() == [[3, 0, 1], [3, 0, 2], [1, 1, 1]]
