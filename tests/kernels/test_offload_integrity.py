"""Rows read back from a cached table's backing files are what was written: a file overwritten
mid-training (random floats, zeros) fails the first lookup that reads a damaged row, naming the
file and the row, and the flush before an export; untouched files train bit-identically to the
unverified path and to the in-memory kernel."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from recsys_core.kernels.cached_tbe import (
    CachedTableBatchedEmbedding,
    OffloadCorruptionError,
    TableCache,
    row_io_available,
)
from recsys_core.kernels.config import EmbOptimType, FusedOptimizerConfig, KernelBackend
from recsys_core.kernels.offload_store import ROWIO, BackingStore, _coefficients, row_checksums
from recsys_core.kernels.tbe import build_table_batched_embedding

ROWS, DIMS = [300, 120], [8, 4]
FEATURES = [0, 1]
BATCH, IDS_PER_BAG = 8, 3
IO = ["pread", "mmap"] if row_io_available() else ["mmap"]


def make(caches: bool, opt: EmbOptimType = EmbOptimType.EXACT_ROWWISE_ADAGRAD, io: str = "pread",
         offload_dir: str | None = None) -> nn.Module:
    config = FusedOptimizerConfig(optimizer=opt, learning_rate=0.05, eps=1e-3)
    kernel = build_table_batched_embedding(
        rows=ROWS, dims=DIMS, feature_table_map=FEATURES, pooling_mean=False, optimizer=config,
        device=torch.device("cpu"), backend=KernelBackend.TORCH,
        caches=[TableCache(slots=40), TableCache(slots=30)] if caches else (),
        offload_dir=offload_dir, table_names=["big", "small"],
    )
    if isinstance(kernel, CachedTableBatchedEmbedding):
        kernel.row_io = io == "pread"
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for w in kernel.split_embedding_weights():
            w.copy_(torch.rand(w.shape, generator=gen) - 0.5)
    return kernel


def batch(step: int, ids: dict[int, list[int]] | None = None):
    gen = torch.Generator().manual_seed(100 + step)
    parts = [torch.randint(0, ROWS[t], (BATCH * IDS_PER_BAG,), generator=gen) for t in FEATURES]
    for t, forced in (ids or {}).items():
        parts[t][: len(forced)] = torch.tensor(forced)
    offsets = torch.arange(0, len(FEATURES) * BATCH * IDS_PER_BAG + 1, IDS_PER_BAG)
    return torch.cat(parts), offsets


def step(kernel: nn.Module, i: int, ids: dict[int, list[int]] | None = None) -> torch.Tensor:
    indices, offsets = batch(i, ids)
    out = kernel(indices, offsets)
    (out * torch.linspace(-1, 1, out.shape[1])).sum().backward()
    return out.detach()


def state(kernel: nn.Module) -> list[torch.Tensor]:
    if isinstance(kernel, CachedTableBatchedEmbedding):
        kernel.flush()
    return ([w.clone() for w in kernel.split_embedding_weights()]
            + [s.clone() for d in kernel.split_optimizer_states() for s in d.values()])


def backing_file(kernel: CachedTableBatchedEmbedding, table: int):
    """The weight file of a table, opened again through /proc as another writer would."""
    f = kernel._tables[table].store.files[0]
    return f, f"/proc/self/fd/{f._fd}"


def table_ids(step: int, table: int) -> set[int]:
    indices, _ = batch(step)
    lo = sum(BATCH * IDS_PER_BAG for _ in FEATURES[:table])
    return set(indices[lo: lo + BATCH * IDS_PER_BAG].tolist())


def evicted_rows(kernel: CachedTableBatchedEmbedding, table: int, count: int) -> list[int]:
    """Rows of ``table`` that were trained, written back and are not resident now, and that
    batch 12 (the lookup after them) does not draw: which rows of a tick LRU evicts is not
    specified, and a damaged row that batch 12 draws by chance would be read first."""
    resident = set(kernel.resident_rows(table))
    seen = set().union(*(table_ids(i, table) for i in range(12)))
    return sorted(seen - resident - table_ids(12, table))[:count]


@pytest.mark.parametrize("io", IO)
@pytest.mark.parametrize("opt", [EmbOptimType.EXACT_ROWWISE_ADAGRAD, EmbOptimType.EXACT_ADAGRAD,
                                 EmbOptimType.EXACT_SGD])
def test_untouched_files_train_bit_identically(io: str, opt: EmbOptimType) -> None:
    memory, checked, unchecked = make(False, opt), make(True, opt, io), make(True, opt, io)
    unchecked.set_row_verification(False)
    for i in range(12):
        outs = [step(k, i) for k in (memory, checked, unchecked)]
        assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2]), i
    assert checked.stats.evictions > 100 and checked.stats.writebacks > 100
    for a, b, c in zip(state(memory), state(checked), state(unchecked), strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.parametrize("io", IO)
@pytest.mark.parametrize("damage", ["random_floats", "zeros"])
def test_overwritten_backing_file_fails_the_lookup_that_reads_it(io: str, damage: str,
                                                                 tmp_path) -> None:
    kernel = make(True, io=io, offload_dir=str(tmp_path))
    for i in range(12):
        step(kernel, i)
    rows = evicted_rows(kernel, 0, 3)
    assert len(rows) == 3
    f, path = backing_file(kernel, 0)
    gen = torch.Generator().manual_seed(9)
    values = (torch.randn(len(rows), DIMS[0], generator=gen) if damage == "random_floats"
              else torch.zeros(len(rows), DIMS[0]))
    with open(path, "r+b") as out:  # another process's write, through the file system
        for r, v in zip(rows, values, strict=True):
            out.seek(r * DIMS[0] * 4)
            out.write(v.numpy().tobytes())
    with pytest.raises(OffloadCorruptionError) as e:
        step(kernel, 12, {0: [rows[1]]})
    err = e.value
    assert (err.path, err.table, err.row) == (f.path, "big", rows[1])
    assert err.path.startswith(str(tmp_path)) and "recsys_offload_big_weight_" in err.path
    message = str(err)
    assert f.path in message and f"row {rows[1]}" in message and "checkpoint" in message
    assert "\n" not in message
    # the damaged rows never reached the cache (no slot holds one), and no step ran
    cache = kernel.inner.split_embedding_weights()[0]
    for v in values:
        assert not bool((cache == v).all(1).any())
    # and the kernel stays failed: later steps, prefetches and exports raise the same error
    for again in (lambda: step(kernel, 13), lambda: kernel.prefetch(*batch(14)), kernel.flush):
        with pytest.raises(OffloadCorruptionError):
            again()


@pytest.mark.parametrize("io", IO)
def test_a_damaged_prefetch_fails_its_forward_once_and_not_the_cleanup(io: str) -> None:
    kernel = make(True, io=io)
    for i in range(12):
        step(kernel, i)
    (row,) = evicted_rows(kernel, 1, 1)
    store = kernel._tables[1].store
    with torch.no_grad():
        store.states["momentum1"][row] += 1.0  # the optimizer-state file this time
    kernel.prefetch(*batch(12, {1: [row]}))
    with pytest.raises(OffloadCorruptionError) as e:
        step(kernel, 12, {1: [row]})
    assert e.value.row == row and e.value.table == "small"
    assert e.value.paths == [f.path for f in store.files]
    kernel.drop_prefetched()  # the pipeline's cleanup: does not raise it a second time
    with pytest.raises(OffloadCorruptionError):
        kernel.flush()


@pytest.mark.parametrize("io", IO)
def test_the_flush_before_an_export_checks_rows_never_read_again(io: str) -> None:
    kernel = make(True, io=io)
    for i in range(6):
        step(kernel, i)
    untouched = sorted(set(range(ROWS[0])) - set(kernel.resident_rows(0)))[-1]
    _, path = backing_file(kernel, 0)
    with open(path, "r+b") as out:
        out.seek(untouched * DIMS[0] * 4 + 4)
        out.write(b"\0\0\0\0")
    with pytest.raises(OffloadCorruptionError, match=f"row {untouched}"):
        kernel.flush()


@pytest.mark.parametrize("io", IO)
def test_state_written_from_outside_is_sealed_again_by_invalidate(io: str) -> None:
    # What a checkpoint load does (DCP, then the load hook): flush and take the store's views,
    # write the checkpoint into them, flush again (not a check of the files against what the
    # cache wrote: they now hold the checkpoint), invalidate; training goes on from it as in
    # memory, and damage afterwards is found again.
    memory, kernel = make(False), make(True, io=io)
    for k in (memory, kernel):
        for i in range(6):
            step(k, i)
        state(k)
        with torch.no_grad():
            for w in k.split_embedding_weights():
                w.mul_(0.5)
            for d in k.split_optimizer_states():
                for s in d.values():
                    s.add_(1.0)
    kernel.flush()
    kernel.invalidate()
    for i in range(6, 12):
        assert torch.equal(step(memory, i), step(kernel, i)), i
    for a, b in zip(state(memory), state(kernel), strict=True):
        assert torch.equal(a, b)
    step(kernel, 12)
    untouched = sorted(set(range(ROWS[0])) - set(kernel.resident_rows(0)))[0]
    _, path = backing_file(kernel, 0)
    with open(path, "r+b") as out:
        out.seek(untouched * DIMS[0] * 4)
        out.write(b"\1\0\0\0")
    with pytest.raises(OffloadCorruptionError, match=f"row {untouched}"):
        kernel.flush()


@pytest.mark.skipif(ROWIO is None, reason="the C helper was not built")
def test_the_c_helper_hashes_rows_as_torch_does() -> None:
    gen = torch.Generator().manual_seed(0)
    weight, state = torch.randn(50, 7, generator=gen), torch.randn(50, 1, generator=gen)
    weight[3] = float("nan")
    weight[4] = 0.0
    coef = _coefficients(8)
    acc = torch.zeros(50, dtype=torch.int64)
    ROWIO.recsys_hash_rows(weight.data_ptr(), 50, 28, coef.data_ptr(), acc.data_ptr())
    ROWIO.recsys_hash_rows(state.data_ptr(), 50, 4, coef[7:].data_ptr(), acc.data_ptr())
    assert torch.equal((acc >> 32).to(torch.int32), row_checksums([weight, state], coef))
    # one flipped bit in one word changes the row's checksum
    flipped = weight.clone()
    flipped.view(torch.int32)[10, 2] ^= 1 << 17
    sums = row_checksums([flipped, state], coef)
    assert (sums != row_checksums([weight, state], coef)).nonzero().flatten().tolist() == [10]


def test_files_are_named_after_their_table_and_cost_4_bytes_a_row(tmp_path) -> None:
    store = BackingStore(1000, 16, {"momentum1": True}, torch.device("cpu"), str(tmp_path),
                         name="t/cat 3")
    names = [os.path.basename(f.path) for f in store.files]
    assert names[0].startswith("recsys_offload_t_cat_3_weight_")
    assert names[1].startswith("recsys_offload_t_cat_3_momentum1_")
    assert store.checksums.dtype == torch.int32 and store.checksums.numel() == 1000
    assert list(tmp_path.iterdir()) == []  # unlinked at once


def test_finalizer_does_not_join_its_workers(tmp_path) -> None:
    # The garbage collector can run a finalizer inside a thread being started, while threading
    # holds its shutdown lock; a finalizer that joins the cache's workers then waits for that
    # lock forever. Run the finalizer with the lock held: it must return.
    import threading

    kernel = make(True, offload_dir=str(tmp_path))
    step(kernel, 0)  # the movers' worker threads exist now
    assert kernel._mover._threads
    done = threading.Event()

    def finalize() -> None:
        with threading._shutdown_locks_lock:  # what a starting thread holds (CPython 3.11-3.13)
            kernel.__del__()
        done.set()

    t = threading.Thread(target=finalize, daemon=True)
    t.start()
    assert done.wait(30), "the finalizer blocked on joining the cache's worker threads"
    kernel._mover.shutdown(wait=True)  # the workers still finish and exit
    assert not any(th.is_alive() for th in kernel._mover._threads)
