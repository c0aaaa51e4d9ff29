"""BatchedTables: grouping, lookups and state views, against plain torch references."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from recsys_core.kernels import fbgemm_available
from recsys_core.kernels.batched import BatchedTables
from recsys_core.kernels.cached_tbe import CachedTableBatchedEmbedding, TableCache
from recsys_core.kernels.config import EmbOptimType, FusedOptimizerConfig, KernelBackend
from recsys_core.kernels.offload_store import row_io_available
from recsys_core.kernels.packed import PackedKernelSpec, PackedTable
from recsys_core.kernels.tbe import IdOutOfRangeError
from recsys_core.sparse import KeyedJaggedTensor

CPU = torch.device("cpu")
SGD = FusedOptimizerConfig(optimizer=EmbOptimType.EXACT_SGD, learning_rate=0.1)
BACKENDS = [
    KernelBackend.TORCH,
    pytest.param(KernelBackend.FBGEMM, marks=pytest.mark.skipif(
        not fbgemm_available(), reason="fbgemm_gpu is not importable")),
]
# The module docstring's example: a (SUM; f0), b (MEAN; f1, f2), c (SUM; f3).
TABLES = [PackedTable(name="a", rows=7, dim=4), PackedTable(name="b", rows=5, dim=8),
          PackedTable(name="c", rows=9, dim=4)]
FEATURES = [["f0"], ["f1", "f2"], ["f3"]]
MEAN = [False, True, False]
FEATURE_TABLE = {"f0": 0, "f1": 1, "f2": 1, "f3": 2}


def random_fill(seed: int):
    gen = torch.Generator().manual_seed(seed)
    order: list[int] = []

    def fill(index: int, view: torch.Tensor) -> None:
        order.append(index)
        with torch.no_grad():
            view.copy_(torch.rand(view.shape, generator=gen) - 0.5)

    return fill, order


def grouped(backend: KernelBackend, weighted: bool = False, seed: int = 3):
    fill, order = random_fill(seed)
    batched = BatchedTables.grouped(
        TABLES, FEATURES, MEAN, device=CPU, optimizer=SGD, backend=backend, weighted=weighted,
        fill=fill,
    )
    return batched, order


def make_kjt(keys: list[str], batch: int, weighted: bool, seed: int) -> KeyedJaggedTensor:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (len(keys) * batch,), generator=gen)
    lengths[0] = 0
    values = torch.cat([
        torch.randint(0, TABLES[FEATURE_TABLE[k]].rows, (int(lengths[i * batch : (i + 1) * batch].sum()),),
                      generator=gen)
        for i, k in enumerate(keys)
    ])
    weights = torch.rand(values.numel(), generator=gen) if weighted else None
    return KeyedJaggedTensor(keys=keys, values=values, lengths=lengths, weights=weights)


def reference_bags(batched: BatchedTables) -> list[nn.EmbeddingBag]:
    """Plain EmbeddingBags holding copies of the tables, in the caller's order."""
    bags = []
    for table, mean, weight in zip(TABLES, MEAN, batched.split_embedding_weights(), strict=True):
        bag = nn.EmbeddingBag(table.rows, table.dim, mode="mean" if mean else "sum",
                              include_last_offset=True)
        bag.weight.data.copy_(weight)
        bags.append(bag)
    return bags


def reference_pooled(bags: list[nn.EmbeddingBag], kjt: KeyedJaggedTensor, weighted: bool) -> torch.Tensor:
    outs = []
    for key, jt in kjt.to_dict().items():
        bag = bags[FEATURE_TABLE[key]]
        psw = jt.weights() if weighted else None
        if bag.mode == "mean" and psw is not None:  # nn.EmbeddingBag weights only SUM bags
            sums = nn.functional.embedding_bag(jt.values(), bag.weight, jt.offsets(), mode="sum",
                                               per_sample_weights=psw, include_last_offset=True)
            outs.append(sums / jt.lengths().clamp(min=1).unsqueeze(1))
        else:
            outs.append(bag(jt.values(), jt.offsets(), per_sample_weights=psw))
    return torch.cat(outs, dim=1)


def test_grouped_packs_one_kernel_per_pooling_type_in_first_seen_order() -> None:
    batched, order = grouped(KernelBackend.TORCH)
    assert batched.members == [[0, 2], [1]]
    assert batched.features == [["f0", "f3"], ["f1", "f2"]]
    assert batched.feature_order == ["f0", "f3", "f1", "f2"]
    assert [s.pooling_mean for s in batched.specs] == [False, True]
    assert [s.feature_table_map for s in batched.specs] == [(0, 1), (0, 0)]
    assert order == [0, 2, 1]  # filled in kernel order, each right after its kernel is built
    assert [tuple(w.shape) for w in batched.split_embedding_weights()] == [(7, 4), (5, 8), (9, 4)]
    assert batched.backends() == [KernelBackend.TORCH, KernelBackend.TORCH]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("weighted", [False, True])
def test_lookup_equals_embedding_bags(backend: KernelBackend, weighted: bool) -> None:
    if backend is KernelBackend.FBGEMM and weighted:
        backend = KernelBackend.AUTO  # FBGEMM's CPU weighted MEAN backward is refused
    batched, _ = grouped(backend, weighted)
    kjt = make_kjt(["f2", "f0", "f3", "f1"], batch=5, weighted=weighted, seed=1)
    ordered = batched.in_kernel_order(kjt)
    assert ordered.keys() == batched.feature_order
    assert batched.in_kernel_order(ordered) is ordered
    got = batched.lookup(ordered, weighted)
    want = reference_pooled(reference_bags(batched), ordered, weighted)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sgd_step_equals_embedding_bags_with_sgd(backend: KernelBackend) -> None:
    batched, _ = grouped(backend)
    bags = reference_bags(batched)
    opt = torch.optim.SGD([b.weight for b in bags], lr=SGD.learning_rate)
    kjt = batched.in_kernel_order(make_kjt(["f0", "f1", "f2", "f3"], batch=4, weighted=False, seed=2))
    grad = torch.randn(4, 4 + 4 + 8 + 8, generator=torch.Generator().manual_seed(5))
    batched.lookup(kjt, False).backward(grad)
    reference_pooled(bags, kjt, False).backward(grad)
    opt.step()
    for got, bag in zip(batched.split_embedding_weights(), bags, strict=True):
        torch.testing.assert_close(got, bag.weight.detach())


@pytest.mark.parametrize("backend", BACKENDS)
def test_lookup_rows_gives_each_ids_row(backend: KernelBackend) -> None:
    # two SUM kernels, the second holding one table looked up by two features
    specs = [
        PackedKernelSpec(tables=(PackedTable(name="x", rows=6, dim=4),), feature_table_map=(0,),
                         pooling_mean=False, weighted=False, optimizer=SGD, backend=backend,
                         features=("u",)),
        PackedKernelSpec(tables=(PackedTable(name="y", rows=4, dim=8),), feature_table_map=(0, 0),
                         pooling_mean=False, weighted=False, optimizer=SGD, backend=backend,
                         features=("v", "w")),
    ]
    fill, _ = random_fill(9)
    batched = BatchedTables(specs, CPU, fill=fill)
    x, y = batched.split_embedding_weights()
    ids = {"u": torch.tensor([5, 0, 5]), "v": torch.tensor([], dtype=torch.long),
           "w": torch.tensor([3])}
    rows = batched.lookup_rows(torch.cat(list(ids.values())), [3, 0, 1])
    for got, table, key in zip(rows, [x, y, y], ids, strict=True):
        torch.testing.assert_close(got, table[ids[key]])


def test_optimizer_states_follow_the_callers_order() -> None:
    config = FusedOptimizerConfig(optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.1)
    batched = BatchedTables.grouped(TABLES, FEATURES, MEAN, device=CPU, optimizer=config,
                                    backend=KernelBackend.TORCH)
    kjt = batched.in_kernel_order(make_kjt(["f0", "f1", "f2", "f3"], batch=3, weighted=False, seed=4))
    batched.lookup(kjt, False).sum().backward()
    states = batched.split_optimizer_states()
    assert [tuple(s["momentum1"].shape) for s in states] == [(7,), (5,), (9,)]
    # a row's momentum grows iff one of its features looked it up
    for index, state in enumerate(states):
        looked_up = torch.cat([jt.values() for k, jt in kjt.to_dict().items()
                               if FEATURE_TABLE[k] == index])
        touched = torch.zeros(TABLES[index].rows, dtype=torch.bool)
        touched[looked_up] = True
        assert torch.equal(state["momentum1"] > 0, touched)


def test_cached_table_looks_up_and_trains_like_an_uncached_one(tmp_path) -> None:
    def build(cache: TableCache | None) -> BatchedTables:
        tables = [PackedTable(name="a", rows=7, dim=4, cache=cache),
                  PackedTable(name="c", rows=9, dim=4)]
        spec = PackedKernelSpec(tables=tuple(tables), feature_table_map=(0, 1), pooling_mean=False,
                                weighted=False, optimizer=SGD, backend=KernelBackend.TORCH,
                                offload_dir=str(tmp_path), features=("f0", "f3"))
        return BatchedTables([spec], CPU, fill=random_fill(6)[0])

    cached, plain = build(TableCache(slots=4)), build(None)
    assert isinstance(cached.kernels[0], CachedTableBatchedEmbedding)
    for seed in range(3):
        kjt = make_kjt(["f0", "f3"], batch=2, weighted=False, seed=seed)
        outs = [b.lookup(kjt, False) for b in (cached, plain)]
        torch.testing.assert_close(outs[0], outs[1])
        for out in outs:
            out.sum().backward()
    cached.kernels[0].flush()
    for got, want in zip(cached.split_embedding_weights(), plain.split_embedding_weights(), strict=True):
        torch.testing.assert_close(got, want)


def test_an_out_of_range_id_names_its_feature() -> None:
    batched, _ = grouped(KernelBackend.TORCH)
    kjt = KeyedJaggedTensor(keys=batched.feature_order, values=torch.tensor([1, 2, 99, 0]),
                            lengths=torch.tensor([1, 1, 1, 1]))
    with pytest.raises(IdOutOfRangeError, match="f1"):
        batched.lookup(kjt, False)


def test_members_must_match_the_kernels() -> None:
    spec = PackedKernelSpec(tables=TABLES[:1], feature_table_map=(0,), pooling_mean=False,
                            weighted=False, optimizer=SGD, backend=KernelBackend.TORCH)
    with pytest.raises(ValueError, match="members"):
        BatchedTables([spec], CPU, members=[[0, 1]])
    with pytest.raises(ValueError, match="feature names"):
        PackedKernelSpec(tables=TABLES[:1], feature_table_map=(0,), pooling_mean=False,
                         weighted=False, optimizer=SGD, features=("f0", "f1"))


def test_fill_rows_fills_each_table_once_and_a_cached_one_in_blocks(tmp_path, monkeypatch) -> None:
    import recsys_core.kernels.batched as batched_module

    monkeypatch.setattr(batched_module, "FILL_BLOCK_ROWS", 3)
    tables = (PackedTable(name="a", rows=7, dim=4, cache=TableCache(slots=4)),
              PackedTable(name="empty", rows=0, dim=4))
    cached = PackedKernelSpec(tables=tables, feature_table_map=(0, 1), pooling_mean=False,
                              weighted=False, optimizer=SGD, backend=KernelBackend.TORCH,
                              offload_dir=str(tmp_path), features=("f0", "f1"))
    plain = PackedKernelSpec(tables=TABLES[2:], feature_table_map=(0,), pooling_mean=False,
                             weighted=False, optimizer=SGD, backend=KernelBackend.TORCH)
    full = [torch.randn(7, 4), None, torch.randn(9, 4)]
    calls: list[tuple[int, int, int]] = []

    def fill_rows(index: int, view: torch.Tensor, first_row: int) -> None:
        calls.append((index, first_row, view.shape[0]))
        view.copy_(full[index][first_row : first_row + view.shape[0]])

    batched = BatchedTables([cached, plain], CPU, fill_rows=fill_rows)
    # the cached table in blocks of 3 rows, the empty one not at all, the plain one at once
    assert calls == [(0, 0, 3), (0, 3, 3), (0, 6, 1), (2, 0, 9)]
    weights = batched.split_embedding_weights()
    assert torch.equal(weights[0], full[0]) and torch.equal(weights[2], full[2])
    with pytest.raises(ValueError, match="fill or fill_rows"):
        BatchedTables([plain], CPU, fill=lambda i, v: None, fill_rows=fill_rows)


def test_build_hook_builds_every_kernel() -> None:
    built: list[PackedKernelSpec] = []

    def build(spec: PackedKernelSpec, device: torch.device) -> nn.Module:
        built.append(spec)
        return spec.build(device)

    batched = BatchedTables.grouped(TABLES, FEATURES, MEAN, device=CPU, optimizer=SGD,
                                    backend=KernelBackend.TORCH)
    hooked = BatchedTables(batched.specs, CPU, members=batched.members, build=build)
    assert built == batched.specs and len(hooked.kernels) == 2


def test_prefetch_brings_a_batch_into_the_cache(tmp_path) -> None:
    tables = (PackedTable(name="a", rows=7, dim=4, cache=TableCache(slots=6)),)
    spec = PackedKernelSpec(tables=tables, feature_table_map=(0,), pooling_mean=False,
                            weighted=False, optimizer=SGD, backend=KernelBackend.TORCH,
                            offload_dir=str(tmp_path), features=("f0",))
    batched = BatchedTables([spec], CPU, fill=random_fill(2)[0])
    kjt = make_kjt(["f0"], batch=2, weighted=False, seed=4)
    batched.prefetch(kjt)
    batched.lookup(kjt, False).sum().backward()
    assert batched.kernels[0].stats.prefetched == 1
    grouped(KernelBackend.TORCH)[0].prefetch(make_kjt(["f0", "f3", "f1", "f2"], 2, False, 5))


@pytest.mark.parametrize("io", ["rowio", "mapped"] if row_io_available() else ["mapped"])
def test_a_table_filled_in_blocks_is_sealed_without_reading_its_files_back(
        tmp_path, monkeypatch, io: str) -> None:
    """Checksums recorded block by block while filling equal those of a whole scan of the
    files, and the first move then needs no scan; damage after the fill is still found."""
    import recsys_core.kernels.batched as batched_module
    import recsys_core.kernels.offload_store as store_module
    from recsys_core.kernels.offload_store import BackingStore, OffloadCorruptionError

    helper = store_module.ROWIO  # None without the C helper: only the mapped case runs
    monkeypatch.setattr(batched_module, "FILL_BLOCK_ROWS", 3)
    adagrad = FusedOptimizerConfig(optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
                                   learning_rate=0.1)
    spec = PackedKernelSpec(
        tables=(PackedTable(name="a", rows=7, dim=4, cache=TableCache(slots=4)),),
        feature_table_map=(0,), pooling_mean=False, weighted=False, optimizer=adagrad,
        backend=KernelBackend.TORCH, offload_dir=str(tmp_path), features=("f0",))
    full = torch.randn(7, 4)
    if io == "mapped":  # hashed by torch while filling, moved through the mappings
        monkeypatch.setattr(store_module, "ROWIO", None)
    batched = BatchedTables([spec], CPU, fill_rows=lambda i, view, first: view.copy_(
        full[first : first + view.shape[0]]))
    monkeypatch.setattr(store_module, "ROWIO", helper)
    if io == "mapped":
        batched.kernels[0].row_io = False
    store = batched.kernels[0]._tables[0].store
    assert store.sealed
    recorded = store.checksums.clone()
    store._scan(record=True)  # what the first move would have done: read every row back
    assert torch.equal(recorded, store.checksums)
    scans: list[bool] = []
    monkeypatch.setattr(BackingStore, "_scan", lambda self, record: scans.append(record))
    kjt = KeyedJaggedTensor(keys=["f0"], values=torch.tensor([1, 5, 6]),
                            lengths=torch.tensor([2, 1]))
    out = batched.lookup(kjt, False)
    torch.testing.assert_close(out, torch.stack([full[1] + full[5], full[6]]))
    assert scans == []  # sealed at the fill: no whole-file scan before the first move
    with torch.no_grad():  # damage a row never read yet, straight in the file
        store.weight[3] += 1.0
    with pytest.raises(OffloadCorruptionError, match="row 3"):
        batched.lookup(KeyedJaggedTensor(keys=["f0"], values=torch.tensor([3]),
                                         lengths=torch.tensor([1])), False)


def test_rows_filled_out_of_order_leave_the_seal_to_the_first_move(tmp_path) -> None:
    from recsys_core.kernels.offload_store import BackingStore

    store = BackingStore(6, 2, {"momentum1": True}, CPU, str(tmp_path), "t")
    try:
        store.weight.copy_(torch.arange(12.0).view(6, 2))
        store.record_written(0, 2)
        store.record_written(4, 6)  # rows 2:4 were never recorded
        assert not store.sealed
        store.record_written(2, 4)  # out of order: still no seal (rows 4:6 may have changed)
        assert not store.sealed
        store.record_written(0, 3)
        store.record_written(3, 6)
        assert store.sealed
        recorded = store.checksums.clone()
        store.seal()
        assert torch.equal(recorded, store.checksums)
    finally:
        store.close()
