"""The cached kernel (tables in backing files behind a cache of row slots) against the uncached
kernel: same outputs, weights and optimizer state after N steps at caches far smaller than the
tables; eviction policies and write-back checked by hand; prefetch keeps results unchanged."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from recsys_core.kernels import cached_tbe, fbgemm_available
from recsys_core.kernels.cached_tbe import (
    CachedTableBatchedEmbedding,
    CacheTooSmallError,
    TableCache,
    row_io_available,
)
from recsys_core.kernels.config import EmbOptimType, FusedOptimizerConfig, KernelBackend
from recsys_core.kernels.tbe import IdOutOfRangeError, build_table_batched_embedding, checked_lookup

ROWS = [200, 100, 300]
DIMS = [4, 8, 4]
FEATURE_TABLE_MAP = [0, 1, 1, 2]  # table 1 is shared by two features
BATCH = 6
MAX_LEN = 4  # ids per bag: at most 24 per feature, 48 distinct rows of table 1 per batch
CPU = torch.device("cpu")

BACKENDS = [KernelBackend.TORCH] + ([KernelBackend.FBGEMM] if fbgemm_available() else [])
FBGEMM_CPU_OPTIMIZERS = {EmbOptimType.EXACT_SGD, EmbOptimType.EXACT_ADAGRAD,
                         EmbOptimType.EXACT_ROWWISE_ADAGRAD}


def batches(steps: int, seed: int = 5, weighted: bool = False):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        lengths = torch.randint(0, MAX_LEN + 1, (len(FEATURE_TABLE_MAP) * BATCH,), generator=gen)
        ids = []
        for f, t in enumerate(FEATURE_TABLE_MAP):
            n = int(lengths[f * BATCH : (f + 1) * BATCH].sum())
            ids.append(torch.randint(0, ROWS[t], (n,), generator=gen))
        indices = torch.cat(ids)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        psw = torch.rand(indices.numel(), generator=gen) if weighted else None
        target = torch.randn(BATCH, sum(DIMS[t] for t in FEATURE_TABLE_MAP), generator=gen)
        out.append((indices, offsets, psw, target))
    return out


def make(
    backend: KernelBackend, opt: EmbOptimType, mean: bool, weighted: bool,
    caches=(), algorithm: str = "lru",
) -> nn.Module:
    config = FusedOptimizerConfig(optimizer=opt, learning_rate=0.05, eps=1e-3)
    caches = [None if c is None else TableCache(slots=c, algorithm=algorithm) for c in caches]
    kernel = build_table_batched_embedding(
        rows=ROWS, dims=DIMS, feature_table_map=FEATURE_TABLE_MAP, pooling_mean=mean,
        optimizer=config, device=CPU, backend=backend, weighted=weighted, caches=caches,
    )
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for w in kernel.split_embedding_weights():
            w.copy_(torch.rand(w.shape, generator=gen) - 0.5)
    return kernel


def train(kernel: nn.Module, data, prefetch: bool = False) -> list[torch.Tensor]:
    outs = []
    for i, (indices, offsets, psw, target) in enumerate(data):
        out = kernel(indices, offsets, psw)
        if prefetch and i + 1 < len(data):
            kernel.prefetch(data[i + 1][0], data[i + 1][1])
        (out * target).sum().backward()
        outs.append(out.detach().clone())
    return outs


def snapshot(kernel: nn.Module) -> list[list[torch.Tensor]]:
    if isinstance(kernel, CachedTableBatchedEmbedding):
        kernel.flush()
    return [
        [w.clone(), *(s.clone() for s in states.values())]
        for w, states in zip(kernel.split_embedding_weights(), kernel.split_optimizer_states(),
                             strict=True)
    ]


def assert_same(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> None:
    for ta, tb in zip(a, b, strict=True):
        for x, y in zip(ta, tb, strict=True):
            torch.testing.assert_close(x, y, rtol=0, atol=1e-6)


CASES = [
    (backend, opt)
    for backend in BACKENDS
    for opt in (EmbOptimType.EXACT_SGD, EmbOptimType.EXACT_ADAGRAD,
                EmbOptimType.EXACT_ROWWISE_ADAGRAD, EmbOptimType.ADAM,
                EmbOptimType.PARTIAL_ROWWISE_ADAM, EmbOptimType.LAMB)
    if backend is KernelBackend.TORCH or opt in FBGEMM_CPU_OPTIMIZERS
]


# How rows move between the backing files and the cache: pread/pwrite through the C helper
# (built at install where a compiler is), or the files' memory mappings (the fallback).
ROW_IO = ["pread", "mmap"]


def use_row_io(kernel: CachedTableBatchedEmbedding, io: str) -> None:
    if io == "pread" and not row_io_available():
        pytest.skip("the C helper recsys_core/kernels/_rowio.c was not built")
    kernel.row_io = io == "pread"


def test_the_row_io_helper_is_built_where_ci_runs() -> None:
    # CI installs with a C compiler: the fast path must be the one its tests exercise
    if os.environ.get("CI") == "true":
        assert row_io_available()
    kernel = make(KernelBackend.TORCH, EmbOptimType.EXACT_SGD, False, False, caches=[None, 8, 8])
    assert kernel.row_io is row_io_available()


@pytest.mark.parametrize(("backend", "opt"), CASES, ids=lambda v: getattr(v, "name", v))
@pytest.mark.parametrize("mean", [False, True], ids=["sum", "mean"])
@pytest.mark.parametrize("io", ROW_IO)
def test_cached_equals_uncached_after_steps(backend: KernelBackend, opt: EmbOptimType, mean: bool,
                                            io: str) -> None:
    weighted = not mean or backend is KernelBackend.TORCH  # FBGEMM-CPU weighted MEAN is refused
    data = batches(10, weighted=weighted)
    plain = make(backend, opt, mean, weighted)
    # table 0 uncached; tables 1 and 2 hold 48 of 100 and 24 of 300 rows: every batch misses
    cached = make(backend, opt, mean, weighted, caches=[None, 48, 24])
    assert isinstance(cached, CachedTableBatchedEmbedding)
    use_row_io(cached, io)
    expected = train(plain, data)
    got = train(cached, data)
    for a, b in zip(expected, got, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)
    assert cached.stats.evictions > 0 and cached.stats.writebacks > 0
    assert_same(snapshot(cached), snapshot(plain))
    assert int(cached.iter) == int(plain.iter)


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
@pytest.mark.parametrize(("io", "block"), [("pread", 256), ("mmap", 256), ("mmap", 3)],
                         ids=["pread", "mmap_one_block", "mmap_blocks_of_3"])
def test_eviction_writes_trained_rows_back(backend: KernelBackend, io: str, block: int) -> None:
    data = batches(6)
    plain = make(backend, EmbOptimType.EXACT_ROWWISE_ADAGRAD, False, False)
    cached = make(backend, EmbOptimType.EXACT_ROWWISE_ADAGRAD, False, False, caches=[None, 48, 24])
    use_row_io(cached, io)
    # through the mappings rows move in blocks of `block` (sorted by row, each block's file
    # pages dropped after it)
    cached.move_block_rows = block
    train(plain, data)
    train(cached, data)
    store = cached.split_embedding_weights()[2]
    truth = plain.split_embedding_weights()[2]
    resident = set(cached.resident_rows(2))
    touched = set(torch.cat([d[0][d[1][3 * BATCH]:] for d in data]).tolist())
    evicted = sorted(touched - resident)
    assert evicted, "the test needs rows that were trained and then evicted"
    # before any flush: every evicted row is already in the backing store, trained ...
    torch.testing.assert_close(store[evicted], truth[evicted], rtol=0, atol=1e-6)
    # ... while trained resident rows are only in the cache until flush()
    stale = [r for r in resident if not torch.allclose(store[r], truth[r])]
    assert stale
    cached.flush()
    torch.testing.assert_close(store, truth, rtol=0, atol=1e-6)


def _hand_kernel(algorithm: str) -> CachedTableBatchedEmbedding:
    kernel = build_table_batched_embedding(
        rows=[5], dims=[4], feature_table_map=[0], pooling_mean=False,
        optimizer=FusedOptimizerConfig(optimizer=EmbOptimType.EXACT_SGD, learning_rate=0.1),
        device=CPU, backend=KernelBackend.TORCH, caches=[TableCache(slots=2, algorithm=algorithm)],
    )
    with torch.no_grad():
        kernel.split_embedding_weights()[0].copy_(torch.arange(20.0).view(5, 4))
    return kernel


@pytest.mark.parametrize(("algorithm", "resident"), [("lru", [1, 2]), ("lfu", [0, 2])])
def test_eviction_policy_by_hand(algorithm: str, resident: list[int]) -> None:
    # Row 0 is used twice, then row 1, then row 2 needs a slot: LRU evicts row 0 (least
    # recently used), LFU evicts row 1 (used once, row 0 twice).
    kernel = _hand_kernel(algorithm)
    with torch.no_grad():
        for row in (0, 0, 1, 2):
            out = kernel(torch.tensor([row]), torch.tensor([0, 1]))
            torch.testing.assert_close(out, torch.arange(4.0).view(1, 4) + 4 * row)
    assert kernel.resident_rows(0) == resident
    assert kernel.stats.misses == 3 and kernel.stats.evictions == 1
    assert kernel.stats.writebacks == 0  # lookups without backward train nothing


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
def test_a_cache_that_holds_every_row_fills_without_evicting(backend: KernelBackend) -> None:
    # caches as large as their tables: every miss takes an empty slot, none evicts, and the
    # results are the uncached kernel's; invalidate empties the slots and they fill again
    data = batches(5)
    plain = make(backend, EmbOptimType.EXACT_ROWWISE_ADAGRAD, False, False)
    cached = make(backend, EmbOptimType.EXACT_ROWWISE_ADAGRAD, False, False,
                  caches=[None, ROWS[1], ROWS[2]])
    for a, b in zip(train(plain, data), train(cached, data), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)
    distinct = [set(torch.cat([d[0][d[1][lo * BATCH]:d[1][hi * BATCH]] for d in data]).tolist())
                for lo, hi in ((1, 3), (3, 4))]  # features 1-2 read table 1, feature 3 table 2
    assert cached.stats.evictions == 0 and cached.stats.writebacks == 0
    assert cached.stats.misses == sum(len(d) for d in distinct)
    assert [cached.resident_rows(t) for t in (1, 2)] == [sorted(d) for d in distinct]
    assert cached.occupancy() == pytest.approx(sum(len(d) for d in distinct) / (ROWS[1] + ROWS[2]))
    assert_same(snapshot(cached), snapshot(plain))
    cached.invalidate()
    assert cached.occupancy() == 0.0 and cached.resident_rows(1) == []
    more = batches(3, seed=6)
    for a, b in zip(train(plain, more), train(cached, more), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)
    assert cached.stats.evictions == 0
    assert_same(snapshot(cached), snapshot(plain))


def _four_slot_table() -> torch.nn.Module:
    """One SGD (lr 0.1) table of 10 rows x 4, row r = 4r..4r+3, behind a cache of 4 slots."""
    kernel = build_table_batched_embedding(
        rows=[10], dims=[4], feature_table_map=[0], pooling_mean=False,
        optimizer=FusedOptimizerConfig(optimizer=EmbOptimType.EXACT_SGD, learning_rate=0.1),
        device=CPU, backend=KernelBackend.TORCH, caches=[TableCache(slots=4)],
    )
    with torch.no_grad():
        kernel.split_embedding_weights()[0].copy_(torch.arange(40.0).view(10, 4))
    return kernel


def test_lru_evicts_the_least_recently_used_unlocked_rows_and_writes_them_back() -> None:
    # 4 slots, one row per lookup (so no two resident rows share a last use)
    kernel = _four_slot_table()
    store = kernel.split_embedding_weights()[0]

    def look(row: int, grad: bool = True) -> torch.Tensor:
        with torch.set_grad_enabled(grad):
            return kernel(torch.tensor([row]), torch.tensor([0, 1]))

    for row in (0, 1, 2, 3, 0):  # each trained once (SGD, lr 0.1, gradient 1), row 0 twice
        look(row).sum().backward()
    assert kernel.stats.evictions == 0 and kernel.occupancy() == 1.0
    look(4).sum().backward()  # evicts row 1, the least recently used: written back at once
    look(5).sum().backward()  # then row 2
    assert kernel.resident_rows(0) == [0, 3, 4, 5]
    assert kernel.stats.evictions == 2 and kernel.stats.writebacks == 2
    torch.testing.assert_close(store[1:3], torch.arange(4.0, 12.0).view(2, 4) - 0.1)
    torch.testing.assert_close(store[0], torch.arange(4.0))  # resident: trained in the cache only
    # row 3 in flight (forward run, backward not yet) is locked; rows 0, 4, 5 used after it
    out = look(3)
    for row in (0, 4, 5):
        look(row, grad=False)
    look(6, grad=False)  # the least recently used row is 3, locked: row 0 goes instead
    assert kernel.resident_rows(0) == [3, 4, 5, 6]
    torch.testing.assert_close(store[0], torch.arange(4.0) - 0.2)  # written back on eviction
    out.sum().backward()  # row 3 unlocked, and now the least recently used
    look(7, grad=False)
    assert kernel.resident_rows(0) == [4, 5, 6, 7]
    torch.testing.assert_close(store[3], torch.arange(12.0, 16.0) - 0.2)
    assert kernel.stats.evictions == 4 and kernel.stats.writebacks == 4
    kernel.flush()
    torch.testing.assert_close(store[4:6], torch.arange(16.0, 24.0).view(2, 4) - 0.1)


@pytest.mark.parametrize("slack", [1, 8, 40, 65536], ids=lambda s: f"compact_beyond_{s}")
def test_lru_victims_are_the_oldest_unlocked_rows_under_any_queue_compaction(
        slack: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # Against a reference that records each row's last use: every row evicted by a batch was
    # used no later than every row that stays resident and that the batch did not use (rows
    # used by the same batch may be evicted in either order). The recency queue is compacted
    # after every lookup (slack 1), every few, or never; with prefetch, results stay exact.
    monkeypatch.setattr(cached_tbe, "_QUEUE_SLACK", slack)
    data = batches(14, seed=8)
    plain = make(KernelBackend.TORCH, EmbOptimType.EXACT_ADAGRAD, False, False)
    cached = make(KernelBackend.TORCH, EmbOptimType.EXACT_ADAGRAD, False, False,
                  caches=[48, 96, 60])
    last_use: dict[tuple[int, int], int] = {}
    resident = {t: set() for t in range(3)}
    for i, (indices, offsets, psw, target) in enumerate(data):
        out = cached(indices, offsets, psw)
        expected = plain(indices, offsets, psw)
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
        used = {t: set() for t in range(3)}
        for f, t in enumerate(FEATURE_TABLE_MAP):
            used[t] |= set(indices[offsets[f * BATCH]:offsets[(f + 1) * BATCH]].tolist())
        for t in range(3):
            now = set(cached.resident_rows(t))
            evicted, kept = resident[t] - now, (now - used[t]) & resident[t]
            if evicted and kept:
                assert max(last_use[t, r] for r in evicted) <= min(last_use[t, r] for r in kept)
            for r in used[t]:
                last_use[t, r] = i
            resident[t] = now
            # the recency queue holds one current entry per filled slot, no more, no less
            ts = cached._tables[t]
            current = [s[(ts.last_used[s] >= lo) & (ts.last_used[s] <= hi)]
                       for lo, hi, s in ts.queue.chunks]
            assert sorted(torch.cat(current).tolist()) == list(range(ts.filled))
            assert ts.queue.entries == sum(s.numel() for _, _, s in ts.queue.chunks)
        (out * target).sum().backward()
        (expected * target).sum().backward()
    assert cached.stats.evictions > 50
    assert_same(snapshot(cached), snapshot(plain))


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
def test_prefetch_keeps_results_and_in_flight_rows(backend: KernelBackend) -> None:
    data = batches(10)
    plain = make(backend, EmbOptimType.EXACT_ADAGRAD, False, False)
    # two batches' rows fit: the prefetched batch is loaded while the current one is in flight
    cached = make(backend, EmbOptimType.EXACT_ADAGRAD, False, False, caches=[None, 96, 48])
    expected = train(plain, data)
    got = train(cached, data, prefetch=True)
    for a, b in zip(expected, got, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)
    assert_same(snapshot(cached), snapshot(plain))


def test_prefetch_never_evicts_the_in_flight_batch() -> None:
    # table 0: 10 rows, 4 slots; batch A needs rows 0-3 (all slots), batch B rows 4-5
    kernel = _four_slot_table()
    out = kernel(torch.tensor([0, 1, 2, 3]), torch.tensor([0, 4]))
    b = torch.tensor([4, 5])
    kernel.prefetch(b, torch.tensor([0, 2]))  # no room beside A: deferred, A untouched
    assert kernel.resident_rows(0) == [0, 1, 2, 3]
    out.sum().backward()  # A's update lands in its rows: SGD, lr 0.1, gradient 1
    with torch.no_grad():
        got = kernel(b, torch.tensor([0, 2]))  # looked up now, evicting two of A's rows
    torch.testing.assert_close(got, torch.arange(16.0, 20.0).view(1, 4) + torch.arange(20.0, 24.0))
    assert kernel.stats.prefetched == 0
    kernel.flush()
    torch.testing.assert_close(kernel.split_embedding_weights()[0][:4], torch.arange(16.0).view(4, 4) - 0.1)
    # with room, the prefetch brings the rows in before the forward
    c = torch.tensor([6])
    kernel.prefetch(c, torch.tensor([0, 1]))
    assert 6 in kernel.resident_rows(0)
    with torch.no_grad():
        torch.testing.assert_close(kernel(c, torch.tensor([0, 1])), torch.arange(24.0, 28.0).view(1, 4))
    assert kernel.stats.prefetched == 1


def test_batch_larger_than_the_cache_is_a_clear_error() -> None:
    kernel = _hand_kernel("lru")
    with pytest.raises(CacheTooSmallError, match="has 2 slots; a batch needs 3 distinct rows"):
        kernel(torch.tensor([0, 1, 2]), torch.tensor([0, 3]))


@pytest.mark.parametrize("bad_id", [5, -1])
def test_out_of_range_ids_of_a_cached_table_name_the_feature(bad_id: int) -> None:
    kernel = _hand_kernel("lru")
    with pytest.raises(IdOutOfRangeError, match=rf"feature 'f'.*{bad_id}"):
        checked_lookup(kernel, torch.tensor([1, bad_id]), torch.tensor([0, 2]), None,
                       feature_names=["f"], rows_per_feature=[5])


def test_invalidate_reads_rows_written_into_the_backing_store() -> None:
    kernel = _hand_kernel("lru")
    out = kernel(torch.tensor([3]), torch.tensor([0, 1]))
    out.sum().backward()  # SGD, lr 0.1: row 3 -> row 3 - 0.1
    kernel.flush()
    store = kernel.split_embedding_weights()[0]
    torch.testing.assert_close(store[3], torch.arange(12.0, 16.0) - 0.1)
    with torch.no_grad():
        store[3] = 100.0  # e.g. a checkpoint load
    kernel.invalidate()
    with torch.no_grad():
        torch.testing.assert_close(kernel(torch.tensor([3]), torch.tensor([0, 1])),
                                   torch.full((1, 4), 100.0))


def test_deepcopy_is_refused_with_advice() -> None:
    import copy

    with pytest.raises(TypeError, match="checkpoint"):
        copy.deepcopy(_hand_kernel("lru"))


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
def test_an_empty_table_with_a_cache_is_an_empty_table(backend: KernelBackend) -> None:
    # a row-wise shard can have no rows: its cache is dropped, its bags pool to zeros, and the
    # other (cached) table trains as usual
    config = FusedOptimizerConfig(optimizer=EmbOptimType.EXACT_SGD, learning_rate=0.5)
    kernel = build_table_batched_embedding(
        rows=[0, 4], dims=[4, 4], feature_table_map=[0, 1], pooling_mean=False, optimizer=config,
        device=CPU, backend=backend, caches=[TableCache(slots=3), TableCache(slots=2)],
    )
    assert isinstance(kernel, CachedTableBatchedEmbedding)
    assert kernel.caches[0] is None and kernel.caches[1].slots == 2
    with torch.no_grad():
        kernel.split_embedding_weights()[1].copy_(torch.arange(16.0).view(4, 4))
    # batch of 2: feature 0 has empty bags, feature 1 bags [3] and [3, 1]
    out = kernel(torch.tensor([3, 3, 1]), torch.tensor([0, 0, 0, 1, 3]))
    w = torch.arange(16.0).view(4, 4)
    torch.testing.assert_close(out, torch.cat([torch.zeros(2, 4), torch.stack([w[3], w[3] + w[1]])], 1))
    out.sum().backward()
    kernel.flush()
    weights = kernel.split_embedding_weights()
    assert weights[0].shape == (0, 4)
    # SGD, lr 0.5, gradient of the sum: row 3 used twice (-1.0), row 1 once (-0.5)
    torch.testing.assert_close(weights[1], w - torch.tensor([0.0, 0.5, 0.0, 1.0]).view(4, 1))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", [KernelBackend.TORCH, KernelBackend.FBGEMM], ids=lambda b: b.name)
def test_cached_on_cuda_equals_uncached(backend: KernelBackend) -> None:
    # CUDA: the torch kernel caches in device memory over pinned host memory; with FBGEMM's
    # CUDA build, FBGEMM's UVM caching kernel. Either way: the uncached kernel's results.
    if backend is KernelBackend.FBGEMM and not fbgemm_available():
        pytest.skip("FBGEMM is not installed")
    cuda = torch.device("cuda")
    config = FusedOptimizerConfig(optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.05,
                                  eps=1e-3)

    def build(caches):
        kernel = build_table_batched_embedding(
            rows=ROWS, dims=DIMS, feature_table_map=FEATURE_TABLE_MAP, pooling_mean=False,
            optimizer=config, device=cuda, backend=backend, weighted=True, caches=caches)
        gen = torch.Generator().manual_seed(11)
        with torch.no_grad():
            for w in kernel.split_embedding_weights():
                w.copy_(torch.rand(w.shape, generator=gen) - 0.5)
        if hasattr(kernel, "invalidate"):
            kernel.invalidate()  # the weights were written behind the cache
        return kernel

    data = [tuple(None if x is None else x.to(cuda) for x in step)
            for step in batches(10, weighted=True)]
    plain = build([])
    cached = build([None, TableCache(slots=48), TableCache(slots=24)])
    for a, b in zip(train(plain, data), train(cached, data), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
    cached.flush()
    for w, v in zip(cached.split_embedding_weights(), plain.split_embedding_weights(), strict=True):
        torch.testing.assert_close(w.cpu(), v.cpu(), rtol=0, atol=1e-5)
    for s, t in zip(cached.split_optimizer_states(), plain.split_optimizer_states(), strict=True):
        for name in t:
            torch.testing.assert_close(s[name].cpu(), t[name].cpu(), rtol=0, atol=1e-5)
