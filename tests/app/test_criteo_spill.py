"""Parse once: the default vocabulary's counting pass keeps the train rows it parsed
(dlrm_app.data.criteo.spill) and the main pass reads them instead of the text. The oracle is
the same run with spilling off (the text parsed twice, as before): every byte must match."""

from __future__ import annotations

import errno
from pathlib import Path

import numpy as np
import pytest
from test_criteo_count_ranges import rows_text

from dlrm_app.data.criteo import fastparse, job, preprocess_criteo, shard_tasks, spill
from dlrm_app.data.criteo.parse import Rows
from dlrm_app.data.criteo.spill import SpillPlan, SpillWriter, spilled_rows
from dlrm_app.data.schema import DatasetSpec


def strict_rows(rows: int, seed: int) -> list[str]:
    """All 40 fields in every row (the C parser's strict format), ids over 32 bits."""
    rng = np.random.default_rng(seed)
    return ["\t".join([str(rng.integers(0, 2)),
                       *(str(v) for v in rng.geometric(0.05, 13) - 1),
                       *(f"{v:08x}" for v in rng.integers(0, 2**32, 26, dtype=np.uint64))])
            for _ in range(rows)]


def outputs(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.is_file()}


def train_rows(out: Path) -> int:
    return next(s.rows for s in DatasetSpec.load(out).splits if s.name == "train")


def spill_counter(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Rows the main pass reads from the spill (this process's tasks), appended per piece."""
    got: list[int] = []

    def counted(*args, **kwargs):
        for rows in spilled_rows(*args, **kwargs):
            got.append(len(rows.label))
            yield rows

    monkeypatch.setattr(shard_tasks, "spilled_rows", counted)
    return got


@pytest.fixture
def inputs(tmp_path: Path) -> list[Path]:
    """Two inputs (shards cross from one to the next): short rows (the pyarrow path) and
    strict ones (the C parser)."""
    a, b = tmp_path / "a.tsv", tmp_path / "b.tsv"
    a.write_text("\n".join(rows_text(700, seed=11)) + "\n")
    b.write_text("\n".join(strict_rows(650, seed=12)) + "\n")
    return [a, b]


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("rows_per_shard,row_group_size", [(300, 64), (333, 50), (10_000, 7)])
def test_spilled_rows_give_the_bytes_of_parsing_twice(tmp_path: Path, inputs: list[Path],
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      workers: int, rows_per_shard: int,
                                                      row_group_size: int) -> None:
    # 4 KB blocks: many counting tasks (spill files), several blocks in some of them
    kwargs = dict(workers=workers, block_bytes=4096, rows_per_shard=rows_per_shard,
                  row_group_size=row_group_size)
    with monkeypatch.context() as patch:
        patch.setattr(job, "should_spill", lambda *a: False)
        got = spill_counter(patch)
        preprocess_criteo(inputs, tmp_path / "twice", **kwargs)
        assert got == []
    got = spill_counter(monkeypatch)
    preprocess_criteo(inputs, tmp_path / "once", **kwargs)
    assert outputs(tmp_path / "once") == outputs(tmp_path / "twice")
    assert not (tmp_path / "once" / ".staging").exists()
    if workers == 1:  # the tasks ran here: every train row came from the spill
        assert sum(got) == train_rows(tmp_path / "once") == 1350 * 6 // 7
        assert max(got) <= row_group_size


class FillingDisk:
    """Spill files on a disk that has ``budget`` bytes left (shared by all files), then fails
    every write with ``error``."""

    def __init__(self, budget: int, error: int) -> None:
        self.left, self.error = budget, error

    def open(self, path: Path, mode: str):
        disk, real = self, open(path, mode)  # noqa: SIM115 (closed by the writer)
        if "w" not in mode:
            return real

        class File:
            closed = property(lambda self: real.closed)

            def write(self, data) -> int:
                size = memoryview(data).nbytes
                if size > disk.left:
                    raise OSError(disk.error, "No space left on device"
                                  if disk.error == errno.ENOSPC else "Input/output error")
                disk.left -= size
                return real.write(data)

            def close(self) -> None:
                real.close()

        return File()


def test_full_disk_while_spilling_parses_those_lines_again(tmp_path: Path, inputs: list[Path],
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    kwargs = dict(block_bytes=4096, rows_per_shard=300, row_group_size=64)
    preprocess_criteo(inputs, tmp_path / "plain", **kwargs)
    monkeypatch.setattr(spill, "open", FillingDisk(60_000, errno.ENOSPC).open, raising=False)
    dropped = []
    real_drop = SpillWriter._drop

    def drop(self):
        dropped.append(self.path)
        real_drop(self)

    monkeypatch.setattr(SpillWriter, "_drop", drop)
    got = spill_counter(monkeypatch)
    preprocess_criteo(inputs, tmp_path / "full", **kwargs)
    assert outputs(tmp_path / "full") == outputs(tmp_path / "plain")
    assert 0 < sum(got) < train_rows(tmp_path / "full")  # some ranges spilled, some not
    assert dropped and not any(p.exists() for p in dropped)


def test_other_write_errors_of_the_spill_fail_the_run(tmp_path: Path, inputs: list[Path],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spill, "open", FillingDisk(0, errno.EIO).open, raising=False)
    with pytest.raises(OSError, match="Input/output error"):
        preprocess_criteo(inputs, tmp_path / "out", block_bytes=4096)
    assert not list((tmp_path / "out").rglob(spill.SPILL_GLOB))


def test_killed_run_leaves_no_spill_and_resumes(tmp_path: Path, inputs: list[Path],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    kwargs = dict(block_bytes=4096, rows_per_shard=300, row_group_size=64)
    preprocess_criteo(inputs, tmp_path / "full", **kwargs)

    def killed(*args, **kw):
        raise KeyboardInterrupt("simulated kill")

    with monkeypatch.context() as patch:
        patch.setattr(job, "finalize", killed)
        with pytest.raises(KeyboardInterrupt):
            preprocess_criteo(inputs, tmp_path / "resumed", **kwargs)
    staging = tmp_path / "resumed" / ".staging"
    assert list(staging.glob("stage-*.parquet")) and not list(staging.glob(spill.SPILL_GLOB))
    # a kill -9 leaves the spill behind: a rerun writes it anew
    (staging / "parsed-00000-000000000000.rows").write_bytes(b"left by a killed run")
    preprocess_criteo(inputs, tmp_path / "resumed", **kwargs)
    assert outputs(tmp_path / "resumed") == outputs(tmp_path / "full")


def test_spill_is_skipped_without_room_on_the_disk(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    class Usage:
        free = 2 * spill.ROW_BYTES_ESTIMATE * 1000

    monkeypatch.setattr(spill.shutil, "disk_usage", lambda path: Usage)
    assert spill.should_spill(tmp_path, 1000)
    assert not spill.should_spill(tmp_path, 1001)


def test_cover_splits_a_range_into_spilled_and_text_parts(tmp_path: Path) -> None:
    f0, f2 = (0, 100, "f0"), (200, 100, "f2")  # lines 100..199: that task hit a full disk
    plan = SpillPlan({str(tmp_path / "a.tsv"): (f0, f2)})
    assert list(plan.cover(tmp_path / "a.tsv", 50, 200)) == \
        [(50, 50, f0), (100, 100, None), (200, 50, f2)]
    assert list(plan.cover(tmp_path / "a.tsv", 250, 100)) == [(250, 50, f2), (300, 50, None)]
    assert list(plan.cover(tmp_path / "b.tsv", 0, 10)) == [(0, 10, None)]


def test_spilled_rows_round_trip_and_end_row_groups(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)

    def block(n: int, big: bool) -> Rows:
        dense = rng.integers(-5, 2**40 if big else 100, (n, 13))  # big: not narrowed
        cats = rng.integers(0, 2**32, (26, n))
        return Rows(rng.integers(0, 2, n).astype(np.float32), dense, list(cats),
                    np.arange(n))

    blocks = [block(7, False), block(5, True), block(6, False)]
    w = SpillWriter(tmp_path / "s.rows")
    for b in blocks:
        w.add(b)
    assert w.close()
    label = np.concatenate([b.label for b in blocks])
    dense = np.concatenate([b.dense for b in blocks])
    cats = np.concatenate([np.asarray(b.cats) for b in blocks], axis=1)
    # the file holds lines 100..117; read 103..114 into a shard that has 2 rows already
    got = list(spilled_rows((100, 18, str(tmp_path / "s.rows")), 103, 12, 4, done=2))
    assert [len(r.label) for r in got] == [2, 4, 4, 2]
    assert np.array_equal(np.concatenate([r.label for r in got]), label[3:15])
    assert np.array_equal(np.concatenate([r.dense for r in got]), dense[3:15])
    assert np.array_equal(np.concatenate([np.asarray(r.cats) for r in got], axis=1),
                          cats[:, 3:15])
    # narrowed where a block's values fit: the first row group's rows all come from block 0
    assert got[0].dense.dtype == np.int32 and got[0].cats[0].dtype == np.uint32
    assert np.concatenate([r.lines for r in got]).tolist() == list(range(104, 116))


@pytest.mark.parametrize("threads", [1, 2])
def test_spill_files_go_as_the_shards_that_read_them_are_written(
        tmp_path: Path, inputs: list[Path], monkeypatch: pytest.MonkeyPatch,
        threads: int) -> None:
    staging = tmp_path / "out" / ".staging"
    present: list[int] = []  # spill files there as each shard task starts
    write = shard_tasks.write_stage_shard

    def counted(*args, **kwargs):
        present.append(len(list(staging.glob(spill.SPILL_GLOB))))
        return write(*args, **kwargs)

    monkeypatch.setattr(shard_tasks, "write_stage_shard", counted)
    got = spill_counter(monkeypatch)
    preprocess_criteo(inputs, tmp_path / "out", block_bytes=4096, rows_per_shard=300,
                      threads=threads)
    assert sum(got) == 1157  # train rows: 4 shards (300, 300, 300, 257), then validation, test
    assert len(present) == 6
    if threads == 1:
        assert present[0] > present[1] > present[2] > present[3] > 0
        assert present[4:] == [0, 0]
    else:  # tasks start two at a time; files still go while the later shards are written
        assert max(present) > min(present) and max(present) > 0, present


def test_spilled_rows_without_the_c_helper(tmp_path: Path, inputs: list[Path],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """numpy's parse and lookup read the narrowed spill the same way (one process)."""
    monkeypatch.setattr(fastparse, "enabled", False)
    kwargs = dict(block_bytes=4096, rows_per_shard=300, row_group_size=64)
    with monkeypatch.context() as patch:
        patch.setattr(job, "should_spill", lambda *a: False)
        preprocess_criteo(inputs, tmp_path / "twice", **kwargs)
    got = spill_counter(monkeypatch)
    preprocess_criteo(inputs, tmp_path / "once", **kwargs)
    assert sum(got) == train_rows(tmp_path / "once")
    assert outputs(tmp_path / "once") == outputs(tmp_path / "twice")
