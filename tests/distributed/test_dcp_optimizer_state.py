"""The fused optimizer's state through raw ``torch.distributed.checkpoint``, as TorchRec users
save and restore it (no wrapper of ours), and in TorchRec's layout.

TorchRec's layout (read from its source and a run of the same program on TorchRec 1.8): the
state dict lists only the tables a rank holds a part of; ``param_groups`` appear only after
``save_param_groups(True)``; a row-wise state of a column-sharded table is one 1-D tensor of
``rows * column_shards`` values; Adam's states are ``momentum1`` and ``exp_avg_sq``.

The restore is checked by training on: a model restored into freshly initialised modules and
the model that was saved take the same next steps (outputs and tables equal), which fails when
any optimizer state (a sum, a moment, Adam's step) was not restored.
"""

from __future__ import annotations

import tempfile

import pytest
import torch
import torch.distributed.checkpoint as dcp
from gloo_setup import equal_tables_dmp, rank_batches
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint import DefaultLoadPlanner

from recsys_core import EmbeddingBagCollection, EmbeddingBagConfig
from recsys_core.distributed import (
    DistributedModelParallel,
)
from recsys_core.distributed.sharding_plan import (
    column_wise,
    row_wise,
    table_wise,
)
from recsys_core.kernels.config import EmbOptimType
from recsys_core.testing import run_gloo

ROWS, DIM = 30, 8
NAMES = ["a", "b", "c"]


def _dmp(world: int, seed: int, optimizer: EmbOptimType) -> DistributedModelParallel:
    torch.manual_seed(seed)
    return equal_tables_dmp(NAMES, ROWS, DIM, {
        "a": table_wise(rank=0, compute_kernel="fused"),  # nothing of it on rank 1
        "b": row_wise(compute_kernel="fused"),
        "c": column_wise(ranks=[0, 1], compute_kernel="fused"),
    }, world, {"optimizer": optimizer, "learning_rate": 0.05})


def _train(dmp: DistributedModelParallel, rank: int, world: int, steps: range) -> torch.Tensor:
    out = torch.zeros(0)
    for step in steps:
        batch = rank_batches(50 + step, world, [f"f{n}" for n in NAMES], [ROWS] * 3, 4)[rank]
        out = dmp(batch).wait().values()
        (out ** 2).sum().backward()
    return out.detach()


def _worker(rank: int, world: int, optimizer: EmbOptimType, path: str) -> dict[str, object]:
    saved = _dmp(world, 0, optimizer)
    _train(saved, rank, world, range(3))
    optim_state = saved.fused_optimizer.state_dict()
    layout = {
        key: {name: tuple(value.size()) for name, value in states.items()}
        for key, states in optim_state["state"].items()
    }
    keys = sorted(optim_state)
    restored = _dmp(world, 1, optimizer)  # other initial weights, fresh optimizer state
    if optimizer is EmbOptimType.ADAM:
        # Adam's bias correction needs the step, kept in param_groups (as in TorchRec, saved
        # only when asked)
        for dmp in (saved, restored):
            dmp.fused_optimizer.save_param_groups(True)
        optim_state = saved.fused_optimizer.state_dict()
    dcp.save({"model": saved.state_dict(), "optim": optim_state}, checkpoint_id=path)
    state = {"model": restored.state_dict(), "optim": restored.fused_optimizer.state_dict()}
    # DCP's default load planner drops a ShardedTensor with no local shard (table a on rank
    # 1), then reads the checkpoint as one of torch <= 2.3, where a list such as param_groups
    # has another key: with param_groups, load without that flattening (TorchRec alike)
    planner = DefaultLoadPlanner(flatten_sharded_tensors=optimizer is not EmbOptimType.ADAM)
    dcp.load(state, checkpoint_id=path, planner=planner)
    restored.load_state_dict(state["model"])
    restored.fused_optimizer.load_state_dict(state["optim"])
    # the next steps are the same steps
    torch.testing.assert_close(_train(restored, rank, world, range(3, 6)),
                               _train(saved, rank, world, range(3, 6)), rtol=0, atol=0)
    for name in NAMES:
        a, b = (m.state_dict()[f"embedding_bags.{name}.weight"] for m in (saved, restored))
        for sa, sb in zip(a.local_shards(), b.local_shards(), strict=True):
            assert torch.equal(sa.tensor, sb.tensor)
    saved.fused_optimizer.save_param_groups(True)
    groups = saved.fused_optimizer.state_dict().get("param_groups")
    return {"layout": layout, "keys": keys, "groups": groups,
            "types": {type(v).__name__ for s in optim_state["state"].values() for v in s.values()}}


@pytest.mark.parametrize("optimizer", [EmbOptimType.EXACT_ROWWISE_ADAGRAD,
                                       EmbOptimType.EXACT_ADAGRAD, EmbOptimType.ADAM])
def test_raw_dcp_restores_the_fused_optimizer_state_in_torchrec_layout(
    optimizer: EmbOptimType,
) -> None:
    with tempfile.TemporaryDirectory() as path:
        results = run_gloo(2, _worker, optimizer, path)
    rowwise = optimizer is EmbOptimType.EXACT_ROWWISE_ADAGRAD
    states = {EmbOptimType.EXACT_ROWWISE_ADAGRAD: ["momentum1"],
              EmbOptimType.EXACT_ADAGRAD: ["momentum1"],
              EmbOptimType.ADAM: ["momentum1", "exp_avg_sq"]}[optimizer]

    def size(table: str) -> tuple[int, ...]:
        if not rowwise:
            return (ROWS, DIM)
        return (ROWS * 2,) if table == "c" else (ROWS,)  # c: two column shards

    for rank, result in enumerate(results):
        held = ["a", "b", "c"] if rank == 0 else ["b", "c"]  # a is table-wise on rank 0
        assert result["layout"] == {
            f"embedding_bags.{t}.weight": {f"{t}.{s}": size(t) for s in states} for t in held}
        assert result["keys"] == ["state"]  # no param_groups unless asked
        assert result["types"] == {ShardedTensor.__name__}
        assert [g["lr"] for g in result["groups"]] == [0.05]
        if optimizer is EmbOptimType.ADAM:  # the bias correction's step
            assert result["groups"][0]["step"] == 6  # 3 steps before the save, 3 after


def _rowwise_column_worker(rank: int, world: int) -> torch.Tensor | None:
    dmp = _dmp(world, 0, EmbOptimType.EXACT_ROWWISE_ADAGRAD)
    _train(dmp, rank, world, range(1))
    value = dmp.fused_optimizer.state_dict()["state"]["embedding_bags.c.weight"]["c.momentum1"]
    full = torch.zeros(ROWS * 2) if rank == 0 else None
    value.gather(0, full)
    return full


def test_column_shards_rowwise_state_is_one_block_per_column_shard() -> None:
    """Column shard j's accumulator at [j * rows, (j + 1) * rows): after one step, row r of
    block j is the mean over shard j's columns of the squared gradient of the mean of the
    ranks' losses, computed here on the unsharded module."""
    full = run_gloo(2, _rowwise_column_worker)[0]
    torch.manual_seed(0)
    reference = EmbeddingBagCollection([
        EmbeddingBagConfig(name=n, feature_names=[f"f{n}"], num_embeddings=ROWS, embedding_dim=DIM)
        for n in NAMES
    ])
    batches = rank_batches(50, 2, [f"f{n}" for n in NAMES], [ROWS] * 3, 4)
    (sum((reference(b).values() ** 2).sum() for b in batches) / 2).backward()
    grad = reference.embedding_bags["c"].weight.grad
    half = DIM // 2
    expected = torch.cat([(grad[:, j * half:(j + 1) * half] ** 2).mean(1) for j in range(2)])
    torch.testing.assert_close(full, expected)
