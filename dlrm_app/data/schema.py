"""The ``dataset.json`` contract between preprocessing and training.

Every preprocessor (Criteo, MovieLens, the synthetic generator) writes a directory of Parquet
shards plus one ``dataset.json`` describing them; training reads table sizes, feature names and
shard lists from that file only, so nothing downstream is hard-coded for one dataset.

Directory layout::

    <dir>/dataset.json
    <dir>/train-00000.parquet, train-00001.parquet, ...
    <dir>/validation-00000.parquet, ...
    <dir>/test-00000.parquet, ...

Parquet layout of every shard (one row per example):

=================  ==========================================  ============================
column             Arrow type                                  meaning
=================  ==========================================  ============================
``<label>``        ``float32`` (or ``int8``, see label_dtype)  click / rating label, 0 or 1
``dense``          ``fixed_size_list<float32>[n_dense]``       all dense features, in the
                                                               order of ``dense_features``
``<sparse name>``  ``list<int64>``                             ids of one sparse feature, each
                                                               in ``[0, num_embeddings)``;
                                                               one-hot features are lists of
                                                               length 1
=================  ==========================================  ============================

Sparse features are always ``list<int64>`` so one-hot and multi-hot (jagged) features share
one layout and one reader path that builds a KeyedJaggedTensor from list offsets and values.

Example::

    spec = DatasetSpec.load("data/synth")      # strict: unknown or missing keys raise
    spec.sparse_features[0].num_embeddings     # table size for the model
    [s.file for s in spec.split("train").shards]
    verify("data/synth")                       # recompute checksums before a long run
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dlrm_app.inputs import DATASET_JSON, missing_dataset

FORMAT_VERSION = 1
"""Version of the dataset.json layout; bump it on any incompatible change."""

SPLIT_NAMES = ("train", "validation", "test")
DENSE_COLUMN = "dense"
LABEL_DTYPES = ("float32", "int8")


class DatasetKind(enum.Enum):
    """Where a dataset came from; recorded for provenance. In training it decides one default:
    Criteo logs are in time order, so ``--epochs`` defaults to one pass over them."""

    CRITEO = "criteo"
    MOVIELENS = "movielens"
    SYNTHETIC = "synthetic"


def _check_type(name: str, value: object, types: type | tuple[type, ...]) -> None:
    # bool is an int subclass; a JSON `true` where a count is expected is a mistake.
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        ok = False
    else:
        ok = isinstance(value, types)
    if not ok:
        wanted = types.__name__ if isinstance(types, type) else " or ".join(
            t.__name__ for t in types)
        raise ValueError(
            f"key '{name}' must be {wanted}, got {type(value).__name__} {value!r}; "
            f"fix the value in {DATASET_JSON}")


def _check_name(name: str, value: object) -> None:
    _check_type(name, value, str)
    if not value:
        raise ValueError(f"key '{name}' must be a non-empty string")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SparseFeature:
    """One categorical feature: a Parquet column ``list<int64>`` and one embedding table."""

    name: str
    """Column name in the shards and feature key in the KeyedJaggedTensor."""
    num_embeddings: int
    """Cardinality: every id is in ``[0, num_embeddings)``; the embedding table's row count."""
    multi_hot: bool
    """False: every list has exactly one id. True: lists have any length (jagged)."""
    dtype: str = "int64"
    """Arrow type of the ids inside the list; always int64 in format version 1."""
    raw_ids: bool = False
    """True: the ids are raw ids (``preprocess --id-mapping zch``), any value in
    ``[0, num_embeddings)`` (the raw id space, e.g. 2^32 for Criteo's hex ids), not table rows:
    the model maps them to the rows of a table sized at training time with zero-collision
    hashing. Written to dataset.json only when true."""

    def __post_init__(self) -> None:
        _check_name("name", self.name)
        _check_type("num_embeddings", self.num_embeddings, int)
        if self.num_embeddings < 1:
            raise ValueError(f"key 'num_embeddings' of sparse feature '{self.name}' must be "
                             f">= 1, got {self.num_embeddings}")
        _check_type("multi_hot", self.multi_hot, bool)
        _check_type("raw_ids", self.raw_ids, bool)
        if self.dtype != "int64":
            raise ValueError(f"key 'dtype' of sparse feature '{self.name}' must be 'int64', "
                             f"got {self.dtype!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShardFile:
    """One complete Parquet file of a split."""

    file: str
    """File name relative to the dataset directory (no directories: shards sit beside it)."""
    rows: int
    """Number of rows in the file."""
    sha256: str
    """Hex SHA-256 of the file's bytes, checked by ``verify``."""
    row_group_size: int
    """Maximum rows per Parquet row group (the unit the loader reads)."""

    def __post_init__(self) -> None:
        _check_name("file", self.file)
        if os.sep in self.file or "/" in self.file:
            raise ValueError(f"key 'file' must be a bare file name, got {self.file!r}")
        _check_type("rows", self.rows, int)
        if self.rows < 1:
            raise ValueError(f"key 'rows' of shard {self.file} must be >= 1, got {self.rows}")
        _check_type("sha256", self.sha256, str)
        if len(self.sha256) != 64 or any(c not in "0123456789abcdef" for c in self.sha256):
            raise ValueError(f"key 'sha256' of shard {self.file} must be 64 lowercase hex "
                             f"digits, got {self.sha256!r}")
        _check_type("row_group_size", self.row_group_size, int)
        if self.row_group_size < 1:
            raise ValueError(f"key 'row_group_size' of shard {self.file} must be >= 1")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SplitSpec:
    """One split (train, validation or test) and its shards, in reading order."""

    name: str
    """One of ``train``, ``validation``, ``test``."""
    label_rate: float
    """Fraction of rows whose label is 1 (for NE's baseline entropy and sanity checks)."""
    shards: tuple[ShardFile, ...]
    """The split's Parquet files, in order."""

    def __post_init__(self) -> None:
        if self.name not in SPLIT_NAMES:
            raise ValueError(f"split name must be one of {SPLIT_NAMES}, got {self.name!r}")
        _check_type("label_rate", self.label_rate, (float, int))
        if not 0.0 <= self.label_rate <= 1.0:
            raise ValueError(f"key 'label_rate' of split {self.name} must be in [0, 1], "
                             f"got {self.label_rate}")
        _check_type("shards", self.shards, tuple)
        for shard in self.shards:
            _check_type("shards[]", shard, ShardFile)

    @property
    def rows(self) -> int:
        """Total rows over all shards."""
        return sum(s.rows for s in self.shards)

    def one_label_note(self) -> str | None:
        """Why no AUC can be computed on this split (its rows all carry one label), or None."""
        if self.rows == 0 or 0.0 < self.label_rate < 1.0:
            return None
        kind = "negative (0)" if self.label_rate == 0.0 else "positive (1)"
        return (f"the {self.name} split ({self.rows} rows) holds only {kind} labels: no AUC "
                "can be computed on it")


PARAMETER_KINDS = {Mapping: "an object", list: "a list", int: "an int", str: "a string"}
"""The JSON types of ``parameters``' known keys, as an error names them."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class DatasetSpec:
    """Everything training needs to know about a preprocessed dataset directory."""

    name: str
    """Human-readable dataset name (e.g. ``criteo-kaggle``, ``synthetic``)."""
    kind: DatasetKind
    """Which preprocessor produced it."""
    dense_features: tuple[str, ...]
    """Names of the dense features, in the order of the ``dense`` column's list."""
    sparse_features: tuple[SparseFeature, ...]
    """Sparse features, in column and KeyedJaggedTensor key order."""
    label: str
    """Name of the label column."""
    label_dtype: str
    """Arrow type of the label column: ``float32`` or ``int8``."""
    splits: tuple[SplitSpec, ...]
    """Exactly the train, validation and test splits, in that order."""
    parameters: Mapping[str, Any]
    """The transform or generation parameters as a plain JSON mapping (provenance only)."""
    created_by: str
    """Tool and version that wrote the dataset, e.g. ``dlrm_app 0.1.0``."""
    dense_dtype: str = "float32"
    """Arrow type of the dense values; always float32 in format version 1."""
    format_version: int = FORMAT_VERSION
    """Layout version of dataset.json; readers reject versions they do not know."""

    def __post_init__(self) -> None:
        _check_name("name", self.name)
        _check_type("kind", self.kind, DatasetKind)
        _check_type("dense_features", self.dense_features, tuple)
        for i, name in enumerate(self.dense_features):
            _check_name(f"dense_features[{i}]", name)
        _check_type("sparse_features", self.sparse_features, tuple)
        for f in self.sparse_features:
            _check_type("sparse_features[]", f, SparseFeature)
        _check_name("label", self.label)
        columns = [self.label, DENSE_COLUMN, *(f.name for f in self.sparse_features)]
        duplicates = sorted({c for c in columns if columns.count(c) > 1})
        if duplicates or len(set(self.dense_features)) != len(self.dense_features):
            raise ValueError(f"column names must be unique (label, 'dense', sparse features) "
                             f"and dense feature names unique; repeated: {duplicates}")
        if self.label_dtype not in LABEL_DTYPES:
            raise ValueError(f"key 'label_dtype' must be one of {LABEL_DTYPES}, "
                             f"got {self.label_dtype!r}")
        _check_type("splits", self.splits, tuple)
        if tuple(getattr(s, "name", None) for s in self.splits) != SPLIT_NAMES:
            raise ValueError(f"key 'splits' must hold exactly {SPLIT_NAMES} in that order")
        _check_type("parameters", self.parameters, Mapping)
        _check_name("created_by", self.created_by)
        if self.dense_dtype != "float32":
            raise ValueError(f"key 'dense_dtype' must be 'float32', got {self.dense_dtype!r}")
        _check_type("format_version", self.format_version, int)
        if self.format_version != FORMAT_VERSION:
            raise ValueError(f"key 'format_version' is {self.format_version}, this reader "
                             f"understands {FORMAT_VERSION}; regenerate the dataset or "
                             f"upgrade dlrm_app")

    # --- the known keys of ``parameters``, typed (dataset.json keeps them in that mapping) ---

    @property
    def teacher_auc(self) -> Mapping[str, float] | None:
        """Generated data: the AUC of the teacher that drew the labels, per split (the best a
        model can reach); None for real data."""
        return self._parameter("teacher_auc", Mapping)

    @property
    def teacher(self) -> Mapping[str, Any] | None:
        """Generated data: the teacher's shape (``dim``, ``temperature``, ...); None otherwise."""
        return self._parameter("teacher", Mapping)

    @property
    def tables(self) -> Mapping[str, Any] | None:
        """The table sizes and the memory they need (``dlrm_app.data.tables.table_summary``);
        None where preprocessing did not record them."""
        return self._parameter("tables", Mapping)

    @property
    def skipped_rows(self) -> int:
        """Bad rows preprocessing dropped (``--on-bad-row skip``); 0 where none were recorded."""
        return self._parameter("skipped_rows", int) or 0

    @property
    def encoding(self) -> Mapping[str, Any] | None:
        """How raw Criteo ids became rows (hash or vocabulary, ``--like`` reuses it); None for
        data with no such encoding."""
        return self._parameter("encoding", Mapping)

    @property
    def id_map_sha256(self) -> str | None:
        """Digest of the id maps the rows were encoded with; None where there are none."""
        return self._parameter("id_map_sha256", str)

    @property
    def day_records(self) -> tuple[Mapping[str, Any], ...]:
        """The days as recorded (``dlrm_app.data.days.read_days`` reads them into ``Day``s);
        empty where the dataset records none."""
        return tuple(self._parameter("days", list) or ())

    @property
    def release(self) -> str | None:
        """MovieLens: the release the ratings came from (``ml-100k``, ...); None otherwise."""
        return self._parameter("release", str)

    def _parameter(self, key: str, kind: type) -> Any:
        value = self.parameters.get(key)
        if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
            raise ValueError(f"dataset '{self.name}': key 'parameters.{key}' must be "
                             f"{PARAMETER_KINDS[kind]}, got {value!r}; preprocess the dataset "
                             "again")
        return value

    def split(self, name: str) -> SplitSpec:
        """The split called ``name`` (train, validation or test)."""
        for s in self.splits:
            if s.name == name:
                return s
        raise KeyError(f"no split {name!r}; splits are {SPLIT_NAMES}")

    def to_json_dict(self) -> dict[str, Any]:
        """The plain JSON mapping written to dataset.json."""
        return {
            "format_version": self.format_version,
            "name": self.name,
            "kind": self.kind.value,
            "created_by": self.created_by,
            "label": self.label,
            "label_dtype": self.label_dtype,
            "dense_dtype": self.dense_dtype,
            "dense_features": list(self.dense_features),
            "sparse_features": [
                {k: v for k, v in dataclasses.asdict(f).items() if k != "raw_ids" or v}
                for f in self.sparse_features
            ],
            "splits": {
                s.name: {"label_rate": s.label_rate,
                         "shards": [dataclasses.asdict(sh) for sh in s.shards]}
                for s in self.splits
            },
            "parameters": dict(self.parameters),
        }

    def save(self, directory: str | os.PathLike[str]) -> Path:
        """Write ``<directory>/dataset.json`` atomically (temp file, then rename)."""
        path = Path(directory) / DATASET_JSON
        tmp = path.with_name(f".{DATASET_JSON}.tmp")
        tmp.write_text(json.dumps(self.to_json_dict(), indent=2) + "\n")
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> DatasetSpec:
        """Read ``<directory>/dataset.json`` strictly.

        Raises ValueError naming the key and the file on unknown keys, missing keys, wrong
        types or out-of-range values.
        """
        path = Path(directory) / DATASET_JSON
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ValueError(missing_dataset(Path(directory))) from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e}); regenerate the dataset") from None
        try:
            return _spec_from_json(data)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None


def _take(data: object, cls: type, where: str, *, exclude: tuple[str, ...] = ()) -> dict:
    """Check ``data`` is a mapping with exactly ``cls``'s keys; return it as kwargs."""
    if not isinstance(data, dict):
        raise ValueError(f"key '{where}' must be an object, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name not in exclude}
    for key in data:
        if key not in fields:
            raise ValueError(f"unknown key '{where}.{key}' (known: {sorted(fields)}); "
                             f"remove it or upgrade dlrm_app")
    for name, f in fields.items():
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if required and name not in data:
            raise ValueError(f"missing required key '{where}.{name}'; regenerate the dataset")
    return dict(data)


def _build(cls: type, kwargs: dict, where: str) -> Any:
    try:
        return cls(**kwargs)
    except ValueError as e:
        raise ValueError(f"in '{where}': {e}") from None


def _as_list(value: object, where: str) -> list:
    if not isinstance(value, list):
        raise ValueError(f"key '{where}' must be a list, got {type(value).__name__}")
    return value


def _spec_from_json(data: object) -> DatasetSpec:
    kw = _take(data, DatasetSpec, "$")
    try:
        kw["kind"] = DatasetKind(kw["kind"])
    except ValueError:
        raise ValueError(f"key '$.kind' must be one of {[k.value for k in DatasetKind]}, "
                         f"got {kw['kind']!r}") from None
    kw["dense_features"] = tuple(_as_list(kw["dense_features"], "$.dense_features"))
    kw["sparse_features"] = tuple(
        _build(SparseFeature, _take(f, SparseFeature, f"$.sparse_features[{i}]"),
               f"$.sparse_features[{i}]")
        for i, f in enumerate(_as_list(kw["sparse_features"], "$.sparse_features")))
    splits = kw["splits"]
    if not isinstance(splits, dict) or tuple(splits) != SPLIT_NAMES:
        raise ValueError(f"key '$.splits' must be an object with keys {list(SPLIT_NAMES)} "
                         f"in that order")
    built = []
    for name, body in splits.items():
        where = f"$.splits.{name}"
        skw = _take(body, SplitSpec, where, exclude=("name",))
        skw["shards"] = tuple(
            _build(ShardFile, _take(sh, ShardFile, f"{where}.shards[{i}]"),
                   f"{where}.shards[{i}]")
            for i, sh in enumerate(_as_list(skw["shards"], f"{where}.shards")))
        built.append(_build(SplitSpec, {"name": name, **skw}, where))
    kw["splits"] = tuple(built)
    if not isinstance(kw["parameters"], dict):
        raise ValueError("key '$.parameters' must be an object")
    return _build(DatasetSpec, kw, "$")


def sha256_file(path: str | os.PathLike[str], chunk_bytes: int = 1 << 20) -> str:
    """Hex SHA-256 of a file, read in ``chunk_bytes`` pieces (bounded memory)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk_bytes):
            digest.update(block)
    return digest.hexdigest()


def verify(directory: str | os.PathLike[str]) -> DatasetSpec:
    """Load ``dataset.json`` and recompute every shard's checksum.

    Returns the spec when all shards are present and intact; raises ValueError naming the
    first missing or modified shard otherwise.
    """
    spec = DatasetSpec.load(directory)
    owned = [(split.name, split.shards) for split in spec.splits]
    for day in spec.day_records:  # days added later own their shards
        owned.append((f"day {day['index']}", tuple(ShardFile(**s) for s in day.get("shards", ()))))
    for name, shards in owned:
        what = name if name.startswith("day ") else f"split '{name}'"
        for shard in shards:
            path = Path(directory) / shard.file
            if not path.is_file():
                raise ValueError(f"{path}: shard of {what} listed in "
                                 f"{DATASET_JSON} is missing; regenerate the dataset")
            actual = sha256_file(path)
            if actual != shard.sha256:
                raise ValueError(f"{path}: checksum mismatch for shard of {what} "
                                 f"(expected {shard.sha256}, got {actual}); "
                                 f"the file was modified or truncated, regenerate it")
    return spec
