"""Checks that a dataset's shards are the ones ``dataset.json`` describes, before training on them.

Every time a loader opens a split (train, evaluate; every rank):

* each shard exists and its Parquet footer reads, with the row count ``dataset.json`` records;
* each shard's sha256 matches ``dataset.json`` once per file version: a verified shard leaves a
  stamp ``.verified/<shard>.json`` (size, mtime, checksum) in the dataset folder, so later runs
  re-hash only files whose size or modification time changed. Where the folder is read-only
  the stamps go to ``$XDG_CACHE_HOME/dlrm_app/verified`` (default ``~/.cache``). With several
  ranks each hashes its share of the shards (``rank::world_size``), in parallel.

Failures raise :class:`DatasetIntegrityError` naming the file and the fix. Hashing runs at about
1.5 GB/s per core (sha256 with the CPU's SHA extensions).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from dlrm_app.data.schema import DATASET_JSON, ShardFile, sha256_file

STAMPS = ".verified"
_FIX = "re-run the preprocessing into a fresh --out (or restore the file)"


class DatasetIntegrityError(ValueError):
    """A shard that is missing, unreadable, or not the file dataset.json describes."""


def _what(split: str) -> str:
    """A split, or the days a loader reads (``day 3``, ``days [3, 4]``)."""
    return split if split.startswith("day") else f"split '{split}'"


def read_footer(path: Path, shard: ShardFile, split: str) -> pq.FileMetaData:
    """The shard's Parquet metadata, after checking it exists and holds ``shard.rows`` rows."""
    if not path.is_file():
        raise DatasetIntegrityError(
            f"{path}: shard of {_what(split)} listed in {path.parent / DATASET_JSON} is "
            f"missing; {_FIX}")
    try:
        meta = pq.ParquetFile(path).metadata
    except (pa.ArrowException, OSError) as exc:
        raise DatasetIntegrityError(
            f"{path}: shard of {_what(split)} is not a readable Parquet file "
            f"({str(exc)[:120]}); {_FIX}") from None
    if meta.num_rows != shard.rows:
        raise DatasetIntegrityError(
            f"{path}: shard of {_what(split)} has {meta.num_rows} rows but {DATASET_JSON} "
            f"records {shard.rows}: it is not the file the dataset was written with; {_FIX}")
    return meta


def verify_file(path: Path, sha256: str | None) -> None:
    """A file ``dataset.json`` records a checksum of (the Criteo vocabulary): present and
    intact, or :class:`DatasetIntegrityError` naming it. ``sha256`` None: nothing recorded."""
    if not path.is_file():
        raise DatasetIntegrityError(f"{path}: listed in {path.parent / DATASET_JSON} but "
                                    f"missing; {_FIX}")
    if sha256 is not None and sha256_file(path) != sha256:
        raise DatasetIntegrityError(f"{path}: does not match its checksum in {DATASET_JSON} "
                                    f"(the bytes changed after preprocessing); {_FIX}")


def verify_checksums(
    dataset_dir: Path, shards: Sequence[ShardFile], split: str, rank: int = 0,
    world_size: int = 1,
) -> int:
    """Hash this rank's share of ``shards`` unless a stamp says the file version was verified;
    returns how many files were hashed. Raises :class:`DatasetIntegrityError` on a mismatch."""
    hashed = 0
    for shard in list(shards)[rank::world_size]:
        path = dataset_dir / shard.file
        stat = path.stat()
        version = {"bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": shard.sha256}
        if _read_stamp(dataset_dir, shard.file) == version:
            continue
        actual = sha256_file(path)
        hashed += 1
        if actual != shard.sha256:
            raise DatasetIntegrityError(
                f"{path}: shard of {_what(split)} does not match its checksum in "
                f"{DATASET_JSON} (the bytes changed after preprocessing); {_FIX}")
        _write_stamp(dataset_dir, shard.file, version)
    return hashed


def _stamp_dirs(dataset_dir: Path) -> list[Path]:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    key = hashlib.sha256(str(dataset_dir.resolve()).encode()).hexdigest()[:16]
    return [dataset_dir / STAMPS, cache / "dlrm_app" / "verified" / key]


def _read_stamp(dataset_dir: Path, file: str) -> dict | None:
    for folder in _stamp_dirs(dataset_dir):
        try:
            return json.loads((folder / (file + ".json")).read_text())
        except (OSError, ValueError):
            continue
    return None


def _write_stamp(dataset_dir: Path, file: str, version: dict) -> None:
    """Best effort: a stamp that cannot be written only means hashing again next time."""
    for folder in _stamp_dirs(dataset_dir):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            tmp = folder / f"{file}.json.{os.getpid()}.tmp"
            tmp.write_text(json.dumps(version))
            tmp.replace(folder / (file + ".json"))
            return
        except OSError:
            continue
