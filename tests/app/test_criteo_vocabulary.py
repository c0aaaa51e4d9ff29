"""Criteo table sizes that follow the data: the default train-split vocabulary (threshold and
cap), held-out files encoded as one split, the table summary, and the errors around them; every
value against a plain-Python count of the sample files."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from shared_data import CRITEO, KAGGLE_10K, ML100K

from dlrm_app.data.criteo import (
    DEFAULT_FREQUENCY_THRESHOLD,
    DEFAULT_MAX_EMBEDDINGS_PER_FEATURE,
    NUM_SPARSE,
    VOCABULARY_FILE,
    load_vocabulary,
    preprocess_criteo,
)
from dlrm_app.data.criteo.vocabulary import IdCounts, select
from dlrm_app.data.loader import ParquetLoader
from dlrm_app.data.schema import DatasetSpec, verify
from dlrm_app.data.tables import format_table_summary

needs_10k = pytest.mark.shared_data(KAGGLE_10K)
DAY = CRITEO / "terabyte_day_sample_1k.tsv"


def raw_ids(path: Path) -> list[list[int]]:
    """Per line, the 26 raw categorical ids (missing -> 0), split field by field."""
    return [[int(h, 16) if h else 0 for h in (line.split("\t") + [""] * 40)[14:40]]
            for line in path.read_text().splitlines()]


def reference_vocab(train: list[list[int]], k: int, threshold: int, cap: int) -> list[int]:
    """Sorted raw ids that keep rows: count >= threshold, the cap - 1 most frequent, ties by
    the smaller raw id."""
    counts = Counter(r[k] for r in train)
    ok = sorted((-c, v) for v, c in counts.items() if c >= threshold)
    return sorted(v for _, v in ok[:cap - 1])


def encoded(out: Path) -> list[np.ndarray]:
    """Per split, the [rows, 26] encoded categorical ids."""
    spec = DatasetSpec.load(out)
    result = []
    for split in spec.splits:
        tables = [pq.read_table(out / s.file) for s in split.shards]
        if not tables:
            result.append(np.zeros((0, NUM_SPARSE), np.int64))
            continue
        t = pa.concat_tables(tables)
        result.append(np.stack([t[f"cat_{k}"].combine_chunks().flatten().to_numpy()
                                for k in range(NUM_SPARSE)], axis=1))
    return result


def check_encoding(out: Path, rows: list[list[int]], vocab: list[list[int]]) -> None:
    """Every row of ``out`` (splits concatenated) encodes ``rows`` through ``vocab``."""
    got = np.concatenate(encoded(out))
    assert got.shape == (len(rows), NUM_SPARSE)
    for k in range(NUM_SPARSE):
        index = {v: i + 1 for i, v in enumerate(vocab[k])}
        np.testing.assert_array_equal(got[:, k], [index.get(r[k], 0) for r in rows],
                                      err_msg=f"cat_{k}")


def test_defaults_are_the_documented_constants() -> None:
    assert DEFAULT_FREQUENCY_THRESHOLD == 1
    assert DEFAULT_MAX_EMBEDDINGS_PER_FEATURE == 10_000_000


@needs_10k
@pytest.mark.slow
def test_default_is_a_train_vocabulary(tmp_path: Path) -> None:
    rows = raw_ids(KAGGLE_10K)
    n_train = len(rows) * 6 // 7  # the split boundaries as with hashing
    spec = preprocess_criteo([KAGGLE_10K], tmp_path)
    assert [s.rows for s in spec.splits] == [n_train, (len(rows) - n_train) // 2,
                                             len(rows) - n_train - (len(rows) - n_train) // 2]
    vocab = [reference_vocab(rows[:n_train], k, 1, 10_000_000) for k in range(NUM_SPARSE)]
    assert [f.num_embeddings for f in spec.sparse_features] == [len(v) + 1 for v in vocab]
    assert [v.tolist() for v in load_vocabulary(tmp_path)] == vocab
    check_encoding(tmp_path, rows, vocab)
    # ids first seen after the train split share row 0
    unseen = [(i, k) for i, r in enumerate(rows[n_train:], n_train) for k in range(NUM_SPARSE)
              if r[k] not in set(vocab[k])]
    assert len(unseen) > 100
    got = np.concatenate(encoded(tmp_path))
    assert all(got[i, k] == 0 for i, k in unseen)
    encoding = spec.parameters["encoding"]
    assert encoding["mode"] == "vocabulary" and encoding["frequency_threshold"] == 1
    assert encoding["max_embeddings_per_feature"] == [10_000_000] * NUM_SPARSE
    assert encoding["distinct_train_ids"] == [len(v) for v in vocab]
    assert encoding["train_coverage"] == [1.0] * NUM_SPARSE
    verify(tmp_path)


@needs_10k
@pytest.mark.parametrize("cap", [50, [2, 3, 1000] + [20] * 23])
def test_cap_keeps_the_most_frequent_ids(tmp_path: Path, cap: int | list[int]) -> None:
    rows = raw_ids(KAGGLE_10K)
    train = rows[:len(rows) * 6 // 7]
    caps = [cap] * NUM_SPARSE if isinstance(cap, int) else cap
    spec = preprocess_criteo([KAGGLE_10K], tmp_path, max_embeddings_per_feature=cap)
    vocab = [reference_vocab(train, k, 1, caps[k]) for k in range(NUM_SPARSE)]
    sizes = [f.num_embeddings for f in spec.sparse_features]
    assert sizes == [len(v) + 1 for v in vocab]
    assert all(n <= c for n, c in zip(sizes, caps, strict=True))
    assert sizes[0] == caps[0] and sizes[2] == caps[2]  # the cap binds on these
    check_encoding(tmp_path, rows, vocab)
    encoding = spec.parameters["encoding"]
    assert encoding["qualified_ids"] == [len(set(r[k] for r in train)) for k in range(26)]
    for k in range(NUM_SPARSE):  # the share of train rows whose id kept its row
        kept = set(vocab[k])
        assert encoding["train_coverage"][k] == pytest.approx(
            sum(r[k] in kept for r in train) / len(train), abs=1e-6)


@needs_10k
def test_threshold_two_against_one(tmp_path: Path) -> None:
    rows = raw_ids(KAGGLE_10K)
    train = rows[:len(rows) * 6 // 7]
    one = preprocess_criteo([KAGGLE_10K], tmp_path / "one", frequency_threshold=1)
    two = preprocess_criteo([KAGGLE_10K], tmp_path / "two", frequency_threshold=2)
    vocab = [reference_vocab(train, k, 2, 10_000_000) for k in range(NUM_SPARSE)]
    check_encoding(tmp_path / "two", rows, vocab)
    sizes_one = [f.num_embeddings for f in one.sparse_features]
    sizes_two = [f.num_embeddings for f in two.sparse_features]
    singletons = [sum(c == 1 for c in Counter(r[k] for r in train).values())
                  for k in range(NUM_SPARSE)]
    assert [a - b for a, b in zip(sizes_one, sizes_two, strict=True)] == singletons
    assert sum(singletons) > 1000  # the sample's long tail


@needs_10k
def test_held_out_file_as_one_split_with_the_reference_encoding(tmp_path: Path) -> None:
    ref = preprocess_criteo([KAGGLE_10K], tmp_path / "ref")
    held = preprocess_criteo([DAY], tmp_path / "held", like=tmp_path / "ref", one_split="test")
    assert [s.rows for s in held.splits] == [0, 0, 1000]
    assert [len(s.shards) for s in held.splits] == [0, 0, 1]
    assert [f.num_embeddings for f in held.sparse_features] == \
        [f.num_embeddings for f in ref.sparse_features]
    assert (tmp_path / "held" / VOCABULARY_FILE).read_bytes() == \
        (tmp_path / "ref" / VOCABULARY_FILE).read_bytes()
    vocab = [v.tolist() for v in load_vocabulary(tmp_path / "ref")]
    check_encoding(tmp_path / "held", raw_ids(DAY), vocab)
    verify(tmp_path / "held")
    # evaluation reads every row of the split (padded batches, each row once)
    loader = ParquetLoader(tmp_path / "held", "test", batch_size=128, drop_last=False,
                           pad_last=True, prefetch=0)
    assert sum(len(b.labels) if b.valid_rows is None else b.valid_rows for b in loader) == 1000
    # the terabyte format of one held-out day, as validation
    day = preprocess_criteo([DAY], tmp_path / "day", fmt="terabyte", like=tmp_path / "ref",
                            one_split="validation")
    assert [s.rows for s in day.splits] == [0, 1000, 0]


def test_one_split_needs_like(tmp_path: Path) -> None:
    path = tmp_path / "in.tsv"
    path.write_text("1\t2\n")
    with pytest.raises(ValueError, match=r"one_split='test' .* like="):
        preprocess_criteo([path], tmp_path / "out", one_split="test")
    with pytest.raises(ValueError, match="one_split must be one of"):
        preprocess_criteo([path], tmp_path / "out", like=tmp_path, one_split="eval")


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(num_embeddings_per_feature=1000, frequency_threshold=2),
     r"--num-embeddings-per-feature.*hashes.*--frequency-threshold.*one kind"),
    (dict(num_embeddings_per_feature=1000, max_embeddings_per_feature=50),
     r"--max-embeddings-per-feature.*one kind"),
    (dict(like="somewhere", max_embeddings_per_feature=50), r"drop max_embeddings_per_feature"),
    (dict(max_embeddings_per_feature=[5] * 25), r"one positive int or 26"),
    (dict(max_embeddings_per_feature=0), r"one positive int or 26"),
    (dict(frequency_threshold=0), r"frequency_threshold must be an int >= 1"),
])
def test_hashing_and_vocabulary_are_exclusive(tmp_path: Path, kwargs: dict,
                                              message: str) -> None:
    path = tmp_path / "in.tsv"
    path.write_text("1\t2\n")
    with pytest.raises(ValueError, match=message):
        preprocess_criteo([path], tmp_path / "out", **kwargs)
    assert not (tmp_path / "out").exists()  # refused before anything is written


@pytest.mark.shared_data(ML100K / "u.data")
@pytest.mark.parametrize("kwargs", [{}, dict(num_embeddings_per_feature=100, workers=2)])
def test_skipping_every_row_is_an_error(tmp_path: Path, kwargs: dict) -> None:
    wrong = tmp_path / "u.data"  # MovieLens ratings, not Criteo rows
    lines = ML100K.joinpath("u.data").read_text().splitlines()[:300]
    # (user 1's ratings would pass for rows: label 1, three integers, categoricals missing)
    wrong.write_text("\n".join(x for x in lines if not x.startswith("1\t")) + "\n")
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=r"u\.data: all \d+ rows read are bad rows .*"
                                         r"u\.data:1 '196\\t242\\t3\\t881250949': label '196' "
                                         r"is not 0 or 1.* not Criteo kaggle rows"):
        preprocess_criteo([wrong], out, on_bad_row="skip", **kwargs)
    assert not (out / "dataset.json").exists()


def test_counting_memory_is_bounded(tmp_path: Path) -> None:
    path = tmp_path / "in.tsv"
    rng = np.random.default_rng(0)
    lines = ["\t".join(["1"] + ["0"] * 13 + [f"{v:08x}" for v in rng.integers(0, 2**32, 26)])
             for _ in range(2000)]
    path.write_text("\n".join(lines) + "\n")
    # 52,000 distinct ids in train need about 0.8 MB held: refused under 0.5 MB
    with pytest.raises(ValueError, match=r"more than 0\.5 MiB .* num_embeddings_per_feature "
                                         r"\(--num-embeddings-per-feature, e\.g\. 40000000"):
        preprocess_criteo([path], tmp_path / "out", vocabulary_memory_bytes=500_000,
                          block_bytes=20_000)
    spec = preprocess_criteo([path], tmp_path / "out", vocabulary_memory_bytes=8_000_000,
                             block_bytes=20_000)
    assert sum(f.num_embeddings for f in spec.sparse_features) == 26 * (2000 * 6 // 7 + 1)


def test_id_counts_merge_exactly() -> None:
    """Many blocks (pending counts merged many times) against a Counter."""
    rng = np.random.default_rng(1)
    counter = IdCounts(1 << 30, "test")
    want = [Counter() for _ in range(NUM_SPARSE)]
    for _ in range(60):
        per_feature = []
        for k in range(NUM_SPARSE):
            values = rng.zipf(1.3, 3000) % (10 ** (k % 6 + 1))
            want[k].update(values.tolist())
            per_feature.append(np.unique(values, return_counts=True))
        counter.add(per_feature, 3000, "here")
    ids, counts = counter.finish("here")
    assert counter.rows == 180_000
    for k in range(NUM_SPARSE):
        assert dict(zip(ids[k].tolist(), counts[k].tolist(), strict=True)) == dict(want[k])
        assert (np.diff(ids[k]) > 0).all()


def test_select_breaks_ties_by_the_smaller_raw_id() -> None:
    ids = np.array([3, 5, 8, 9, 12, 40])
    counts = np.array([2, 7, 2, 1, 7, 2])
    # 5 and 12 (7 each), then 3 of 3 / 8 / 40 (2 each)
    assert ids[select(ids, counts, threshold=2, max_embeddings=4)].tolist() == [3, 5, 12]
    assert ids[select(ids, counts, threshold=2, max_embeddings=100)].tolist() == \
        [3, 5, 8, 12, 40]
    assert ids[select(ids, counts, threshold=1, max_embeddings=100)].tolist() == ids.tolist()
    assert select(ids, counts, threshold=1, max_embeddings=1).tolist() == []  # only row 0


@needs_10k
def test_table_summary_sizes_and_memory(tmp_path: Path) -> None:
    spec = preprocess_criteo([KAGGLE_10K], tmp_path, max_embeddings_per_feature=1000)
    tables = spec.parameters["tables"]
    sizes = [f.num_embeddings for f in spec.sparse_features]
    assert tables["num_embeddings"] == {f"cat_{k}": n for k, n in enumerate(sizes)}
    assert tables["total_rows"] == sum(sizes)
    assert tables["optimizer"] == "rowwise_adagrad"
    # fp32 weights + one fp32 row-wise Adagrad accumulator per row
    assert tables["train_memory_bytes"] == {str(d): sum(sizes) * (4 * d + 4)
                                            for d in (16, 64, 128)}
    assert DatasetSpec.load(tmp_path).parameters["tables"] == tables
    text = format_table_summary(tables).splitlines()
    assert text[0] == f"cat_0   {sizes[0]:>13,} rows" and len(text) == 28
    mib = [sum(sizes) * (4 * d + 4) / 2**20 for d in (16, 64, 128)]
    assert text[-1] == ("tables in training (fp32 weights + rowwise_adagrad state): "
                        f"dim 16: {mib[0]:.1f} MiB, dim 64: {mib[1]:.1f} MiB, "
                        f"dim 128: {mib[2]:.1f} MiB")
