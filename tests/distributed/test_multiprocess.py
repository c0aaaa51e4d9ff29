"""run_gloo: real spawned gloo ranks, real collectives, failures surfaced in the parent."""

from __future__ import annotations

import os
import pickle
import time

import pytest
import torch
import torch.distributed as dist

from recsys_core.testing import find_free_port, run_gloo


def _collectives(rank: int, world_size: int, scale: float, *, tag: str) -> dict[str, object]:
    summed = torch.tensor([rank + 1.0, scale * (rank + 1)])
    dist.all_reduce(summed)
    # Uneven all-to-all: rank r sends r + j + 1 values to rank j, valued 100 r + 10 j + k.
    send_counts = [rank + j + 1 for j in range(world_size)]
    recv_counts = [r + rank + 1 for r in range(world_size)]
    sent = torch.cat([
        torch.arange(count, dtype=torch.float32) + 100 * rank + 10 * j
        for j, count in enumerate(send_counts)
    ])
    received = torch.empty(sum(recv_counts))
    dist.all_to_all_single(received, sent, recv_counts, send_counts)
    env = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    return {"sum": summed, "received": received, "env": env, "tag": tag,
            "threads": torch.get_num_threads()}


# What each rank receives in the all-to-all above, written out by hand.
_RECEIVED = {
    1: {0: [0]},
    2: {0: [0, 100, 101], 1: [10, 11, 110, 111, 112]},
    4: {
        0: [0, 100, 101, 200, 201, 202, 300, 301, 302, 303],
        3: [30, 31, 32, 33, 130, 131, 132, 133, 134,
            230, 231, 232, 233, 234, 235, 330, 331, 332, 333, 334, 335, 336],
    },
}


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_all_reduce_and_uneven_all_to_all(world_size: int) -> None:
    local = 2 if world_size == 4 else world_size
    out = run_gloo(world_size, _collectives, 10.0, tag="x", local_world_size=local)

    assert len(out) == world_size
    total = world_size * (world_size + 1) / 2  # 1 + 2 + ... + world_size
    for rank, result in enumerate(out):
        assert torch.equal(result["sum"], torch.tensor([total, 10.0 * total]))
        assert result["tag"] == "x" and result["threads"] == 1
        assert result["env"] == {
            "RANK": str(rank), "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank % local), "LOCAL_WORLD_SIZE": str(local),
        }
        assert result["received"].numel() == sum(r + rank + 1 for r in range(world_size))
    for rank, expected in _RECEIVED[world_size].items():
        assert out[rank]["received"].tolist() == expected


def _rank_one_raises(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("boom on purpose")
    dist.all_reduce(torch.ones(1))  # would wait forever for rank 1 if nobody intervened


def test_failing_rank_raises_in_parent_with_traceback() -> None:
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 1 raised") as info:
        run_gloo(2, _rank_one_raises, timeout_s=60)
    message = str(info.value)
    assert "ValueError: boom on purpose" in message
    assert "Traceback" in message and "_rank_one_raises" in message
    assert message.startswith("run_gloo (2 ranks): rank 1 raised")  # the root cause comes first
    assert time.monotonic() - start < 50


def _rank_one_dies(rank: int, world_size: int) -> None:
    if rank == 1:
        os._exit(3)
    dist.all_reduce(torch.ones(1))


def test_rank_that_dies_without_reporting() -> None:
    with pytest.raises(RuntimeError, match=r"rank 1 exited with code 3"):
        run_gloo(2, _rank_one_dies, timeout_s=60)


def _sleeps(rank: int, world_size: int) -> None:
    time.sleep(600)


@pytest.mark.slow
def test_timeout_terminates_ranks() -> None:
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"did not finish within 5"):
        run_gloo(2, _sleeps, timeout_s=5)
    assert time.monotonic() - start < 30


def test_bad_world_and_free_port() -> None:
    with pytest.raises(ValueError, match="multiple of local_world_size 3"):
        run_gloo(4, _sleeps, local_world_size=3)
    assert 0 < find_free_port() < 65536


def _loads_with_workers(rank: int, world_size: int) -> list[int]:
    data = torch.utils.data.DataLoader(list(range(4)), batch_size=2, num_workers=1)
    return [int(x) for batch in data for x in batch]


def test_rank_may_start_worker_processes() -> None:
    assert run_gloo(1, _loads_with_workers) == [[0, 1, 2, 3]]


def test_unpicklable_fn_fails_in_parent() -> None:
    def local_fn(rank: int, world_size: int) -> int:
        return rank

    with pytest.raises((AttributeError, TypeError, pickle.PicklingError), match="local"):
        run_gloo(2, local_fn)


_STATE = {"touched": False}


def _touches_state(rank: int, world_size: int, seed: int) -> dict[str, object]:
    seen = dict(_STATE)
    _STATE["touched"] = True
    os.environ["RUN_GLOO_TEST_LEFTOVER"] = "1"
    before = torch.get_num_threads()
    torch.manual_seed(seed)
    return {"seen": seen, "env": os.environ.get("RUN_GLOO_TEST_LEFTOVER_SEEN"),
            "draw": torch.rand(3), "pid": os.getpid(), "parent": os.getppid(),
            "threads": before}


def _reads_leftovers(rank: int, world_size: int) -> dict[str, object]:
    return {"seen": dict(_STATE), "env": os.environ.get("RUN_GLOO_TEST_LEFTOVER"),
            "draw": torch.rand(3), "pid": os.getpid(), "parent": os.getppid()}


def test_every_call_gets_fresh_rank_processes() -> None:
    # Ranks fork from a server that imported torch once; each call's ranks are new processes
    # that see nothing an earlier call's ranks changed (module state, environment, RNG).
    first = run_gloo(2, _touches_state, 7)
    second = run_gloo(2, _reads_leftovers)
    assert all(r["seen"] == {"touched": False} and r["threads"] == 1 for r in first)
    assert all(r["seen"] == {"touched": False} and r["env"] is None for r in second)
    pids = {r["pid"] for r in first + second}
    assert len(pids) == 4 and os.getpid() not in pids
    # torch's default generator starts from its fixed default seed in every new process, so
    # the second call's draws are those of a fresh interpreter, not the seeded one's sequel
    torch.manual_seed(7)
    seeded = torch.rand(3)
    assert all(torch.equal(r["draw"], seeded) for r in first)
    fresh = [r["draw"] for r in second]
    assert torch.equal(fresh[0], fresh[1]) and not torch.equal(fresh[0], seeded)
