"""The shared-memory transport (recsys_core.distributed.shm_comm) against gloo and against values
built by hand from every rank's inputs: all-to-all with uneven and zero-size parts, all-gather,
reduce-scatter, all-reduce; 2 and 3 ranks; fp32, bf16, int64. Also: a sharded EBC trains to the
same bits with the transport on and off, no /dev/shm name outlives the setup (even when a rank
raises), and a mismatched call raises a clear error instead of hanging."""

from __future__ import annotations

import copy
import glob
import os
import threading
import time

import pytest
import torch
import torch.distributed as dist

from recsys_core import EmbeddingBagCollection, EmbeddingBagConfig, EmbOptimType
from recsys_core.distributed import comm, shm_comm
from recsys_core.testing import run_gloo
from tests.gloo_setup import rank_batches, shard_beside_reference, shard_weights, two_table_plans

pytestmark = pytest.mark.skipif(
    shm_comm._shm_sync is None and os.environ.get("CI") != "true",
    reason="the _shm_sync extension is not built (no compiler); CI must build it")
SEGMENTS = "/dev/shm/recsys_shm_comm_*"


def _inputs(rank: int, n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    if dtype == torch.int64:
        return torch.randint(-(2**40), 2**40, (n,), generator=gen)
    return torch.randn(n, generator=gen).to(dtype)


def _splits(world: int) -> list[list[int]]:
    """splits[src][dst]: uneven, with zero-size parts (rank 0 sends itself nothing, the last
    rank sends rank 0 nothing)."""
    table = [[(3 * src + 2 * dst + 1) % 5 for dst in range(world)] for src in range(world)]
    table[0][0] = 0
    table[world - 1][0] = 0
    return table


def _collectives(rank: int, world: int, dtype: torch.dtype) -> None:
    shm = shm_comm.for_group(dist.group.WORLD, torch.device("cpu"))
    assert shm is not None
    splits = _splits(world)
    xs = [_inputs(r, sum(splits[r]), dtype) for r in range(world)]  # every rank's input
    x = xs[rank]
    for repeat in range(2):  # the second round reuses the regions and slots
        # all-to-all: by hand, gloo and shm agree bit for bit
        out_splits = [splits[p][rank] for p in range(world)]
        expect = torch.cat([xs[p].split(splits[p])[rank] for p in range(world)])
        out = x.new_empty(sum(out_splits))
        shm.all_to_all_single(out, x, out_splits, splits[rank]).wait()
        ref = x.new_empty(sum(out_splits))
        dist.all_to_all_single(ref, x, out_splits, splits[rank])
        assert torch.equal(out, expect) and torch.equal(ref, expect)
        # all-gather
        n = 7
        parts = [_inputs(r, n, dtype, seed=1 + repeat) for r in range(world)]
        gathered = parts[rank].new_empty(world * n)
        shm.all_gather(gathered, parts[rank]).wait()
        assert torch.equal(gathered, torch.cat(parts))
        # reduce-scatter: rank r's chunk summed in rank order (what comm.py's gloo path does)
        full = [_inputs(r, world * 5, dtype, seed=3) for r in range(world)]
        mine = full[rank].new_empty(5)
        shm.reduce_scatter(mine, full[rank]).wait()
        by_hand = torch.stack([f.view(world, 5)[rank] for f in full]).sum(0)
        assert torch.equal(mine, by_hand)
        # all-reduce (sizes not divisible by the world; one smaller than it): equal on every
        # rank; equal to gloo for 2 ranks (a + b == b + a) and for integers at any world size
        for size in (2, 1001):
            values = [_inputs(r, size, dtype, seed=4) for r in range(world)]
            summed = values[rank].clone()
            shm.all_reduce(summed).wait()
            ref = values[rank].clone()
            dist.all_reduce(ref)
            assert torch.equal(summed, torch.stack(values).sum(0))
            if world == 2 or dtype == torch.int64:
                assert torch.equal(summed, ref)
            else:  # 3 ranks: gloo's ring sums in another order (bf16: within 2 rounding steps)
                tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
                torch.testing.assert_close(summed, ref, atol=tol, rtol=tol)
            agreed = [summed.clone() for _ in range(world)]
            dist.all_gather(agreed, summed)
            assert all(torch.equal(a, summed) for a in agreed)
    # several in flight at once, waited in reverse order
    works, outs = [], []
    for k in range(3):
        t = _inputs(rank, world * 4, dtype, seed=10 + k)
        outs.append((t, t.new_empty(world * 4)))
        works.append(shm.all_to_all_single(outs[-1][1], t, [4] * world, [4] * world))
    for work in reversed(works):
        work.wait()
    for k, (_, got) in enumerate(outs):
        want = torch.cat([_inputs(p, world * 4, dtype, seed=10 + k).view(world, 4)[rank]
                          for p in range(world)])
        assert torch.equal(got, want)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_collectives_equal_gloo_and_hand_values(world: int, dtype: torch.dtype) -> None:
    run_gloo(world, _collectives, dtype)
    assert not glob.glob(SEGMENTS.replace("*", f"{os.getpid()}_*"))


def _name_gone_then_raise(rank: int, world: int) -> None:
    shm = shm_comm.for_group(dist.group.WORLD, torch.device("cpu"))
    assert shm is not None and not os.path.exists(shm._path)  # unlinked once mapped
    out = torch.empty(world)
    shm.all_to_all_single(out, torch.ones(world), [1] * world, [1] * world).wait()
    if rank == 1:
        raise RuntimeError("a rank fails mid-run")
    dist.barrier()


def test_no_segment_outlives_the_setup_even_when_a_rank_raises() -> None:
    before = set(glob.glob(SEGMENTS))
    with pytest.raises(RuntimeError, match="a rank fails mid-run"):
        run_gloo(2, _name_gone_then_raise, timeout_s=60)
    assert set(glob.glob(SEGMENTS)) <= before


def _mismatched(rank: int, world: int) -> str:
    os.environ[shm_comm.ENV_TIMEOUT] = "20"
    shm = shm_comm.for_group(dist.group.WORLD, torch.device("cpu"))
    # rank 0 sends rank 1 three elements; rank 1 expects two
    in_splits = [[1, 3], [2, 2]][rank]
    out_splits = [[1, 2], [2, 2]][rank]
    x = torch.arange(sum(in_splits), dtype=torch.float32)
    try:
        shm.all_to_all_single(x.new_empty(sum(out_splits)), x, out_splits, in_splits).wait()
        # a rank whose own part matched fails at its next collective (the group is aborted)
        shm.all_reduce(torch.ones(4)).wait()
    except shm_comm.ShmCommError as e:
        return str(e)
    return "no error"


def test_mismatched_splits_raise_instead_of_hanging() -> None:
    errors = run_gloo(2, _mismatched, timeout_s=60)
    assert "rank 0 sends rank 1 12 bytes of float32, rank 1 expects 8 bytes" in errors[1]
    assert "disagree" in errors[1]
    assert "rank 1 of the group failed" in errors[0] or "rank 1 (pid" in errors[0]


def _env_switch_off(rank: int, world: int) -> bool:
    os.environ[shm_comm.ENV_SWITCH] = "0" if rank == 1 else "1"  # one rank off: all use gloo
    return shm_comm.for_group(dist.group.WORLD, torch.device("cpu")) is None


def test_switch_off_on_any_rank_keeps_the_group_on_gloo() -> None:
    assert run_gloo(2, _env_switch_off) == [True, True]


# ---- a sharded EBC trains to the same bits on either transport ------------------------------
TABLES = [EmbeddingBagConfig(name=t, embedding_dim=8, num_embeddings=40, feature_names=[f])
          for t, f in (("t0", "f0"), ("t1", "f1"))]


def _train(rank: int, world: int, transport: str, kind: str) -> dict[str, torch.Tensor]:
    os.environ[shm_comm.ENV_SWITCH] = "1" if transport == "shm" else "0"
    torch.manual_seed(0)
    module = EmbeddingBagCollection(TABLES)
    sharded, _ = shard_beside_reference(
        module, two_table_plans("t0", "t1", world)[kind], world,
        fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1})
    assert (shm_comm.for_group(dist.group.WORLD, torch.device("cpu")) is not None) == (
        transport == "shm")
    outputs = []
    for step in range(3):
        batch = rank_batches(step, world, ["f0", "f1"], [40, 40], 6)[rank]
        out = sharded(batch).wait().values()
        (out * torch.arange(out.numel()).view_as(out).sin()).sum().backward()
        outputs.append(out.detach())
    # the dense path of the DDP hook: one all-reduce through comm.py
    dense = torch.arange(10, dtype=torch.float32) * (rank + 1)
    comm.all_reduce_sum_(dense, dist.group.WORLD)
    weights = {str(k): v for k, v in shard_weights(sharded).items()}
    return {"outputs": torch.cat(outputs), "dense": dense, **weights}


@pytest.mark.parametrize("kind", ["table_wise", "row_wise"])
def test_sharded_ebc_trains_to_the_same_bits_on_either_transport(kind: str) -> None:
    shm = run_gloo(2, _train, "shm", kind)
    gloo = run_gloo(2, _train, "gloo", kind)
    for a, b in zip(shm, gloo, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), key


def _many_small(rank: int, world: int) -> int:
    """More collectives than slots: every slot and its region bytes are reused."""
    shm = shm_comm.for_group(dist.group.WORLD, torch.device("cpu"))
    assert shm is not None
    for step in range(shm_comm.SLOTS + 50):
        x = torch.full((world * 3,), float(rank * 10_000 + step))
        out = torch.empty(world * 3)
        pending = shm.all_to_all_single(out, x, [3] * world, [3] * world)
        if step % 2:  # every other one waited late, after the next has started
            pending.wait()
        else:
            nxt = torch.full((world,), float(step))
            shm.all_reduce(nxt).wait()
            pending.wait()
            assert torch.equal(nxt, torch.full((world,), float(step * world)))
        want = torch.tensor([p * 10_000 + step for p in range(world)], dtype=torch.float32)
        assert torch.equal(out, want.repeat_interleave(3))
    return len(shm._live)


def test_slots_and_region_are_reused() -> None:
    assert all(live <= 4 for live in run_gloo(2, _many_small))


def _ddp_hook_step(rank: int, world: int, transport: str) -> list[torch.Tensor]:
    from torch.nn.parallel import DistributedDataParallel

    from dlrm_app.training.build import _sum_allreduce_hook

    os.environ[shm_comm.ENV_SWITCH] = "1" if transport == "shm" else "0"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 300), torch.nn.ReLU(), torch.nn.Linear(300, 2))
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.5)  # several buckets
    ddp.register_comm_hook(dist.group.WORLD, _sum_allreduce_hook)
    grads = []
    for step in range(2):
        gen = torch.Generator().manual_seed(100 * step + rank)
        ddp.zero_grad()
        ddp(torch.randn(8, 5, generator=gen)).square().sum().backward()
        got = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        # by hand: each rank's gradient on a plain copy of the model, summed over ranks
        local = []
        for r in range(world):
            own = copy.deepcopy(model)
            own.zero_grad()
            x = torch.randn(8, 5, generator=torch.Generator().manual_seed(100 * step + r))
            own(x).square().sum().backward()
            local.append(torch.cat([p.grad.reshape(-1) for p in own.parameters()]))
        torch.testing.assert_close(got, local[0] + local[1], atol=1e-5, rtol=1e-6)
        grads.append(got)
    return grads


def test_ddp_hook_sums_to_the_same_bits_on_either_transport() -> None:
    shm = run_gloo(2, _ddp_hook_step, "shm")
    gloo = run_gloo(2, _ddp_hook_step, "gloo")
    for a, b in zip(shm, gloo, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert all(torch.equal(x, y) for x, y in zip(shm[0], shm[1], strict=True))


def _close_during_hook(rank: int, world: int) -> tuple[list[float], bool, str]:
    import time

    shm = shm_comm.for_group(dist.group.WORLD, torch.device("cpu"))
    assert shm is not None
    x = torch.full((1000,), float(rank + 1))
    if rank == 1:
        time.sleep(1.0)  # rank 0 closes while its all-reduce still waits for this part
    fut = shm.all_reduce_future(x)
    pending = shm.all_reduce(torch.ones(3))  # posted, never waited before close
    if rank == 0:
        shm.close()  # must let the hook's thread finish before it unmaps the segment
        done_at_close = fut.done()
    else:
        fut.wait()
        done_at_close = True
        pending.wait()
    try:
        if rank == 0:
            pending.wait()
        error = ""
    except shm_comm.ShmCommError as e:
        error = str(e)
    dist.barrier()
    return sorted(set(fut.wait().tolist())), done_at_close, error


def test_close_waits_for_the_hooks_thread_and_later_waits_raise() -> None:
    (sums, done, error), (peer_sums, _, peer_error) = run_gloo(2, _close_during_hook,
                                                              timeout_s=60)
    assert sums == peer_sums == [3.0]  # 1 + 2, the all-reduce finished before the unmap
    assert done  # close() returned only after the helper thread's all-reduce completed
    assert "closed group" in error and peer_error == ""


def _stalled_peer(rank: int, world: int) -> tuple[float, str]:
    shm = shm_comm.for_group(dist.group.WORLD, torch.device("cpu"))
    assert shm is not None
    group_timeout = shm._timeout_s  # the process group's (run_gloo's timeout_s)
    if rank == 1:
        time.sleep(6)  # alive, but issues nothing: a stalled rank
        return group_timeout, ""
    os.environ[shm_comm.ENV_TIMEOUT] = "2"
    shm._timeout_s = shm_comm._timeout_s(dist.group.WORLD)
    try:
        shm.all_to_all_single(torch.empty(2), torch.ones(2), [1, 1], [1, 1]).wait()
    except shm_comm.ShmCommError as e:
        return group_timeout, str(e)
    return group_timeout, "no error"


def test_a_stalled_peer_times_out_with_gloos_wording() -> None:
    (timeout, error), (peer_timeout, _) = run_gloo(2, _stalled_peer, timeout_s=45)
    assert timeout == peer_timeout == 45.0  # the group's own timeout, unless overridden
    assert "timed out after 2 s" in error and "rank 1's part of all_to_all" in error


def _own_thread_failed(rank: int, world: int) -> str:
    shm = shm_comm.for_group(dist.group.WORLD, torch.device("cpu"))
    assert shm is not None
    if rank == 1:
        time.sleep(4)  # alive, issues nothing
        return ""
    os.environ[shm_comm.ENV_TIMEOUT] = "1"
    shm._timeout_s = shm_comm._timeout_s(dist.group.WORLD)
    failed: list[str] = []

    def hook() -> None:  # as the DDP hook's thread: its wait times out first
        try:
            shm.all_reduce(torch.ones(2)).wait()
        except shm_comm.ShmCommError as e:
            failed.append(str(e))

    thread = threading.Thread(target=hook)
    thread.start()
    thread.join()
    shm._timeout_s = 30.0  # the main thread's own wait would end much later
    try:
        shm.all_to_all_single(torch.empty(2), torch.ones(2), [1, 1], [1, 1]).wait()
    except shm_comm.ShmCommError as e:
        return failed[0] + " | " + str(e)
    return "no error"


def test_a_wait_after_this_ranks_other_thread_failed_gives_that_reason() -> None:
    # the main thread reports the hook thread's timeout, not "connection closed by peer"
    # (which would send the user looking for another rank's error)
    (error, _) = run_gloo(2, _own_thread_failed, timeout_s=45)
    first, then = error.split(" | ")
    assert "timed out after 1 s" in first
    assert then == first and "closed by peer" not in then


def test_the_helper_is_built_where_ci_runs() -> None:
    """Without the helper every test here would skip and CI stay green: under CI its absence
    is a failure (setup builds it with the machine's C compiler)."""
    if os.environ.get("CI") == "true":
        assert shm_comm._shm_sync is not None, "recsys_core/distributed/_shm_sync.c was not built"
