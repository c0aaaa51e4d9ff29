"""ParquetLoader: values match a plain pyarrow read; ranks are disjoint, balanced and cover the
split; order is deterministic per (seed, epoch); resume is exact; bad inputs fail clearly."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from dlrm_app.data.loader import Batch, ParquetLoader
from dlrm_app.data.schema import DatasetSpec
from dlrm_app.data.synthetic import generate

B = 128
Row = tuple  # (label, dense tuple, ids of feature 0, ids of feature 1, ...)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # train: 4800 rows in shards of 2000, 2000, 800; row groups of 300 -> 7 + 7 + 3 = 17
    out = tmp_path_factory.mktemp("loader")
    generate(out, rows=6000, num_dense=3, cardinalities=[50, 1000, 7],
             pooling_factors=[1.0, 3.0, 1.0], rows_per_shard=2000, row_group_size=300, seed=3)
    return out


def _file_rows(data: Path, split: str = "train") -> list[Row]:
    """The split's rows in file order, by plain pyarrow to_pylist (independent of the loader)."""
    spec = DatasetSpec.load(data)
    keys = [f.name for f in spec.sparse_features]
    rows: list[Row] = []
    for shard in spec.split(split).shards:
        table = pq.read_table(data / shard.file).to_pylist()
        rows += [(r[spec.label], tuple(r["dense"]), *(tuple(r[k]) for k in keys))
                 for r in table]
    return rows


def _batch_rows(batch: Batch) -> list[Row]:
    per_key = [[tuple(t.tolist()) for t in jt.to_dense()]
               for jt in batch.sparse.to_dict().values()]
    return [(batch.labels[i].item(), tuple(batch.dense[i].tolist()),
             *(ids[i] for ids in per_key)) for i in range(batch.labels.shape[0])]


def _rows(batches: list[Batch]) -> list[Row]:
    return [row for b in batches for row in _batch_rows(b)]


def _batches_equal(a: list[Batch], b: list[Batch]) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x.dense, y.dense) and torch.equal(x.labels, y.labels)
        and torch.equal(x.sparse.values(), y.sparse.values())
        and torch.equal(x.sparse.lengths(), y.sparse.lengths()) for x, y in zip(a, b, strict=True))


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


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("shuffle", [False, True])
def test_ranks_disjoint_balanced_and_cover(data: Path, world_size: int, shuffle: bool) -> None:
    meta_rows = [300] * 6 + [200] + [300] * 6 + [200] + [300, 300, 200]
    per_rank = [list(ParquetLoader(data, "train", batch_size=B, rank=r, world_size=world_size,
                                   shuffle=shuffle, seed=5, epoch=1))
                for r in range(world_size)]
    counts = {len(batches) for batches in per_rank}
    assert len(counts) == 1
    if not shuffle:  # round-robin over file order: the documented min over ranks
        assert counts.pop() == min(sum(meta_rows[r::world_size]) // B
                                   for r in range(world_size))
    seen = [row for batches in per_rank for row in _rows(batches)]
    assert len(seen) == len(set(seen)) == world_size * len(per_rank[0]) * B
    all_rows = set(_file_rows(data))
    assert set(seen) <= all_rows
    # every dropped row is beyond the common count on its rank: less than the leftover
    dropped = len(all_rows) - len(seen)
    assert dropped == 4800 - world_size * len(per_rank[0]) * B


@pytest.mark.parametrize("world_size", [2, 3])
def test_pad_last_yields_every_row_once(data: Path, world_size: int) -> None:
    per_rank = [list(ParquetLoader(data, "train", batch_size=B, rank=r, world_size=world_size,
                                   drop_last=False, pad_last=True, shuffle=True, seed=1))
                for r in range(world_size)]
    assert len({len(batches) for batches in per_rank}) == 1  # same count on every rank
    seen: list[Row] = []
    for batches in per_rank:
        for batch in batches:
            assert batch.labels.shape[0] == batch.dense.shape[0] == batch.sparse.stride() == B
            valid = B if batch.valid_rows is None else batch.valid_rows  # None: all real
            assert 0 <= valid <= B
            rows = _batch_rows(batch)
            seen += rows[:valid]
            # padding: label 0, dense zeros, empty bags
            assert all(r[0] == 0 and set(r[1]) <= {0.0} and all(ids == () for ids in r[2:])
                       for r in rows[valid:])
    assert sorted(seen) == sorted(_file_rows(data))  # each of the 4800 rows exactly once


def test_pad_last_needs_drop_last_false(data: Path) -> None:
    with pytest.raises(ValueError, match="pass drop_last=False"):
        ParquetLoader(data, "train", batch_size=B, pad_last=True)


def test_deterministic_per_seed_and_epoch(data: Path) -> None:
    def run(epoch: int, seed: int = 7) -> list[Batch]:
        return list(ParquetLoader(data, "train", batch_size=B, shuffle=True, seed=seed,
                                  epoch=epoch, drop_last=False))

    assert _batches_equal(run(0), run(0))
    e0, e1 = _rows(run(0)), _rows(run(1))
    assert e0 != e1
    assert sorted(e0) == sorted(e1) == sorted(_file_rows(data))
    loader = ParquetLoader(data, "train", batch_size=B, shuffle=True, seed=7, drop_last=False)
    loader.set_epoch(1)
    assert _rows(list(loader)) == e1 and loader.epoch == 1


@pytest.mark.parametrize("k", [0, 3, 7, 16])
def test_resume_mid_epoch(data: Path, k: int) -> None:
    kw = dict(batch_size=B, rank=1, world_size=2, shuffle=True, seed=11, epoch=2)
    full = list(ParquetLoader(data, "train", **kw))
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
    ({"world_size": 18, "rank": 0}, ValueError, "17 row groups, fewer than world_size=18"),
])
def test_bad_arguments(data: Path, kwargs: dict, exc: type, match: str) -> None:
    args = {"split": "train", "batch_size": B, **kwargs}
    split = args.pop("split")
    with pytest.raises(exc, match=match):
        ParquetLoader(data, split, **args)


def test_missing_shard_is_named(data: Path, tmp_path: Path) -> None:
    copy = tmp_path / "d"
    shutil.copytree(data, copy)
    (copy / "train-00002.parquet").unlink()
    with pytest.raises(FileNotFoundError, match="train-00002.parquet"):
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
