"""Criteo preprocessing with worker processes: the same bytes as one process on every path
(workers writing whole shards of plain or gzip input, streaming), errors and resumption
included. Workers come from a fork server, so a ``workers > 1`` run starts in well under a
second after the first."""

from __future__ import annotations

import gzip
import hashlib
from pathlib import Path

import pytest
from app_setup import criteo_lines
from shared_data import CRITEO

from dlrm_app.data import criteo, shard_writer
from dlrm_app.data.criteo import job, lines, preprocess_criteo, shard_tasks

DATA = CRITEO
needs_data = pytest.mark.shared_data(DATA)
SMALL = dict(rows_per_shard=700, row_group_size=256, block_bytes=50_000)


@pytest.fixture(autouse=True)
def many_shards(monkeypatch) -> None:
    """These inputs are tiny: take the path meant for inputs of many shards (gzip lines cut
    into shard tasks for the workers) wherever it applies, as a real input would."""
    monkeypatch.setattr(job, "many_shards", lambda *args: True)


def digest(out: Path) -> dict[str, str]:
    """sha256 of every shard, the vocabulary and dataset.json (what a reader sees)."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.iterdir())
            if p.suffix in (".parquet", ".json")}


def write_rows(path: Path, rows: int, seed: int, bad: tuple[int, ...] = ()) -> None:
    """Criteo-shaped rows with missing and stripped trailing fields; 0-based rows in ``bad``
    get the label 2."""
    lines = criteo_lines(rows, seed, ids=300, lowest_dense=-1, bad=bad)
    data = ("\n".join(lines) + "\n").encode()
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)


@needs_data
@pytest.mark.parametrize("case", ["kaggle_gz", "terabyte", "vocabulary", "default",
                                  "default_gz"])
@pytest.mark.slow
def test_two_workers_match_one_on_samples(tmp_path: Path, case: str) -> None:
    head = DATA / "kaggle_head_10k.tsv"
    day = DATA / "terabyte_day_sample_1k.tsv"
    gz = tmp_path / "head.tsv.gz"
    gz.write_bytes(gzip.compress(head.read_bytes()))
    inputs, one_inputs, kwargs = {
        # gzip in one pass (the splits are found after reading) against the counted plain file
        "kaggle_gz": ([gz], [head], dict(num_embeddings_per_feature=1000)),
        "terabyte": ([day, gz, day], [day, gz, day],
                     dict(fmt="terabyte", num_embeddings_per_feature=1000)),
        "vocabulary": ([head], [head], dict(frequency_threshold=3)),
        # the default encoding: a train vocabulary sized from the data
        "default": ([head], [head], {}),
        "default_gz": ([gz], [head], dict(max_embeddings_per_feature=100)),
    }[case]
    one = preprocess_criteo(one_inputs, tmp_path / "one", **SMALL, **kwargs)
    two = preprocess_criteo(inputs, tmp_path / "two", workers=2, **SMALL, **kwargs)
    a, b = digest(tmp_path / "one"), digest(tmp_path / "two")
    if inputs != one_inputs:  # dataset.json names the inputs
        assert one.to_json_dict()["splits"] == two.to_json_dict()["splits"]
        del a["dataset.json"], b["dataset.json"]
    assert a == b and len(a) > 10
    assert not (tmp_path / "two" / criteo.STAGING_DIR).exists()


@pytest.mark.parametrize("workers", [1, 2])  # streaming; lines cut into shards for workers
@pytest.mark.slow
def test_gzip_is_read_once_and_matches_plain(tmp_path: Path, monkeypatch, workers: int) -> None:
    plain, gz = tmp_path / "in.tsv", tmp_path / "in.tsv.gz"
    write_rows(plain, 3000, seed=1)
    write_rows(gz, 3000, seed=1)
    opened = []
    real = lines.read_blocks

    def tracking_read_blocks(path, *args, **kwargs):
        opened.append(Path(path).name)
        return real(path, *args, **kwargs)

    def no_counting(path, *args, **kwargs):
        raise AssertionError(f"{path} decompressed to count its lines")

    monkeypatch.setattr(lines, "read_blocks", tracking_read_blocks)
    monkeypatch.setattr(lines, "count_lines", no_counting)
    kwargs = dict(num_embeddings_per_feature=1000, block_bytes=8192, rows_per_shard=500,
                  row_group_size=128)
    spec = preprocess_criteo([gz], tmp_path / "gz", workers=workers, **kwargs)
    assert opened == ["in.tsv.gz"]  # by this process, the only one that can read it
    preprocess_criteo([plain], tmp_path / "plain", **kwargs)
    a, b = digest(tmp_path / "gz"), digest(tmp_path / "plain")
    assert a.pop("dataset.json") != b.pop("dataset.json")  # only the input name differs
    assert a == b
    assert [s.rows for s in spec.splits] == [2571, 214, 215]


@pytest.mark.parametrize("path", ["direct", "streaming"])
@pytest.mark.slow
def test_many_blocks_same_bytes_for_1_2_3_workers(tmp_path: Path, path: str) -> None:
    """Two inputs of about 40 blocks each: plain with bad rows as errors (workers write whole
    shards) or gzip with bad rows skipped (the parent writes)."""
    streaming = path == "streaming"
    paths = [tmp_path / ("a.tsv.gz" if streaming else "a.tsv"), tmp_path / "b.tsv"]
    write_rows(paths[0], 2500, seed=2, bad=(3, 1100, 1101, 2400) if streaming else ())
    write_rows(paths[1], 700, seed=3, bad=(0,) if streaming else ())
    kwargs = dict(num_embeddings_per_feature=97, on_bad_row="skip" if streaming else "error",
                  rows_per_shard=300, row_group_size=64, block_bytes=4096)
    outs = []
    for workers in (1, 2, 3):
        spec = preprocess_criteo(paths, tmp_path / f"w{workers}", workers=workers, **kwargs)
        assert spec.parameters["skipped_rows"] == (5 if streaming else 0)
        outs.append(digest(tmp_path / f"w{workers}"))
    assert outs[0] == outs[1] == outs[2]
    assert len(outs[0]) == 13  # 10 train shards, validation, test, dataset.json


@pytest.mark.parametrize(("suffix", "many"), [(".tsv", True), (".tsv.gz", True),
                                             (".tsv.gz", False)])  # the last streams
@pytest.mark.slow
def test_worker_bad_row_names_file_and_line_and_leaves_nothing_finished(
        tmp_path: Path, monkeypatch, suffix: str, many: bool) -> None:
    monkeypatch.setattr(job, "many_shards", lambda *args: many)
    path = tmp_path / f"in{suffix}"
    write_rows(path, 3000, seed=4, bad=(2499,))
    out = tmp_path / "out"
    # shards of 100 rows: many staging shards are finished before the bad block is reached
    with pytest.raises(ValueError, match=r"in\.tsv(\.gz)?:2500: label '2' is not 0 or 1"):
        preprocess_criteo([path], out, num_embeddings_per_feature=10, workers=2,
                          rows_per_shard=100, block_bytes=4096)
    assert not (out / "dataset.json").exists()
    assert not list(out.glob("*.parquet"))
    assert not list(out.rglob("*.tmp"))


def test_worker_truncated_gzip_raises(tmp_path: Path) -> None:
    path = tmp_path / "cut.tsv.gz"
    write_rows(path, 3000, seed=5)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"cut\.tsv\.gz: truncated or corrupt gzip"):
        preprocess_criteo([path], tmp_path / "out", workers=2, block_bytes=4096)
    assert not (tmp_path / "out" / "dataset.json").exists()


@pytest.mark.parametrize(("kill_at", "workers", "suffix", "on_bad_row"), [
    ("stage-00002.parquet", 2, ".tsv.gz", "skip"),  # streaming: the parent writes
    ("validation-00000.parquet", 1, ".tsv.gz", "skip"),  # cutting validation from staging
    ("_finalize", 2, ".tsv", "error"),  # after the workers wrote every shard of a plain input
    ("_Spiller._close", 2, ".tsv.gz", "error"),  # while gzip lines go to the workers
])
@pytest.mark.slow
def test_kill_and_rerun_is_byte_identical(tmp_path: Path, monkeypatch, kill_at: str,
                                          workers: int, suffix: str, on_bad_row: str) -> None:
    path = tmp_path / f"in{suffix}"
    write_rows(path, 3000, seed=6, bad=(10, 2800) if on_bad_row == "skip" else ())
    kwargs = dict(num_embeddings_per_feature=1000, on_bad_row=on_bad_row, rows_per_shard=400,
                  row_group_size=100, block_bytes=8192)
    preprocess_criteo([path], tmp_path / "full", **kwargs)
    owner, name = (shard_tasks.Spiller, "_close") if kill_at == "_Spiller._close" else \
        (job, "finalize") if kill_at == "_finalize" else (shard_writer, "finish_shard")
    real, calls = getattr(owner, name), []

    def killed(*args, **kw):
        calls.append(args)
        if kill_at == "_finalize":  # before anything is renamed
            raise KeyboardInterrupt("simulated kill")
        result = real(*args, **kw)
        if (kill_at == "_Spiller._close" and len(calls) == 4) or args[1:2] == (kill_at,):
            raise KeyboardInterrupt("simulated kill")
        return result

    with monkeypatch.context() as patch:
        patch.setattr(owner, name, killed)
        with pytest.raises(KeyboardInterrupt):
            preprocess_criteo([path], tmp_path / "resumed", workers=workers, **kwargs)
    resumed = tmp_path / "resumed"
    assert not (resumed / "dataset.json").exists()
    finished = {p.name: p.stat().st_mtime_ns for p in resumed.rglob("*.parquet")}
    assert finished
    preprocess_criteo([path], resumed, workers=workers, **kwargs)
    assert digest(tmp_path / "full") == digest(resumed)
    if workers > 1 and kill_at != "stage-00002.parquet":  # no finished shard was rewritten
        kept = {p.stat().st_mtime_ns for p in resumed.glob("*.parquet")}
        assert set(finished.values()) <= kept
    assert not list(resumed.rglob("*.tsv"))


def test_workers_must_be_positive(tmp_path: Path) -> None:
    path = tmp_path / "in.tsv"
    write_rows(path, 10, seed=7)
    with pytest.raises(ValueError, match="workers must be a positive int"):
        preprocess_criteo([path], tmp_path / "out", workers=0)
