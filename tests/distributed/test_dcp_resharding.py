"""Checkpoints resharded through raw ``torch.distributed.checkpoint``, as TorchRec users call
it: saved on N ranks with one plan, loaded on M ranks (growing and shrinking) with another,
training continued, compared with the run that never stopped.

Each rank's loss is its rows' summed loss over the GLOBAL batch, gradient division off (what
dlrm-app runs), so a step is the same step on any world size and the continued run must
reach the uninterrupted run's tables. Right after the load the tables are the saved ones
bit for bit; two steps later they match within float tolerance (another sharding sums in
another order). The optimizer state goes along: Adam's two moments and step (its bias
correction), row-wise Adagrad's per-row sums; a lost state would move the tables elsewhere.
"""

from __future__ import annotations

import tempfile
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from gloo_setup import (
    concat_ranks,
    equal_tables_dmp,
    gather_to_rank0,
    one_table_per_type,
    rank_batches,
)
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint import DefaultLoadPlanner

from recsys_core.distributed import (
    DistributedModelParallel,
)
from recsys_core.distributed import checkpoint as dcp_checkpoint
from recsys_core.distributed.comm_ops import set_gradient_division
from recsys_core.kernels.config import EmbOptimType
from recsys_core.testing import run_gloo

NAMES, ROWS, DIM, GLOBAL = ["a", "b", "c", "d"], 20, 8, 8


def _generators(world: int, column_shards: bool) -> dict[str, Any]:
    """A plan per world size, different for each (every sharding type appears somewhere).
    Without ``column_shards`` no table is split by columns: a row-wise state of a column
    shard has another layout (TorchRec's too), which only loads into column shards."""
    if world == 1:
        kinds = {"a": "tw", "b": "rw", "c": "tw", "d": "dp"}
    elif world == 2:
        kinds = {"a": "tw", "b": "rw", "c": "cw" if column_shards else "twrw", "d": "dp"}
    else:
        kinds = {"a": "rw", "b": "tw", "c": "twcw" if column_shards else "twrw", "d": "dp"}
    # tw: on the last rank; cw: ranks 0 and the last; twrw/twcw: host 0
    every = one_table_per_type(world, compute_kernel="fused")
    return {table: every[kind] for table, kind in kinds.items()}


def _dmp(world: int, optimizer: EmbOptimType, seed: int) -> DistributedModelParallel:
    torch.manual_seed(seed)
    column_shards = optimizer is not EmbOptimType.EXACT_ROWWISE_ADAGRAD
    dmp = equal_tables_dmp(NAMES, ROWS, DIM, _generators(world, column_shards), world,
                           {"optimizer": optimizer, "learning_rate": 0.05, "eps": 1e-3})
    dmp.fused_optimizer.save_param_groups(True)  # Adam's step travels in param_groups
    return dmp


def _steps(dmp: DistributedModelParallel, rank: int, world: int, steps: range) -> None:
    for step in steps:
        rows = rank_batches(70 + step, GLOBAL, [f"f{n}" for n in NAMES], [ROWS] * 4, 1)
        per_rank = GLOBAL // world
        mine = concat_ranks(rows[rank * per_rank:(rank + 1) * per_rank])
        out = dmp(mine).wait().values()
        ((out ** 2).sum() / GLOBAL).backward()


def _tables(dmp: DistributedModelParallel, rank: int) -> dict[str, torch.Tensor] | None:
    """Every table whole on rank 0 (None elsewhere); collective."""
    state, out = dmp.state_dict(), {}
    for n in NAMES:
        value = state[f"embedding_bags.{n}.weight"]
        out[n] = (gather_to_rank0(value, rank) if isinstance(value, ShardedTensor)
                  else value.detach().clone())
    return out if rank == 0 else None


def _save_and_go_on(rank: int, world: int, optimizer: str, path: str) -> Any:
    set_gradient_division(False)
    dmp = _dmp(world, EmbOptimType[optimizer], 0)
    _steps(dmp, rank, world, range(2))
    dcp.save({"model": dmp.state_dict(), "optim": dmp.fused_optimizer.state_dict()},
             checkpoint_id=path)
    saved = _tables(dmp, rank)
    _steps(dmp, rank, world, range(2, 4))
    return saved, _tables(dmp, rank)


def _load_and_continue(rank: int, world: int, optimizer: str, path: str) -> Any:
    set_gradient_division(False)
    dmp = _dmp(world, EmbOptimType[optimizer], 1)  # other initial weights
    state = {"model": dmp.state_dict(), "optim": dmp.fused_optimizer.state_dict()}
    dcp.load(state, checkpoint_id=path,
             planner=DefaultLoadPlanner(flatten_sharded_tensors=False))
    dmp.load_state_dict(state["model"])
    dmp.fused_optimizer.load_state_dict(state["optim"])
    loaded = _tables(dmp, rank)
    _steps(dmp, rank, world, range(2, 4))
    dist.barrier()
    return loaded, _tables(dmp, rank)


def _reshard(saved_on: int, loaded_on: int, optimizer: str) -> None:
    with tempfile.TemporaryDirectory() as path:
        (at_save, uninterrupted), *_ = run_gloo(saved_on, _save_and_go_on, optimizer, path)
        (at_load, continued), *_ = run_gloo(loaded_on, _load_and_continue, optimizer, path)
    for n in NAMES:
        assert torch.equal(at_load[n], at_save[n]), n
        assert not torch.equal(continued[n], at_load[n]), n  # it trained on
        torch.testing.assert_close(continued[n], uninterrupted[n], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("optimizer", ["ADAM", "EXACT_ROWWISE_ADAGRAD"])
@pytest.mark.parametrize(("saved_on", "loaded_on"), [(2, 1), (1, 2)])
def test_reshard_and_continue(saved_on: int, loaded_on: int, optimizer: str) -> None:
    _reshard(saved_on, loaded_on, optimizer)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["ADAM", "EXACT_ROWWISE_ADAGRAD"])
@pytest.mark.parametrize(("saved_on", "loaded_on"), [(2, 4), (4, 2)])
def test_reshard_to_and_from_four_ranks(saved_on: int, loaded_on: int, optimizer: str) -> None:
    _reshard(saved_on, loaded_on, optimizer)


def test_a_failed_save_raises_the_error_itself_and_ctrl_c_stays_an_interrupt(
        tmp_path, monkeypatch) -> None:
    """DCP wraps every failure in a CheckpointException (a BaseException that an application's
    ``except Exception`` misses): checkpoint.save raises a full disk as its OSError, and a
    Ctrl-C during the write as KeyboardInterrupt."""
    import errno

    import torch.distributed.checkpoint.filesystem as dcp_filesystem

    model = torch.nn.Linear(3, 2)

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(dcp_filesystem.os, "fsync", full)
    with pytest.raises(OSError, match="No space left on device"):
        dcp_checkpoint.save(str(tmp_path / "full"), model=model)

    def interrupted(fd: int) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(dcp_filesystem.os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        dcp_checkpoint.save(str(tmp_path / "interrupted"), model=model)
    monkeypatch.undo()
    dcp_checkpoint.save(str(tmp_path / "fine"), model=model)  # and a good save still works
