"""Criteo preprocessing against an independent plain-Python parse of the sample files."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from shared_data import CRITEO

from dlrm_app.data import criteo, shard_writer
from dlrm_app.data.criteo import lines, parse, preprocess_criteo, shard_tasks
from dlrm_app.data.criteo.workers import InProcess
from dlrm_app.data.schema import DatasetSpec, verify

DATA = CRITEO
needs_data = pytest.mark.shared_data(DATA)
N = 1000  # hash size used in the tests


def plain_parse(path: Path) -> list[tuple[float, list[float], list[int], list[bool]]]:
    """The reference DLRM style: split on tabs, pad to 40, convert field by field."""
    rows = []
    for line in path.read_text().splitlines():
        f = line.split("\t")
        f += [""] * (40 - len(f))
        dense = [math.log1p(max(int(x), 0)) if x else 0.0 for x in f[1:14]]
        cats = [int(h, 16) % N if h else 0 for h in f[14:]]
        rows.append((float(f[0]), dense, cats, [h == "" for h in f[14:]]))
    return rows


def read_all(out: Path) -> list[pa.Table]:
    spec = DatasetSpec.load(out)
    return [pa.concat_tables([pq.read_table(out / s.file) for s in split.shards])
            for split in spec.splits]


def check_rows(table: pa.Table, expected: list) -> None:
    assert len(table) == len(expected)
    label = table["label"].to_numpy()
    dense = np.asarray(table["dense"].combine_chunks().flatten()).reshape(-1, 13)
    cats = np.stack([table[f"cat_{k}"].combine_chunks().flatten().to_numpy()
                     for k in range(26)], axis=1)
    np.testing.assert_array_equal(label, [r[0] for r in expected])
    np.testing.assert_allclose(dense, [r[1] for r in expected], rtol=1e-6)
    np.testing.assert_array_equal(cats, [r[2] for r in expected])


@needs_data
@pytest.mark.parametrize("name", ["kaggle_head_10k.tsv", "kaggle_1k_trailing_fields_stripped.tsv"])
def test_kaggle_matches_plain_parse_and_splits(tmp_path: Path, name: str) -> None:
    expected = plain_parse(DATA / name)
    # small blocks so that several blocks, shards and row groups are exercised
    spec = preprocess_criteo([DATA / name], tmp_path, num_embeddings_per_feature=N,
                             rows_per_shard=700, row_group_size=256, block_bytes=50_000)
    n = len(expected)
    train = n * 6 // 7
    val = (n - train) // 2
    assert [s.rows for s in spec.splits] == [train, val, n - train - val]
    tables = read_all(tmp_path)
    check_rows(pa.concat_tables(tables), expected)
    assert spec.parameters["skipped_rows"] == 0
    verify(tmp_path)


@needs_data
def test_stripped_rows_read_back_as_missing(tmp_path: Path) -> None:
    path = DATA / "kaggle_1k_trailing_fields_stripped.tsv"
    expected = plain_parse(path)
    short = [i for i, line in enumerate(path.read_text().splitlines())
             if line.count("\t") < 39]
    assert short, "the sample should have rows with stripped trailing fields"
    preprocess_criteo([path], tmp_path, num_embeddings_per_feature=N)
    table = pa.concat_tables(read_all(tmp_path))
    for i in short:
        row = table.slice(i, 1).to_pylist()[0]
        missing = expected[i][3]
        assert missing[-1]
        assert all(row[f"cat_{k}"] == [0] for k in range(26) if missing[k])


@needs_data
def test_terabyte_days_split_and_gzip(tmp_path: Path) -> None:
    src = DATA / "terabyte_day_sample_1k.tsv"
    day1 = tmp_path / "day_1.gz"
    day1.write_bytes(gzip.compress(src.read_bytes()))
    expected = plain_parse(src)
    spec = preprocess_criteo([src, day1], tmp_path / "out", fmt="terabyte",
                             num_embeddings_per_feature=N, rows_per_shard=400)
    assert [s.rows for s in spec.splits] == [1000, 500, 500]
    train, val, test = read_all(tmp_path / "out")
    check_rows(train, expected)
    check_rows(pa.concat_tables([val, test]), expected)


@needs_data
def test_frequency_threshold_vocabulary_and_like(tmp_path: Path) -> None:
    path = DATA / "kaggle_head_10k.tsv"
    k = 5
    spec = preprocess_criteo([path], tmp_path / "a", frequency_threshold=k)
    lines = path.read_text().splitlines()
    n_train = len(lines) * 6 // 7
    from collections import Counter
    raw = [[int(h, 16) if h else 0 for h in (line.split("\t") + [""] * 40)[14:40]]
           for line in lines]
    table = pa.concat_tables(read_all(tmp_path / "a"))
    for f in (0, 2, 25):
        counts = Counter(r[f] for r in raw[:n_train])
        vocab = sorted(v for v, c in counts.items() if c >= k)
        assert spec.sparse_features[f].num_embeddings == len(vocab) + 1
        index = {v: i + 1 for i, v in enumerate(vocab)}
        got = table[f"cat_{f}"].combine_chunks().flatten().to_numpy()
        np.testing.assert_array_equal(got, [index.get(r[f], 0) for r in raw])
        assert (got == criteo.RARE_ID).any()
    # reuse: a second input encoded with the first dataset's vocabulary
    other = DATA / "terabyte_day_sample_1k.tsv"
    spec_b = preprocess_criteo([other], tmp_path / "b", like=tmp_path / "a")
    assert spec_b.parameters["encoding"]["vocabulary_sha256"] == \
        spec.parameters["encoding"]["vocabulary_sha256"]
    assert (tmp_path / "b" / criteo.VOCABULARY_FILE).read_bytes() == \
        (tmp_path / "a" / criteo.VOCABULARY_FILE).read_bytes()
    got = pa.concat_tables(read_all(tmp_path / "b"))["cat_0"].combine_chunks().flatten()
    counts = Counter(r[0] for r in raw[:n_train])
    vocab = sorted(v for v, c in counts.items() if c >= k)
    index = {v: i + 1 for i, v in enumerate(vocab)}
    want = [index.get(int(f[14], 16) if f[14] else 0, 0)
            for f in (line.split("\t") for line in other.read_text().splitlines())]
    np.testing.assert_array_equal(got.to_numpy(), want)


GOOD = "\t".join(["1"] + ["3"] * 13 + ["68fd1e64"] * 26)
BAD_ROWS = {
    "too_many_columns": (GOOD + "\t5", "41 tab-separated fields"),
    "non_hex": (GOOD.replace("68fd1e64", "zz", 1), "cat_0 = 'zz'"),
    "non_numeric": (GOOD.replace("\t3\t", "\tabc\t", 1), "int_0 = 'abc'"),
    "label": ("2" + GOOD[1:], "label '2'"),
}


@pytest.mark.parametrize("case", sorted(BAD_ROWS))
def test_bad_row_errors_with_file_and_line_or_is_skipped(tmp_path: Path, case: str) -> None:
    bad, message = BAD_ROWS[case]
    path = tmp_path / "in.tsv"
    path.write_text("\n".join([GOOD] * 10 + [bad] + [GOOD] * 3) + "\n")
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=rf"in\.tsv:11: .*{message}"):
        preprocess_criteo([path], out, num_embeddings_per_feature=N)
    assert not (out / "dataset.json").exists()
    assert not list(out.glob("*.parquet"))
    spec = preprocess_criteo([path], out, num_embeddings_per_feature=N, on_bad_row="skip")
    assert spec.parameters["skipped_rows"] == 1
    assert sum(s.rows for s in spec.splits) == 13


def test_truncated_gzip_and_empty_file_raise(tmp_path: Path) -> None:
    path = tmp_path / "cut.tsv.gz"
    data = gzip.compress(("\n".join([GOOD] * 2000) + "\n").encode())
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"cut\.tsv\.gz: truncated or corrupt gzip"):
        preprocess_criteo([path], tmp_path / "o", on_bad_row="skip")
    empty = tmp_path / "empty.tsv"
    empty.write_text("")
    with pytest.raises(ValueError, match=r"empty\.tsv: empty file"):
        preprocess_criteo([empty], tmp_path / "o")
    assert not (tmp_path / "o" / "dataset.json").exists()


@needs_data
@pytest.mark.parametrize("threads", [1, 2])
def test_kill_and_resume_is_byte_identical(tmp_path: Path, monkeypatch, threads: int) -> None:
    src = [DATA / "kaggle_head_10k.tsv"]
    kwargs = dict(num_embeddings_per_feature=N, rows_per_shard=2000, row_group_size=500,
                  block_bytes=100_000, threads=threads)
    preprocess_criteo(src, tmp_path / "full", **kwargs)

    real = shard_writer.finish_shard
    calls = []

    def killed_after_first_shard(*args, **kw):
        result = real(*args, **kw)
        calls.append(args[1])
        if len(calls) == 1:
            raise KeyboardInterrupt("simulated kill")
        return result

    monkeypatch.setattr(shard_writer, "finish_shard", killed_after_first_shard)
    with pytest.raises(KeyboardInterrupt):
        preprocess_criteo(src, tmp_path / "resumed", **kwargs)
    resumed = tmp_path / "resumed"
    assert not (resumed / "dataset.json").exists()
    # nothing finished-looking: the one finished shard waits in the hidden staging folder
    assert not list(resumed.glob("*.parquet"))
    staged = sorted(p.name for p in resumed.rglob("*.parquet"))
    if threads == 1:
        assert staged == ["stage-00000.parquet"]
    else:  # tasks in flight beside the killed one (at most 2 x threads) finished their shards
        assert staged[0] == "stage-00000.parquet" and len(staged) <= 2 * threads, staged
    for name in staged:  # every shard left is complete: recorded in its done-marker
        assert (resumed / criteo.STAGING_DIR / f".{name}.done").is_file(), name
    first = (resumed / criteo.STAGING_DIR / "stage-00000.parquet").stat().st_mtime_ns

    parsed = []
    real_parse = shard_tasks.parse_block  # plain input, bad rows are errors: shard tasks

    def counting_parse(buf, *args, **kw):
        parsed.append(buf.count(b"\n"))
        return real_parse(buf, *args, **kw)

    monkeypatch.setattr(shard_tasks, "parse_block", counting_parse)
    preprocess_criteo(src, resumed, **kwargs)
    # the finished shard was neither rewritten (it was renamed to its final name) nor
    # re-parsed: the rerun starts at the block holding the shard's last row
    assert (resumed / "train-00000.parquet").stat().st_mtime_ns == first
    assert calls.count("stage-00000.parquet") == 1
    redo = 10_000 - 2000 * len(staged)  # the finished shards' rows are not parsed again
    assert redo <= sum(parsed) < redo + 100_000 // 200
    assert not (resumed / criteo.STAGING_DIR).exists()
    full = {p.name: p.read_bytes() for p in (tmp_path / "full").iterdir()
            if p.suffix in (".parquet", ".json")}
    resumed_files = {p.name: p.read_bytes() for p in resumed.iterdir()
                     if p.suffix in (".parquet", ".json")}
    assert full.keys() == resumed_files.keys() and len(full) == 8
    for name in full:
        if name == "dataset.json":
            a, b = json.loads(full[name]), json.loads(resumed_files[name])
            assert a["splits"] == b["splits"]
            # the only difference allowed: the output directory is not recorded at all
            assert a == b
        else:
            assert full[name] == resumed_files[name], name


@needs_data
@pytest.mark.parametrize("workers", ["1", "2"])
def test_cli_prints_one_json_line(tmp_path: Path, capsys, workers: str) -> None:
    from dlrm_app.cli import main

    assert main(["preprocess", "criteo", str(DATA / "kaggle_1k_trailing_fields_stripped.tsv"),
                 "--out", str(tmp_path), "--format", "kaggle", "--workers", workers,
                 "--num-embeddings-per-feature", "1000", "--rows-per-shard", "500"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["rows"] == 1000 and summary["skipped"] == 0 and summary["shards"] == 4
    assert summary["rows_per_s"] > 0


def test_hex_fast_path_matches_python_for_every_byte(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    good = [f"{v:08x}" for v in rng.integers(0, 2**32, 5000)] + ["DEADbeef", "", "00000000"]
    ids, bad = parse.parse_hex(pa.array(good))
    assert not bad.any()
    np.testing.assert_array_equal(ids, [int(h, 16) if h else 0 for h in good])
    for pos in range(8):
        for b in range(128):
            s = bytearray(b"0a1B2c3D")
            s[pos] = b
            text = s.decode()
            _, bad = parse.parse_hex(pa.array([text, "", "68fd1e64"]))
            valid = all(c in "0123456789abcdefABCDEF" for c in text)
            assert list(bad) == [not valid, False, False], text


def test_count_lines_counts_unterminated_last_line(tmp_path: Path) -> None:
    path = tmp_path / "x.tsv"
    path.write_bytes(b"a\nb\nc")
    assert criteo.count_lines(path) == 3
    path.write_bytes(b"a\nb\n")
    assert criteo.count_lines(path) == 2


@pytest.mark.parametrize("data", [b"a\nbb\nc", b"a\nbb\nccc\n", b"\n\n", b"abcdefghij",
                                  b"a\n\n\nlonger line\nb\n"])
def test_line_count_and_index_over_byte_ranges(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "x.tsv"
    path.write_bytes(data)
    # tasks of 4 bytes counting ranges of 2: both cut lines anywhere
    counts, indexes = lines.line_counts(InProcess(), [path, path], [True, False], 4,
                                        step=2)
    starts = [0] + [i + 1 for i, b in enumerate(data[:-1]) if b == ord("\n")]
    assert counts == [len(starts), None] and indexes[1] is None
    assert [indexes[0].locate(path, line) for line in range(len(starts) + 1)] == \
        [*starts, len(data)]
