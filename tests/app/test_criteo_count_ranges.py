"""The vocabulary's counting pass over plain inputs: workers read their own line ranges (found
with the line index) instead of blocks handed out by the parent. Every range is checked
against a plain-Python count of exactly its lines, including ranges that start mid-file, span
several blocks, end at a last line without newline, or hold CRLF line ends; a bad row is
reported with the right file:line from any range."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from app_setup import criteo_lines

from dlrm_app.data.criteo import job, preprocess_criteo
from dlrm_app.data.criteo.encoding import EncodeSpec, encoder
from dlrm_app.data.criteo.lines import line_counts
from dlrm_app.data.criteo.vocabulary import count_lines_of, load_vocabulary, merge_counts
from dlrm_app.data.criteo.workers import InProcess


def rows_text(rows: int, seed: int, bad: tuple[int, ...] = ()) -> list[str]:
    """Criteo-shaped lines (some missing and stripped trailing fields); 0-based rows in
    ``bad`` get the label 2."""
    return criteo_lines(rows, seed, ids=400, bad=bad)


def python_counts(lines: list[str]) -> list[Counter]:
    """Per feature, a Counter of the raw ids of ``lines`` (missing -> 0)."""
    ids = [[int(h, 16) if h else 0 for h in (line.split("\t") + [""] * 40)[14:40]]
           for line in lines]
    return [Counter(r[k] for r in ids) for k in range(26)]


@pytest.mark.parametrize("end", ["\n", "", "\r\n"])  # newline, last line without, CRLF
@pytest.mark.slow
def test_line_ranges_count_exactly_their_lines(tmp_path: Path, end: str) -> None:
    lines = rows_text(900, seed=1)
    newline = "\r\n" if end == "\r\n" else "\n"
    path = tmp_path / "in.tsv"
    path.write_bytes((newline.join(lines) + end).encode())
    # a 2 KB line index step: the ranges start inside many steps of the index
    counts, indexes = line_counts(InProcess(), [path], [True], 4096, step=2048)
    assert counts == [900]
    for first, n in [(0, 900), (0, 1), (1, 250), (333, 567), (899, 1), (450, 10)]:
        # 3 KB blocks: most ranges are read in several blocks, merged in the task
        got, rows, _ = count_lines_of(path, first, n, indexes[0], 3000, "error")
        want = python_counts(lines[first:first + n])
        assert rows == n
        for k, (ids, c) in enumerate(got):
            assert dict(zip(ids.tolist(), c.tolist(), strict=True)) == dict(want[k])
            assert (np.diff(ids) > 0).all()


def test_bad_row_in_a_later_range_names_its_line(tmp_path: Path) -> None:
    path = tmp_path / "in.tsv"
    path.write_text("\n".join(rows_text(900, seed=2, bad=(700,))) + "\n")
    _, indexes = line_counts(InProcess(), [path], [True], 4096, step=2048)
    with pytest.raises(ValueError, match=r"in\.tsv:701: label '2' is not 0 or 1"):
        count_lines_of(path, 600, 200, indexes[0], 3000, "error")
    got, rows, _ = count_lines_of(path, 600, 200, indexes[0], 3000, "skip")
    assert rows == 199


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.slow
def test_default_vocabulary_from_worker_ranges(tmp_path: Path, workers: int) -> None:
    """Many small ranges (2 KB blocks), CRLF line ends and a last line without newline: the
    vocabulary is every train id (the first 6/7 of the lines), as a plain count says, and
    the same bytes come out of 1 and 2 workers; a bad train row stops the count with its
    line."""
    lines = rows_text(1400, seed=3)
    path = tmp_path / "in.tsv"
    path.write_bytes("\r\n".join(lines).encode())
    spec = preprocess_criteo([path], tmp_path / "out", workers=workers, block_bytes=2048,
                             rows_per_shard=500)
    train = python_counts(lines[:1200])
    vocab = load_vocabulary(tmp_path / "out")
    assert [v.tolist() for v in vocab] == [sorted(c) for c in train]
    assert spec.parameters["encoding"]["distinct_train_ids"] == [len(c) for c in train]
    assert [s.rows for s in spec.splits] == [1200, 100, 100]
    bad = tmp_path / "bad.tsv"
    bad.write_text("\n".join(rows_text(1400, seed=3, bad=(1000,))) + "\n")
    with pytest.raises(ValueError, match=r"bad\.tsv:1001: label '2' is not 0 or 1"):
        preprocess_criteo([bad], tmp_path / "bad", workers=workers, block_bytes=2048)


def test_merge_counts_sums_and_skips_empty_parts() -> None:
    empty = (np.zeros(0, np.int64), np.zeros(0, np.int64))
    ids, counts = merge_counts([empty, (np.array([1, 5]), np.array([2, 1])), empty,
                                (np.array([0, 5, 9]), np.array([1, 3, 4]))])
    assert ids.tolist() == [0, 1, 5, 9] and counts.tolist() == [1, 2, 4, 4]
    ids, counts = merge_counts([empty, empty])
    assert ids.tolist() == [] and counts.tolist() == []


def test_encoders_map_one_shared_copy_of_the_vocabulary(tmp_path: Path) -> None:
    vocab = [np.arange(k, k + 3 * k + 1, dtype=np.int64) for k in range(26)]
    encoding = {"mode": "vocabulary", "num_embeddings": [len(v) + 1 for v in vocab],
                "vocabulary_sha256": "test"}
    spec = EncodeSpec.of(encoding, tmp_path, tmp_path / "staging", vocab)
    mapped = encoder(spec).vocab
    encoder.cache_clear()
    assert mapped is not None and all(isinstance(v.base, np.memmap) for v in mapped)
    assert [v.tolist() for v in mapped] == [v.tolist() for v in vocab]


@pytest.mark.slow
def test_terabyte_train_days_counted_in_ranges(tmp_path: Path) -> None:
    """Terabyte format: every day but the last is train, each read in worker ranges (the
    plain days are counted and indexed first); 1 and 2 workers give the same bytes."""
    days = [rows_text(500, seed=10 + d) for d in range(3)]
    paths = []
    for d, lines in enumerate(days):
        paths.append(tmp_path / f"day_{d}")
        paths[-1].write_text("\n".join(lines) + "\n")
    train = python_counts(days[0] + days[1])
    digests = []
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        preprocess_criteo(paths, out, fmt="terabyte", workers=workers, block_bytes=4096,
                          rows_per_shard=400)
        assert [v.tolist() for v in load_vocabulary(out)] == [sorted(c) for c in train]
        digests.append({p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.is_file()})
    assert digests[0] == digests[1]


@pytest.mark.slow
def test_default_vocabulary_rerun_keeps_finished_shards(tmp_path: Path, monkeypatch) -> None:
    """vocabulary.parquet is written during the main pass, so the run's fingerprint holds a
    digest of the vocabulary's ids: a rerun after a kill keeps every finished shard and gives
    the bytes of one uninterrupted run."""
    path = tmp_path / "in.tsv"
    path.write_text("\n".join(rows_text(1400, seed=4)) + "\n")
    kwargs = dict(workers=2, block_bytes=4096, rows_per_shard=300)
    preprocess_criteo([path], tmp_path / "full", **kwargs)

    def killed(*args, **kw):
        raise KeyboardInterrupt("simulated kill")

    with monkeypatch.context() as patch:
        patch.setattr(job, "finalize", killed)
        with pytest.raises(KeyboardInterrupt):
            preprocess_criteo([path], tmp_path / "resumed", **kwargs)
    staged = {p: p.stat().st_mtime_ns for p in (tmp_path / "resumed").rglob("stage-*.parquet")}
    assert len(staged) == 6  # 4 train, validation, test
    preprocess_criteo([path], tmp_path / "resumed", **kwargs)
    kept = {p.stat().st_mtime_ns for p in (tmp_path / "resumed").glob("*.parquet")}
    assert set(staged.values()) <= kept  # renamed, not rewritten
    files = sorted(p.name for p in (tmp_path / "full").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "resumed").iterdir())
    for name in files:
        assert (tmp_path / "full" / name).read_bytes() == \
            (tmp_path / "resumed" / name).read_bytes(), name
