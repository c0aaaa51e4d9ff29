"""ParquetLoader against a plain pyarrow read: ranks get balanced contiguous row shares that
cover the split exactly once, at any world size (also with one row group); the row-level
shuffle is deterministic per (seed, epoch) and moves rows across row groups within its window;
resume is exact and skips unread; bad inputs fail clearly."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from dlrm_app.data.integrity import DatasetIntegrityError
from dlrm_app.data.loader import Batch, ParquetLoader
from dlrm_app.data.schema import DatasetSpec
from dlrm_app.data.synthetic import generate

B = 128
Row = tuple  # (label, dense tuple, ids of feature 0, ids of feature 1, ...)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # train: 4800 rows in shards of 2000, 2000, 800; row groups of 300 -> 7 + 7 + 3 = 17,
    # uneven: each shard ends with a row group of 200
    out = tmp_path_factory.mktemp("loader")
    generate(out, rows=6000, num_dense=3, cardinalities=[50, 1000, 7],
             pooling_factors=[1.0, 3.0, 1.0], rows_per_shard=2000, row_group_size=300, seed=3)
    return out


@pytest.fixture(scope="module")
def one_group(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # train: 997 rows in a single row group; validation 2 rows, test 1 row
    out = tmp_path_factory.mktemp("one_group")
    generate(out, rows=1000, num_dense=2, cardinalities=[30, 200], pooling_factors=[1.0, 2.0],
             splits=(0.997, 0.002, 0.001), rows_per_shard=1000, row_group_size=1000, seed=4)
    return out


@pytest.fixture(params=["data", "one_group"])
def dataset(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(request.param)


def _groups(data: Path, split: str = "train") -> list[list[Row]]:
    """The split's rows per row group in file order, by plain pyarrow (not the loader)."""
    spec = DatasetSpec.load(data)
    keys = [f.name for f in spec.sparse_features]
    groups = []
    for shard in spec.split(split).shards:
        f = pq.ParquetFile(data / shard.file)
        for g in range(f.num_row_groups):
            groups.append([(r[spec.label], tuple(r["dense"]), *(tuple(r[k]) for k in keys))
                           for r in f.read_row_group(g).to_pylist()])
    return groups


def _file_rows(data: Path, split: str = "train") -> list[Row]:
    return [row for group in _groups(data, split) for row in group]


def _batch_rows(batch: Batch) -> list[Row]:
    per_key = [[tuple(t.tolist()) for t in jt.to_dense()]
               for jt in batch.sparse.to_dict().values()]
    rows = [(batch.labels[i].item(), tuple(batch.dense[i].tolist()),
             *(ids[i] for ids in per_key)) for i in range(batch.labels.shape[0])]
    return rows if batch.valid_rows is None else rows[:batch.valid_rows]


def _rows(batches: list[Batch]) -> list[Row]:
    return [row for b in batches for row in _batch_rows(b)]


def _batches_equal(a: list[Batch], b: list[Batch]) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x.dense, y.dense) and torch.equal(x.labels, y.labels)
        and torch.equal(x.sparse.values(), y.sparse.values())
        and torch.equal(x.sparse.lengths(), y.sparse.lengths()) and x.valid_rows == y.valid_rows
        for x, y in zip(a, b, strict=True))


def _per_rank(data: Path, world_size: int, split: str = "train",
              **kwargs: object) -> list[list[Batch]]:
    kwargs = {"batch_size": B, "prefetch": 0, **kwargs}
    return [list(ParquetLoader(data, split, rank=r, world_size=world_size, **kwargs))
            for r in range(world_size)]


def _share(n: int, rank: int, world_size: int) -> tuple[int, int]:
    return rank * n // world_size, (rank + 1) * n // world_size


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("drop_last", [True, False])
def test_values_match_pyarrow_read(data: Path, prefetch: int, drop_last: bool) -> None:
    loader = ParquetLoader(data, "train", batch_size=B, prefetch=prefetch, drop_last=drop_last)
    batches = list(loader)
    expected = _file_rows(data)
    if drop_last:
        assert len(batches) == len(loader) == 4800 // B
        expected = expected[:len(batches) * B]
    else:
        assert len(batches) == len(loader) == -(-4800 // B)
        assert batches[-1].labels.shape[0] == 4800 % B
    assert _rows(batches) == expected
    first = batches[0]
    assert first.sparse.keys() == ["cat_0", "cat_1", "cat_2"]
    assert first.dense.dtype == first.labels.dtype == torch.float32
    assert first.dense.shape == (B, 3) and first.labels.shape == (B,)
    assert first.sparse.values().dtype == torch.int64
    assert first.sparse.lengths().dtype in (torch.int32, torch.int64)
    assert first.sparse.stride() == B
    # multi-hot feature really is jagged; one-hot ones have one id per row
    lengths = first.sparse.lengths().view(3, B)
    assert lengths[1].min() >= 1 and lengths[1].max() > 1
    assert bool((lengths[0] == 1).all()) and bool((lengths[2] == 1).all())
    moved = first.to("cpu")
    assert torch.equal(moved.dense, first.dense)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("shuffle", [False, True])
def test_every_row_once_in_balanced_contiguous_shares(dataset: Path, world_size: int,
                                                      shuffle: bool) -> None:
    """pad_last: each rank yields its share of the epoch's row stream, the shares differ by
    at most one row, and together they hold every row of the split exactly once."""
    expected = _file_rows(dataset)
    n = len(expected)
    per_rank = _per_rank(dataset, world_size, drop_last=False, pad_last=True, shuffle=shuffle,
                         seed=5, epoch=1, shuffle_window=500)
    assert len({len(batches) for batches in per_rank}) == 1  # same count on every rank
    shares = [_rows(batches) for batches in per_rank]
    assert [len(s) for s in shares] == [b - a for a, b in
                                        (_share(n, r, world_size) for r in range(world_size))]
    assert max(map(len, shares)) - min(map(len, shares)) <= 1
    seen = [row for share in shares for row in share]
    if shuffle:
        assert seen != expected and sorted(seen) == sorted(expected)
    else:  # file order, cut into contiguous shares
        assert seen == expected
    for batch in (batch for batches in per_rank for batch in batches):
        assert batch.labels.shape[0] == batch.dense.shape[0] == batch.sparse.stride() == B
        # padding: label 0, dense zeros, empty bags
        every_row = Batch(dense=batch.dense, sparse=batch.sparse, labels=batch.labels)
        padding = _batch_rows(every_row)[len(_batch_rows(batch)):]
        assert all(r[0] == 0 and set(r[1]) <= {0.0} and all(ids == () for ids in r[2:])
                   for r in padding)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_drop_last_takes_the_head_of_each_share(dataset: Path, world_size: int) -> None:
    expected = _file_rows(dataset)
    n = len(expected)
    batch_size = 64 if dataset.name.startswith("one_group") else B
    per_rank = _per_rank(dataset, world_size, batch_size=batch_size)
    count = min((b - a) // batch_size for a, b in
                (_share(n, r, world_size) for r in range(world_size)))
    assert count > 0
    for r, batches in enumerate(per_rank):
        assert len(batches) == count
        begin = _share(n, r, world_size)[0]
        assert _rows(batches) == expected[begin:begin + count * batch_size]


def test_one_row_group_trains_on_four_ranks(one_group: Path) -> None:
    assert len(_groups(one_group)) == 1
    loaders = [ParquetLoader(one_group, "train", batch_size=64, rank=r, world_size=4,
                             shuffle=True) for r in range(4)]
    assert {len(loader) for loader in loaders} == {997 // 4 // 64}
    assert all(len(list(loader)) == 3 for loader in loaders)


def test_deterministic_per_seed_and_epoch(data: Path) -> None:
    def run(epoch: int, seed: int = 7) -> list[Batch]:
        return list(ParquetLoader(data, "train", batch_size=B, shuffle=True, seed=seed,
                                  epoch=epoch, drop_last=False, shuffle_window=1000))

    assert _batches_equal(run(0), run(0))
    e0, e1, other_seed = _rows(run(0)), _rows(run(1)), _rows(run(0, seed=8))
    assert len({tuple(e0), tuple(e1), tuple(other_seed)}) == 3
    assert sorted(e0) == sorted(e1) == sorted(other_seed) == sorted(_file_rows(data))
    loader = ParquetLoader(data, "train", batch_size=B, shuffle=True, seed=7, drop_last=False,
                           shuffle_window=1000)
    loader.set_epoch(1)
    assert _rows(list(loader)) == e1 and loader.epoch == 1


def test_one_row_group_is_shuffled_by_rows(one_group: Path) -> None:
    rows = _rows(list(ParquetLoader(one_group, "train", batch_size=B, shuffle=True,
                                    drop_last=False)))
    assert rows != _file_rows(one_group) and sorted(rows) == sorted(_file_rows(one_group))


@pytest.mark.parametrize("window", [600, 1000])
def test_shuffle_window_mixes_row_groups_and_bounds_them(data: Path, window: int) -> None:
    """Each window of the yielded order mixes rows of several row groups, and holds only the
    rows of one stretch of the row-group stream: every row group is spread over at most two
    consecutive windows (so memory is one window plus the row group being read)."""
    group_of = {row: g for g, group in enumerate(_groups(data)) for row in group}
    rows = _rows(list(ParquetLoader(data, "train", batch_size=B, shuffle=True, seed=2,
                                    drop_last=False, shuffle_window=window)))
    windows = [rows[i:i + window] for i in range(0, len(rows), window)]
    windows_of: dict[int, set[int]] = {}
    for w, rows_w in enumerate(windows):
        groups = [group_of[row] for row in rows_w]
        assert len(set(groups)) >= 2
        # rows really move: the window is not row groups laid end to end
        assert sum(a != b for a, b in zip(groups, groups[1:], strict=False)) > len(set(groups))
        for g in groups:
            windows_of.setdefault(g, set()).add(w)
    assert len(windows_of) == 17
    assert all(len(ws) <= 2 and max(ws) - min(ws) <= 1 for ws in windows_of.values())


@pytest.mark.parametrize("k", [0, 3, 7, 18])
@pytest.mark.parametrize("shuffle", [False, True])
def test_resume_mid_epoch(data: Path, k: int, shuffle: bool) -> None:
    kw = dict(batch_size=B, rank=1, world_size=2, shuffle=shuffle, seed=11, epoch=2,
              shuffle_window=700)  # resume points fall inside windows, after whole ones
    full = list(ParquetLoader(data, "train", **kw))
    assert len(full) == 18
    first = ParquetLoader(data, "train", **kw)
    it = iter(first)
    head = [next(it) for _ in range(k)]
    state = first.state_dict()
    assert state == {"epoch": 2, "batches_yielded": k}
    del it
    resumed = ParquetLoader(data, "train", **{**kw, "epoch": 0})
    resumed.load_state_dict(state)
    tail = list(resumed)
    assert _batches_equal(head + tail, full)
    assert resumed.state_dict() == {"epoch": 2, "batches_yielded": len(full)}


def test_resume_pad_last_past_the_end_of_a_share(data: Path) -> None:
    # 4800 rows on 7 ranks with B=128: shares of 685-686 rows, 6 batches, the last padded
    kw = dict(batch_size=B, rank=0, world_size=7, drop_last=False, pad_last=True,
              shuffle=True, prefetch=0)
    full = list(ParquetLoader(data, "train", **kw))
    for k in range(len(full) + 1):
        resumed = ParquetLoader(data, "train", **kw)
        resumed.load_state_dict({"epoch": 0, "batches_yielded": k})
        assert _batches_equal(list(resumed), full[k:])


def test_resume_does_not_read_skipped_row_groups(data: Path, tmp_path: Path) -> None:
    copy = tmp_path / "d"
    shutil.copytree(data, copy)
    full = list(ParquetLoader(copy, "train", batch_size=B, prefetch=0))
    resumed = ParquetLoader(copy, "train", batch_size=B, prefetch=0)
    resumed.load_state_dict({"epoch": 0, "batches_yielded": 16})  # 2048 rows: past shard 0
    shard = copy / "train-00000.parquet"
    raw = shard.read_bytes()
    shard.write_bytes(b"\0" * (len(raw) - 4096) + raw[-4096:])  # data pages unreadable
    assert _batches_equal(list(resumed), full[16:])


def _prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "ParquetLoader-prefetch"]


def test_abandoned_iterator_stops_thread(data: Path) -> None:
    it = iter(ParquetLoader(data, "train", batch_size=B, prefetch=2))
    next(it)
    assert _prefetch_threads()
    it.close()
    assert not _prefetch_threads()


def test_thread_error_reaches_consumer(data: Path, tmp_path: Path) -> None:
    copy = tmp_path / "d"
    shutil.copytree(data, copy)
    loader = ParquetLoader(copy, "train", batch_size=B, prefetch=2)
    shard = copy / "train-00001.parquet"
    raw = shard.read_bytes()
    # keep the footer (metadata was read already) but corrupt the data pages
    shard.write_bytes(b"\0" * (len(raw) - 4096) + raw[-4096:])
    with pytest.raises((OSError, ValueError)):
        list(loader)
    assert not _prefetch_threads()


@pytest.mark.parametrize(("kwargs", "exc", "match"), [
    ({"split": "dev"}, ValueError, "unknown split 'dev'"),
    ({"batch_size": 0}, ValueError, "batch_size must be a positive int, got 0"),
    ({"batch_size": -4}, ValueError, "batch_size"),
    ({"rank": 2, "world_size": 2}, ValueError, "rank 2 is outside the world"),
    ({"rank": -1}, ValueError, "rank -1 is outside the world"),
    ({"world_size": 0}, ValueError, "world_size must be >= 1"),
    ({"prefetch": -1}, ValueError, "prefetch must be >= 0"),
    ({"shuffle_window": 0}, ValueError, "shuffle_window must be >= 1 row"),
])
def test_bad_arguments(data: Path, kwargs: dict, exc: type, match: str) -> None:
    args = {"split": "train", "batch_size": B, **kwargs}
    split = args.pop("split")
    with pytest.raises(exc, match=match):
        ParquetLoader(data, split, **args)


def test_fewer_rows_than_ranks_is_refused(one_group: Path) -> None:
    # validation has 2 rows: 2 ranks get one each, 3 ranks are refused with the fix
    assert [len(_rows(b)) for b in _per_rank(one_group, 2, "validation", batch_size=1)] == [1, 1]
    with pytest.raises(ValueError, match=r"split 'validation' of .* has 2 rows, fewer than "
                                         r"world_size=3.*Use at most 2 ranks"):
        ParquetLoader(one_group, "validation", batch_size=1, rank=0, world_size=3)


def test_missing_shard_is_named(data: Path, tmp_path: Path) -> None:
    copy = tmp_path / "d"
    shutil.copytree(data, copy)
    (copy / "train-00002.parquet").unlink()
    with pytest.raises(DatasetIntegrityError, match="train-00002.parquet: shard of split "
                       "'train' listed in .*dataset.json is missing"):
        ParquetLoader(copy, "train", batch_size=B)


def test_bad_state_dict(data: Path) -> None:
    loader = ParquetLoader(data, "train", batch_size=B)
    with pytest.raises(ValueError, match="exactly the keys"):
        loader.load_state_dict({"epoch": 0})
    with pytest.raises(ValueError, match="only 37 per epoch"):
        loader.load_state_dict({"epoch": 0, "batches_yielded": 38})


@pytest.mark.gpu
def test_pin_memory_and_cuda_copy(data: Path) -> None:
    batch = next(iter(ParquetLoader(data, "validation", batch_size=B)))
    pinned = batch.pin_memory()
    assert pinned.dense.is_pinned() and pinned.labels.is_pinned()
    assert pinned.sparse.values().is_pinned()
    on_gpu = pinned.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert on_gpu.dense.is_cuda and on_gpu.sparse.values().is_cuda
    assert torch.equal(on_gpu.sparse.lengths().cpu(), batch.sparse.lengths())
