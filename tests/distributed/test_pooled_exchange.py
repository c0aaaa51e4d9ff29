"""The table-wise output dist through shared memory in one step
(``comm.pooled_all_to_all_assembled``: each peer's part read in place and copied straight to its
output columns, the gradient's columns written straight into the segment) against values built
by hand from every rank's inputs, and against the all-to-all + assembly it replaces: uneven
batches, a rank that holds no columns, a column order across ranks, 2 and 3 ranks, fp32 and
bf16, a contiguous and an expanded (stride 0) upstream gradient, gradient division on and off,
no grad."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from recsys_core.distributed import comm, shm_comm
from recsys_core.distributed.comm_ops import set_gradient_division
from recsys_core.kernels.packed import column_permutation, permute_received, select_columns_by_index
from recsys_core.testing import run_gloo

pytestmark = pytest.mark.skipif(
    shm_comm._shm_sync is None and os.environ.get("CI") != "true",
    reason="the _shm_sync extension is not built (no compiler); CI must build it")

LAYOUTS = {2: ([3, 5], [8, 4]), 3: ([3, 5, 2], [8, 0, 4])}  # batch and columns per rank


def _pooled(rank: int, batches: list[int], dim: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + rank)
    return torch.randn(sum(batches), dim, generator=gen).to(dtype)


def _upstream(rank: int, batch: int, total: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(200 + rank)
    return torch.randn(batch, total, generator=gen).to(dtype)


def _order(total: int) -> list[int]:
    """Output column c is received column order[c]: blocks of 2 in a fixed shuffled order."""
    gen = torch.Generator().manual_seed(7)
    blocks = torch.randperm(total // 2, generator=gen).tolist()
    return [2 * b + i for b in blocks for i in range(2)]


def _exchange(rank: int, world: int, dtype: torch.dtype, expanded: bool,
              division: bool) -> None:
    set_gradient_division(division)
    batches, dims = LAYOUTS[world]
    total = sum(dims)
    columns = column_permutation(_order(total))
    assert columns is not None
    runs = list(columns.placement(tuple(dims)).copies)
    # every rank's inputs, so that each rank can build its expected values by hand
    inputs = [_pooled(r, batches, dims[r], dtype) for r in range(world)]
    grads_out = [_upstream(q, batches[q], total, dtype) for q in range(world)]
    leaves = [[inputs[p].split(batches)[q].clone().requires_grad_(True) for q in range(world)]
              for p in range(world)]
    expected = []
    for q in range(world):
        out_q = select_columns_by_index(torch.cat([leaves[p][q] for p in range(world)], 1),
                                        columns)
        expected.append(out_q.detach())
        if expanded:
            out_q.sum().backward()
        else:
            out_q.backward(grads_out[q])
    scale = world if division else 1
    expected_grad = torch.cat([leaves[rank][q].grad for q in range(world)]) / scale

    pooled = inputs[rank].clone().requires_grad_(True)
    work = comm.pooled_all_to_all_assembled(pooled, batches, batches[rank], dims, runs,
                                            dist.group.WORLD)
    assert work is not None  # every rank on this host: the shared-memory path
    out = work.wait()
    assert out.shape == (batches[rank], total) and out.dtype == dtype
    assert torch.equal(out, expected[rank])
    if expanded:
        out.sum().backward()
    else:
        out.backward(grads_out[rank])
    assert torch.equal(pooled.grad, expected_grad)

    # the all-to-all + assembly it replaces: the same bits
    ref_in = inputs[rank].clone().requires_grad_(True)
    received = comm.all_to_all_1d(
        ref_in, [b * dims[rank] for b in batches], [batches[rank] * d for d in dims],
        dist.group.WORLD).wait()
    ref = permute_received(received, batches[rank], dims, columns)
    assert torch.equal(ref, out)
    if expanded:
        ref.sum().backward()
    else:
        ref.backward(grads_out[rank])
    assert torch.equal(ref_in.grad, pooled.grad)

    # without grad (evaluation): the forward alone, twice (slots and regions reused)
    with torch.no_grad():
        for _ in range(2):
            again = comm.pooled_all_to_all_assembled(
                inputs[rank], batches, batches[rank], dims, runs, dist.group.WORLD)
            assert again is not None and torch.equal(again.wait(), expected[rank])
    set_gradient_division(True)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_hand_built_values_and_the_all_to_all(world: int, dtype: torch.dtype) -> None:
    run_gloo(world, _exchange, dtype, False, True)


@pytest.mark.parametrize("division", [True, False])
def test_expanded_gradient_and_gradient_division(division: bool) -> None:
    run_gloo(2, _exchange, torch.float32, True, division)


def _not_applicable(rank: int, world: int) -> None:
    pooled = torch.randn(4, 3)
    # one rank alone: nothing to exchange, the caller's all-to-all path returns the view
    assert comm.pooled_all_to_all_assembled(pooled, [4], 4, [3], [(0, 0, 0, 3)], None) is None
    shm_comm.pause(True)  # the transport off (gloo): not this path
    try:
        work = comm.pooled_all_to_all_assembled(
            torch.randn(4, 3), [2, 2], 2, [3, 3], [(0, 0, 0, 3), (1, 0, 3, 3)], dist.group.WORLD)
        assert work is None
    finally:
        shm_comm.pause(False)
    with pytest.raises(ValueError, match=r"sends 4 rows of 3 columns, got .* \[4, 2\]"):
        comm.pooled_all_to_all_assembled(torch.randn(4, 2), [2, 2], 2, [3, 3],
                                         [(0, 0, 0, 3), (1, 0, 3, 3)], dist.group.WORLD)
    # runs that leave an output column unwritten, overlap, or read past a part: refused
    # before anything is sent (the same on every rank, so no rank is left waiting)
    for runs in ([(0, 0, 0, 3), (1, 0, 3, 2)], [(0, 0, 0, 3), (1, 0, 2, 3)],
                 [(0, 1, 0, 3), (1, 0, 3, 3)]):
        with pytest.raises(ValueError, match="pooled all-to-all: the runs"):
            comm.pooled_all_to_all_assembled(torch.randn(4, 3), [2, 2], 2, [3, 3], runs,
                                             dist.group.WORLD)


def test_not_applicable_without_the_transport_and_a_wrong_shape() -> None:
    run_gloo(2, _not_applicable)
