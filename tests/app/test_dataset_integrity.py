"""A dataset's shards are checked against dataset.json before anything trains on them: existence,
row counts (every time, from the Parquet footers) and sha256 (once per file version, stamped)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from app_setup import SMALL_MODEL
from shared_data import KAGGLE_10K

from dlrm_app.data import integrity
from dlrm_app.data.integrity import STAMPS, DatasetIntegrityError
from dlrm_app.data.loader import ParquetLoader
from dlrm_app.data.schema import DatasetSpec
from dlrm_app.data.synthetic import generate
from dlrm_app.training.config import TrainConfig
from dlrm_app.training.trainer import train


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("integrity") / "data"
    # 9000 train rows in shards of 4000: 4000, 4000, 1000
    generate(out, rows=11_250, num_dense=2, cardinalities=[100, 30], pooling_factors=[1.0, 2.0],
             zipf_alpha=1.05, seed=0, rows_per_shard=4_000, row_group_size=500)
    return out


@pytest.fixture
def data(pristine: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "data"
    shutil.copytree(pristine, copy)
    shutil.rmtree(copy / STAMPS, ignore_errors=True)
    return copy


@pytest.fixture
def hashes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The files the integrity check hashes, in order."""
    seen: list[str] = []
    real = integrity.sha256_file

    def counting(path: os.PathLike[str]) -> str:
        seen.append(Path(path).name)
        return real(path)

    monkeypatch.setattr(integrity, "sha256_file", counting)
    return seen


def _train_shards(data: Path) -> list[str]:
    return [s.file for s in DatasetSpec.load(data).split("train").shards]


def test_checksums_are_verified_once_per_file_version(data: Path, hashes: list[str]) -> None:
    shards = _train_shards(data)
    assert len(shards) == 3
    ParquetLoader(data, "train", batch_size=64)
    assert hashes == shards  # first open: every shard hashed
    ParquetLoader(data, "train", batch_size=64)
    assert hashes == shards  # second open: stamps say verified, nothing hashed
    stat = (data / shards[1]).stat()
    os.utime(data / shards[1], ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    ParquetLoader(data, "train", batch_size=64)
    assert hashes == [*shards, shards[1]]  # a touched file is hashed again


def test_ranks_share_the_hashing(data: Path, hashes: list[str]) -> None:
    shards = _train_shards(data)
    ParquetLoader(data, "train", batch_size=64, rank=1, world_size=2)
    assert hashes == [shards[1]]
    ParquetLoader(data, "train", batch_size=64, rank=0, world_size=2)
    assert hashes == [shards[1], shards[0], shards[2]]


def test_flipped_bytes_fail_naming_the_shard(data: Path) -> None:
    shard = data / _train_shards(data)[1]
    ParquetLoader(data, "train", batch_size=64)  # verified and stamped while intact
    raw = bytearray(shard.read_bytes())
    middle = len(raw) // 2
    raw[middle:middle + 64] = bytes(b ^ 0xFF for b in raw[middle:middle + 64])
    shard.write_bytes(bytes(raw))  # same size, new mtime: the stamp no longer applies
    with pytest.raises(DatasetIntegrityError,
                       match=f"{shard}: shard of split 'train' does not match its checksum"):
        ParquetLoader(data, "train", batch_size=64)


def test_replaced_shard_fails_on_its_row_count(data: Path) -> None:
    shards = _train_shards(data)
    shutil.copyfile(data / shards[2], data / shards[0])  # 1000 rows where 4000 were written
    with pytest.raises(DatasetIntegrityError,
                       match=f"{data / shards[0]}: shard of split 'train' has 1000 rows but "
                             "dataset.json records 4000"):
        ParquetLoader(data, "train", batch_size=64)


def test_truncated_shard_is_named(data: Path) -> None:
    shard = data / _train_shards(data)[0]
    shard.write_bytes(shard.read_bytes()[:200])
    with pytest.raises(DatasetIntegrityError, match=f"{shard}: .*not a readable Parquet file"):
        ParquetLoader(data, "train", batch_size=64)


def test_stamps_fall_back_to_the_user_cache(data: Path, hashes: list[str], tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    (data / STAMPS).write_text("a file where the stamp folder would go")  # unwritable
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    ParquetLoader(data, "train", batch_size=64)
    ParquetLoader(data, "train", batch_size=64)
    assert hashes == _train_shards(data)  # hashed once, remembered in the user cache
    assert len(list((tmp_path / "cache" / "dlrm_app" / "verified").glob("*/*.json"))) == 3


def test_training_refuses_a_damaged_dataset(data: Path, tmp_path: Path) -> None:
    shard = data / DatasetSpec.load(data).split("validation").shards[0].file
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    shard.write_bytes(bytes(raw))
    config = TrainConfig.from_flags(data=str(data), out=str(tmp_path / "run"), model=SMALL_MODEL,
                                    batch_size=256, max_steps=2)
    with pytest.raises(DatasetIntegrityError, match=f"{shard}: shard of split 'validation'"):
        train(config, progress=False)


@pytest.mark.shared_data(KAGGLE_10K)
def test_export_refuses_an_altered_vocabulary(tmp_path: Path) -> None:
    from dlrm_app.data.criteo import VOCABULARY_FILE, preprocess_criteo
    from dlrm_app.serving.export import dataset_preprocessing

    sample = tmp_path / "sample.tsv"
    sample.write_bytes(b"\n".join(KAGGLE_10K.read_bytes().split(b"\n")[:2000]) + b"\n")
    spec = preprocess_criteo([sample], tmp_path / "criteo")
    assert dataset_preprocessing(spec, tmp_path / "criteo").vocabulary  # intact: used
    vocab = tmp_path / "criteo" / VOCABULARY_FILE
    raw = bytearray(vocab.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    vocab.write_bytes(bytes(raw))
    with pytest.raises(DatasetIntegrityError, match=f"{vocab}: does not match its checksum"):
        dataset_preprocessing(spec, tmp_path / "criteo")
