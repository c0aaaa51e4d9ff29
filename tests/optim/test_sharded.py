"""Keyed optimizers over sharded state and sharded parameters, on 2 gloo ranks: in-place load of
ShardedTensor state, and global-norm clipping whose norm spans the ranks."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed._shard import sharded_tensor
from torch.distributed._shard.sharding_spec import ChunkShardingSpec

from recsys_core.optim.clipping import GradientClipping, GradientClippingOptimizer
from recsys_core.optim.keyed import KeyedOptimizer, KeyedOptimizerWrapper
from recsys_core.testing import run_gloo

SPEC = ChunkShardingSpec(dim=0, placements=["rank:0/cpu", "rank:1/cpu"])


def sharded_state_worker(rank: int, world: int) -> tuple[list[float], bool, str]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ShardedTensor's deprecation notice
        state = sharded_tensor.full(SPEC, (4,), fill_value=1.0)
        saved = sharded_tensor.full(SPEC, (4,), fill_value=5.0 + rank)
        wide = sharded_tensor.full(ChunkShardingSpec(dim=0, placements=["rank:0/cpu"] * 2), (4,), 0.0)
    p = torch.zeros(2)
    opt = KeyedOptimizer({"p": p}, {p: {"sharded": state}}, [{"params": [p]}])
    local = state.local_shards()[0].tensor
    opt.load_state_dict({"state": {"p": {"sharded": saved}}})
    same_storage = state.local_shards()[0].tensor.data_ptr() == local.data_ptr()
    try:
        opt.load_state_dict({"state": {"p": {"sharded": wide}}})
        error = ""
    except ValueError as e:
        error = str(e)
    return local.tolist(), same_storage, error


def test_sharded_tensor_state_loads_in_place() -> None:
    (v0, same0, err0), (v1, same1, err1) = run_gloo(2, sharded_state_worker)
    assert v0 == [5.0, 5.0] and v1 == [6.0, 6.0]
    assert same0 and same1
    # rank 0 holds both shards of the "wide" tensor, rank 1 none: a clear error on both
    assert "Different number of shards 1 vs 2" in err0
    assert "Different number of shards 1 vs 0" in err1


def global_clip_worker(rank: int, world: int) -> tuple[float, list[float], list[float]]:
    a = torch.nn.Parameter(torch.zeros(2))  # this rank's shard of a row-wise sharded parameter
    b = torch.nn.Parameter(torch.zeros(1))  # replicated: the same gradient on every rank
    opt = GradientClippingOptimizer(
        KeyedOptimizerWrapper({"a": a, "b": b}, lambda ps: torch.optim.SGD(ps, lr=1.0)),
        clipping=GradientClipping.NORM, max_gradient=5.0,
        enable_global_grad_clip=True, param_to_pgs={a: [dist.group.WORLD]},
    )
    a.grad = torch.tensor([2.0, 4.0]) if rank == 0 else torch.tensor([4.0, 0.0])
    b.grad = torch.tensor([8.0])
    opt.step()
    assert opt.last_total_grad_norm is not None
    return float(opt.last_total_grad_norm), a.detach().tolist(), b.detach().tolist()


def test_global_norm_clipping_spans_ranks() -> None:
    # |a|^2 summed over the ranks: 4 + 16 + 16 = 36; replicated b counted once: 64; norm 10.
    (n0, a0, b0), (n1, a1, b1) = run_gloo(2, global_clip_worker)
    assert n0 == pytest.approx(10.0) and n1 == pytest.approx(10.0)
    coef = 5.0 / (10.0 + 1e-6)
    assert a0 == pytest.approx([-2.0 * coef, -4.0 * coef])
    assert a1 == pytest.approx([-4.0 * coef, 0.0])
    assert b0 == b1 == pytest.approx([-8.0 * coef])
