"""MovieLens ratings -> a CTR-style dataset: Parquet shards + ``dataset.json`` (kind movielens).

Releases, detected from the files in the source folder:

=================  ==========================================  ===============================
release            files                                       notes
=================  ==========================================  ===============================
``100k``           ``u.data`` (tab), ``u.item``, ``u.user``    19 genre flags; raw ages
                   (``|``-separated, latin-1)
``1m``             ``ratings.dat``, ``movies.dat``,            ``::``-separated, latin-1;
                   ``users.dat``                               genres ``A|B``; age codes
``csv``            ``ratings.csv``, ``movies.csv`` (header)    ml-20m / ml-25m / ml-latest;
                                                               no user attributes
=================  ==========================================  ===============================

Task: one row per rating, ``label = float32(rating >= positive_rating)``.

Sparse features (all ``list<int64>``; every vocabulary is saved in ``id_map.parquet`` as rows
``(feature, id, raw)``, so any id maps back to its raw value):

* ``user_id``, ``movie_id``: the raw ids that occur in the ratings, sorted ascending as
  integers, get ids ``0..n-1`` (deterministic and independent of the file's row order);
* ``genres`` (multi-hot): 100k uses the fixed flag order of ``u.genre`` (flag ``k`` -> id
  ``k``); 1m and csv releases use the sorted genre names of the movies file. A movie with no
  genre (csv ``(no genres listed)``, or all flags 0) has an empty list;
* only where the release has a users file: ``age`` (bucket of the 1m release: <18, 18-24,
  25-34, 35-44, 45-49, 50-55, 56+ -> ids 0..6; 100k's raw ages are bucketed the same way),
  ``gender`` (F -> 0, M -> 1), ``occupation`` (sorted distinct raw values, as strings; 1m
  stores occupation codes), ``zip3`` (first 3 characters of the zip code, upper-cased,
  sorted distinct values; US ZIP3 is a regional area, Canadian codes just keep their prefix).

Dense features (float32):

* ``release_year``: ``(year - min) / (max - min)`` over the known years of the rated movies
  (100k: from the release date; 1m/csv: the ``(YYYY)`` at the end of the title); a movie
  without a year gets 0;
* ``log_movie_count``, ``log_user_count``: ``log(1 + n)`` with ``n`` the number of the movie's
  (user's) ratings in the *train* split only, so validation/test labels do not leak into
  features (a movie never rated in train gets 0).

Splits, time-ordered per user (each user's ratings sorted by timestamp, ties by raw movie
id):

* ``leave_last_out``: the user's last rating is test; the one before is validation if the
  user has at least 3 ratings (so a user with 2 keeps one rating in train); the rest train;
* ``fraction``: the last ``floor(n * test_fraction)`` ratings are test, the
  ``floor(n * test_fraction)`` before them validation, the rest train.

Inside each split the rows are shuffled with ``seed`` (the loader shuffles rows only within a
window of a few row groups, so the files must not be user-ordered). Everything is held in memory (about 100 bytes
per rating: fine for ml-25m on a workstation). Every shard is written to a hidden temp name
and renamed when complete; ``dataset.json`` is removed at the start and written last, so a
directory with a ``dataset.json`` is always complete. A rerun rewrites every file.
"""

from __future__ import annotations

import csv
import importlib.metadata
import io
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from dlrm_app.data.schema import (
    DENSE_COLUMN,
    SPLIT_NAMES,
    DatasetKind,
    DatasetSpec,
    SparseFeature,
    SplitSpec,
    sha256_file,
)
from dlrm_app.data.shard_writer import write_split_shards
from dlrm_app.data.tables import table_summary
from dlrm_app.inputs import check_movielens_source

LABEL = "label"
DENSE_NAMES = ("release_year", "log_movie_count", "log_user_count")
USER_FEATURES = ("age", "gender", "occupation", "zip3")
ID_MAP_FILE = "id_map.parquet"
AGE_BUCKETS = (18, 25, 35, 45, 50, 56)
"""Lower bounds of the 1m release's age buckets 1..6 (bucket 0 is under 18)."""
GENRES_100K = ("unknown", "Action", "Adventure", "Animation", "Children's", "Comedy", "Crime",
               "Documentary", "Drama", "Fantasy", "Film-Noir", "Horror", "Musical", "Mystery",
               "Romance", "Sci-Fi", "Thriller", "War", "Western")
RELEASE_FILES = {
    "100k": ("u.data", "u.item", "u.user"),
    "1m": ("ratings.dat", "movies.dat", "users.dat"),
    "csv": ("ratings.csv", "movies.csv"),
}
_YEAR_IN_TITLE = re.compile(r"\((\d{4})\)\s*$")


@dataclass(frozen=True)
class _Raw:
    """One release parsed: ratings as arrays, movies and users as dicts keyed by raw id."""

    user: np.ndarray  # int64 raw user ids
    movie: np.ndarray  # int64 raw movie ids
    rating: np.ndarray  # float64
    timestamp: np.ndarray  # int64
    genre_names: tuple[str, ...]  # genre id -> name
    movies: dict[int, tuple[int | None, list[int]]]  # raw id -> (year, genre ids)
    users: dict[int, tuple[int, str, str, str]] | None  # raw id -> (age, gender, occ, zip)


def detect_release(src_dir: Path) -> str:
    """``100k``, ``1m`` or ``csv`` from the files present; ValueError listing what it sought."""
    for release, files in RELEASE_FILES.items():
        if all((src_dir / f).is_file() for f in files):
            return release
    looked = "; ".join(f"{r}: {', '.join(fs)}" for r, fs in RELEASE_FILES.items())
    raise ValueError(f"{src_dir}: not a MovieLens release folder; looked for ({looked}). "
                     f"Point it at the unpacked release (e.g. .../ml-100k)")


def age_bucket(age: int) -> int:
    """Bucket 0..6 of an age in years (or of a 1m age code, which is the bucket's lower bound)."""
    return int(np.searchsorted(AGE_BUCKETS, age, side="right"))


def _lines(path: Path) -> list[str]:
    # MovieLens text files are latin-1 (accented titles); no line is ever empty in the middle.
    return [line for line in path.read_text(encoding="latin-1").splitlines() if line]


def _fields(path: Path, sep: str, count: int) -> list[tuple[int, list[str]]]:
    """(line number, fields) of every line, checking the field count."""
    out = []
    for no, line in enumerate(_lines(path), start=1):
        parts = line.split(sep)
        if len(parts) != count:
            raise ValueError(f"{path}:{no}: {len(parts)} {sep!r}-separated fields, expected "
                             f"{count}; fix or delete the line")
        out.append((no, parts))
    return out


def _read_ratings(data: bytes, path: Path, header: bool) -> tuple[np.ndarray, ...]:
    names = ["user", "movie", "rating", "timestamp"]
    types = {"user": pa.int64(), "movie": pa.int64(), "rating": pa.float64(),
             "timestamp": pa.int64()}
    read = pacsv.ReadOptions(column_names=names, skip_rows=1 if header else 0)
    parse = pacsv.ParseOptions(delimiter="," if header else "\t")
    try:
        table = pacsv.read_csv(io.BytesIO(data), read, parse,
                               pacsv.ConvertOptions(column_types=types))
    except pa.ArrowException as e:
        raise ValueError(_bad_rating(data, path, parse.delimiter, header, e)) from None
    return tuple(table[n].to_numpy() for n in names)


def _bad_rating(data: bytes, path: Path, sep: str, header: bool, error: Exception) -> str:
    """``path:line: what`` for the first line that is not a user, movie, rating, timestamp row
    (found line by line: only on the error path); the echoed text is cut to 80 characters."""
    kinds = (int, int, float, int)
    for no, raw in enumerate(data.split(b"\n"), start=1):
        if (header and no == 1) or not raw.strip():
            continue
        shown = raw[:80].decode("latin-1") + ("..." if len(raw) > 80 else "")
        try:
            fields = raw.decode("utf-8").rstrip("\r").split(sep)
            if len(fields) != 4:
                problem = f"{len(fields)} {sep!r}-separated fields, expected 4"
            else:
                for kind, field in zip(kinds, fields, strict=True):
                    kind(field)
                continue
        except UnicodeDecodeError:
            problem = "bytes that are not UTF-8 text"
        except ValueError:
            problem = "a field that is not a number"
        return (f"{path}:{no}: {problem} in {shown!r}; expected user, movie, rating, timestamp "
                f"rows: fix or delete the line, or re-download the release")
    return (f"{path}: not user, movie, rating, timestamp rows ({str(error)[:100]}); "
            f"re-download the release")


def _year_of_title(title: str) -> int | None:
    match = _YEAR_IN_TITLE.search(title)
    return int(match.group(1)) if match else None


def _genre_vocab(named: dict[int, tuple[int | None, list[str]]]
                 ) -> tuple[tuple[str, ...], dict[int, tuple[int | None, list[int]]]]:
    names = tuple(sorted({g for _, gs in named.values() for g in gs}))
    index = {g: i for i, g in enumerate(names)}
    return names, {m: (y, sorted(index[g] for g in gs)) for m, (y, gs) in named.items()}


def _load_100k(src: Path) -> _Raw:
    user, movie, rating, ts = _read_ratings((src / "u.data").read_bytes(), src / "u.data",
                                            header=False)
    movies = {}
    for no, f in _fields(src / "u.item", "|", 5 + len(GENRES_100K)):
        flags = f[5:]
        if any(x not in ("0", "1") for x in flags):
            raise ValueError(f"{src / 'u.item'}:{no}: genre flags must be 0 or 1, got {flags}")
        date = f[2].strip()
        movies[int(f[0])] = (int(date[-4:]) if date else None,
                             [k for k, x in enumerate(flags) if x == "1"])
    users = {int(f[0]): (int(f[1]), f[2], f[3], f[4])
             for _, f in _fields(src / "u.user", "|", 5)}
    return _Raw(user, movie, rating, ts, GENRES_100K, movies, users)


def _load_1m(src: Path) -> _Raw:
    # pyarrow's reader wants a one-byte delimiter; "::" never occurs inside a rating row.
    data = (src / "ratings.dat").read_bytes().replace(b"::", b"\t")
    user, movie, rating, ts = _read_ratings(data, src / "ratings.dat", header=False)
    named = {int(f[0]): (_year_of_title(f[1]), [g for g in f[2].split("|") if g])
             for _, f in _fields(src / "movies.dat", "::", 3)}
    genre_names, movies = _genre_vocab(named)
    # users.dat: UserID::Gender::Age::Occupation::Zip-code (age is a bucket's lower bound)
    users = {int(f[0]): (int(f[2]), f[1], f[3], f[4])
             for _, f in _fields(src / "users.dat", "::", 5)}
    return _Raw(user, movie, rating, ts, genre_names, movies, users)


def _load_csv(src: Path) -> _Raw:
    path = src / "ratings.csv"
    user, movie, rating, ts = _read_ratings(path.read_bytes(), path, header=True)
    named: dict[int, tuple[int | None, list[str]]] = {}
    with open(src / "movies.csv", encoding="utf-8", newline="") as f:
        rows = csv.reader(f)  # titles are quoted when they contain commas
        next(rows, None)
        for no, row in enumerate(rows, start=2):
            if len(row) != 3:
                raise ValueError(f"{src / 'movies.csv'}:{no}: {len(row)} fields, expected "
                                 f"movieId,title,genres; fix or delete the line")
            genres = [] if row[2] == "(no genres listed)" else [g for g in row[2].split("|")
                                                                 if g]
            named[int(row[0])] = (_year_of_title(row[1]), genres)
    genre_names, movies = _genre_vocab(named)
    return _Raw(user, movie, rating, ts, genre_names, movies, None)


_LOADERS: dict[str, Callable[[Path], _Raw]] = {"100k": _load_100k, "1m": _load_1m,
                                               "csv": _load_csv}


def split_by_user(user: np.ndarray, movie: np.ndarray, timestamp: np.ndarray, *,
                  split: str, test_fraction: float) -> np.ndarray:
    """Split index per rating (0 train, 1 validation, 2 test); see the module docstring."""
    order = np.lexsort((movie, timestamp, user))  # by user, then time, ties by movie id
    u = user[order]
    starts = np.flatnonzero(np.r_[True, u[1:] != u[:-1]])
    counts = np.diff(np.r_[starts, len(u)])
    n_user = np.repeat(counts, counts)
    from_end = np.repeat(starts + counts, counts) - 1 - np.arange(len(u))  # 0 = latest
    if split == "leave_last_out":
        n_test = np.ones_like(n_user)
        n_val = (n_user >= 3).astype(np.int64)
    else:
        n_test = np.floor(n_user * test_fraction).astype(np.int64)
        n_val = n_test
    sorted_split = np.where(from_end < n_test, 2, np.where(from_end < n_test + n_val, 1, 0))
    out = np.empty(len(u), np.int8)
    out[order] = sorted_split
    return out


class _Vocab:
    """Sorted distinct raw values -> ids ``0..n-1``; collects rows for ``id_map.parquet``."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, int, str]] = []
        self.sizes: dict[str, int] = {}

    def add(self, feature: str, raw: list[str]) -> None:
        self.sizes[feature] = len(raw)
        self.rows += [(feature, i, r) for i, r in enumerate(raw)]

    def encode(self, feature: str, values: np.ndarray) -> np.ndarray:
        uniq, ids = np.unique(values, return_inverse=True)
        self.add(feature, [str(v) for v in uniq])
        return ids.astype(np.int64)

    def save(self, out: Path) -> str:
        feature, ids, raw = zip(*self.rows, strict=True)
        table = pa.table({"feature": pa.array(feature), "id": pa.array(ids, pa.int64()),
                          "raw": pa.array(raw)})
        tmp = out / f".{ID_MAP_FILE}.tmp"
        pq.write_table(table, tmp)
        os.replace(tmp, out / ID_MAP_FILE)
        return sha256_file(out / ID_MAP_FILE)


def _one_hot(ids: np.ndarray) -> pa.Array:
    return pa.ListArray.from_arrays(pa.array(np.arange(len(ids) + 1, dtype=np.int32)),
                                    pa.array(ids, pa.int64()))


def _multi_hot(rows: np.ndarray, offsets: np.ndarray, values: np.ndarray) -> pa.Array:
    """Gather the CSR lists ``offsets``/``values`` at ``rows`` into one Arrow list array."""
    starts, lengths = offsets[rows], offsets[rows + 1] - offsets[rows]
    out_off = np.r_[0, np.cumsum(lengths)].astype(np.int32)
    gather = np.repeat(starts - out_off[:-1], lengths) + np.arange(out_off[-1])
    return pa.ListArray.from_arrays(pa.array(out_off), pa.array(values[gather], pa.int64()))


def _write_split(out: Path, name: str, table: pa.Table, rows_per_shard: int,
                 row_group_size: int) -> SplitSpec:
    shards = write_split_shards(out, name, table, rows_per_shard, row_group_size)
    labels = table[LABEL].to_numpy()
    rate = float(labels.mean()) if len(labels) else 0.0
    return SplitSpec(name=name, label_rate=rate, shards=shards)


def preprocess_movielens(
    src_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    positive_rating: float = 4.0,
    split: Literal["leave_last_out", "fraction"] = "leave_last_out",
    test_fraction: float = 0.1,
    seed: int = 0,
    rows_per_shard: int = 1_000_000,
    row_group_size: int = 65_536,
    id_mapping: Literal["vocabulary", "hash", "zch"] = "vocabulary",
    num_embeddings_per_feature: int | None = None,
) -> DatasetSpec:
    """Preprocess a MovieLens release folder into ``out_dir``; see the module docstring.

    ``id_mapping="zch"`` keeps the raw ``user_id`` and ``movie_id`` values (in
    ``[0, 2^31)``; features marked ``raw_ids``) for the model to map at training time with
    zero-collision hashing; ``"hash"`` maps them to ``raw % num_embeddings_per_feature`` rows.
    The small vocabularies (genres, user attributes) stay as they are.

    ``test_fraction`` (in ``(0, 0.5]``) is used only by ``split="fraction"``; ``seed`` fixes
    the row order inside each split. Raises ValueError for an unknown folder (listing the
    files looked for), malformed lines (with file and line), and ratings whose movie or user
    is missing from the movies or users file.
    """
    src, out = Path(src_dir), Path(out_dir)
    if split not in ("leave_last_out", "fraction"):
        raise ValueError(f"split must be 'leave_last_out' or 'fraction', got {split!r}")
    if split == "fraction" and not 0.0 < test_fraction <= 0.5:
        raise ValueError(f"test_fraction must be in (0, 0.5] (validation takes as many "
                         f"ratings as test), got {test_fraction}")
    if rows_per_shard < 1 or row_group_size < 1:
        raise ValueError("rows_per_shard and row_group_size must be positive")
    if id_mapping not in ("vocabulary", "hash", "zch"):
        raise ValueError(f"id_mapping (--id-mapping) must be 'vocabulary', 'hash' or 'zch', "
                         f"got {id_mapping!r}")
    if (id_mapping == "hash") != (num_embeddings_per_feature is not None):
        raise ValueError("--num-embeddings-per-feature N (rows of the user_id and movie_id "
                         "tables) goes with --id-mapping hash, and only with it")
    if num_embeddings_per_feature is not None and (
            isinstance(num_embeddings_per_feature, bool) or num_embeddings_per_feature < 1):
        raise ValueError(f"--num-embeddings-per-feature must be a positive int, got "
                         f"{num_embeddings_per_feature!r}")
    check_movielens_source(src)
    release = detect_release(src)
    raw = _LOADERS[release](src)
    if len(raw.user) == 0:
        raise ValueError(f"{src / RELEASE_FILES[release][0]}: no ratings")
    missing = sorted(set(np.unique(raw.movie).tolist()) - set(raw.movies))
    if missing:
        raise ValueError(f"{src / RELEASE_FILES[release][0]}: movie ids {missing[:5]} have no "
                         f"entry in {RELEASE_FILES[release][1]}; use a complete release")
    if raw.users is not None:
        missing = sorted(set(np.unique(raw.user).tolist()) - set(raw.users))
        if missing:
            raise ValueError(f"{src / RELEASE_FILES[release][0]}: user ids {missing[:5]} have "
                             f"no entry in {RELEASE_FILES[release][2]}; use a complete release")
    out.mkdir(parents=True, exist_ok=True)
    (out / "dataset.json").unlink(missing_ok=True)  # a run in progress is not finished

    vocab = _Vocab()
    user_id = vocab.encode("user_id", raw.user)
    movie_id = vocab.encode("movie_id", raw.movie)
    user_raw = np.unique(raw.user)
    movie_raw = np.unique(raw.movie)
    vocab.add("genres", list(raw.genre_names))
    part = split_by_user(raw.user, raw.movie, raw.timestamp, split=split,
                         test_fraction=test_fraction)

    # Per-movie tables indexed by the dense movie id: genres as CSR, year.
    movie_genres = [raw.movies[int(m)][1] for m in movie_raw]
    genre_off = np.r_[0, np.cumsum([len(g) for g in movie_genres])].astype(np.int64)
    genre_val = np.array([g for gs in movie_genres for g in gs], np.int64)
    years = np.array([raw.movies[int(m)][0] or 0 for m in movie_raw], np.float64)
    known = years > 0
    y_min = int(years[known].min()) if known.any() else 0
    y_max = int(years[known].max()) if known.any() else 0
    year_feat = np.where(known, (years - y_min) / max(y_max - y_min, 1), 0.0)

    train = part == 0
    movie_count = np.bincount(movie_id[train], minlength=len(movie_raw))
    user_count = np.bincount(user_id[train], minlength=len(user_raw))
    dense = np.stack([year_feat[movie_id], np.log1p(movie_count[movie_id]),
                      np.log1p(user_count[user_id])], axis=1).astype(np.float32)

    columns: dict[str, np.ndarray] = {"user_id": user_id, "movie_id": movie_id}
    raw_features: set[str] = set()
    hashed: dict[str, int] = {}
    if id_mapping == "hash":
        for name, values in (("user_id", raw.user), ("movie_id", raw.movie)):
            columns[name] = np.asarray(values).astype(np.int64) % num_embeddings_per_feature
            hashed[name] = int(num_embeddings_per_feature)
    if id_mapping == "zch":
        for name, values in (("user_id", raw.user), ("movie_id", raw.movie)):
            values = np.asarray(values).astype(np.int64)
            if values.min() < 0 or values.max() >= RAW_ID_SPACE:
                raise ValueError(f"{src / RELEASE_FILES[release][0]}: {name} values must lie "
                                 f"in [0, 2^31) to be kept raw (--id-mapping zch); use "
                                 f"--id-mapping vocabulary")
            columns[name] = values
            raw_features.add(name)
    if raw.users is not None:
        attrs = [raw.users[int(u)] for u in user_raw]
        per_user = {
            "age": np.array([age_bucket(a) for a, _, _, _ in attrs], np.int64),
            "gender": np.array([{"F": 0, "M": 1}.get(g.upper(), -1) for _, g, _, _ in attrs]),
        }
        if (per_user["gender"] < 0).any():
            bad = user_raw[int(np.argmax(per_user["gender"] < 0))]
            raise ValueError(f"{src / RELEASE_FILES[release][2]}: user {bad} has gender "
                             f"{raw.users[int(bad)][1]!r}, expected F or M")
        vocab.add("age", ["<18", "18-24", "25-34", "35-44", "45-49", "50-55", "56+"])
        vocab.add("gender", ["F", "M"])
        per_user["occupation"] = vocab.encode("occupation", np.array([o for *_, o, _ in attrs]))
        per_user["zip3"] = vocab.encode("zip3", np.array([z[:3].upper() for *_, z in attrs]))
        for name in USER_FEATURES:
            columns[name] = per_user[name][user_id]

    label = (raw.rating >= positive_rating).astype(np.float32)
    rng = np.random.default_rng(seed)
    splits = []
    for k, name in enumerate(SPLIT_NAMES):
        rows = np.flatnonzero(part == k)
        rows = rows[rng.permutation(len(rows))]
        arrays = {LABEL: pa.array(label[rows]),
                  DENSE_COLUMN: pa.FixedSizeListArray.from_arrays(
                      pa.array(dense[rows].reshape(-1)), len(DENSE_NAMES))}
        for feature, ids in columns.items():
            arrays[feature] = _one_hot(ids[rows])
            if feature == "movie_id":
                arrays["genres"] = _multi_hot(movie_id[rows], genre_off, genre_val)
        splits.append(_write_split(out, name, pa.table(arrays), rows_per_shard,
                                   row_group_size))
    sparse_names = list(arrays)[2:]
    features = tuple(
        SparseFeature(name=n, num_embeddings=RAW_ID_SPACE, multi_hot=False, raw_ids=True)
        if n in raw_features else
        SparseFeature(name=n, num_embeddings=hashed[n], multi_hot=False) if n in hashed else
        SparseFeature(name=n, num_embeddings=max(vocab.sizes[n], 1), multi_hot=n == "genres")
        for n in sparse_names)
    spec = DatasetSpec(
        name=f"movielens-{release if release != 'csv' else src.name}",
        kind=DatasetKind.MOVIELENS,
        dense_features=DENSE_NAMES,
        sparse_features=features,
        label=LABEL,
        label_dtype="float32",
        splits=tuple(splits),
        parameters={
            "preprocessor": "dlrm_app.data.movielens",
            "release": release,
            "source": str(src),
            "ratings": int(len(label)),
            "positive_rating": positive_rating,
            "label_rule": "rating >= positive_rating",
            "split": split,
            "test_fraction": test_fraction if split == "fraction" else None,
            "split_rule": ("per user by (timestamp, movie id): last -> test, the one before "
                           "-> validation if >= 3 ratings" if split == "leave_last_out" else
                           "per user by (timestamp, movie id): last floor(n*test_fraction) "
                           "-> test, as many before -> validation"),
            "id_mapping": id_mapping,
            "id_order": "user_id, movie_id: raw ids sorted ascending; genres: u.genre order "
                        "(100k) or sorted names; occupation, zip3: sorted strings",
            "id_map": ID_MAP_FILE,
            "id_map_sha256": vocab.save(out),
            "dense_transform": "release_year: (year-min)/(max-min), missing -> 0; "
                               "log_movie_count, log_user_count: log(1+n) over train only",
            "release_year_range": [y_min, y_max],
            "tables": table_summary(features),
            "seed": seed,
            "rows_per_shard": rows_per_shard,
            "row_group_size": row_group_size,
        },
        created_by=f"dlrm_app {importlib.metadata.version('recsys-dlrm')}",
    )
    spec.save(out)
    return spec


RAW_ID_SPACE = 1 << 31
"""With ``--id-mapping zch``: the range raw user and movie ids are kept in."""


def load_id_map(directory: str | os.PathLike[str]) -> dict[str, list[str]]:
    """Per sparse feature, the raw value of every id (index = id), from ``id_map.parquet``."""
    table = pq.read_table(Path(directory) / ID_MAP_FILE).to_pydict()
    out: dict[str, list[str]] = {}
    for feature, i, raw in zip(table["feature"], table["id"], table["raw"], strict=True):
        values = out.setdefault(feature, [])
        if i != len(values):
            raise ValueError(f"{Path(directory) / ID_MAP_FILE}: ids of '{feature}' are not "
                             f"0..n-1 in order; regenerate the dataset")
        values.append(raw)
    return out
