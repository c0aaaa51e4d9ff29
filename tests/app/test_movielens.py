"""MovieLens preprocessing: ml-100k against a plain-Python oracle, 1m/csv on tiny folders."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from shared_data import ML100K

from dlrm_app.data.loader import ParquetLoader
from dlrm_app.data.movielens import age_bucket, load_id_map, preprocess_movielens
from dlrm_app.data.schema import DatasetKind, verify

needs_100k = pytest.mark.shared_data(ML100K / "u.data")


def read_split(out: Path, split: str) -> dict[str, list]:
    """All rows of one split as Python lists, shards concatenated."""
    spec = verify(out)
    tables = [pq.read_table(out / s.file).to_pydict() for s in spec.split(split).shards]
    return {k: [v for t in tables for v in t[k]] for k in (tables[0] if tables else {})}


def rows_by_key(out: Path) -> dict[tuple[int, int], tuple[str, dict]]:
    """(raw user, raw movie) -> (split, row) over every split, raw ids from id_map.parquet."""
    ids = load_id_map(out)
    found: dict[tuple[int, int], tuple[str, dict]] = {}
    for split in ("train", "validation", "test"):
        cols = read_split(out, split)
        for i in range(len(cols.get("label", []))):
            row = {k: v[i] for k, v in cols.items()}
            key = (int(ids["user_id"][row["user_id"][0]]),
                   int(ids["movie_id"][row["movie_id"][0]]))
            assert key not in found, f"duplicate rating {key}"
            found[key] = (split, row)
    return found


@pytest.fixture(scope="module")
def ml100k(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ml100k")
    preprocess_movielens(ML100K, out, rows_per_shard=40_000, row_group_size=4096)
    return out


@needs_100k
@pytest.mark.slow
def test_ml100k_rows_match_plain_parse(ml100k: Path) -> None:
    ratings = {}
    by_user: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for line in (ML100K / "u.data").read_text().splitlines():
        u, i, r, t = (int(x) for x in line.split("\t"))
        ratings[(u, i)] = r
        by_user[u].append((t, i))
    genres, users = {}, {}
    for line in (ML100K / "u.item").read_text(encoding="latin-1").splitlines():
        f = line.split("|")
        genres[int(f[0])] = [k for k, flag in enumerate(f[5:]) if flag == "1"]
    for line in (ML100K / "u.user").read_text().splitlines():
        f = line.split("|")
        users[int(f[0])] = (int(f[1]), f[2], f[3], f[4][:3].upper())

    spec = verify(ml100k)
    assert spec.kind is DatasetKind.MOVIELENS
    assert sum(s.rows for s in spec.splits) == 100_000
    assert spec.parameters["split"] == "leave_last_out"
    features = {f.name: f for f in spec.sparse_features}
    assert features["user_id"].num_embeddings == len(by_user) == 943
    assert features["movie_id"].num_embeddings == 1682
    assert features["genres"].multi_hot and not features["movie_id"].multi_hot

    ids = load_id_map(ml100k)
    found = rows_by_key(ml100k)
    assert set(found) == set(ratings)
    for (u, i), (_, row) in found.items():
        assert row["label"] == float(ratings[(u, i)] >= 4)
        assert row["genres"] == genres[i]
        age, gender, occupation, zip3 = users[u]
        assert row["age"] == [age_bucket(age)]
        assert ids["gender"][row["gender"][0]] == gender
        assert ids["occupation"][row["occupation"][0]] == occupation
        assert ids["zip3"][row["zip3"][0]] == zip3
        assert len(row["dense"]) == 3 and 0.0 <= row["dense"][0] <= 1.0

    # Per user: test is the latest (timestamp, movie id), validation the one before.
    for u, seen in by_user.items():
        ordered = [i for _, i in sorted(seen)]
        assert found[(u, ordered[-1])][0] == "test"
        assert found[(u, ordered[-2])][0] == "validation"
        assert {found[(u, i)][0] for i in ordered[:-2]} == {"train"}


@needs_100k
def test_ml100k_table_summary(ml100k: Path) -> None:
    """The table sizes follow the data (remapped ids) and the summary says what they need."""
    spec = verify(ml100k)
    tables = spec.parameters["tables"]
    sizes = {f.name: f.num_embeddings for f in spec.sparse_features}
    assert tables["num_embeddings"] == sizes
    assert sizes["user_id"] == 943 and sizes["movie_id"] == 1682 and sizes["genres"] == 19
    assert sizes["age"] == 7 and sizes["gender"] == 2
    assert tables["total_rows"] == sum(sizes.values())
    # fp32 weights + one fp32 row-wise Adagrad accumulator per row
    assert tables["optimizer"] == "rowwise_adagrad"
    assert tables["train_memory_bytes"] == {str(d): sum(sizes.values()) * (4 * d + 4)
                                            for d in (16, 64, 128)}


@needs_100k
@pytest.mark.slow
def test_ml100k_popularity_counts_train_only(ml100k: Path) -> None:
    train = read_split(ml100k, "train")
    per_movie: dict[int, int] = defaultdict(int)
    for m in train["movie_id"]:
        per_movie[m[0]] += 1
    for split in ("train", "test"):
        cols = read_split(ml100k, split)
        for m, dense in zip(cols["movie_id"], cols["dense"], strict=True):
            assert dense[1] == pytest.approx(math.log1p(per_movie[m[0]]), rel=1e-6)


@needs_100k
def test_ml100k_parquet_loader_reads_output(ml100k: Path) -> None:
    spec = verify(ml100k)
    loader = ParquetLoader(ml100k, "train", batch_size=256, prefetch=0)
    batch = next(iter(loader))
    names = [f.name for f in spec.sparse_features]
    assert batch.sparse.keys() == names
    assert batch.dense.shape == (256, 3) and batch.labels.shape == (256,)
    lengths = batch.sparse.lengths().view(len(names), 256)
    for k, name in enumerate(names):
        if name != "genres":
            assert (lengths[k] == 1).all()
    first = pq.read_table(ml100k / spec.split("train").shards[0].file).slice(0, 256)
    expected = [len(g) for g in first["genres"].to_pylist()]
    assert lengths[names.index("genres")].tolist() == expected
    sizes = {f.name: f.num_embeddings for f in spec.sparse_features}
    values = batch.sparse.to_dict()
    for name in names:
        v = values[name].values()
        assert v.numel() == 0 or (0 <= int(v.min()) and int(v.max()) < sizes[name])


def write(path: Path, lines: list[str]) -> None:
    path.write_text("\n".join(lines) + "\n", encoding="latin-1")


def tiny_1m(src: Path) -> None:
    src.mkdir()
    write(src / "ratings.dat", ["10::5::5::300", "10::7::3::100", "10::9::4::200",
                                "20::7::4::50", "20::5::2::60", "30::9::1::10"])
    write(src / "movies.dat", ["5::Heat (1995)::Action|Crime|Thriller",
                               "7::Sabrina (1995)::Comedy|Romance", "9::Untitled::Drama"])
    write(src / "users.dat", ["10::F::1::10::48067", "20::M::56::16::70072",
                              "30::M::25::15::55117"])


def test_ml1m_format(tmp_path: Path) -> None:
    tiny_1m(tmp_path / "ml-1m")
    spec = preprocess_movielens(tmp_path / "ml-1m", tmp_path / "out")
    assert spec.parameters["release"] == "1m"
    assert {s.name: s.rows for s in spec.splits} == {"train": 2, "validation": 1, "test": 3}
    ids = load_id_map(tmp_path / "out")
    assert ids["user_id"] == ["10", "20", "30"] and ids["movie_id"] == ["5", "7", "9"]
    assert ids["genres"] == ["Action", "Comedy", "Crime", "Drama", "Romance", "Thriller"]
    found = rows_by_key(tmp_path / "out")
    # user 10 by time: movie 7 (t=100) train, 9 (t=200) validation, 5 (t=300) test
    assert [found[(10, m)][0] for m in (7, 9, 5)] == ["train", "validation", "test"]
    assert [found[(20, m)][0] for m in (7, 5)] == ["train", "test"]  # < 3 ratings
    assert found[(30, 9)][0] == "test"
    heat = found[(10, 5)][1]
    assert heat["label"] == 1.0 and heat["genres"] == [0, 2, 5]
    assert ids["gender"][heat["gender"][0]] == "F" and heat["age"] == [0]
    assert ids["zip3"][heat["zip3"][0]] == "480"
    assert found[(20, 7)][1]["age"] == [6]
    untitled = found[(30, 9)][1]
    assert untitled["dense"][0] == 0.0  # no year in the title -> 0
    assert untitled["dense"][1] == 0.0  # movie 9's only other rating is in validation


def test_csv_format_and_fraction_split(tmp_path: Path) -> None:
    src = tmp_path / "ml-latest-small"
    src.mkdir()
    ratings = ["userId,movieId,rating,timestamp"]
    ratings += ["1,1,4.5,1", "1,2,3.5,2", "1,3,4.0,3"]
    ratings += [f"2,{m},{4.0 if m % 2 else 2.5},{100 - m}" for m in range(1, 11)]
    write(src / "ratings.csv", ratings)
    write(src / "movies.csv", ["movieId,title,genres",
                               '1,"American President, The (1995)",Comedy|Drama|Romance',
                               "2,Jumanji (1995),Adventure|Children|Fantasy",
                               "3,Grumpier Old Men (1995),(no genres listed)"]
          + [f"{m},Film {m} ({1990 + m}),Drama" for m in range(4, 11)])
    spec = preprocess_movielens(src, tmp_path / "out", split="fraction", test_fraction=0.2,
                                positive_rating=3.5)
    assert spec.parameters["release"] == "csv" and spec.parameters["test_fraction"] == 0.2
    assert [f.name for f in spec.sparse_features] == ["user_id", "movie_id", "genres"]
    # user 1: floor(3 * 0.2) = 0 held out; user 2: 2 test (latest = smallest m), 2 validation
    assert {s.name: s.rows for s in spec.splits} == {"train": 9, "validation": 2, "test": 2}
    found = rows_by_key(tmp_path / "out")
    assert {m for (u, m), (s, _) in found.items() if s == "test"} == {1, 2}
    assert {m for (u, m), (s, _) in found.items() if s == "validation"} == {3, 4}
    assert found[(1, 3)][1]["genres"] == []
    assert found[(1, 2)][1]["label"] == 1.0 and found[(2, 2)][1]["label"] == 0.0
    ids = load_id_map(tmp_path / "out")
    assert [ids["genres"][g] for g in found[(1, 1)][1]["genres"]] == ["Comedy", "Drama",
                                                                     "Romance"]
    ParquetLoader(tmp_path / "out", "train", batch_size=4, prefetch=0)


def test_unknown_folder_lists_expected_files(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ValueError, match=r"u\.data.*ratings\.dat.*ratings\.csv"):
        preprocess_movielens(tmp_path, tmp_path / "out")


def test_missing_movie_is_an_error(tmp_path: Path) -> None:
    tiny_1m(tmp_path / "ml-1m")
    write(tmp_path / "ml-1m" / "movies.dat", ["5::Heat (1995)::Action"])
    with pytest.raises(ValueError, match=r"movie ids \[7, 9\] have no entry in movies\.dat"):
        preprocess_movielens(tmp_path / "ml-1m", tmp_path / "out")


@pytest.mark.slow
def test_cli_prints_one_json_line(tmp_path: Path) -> None:
    tiny_1m(tmp_path / "ml-1m")
    out = subprocess.run(
        [sys.executable, "-m", "dlrm_app", "preprocess", "movielens", str(tmp_path / "ml-1m"),
         "--out", str(tmp_path / "out")],
        check=True, capture_output=True, text=True,
    ).stdout
    lines = out.strip().splitlines()
    assert len(lines) == 1
    summary = json.loads(lines[0])
    assert summary["release"] == "1m"
    assert summary["rows"] == {"train": 2, "validation": 1, "test": 3}
    assert summary["num_embeddings"]["user_id"] == 3
    verify(tmp_path / "out")


def test_cli_unknown_folder_exits_with_message(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "dlrm_app", "preprocess", "movielens", str(tmp_path),
         "--out", str(tmp_path / "out")],
        capture_output=True, text=True,
    )
    assert result.returncode != 0
    assert "not a MovieLens release folder" in result.stderr
