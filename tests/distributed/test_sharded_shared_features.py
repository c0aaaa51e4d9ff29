"""Shared features through the sharded modules (TorchRec's ``f@t`` naming), world size 2, gloo.

Feature ``f1`` is looked up in tables t1 and t2: the outputs are ``f1@t1`` and ``f1@t2``
(``f2`` is only in t1 and keeps its name). For every sharding type the sharded module's output,
the gradient reaching it and the tables after two SGD steps equal the unsharded module's on
the global batch.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from recsys_core import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    EmbOptimType,
    KeyedJaggedTensor,
    PoolingType,
)
from recsys_core.distributed import (
    EmbeddingBagCollectionSharder,
    EmbeddingCollectionSharder,
    ShardingEnv,
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_column_wise,
    table_row_wise,
    table_wise,
)
from recsys_core.testing import run_gloo

ROWS = {"t1": 9, "t2": 6}
BAG_TABLES = [
    EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=9, feature_names=["f1", "f2"]),
    EmbeddingBagConfig(name="t2", embedding_dim=8, num_embeddings=6, feature_names=["f1"], pooling=PoolingType.MEAN),
]
SEQ_TABLES = [
    EmbeddingConfig(name="t1", embedding_dim=4, num_embeddings=9, feature_names=["f1", "f2"]),
    EmbeddingConfig(name="t2", embedding_dim=4, num_embeddings=6, feature_names=["f1"]),
]
PLANS = {
    "table_wise": {"t1": table_wise(rank=1, compute_kernel="fused"), "t2": table_wise(rank=0, compute_kernel="fused")},
    "column_wise": {"t1": column_wise(ranks=[1, 0], compute_kernel="fused"), "t2": column_wise(ranks=[0], compute_kernel="fused")},
    "row_wise": {"t1": row_wise(compute_kernel="fused"), "t2": row_wise(compute_kernel="fused")},
    "table_row_wise": {"t1": table_row_wise(host_index=0, compute_kernel="fused"), "t2": table_row_wise(host_index=0, compute_kernel="fused")},
    "table_column_wise": {"t1": table_column_wise(host_index=0, compute_kernel="fused"), "t2": table_wise(rank=1, compute_kernel="fused")},
    "data_parallel": {"t1": data_parallel(compute_kernel="fused"), "t2": data_parallel(compute_kernel="fused")},
    "mixed": {"t1": row_wise(compute_kernel="fused"), "t2": table_wise(rank=1, compute_kernel="fused")},
}
SEQUENCE_KINDS = ["column_wise", "mixed", "row_wise", "table_wise"]
BATCH, LR = 2, 0.5


def _batch(rank: int, step: int) -> KeyedJaggedTensor:
    # key order differs from the tables' (f2 before f1): the input order must not matter
    gen = torch.Generator().manual_seed(10 * step + rank)
    lengths = torch.randint(0, 3, (2 * BATCH,), generator=gen)
    n2, n1 = int(lengths[:BATCH].sum()), int(lengths[BATCH:].sum())
    values = torch.cat([torch.randint(0, 9, (n2,), generator=gen), torch.randint(0, 6, (n1,), generator=gen)])
    return KeyedJaggedTensor(keys=["f2", "f1"], values=values, lengths=lengths)


def _global(kjts: list[KeyedJaggedTensor]) -> KeyedJaggedTensor:
    dicts = [k.to_dict() for k in kjts]
    return KeyedJaggedTensor(
        keys=["f2", "f1"],
        values=torch.cat([d[f].values() for f in ("f2", "f1") for d in dicts]),
        lengths=torch.cat([d[f].lengths() for f in ("f2", "f1") for d in dicts]),
    )


def _tables(sharded: torch.nn.Module) -> dict:
    return {
        (name, s.spec.row_offset, s.spec.col_offset): s.weight.clone()
        for name, shards in sharded.table_shards().items() for s in shards
    }


def bag_worker(rank: int, world: int, kind: str) -> dict:
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(BAG_TABLES)
    reference = copy.deepcopy(ebc)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
    plan = construct_module_sharding_plan(ebc, PLANS[kind], world)
    sharder = EmbeddingBagCollectionSharder(fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": LR})
    sharded = sharder.shard(ebc, plan, ShardingEnv.from_process_group(dist.GroupMember.WORLD))
    rows = slice(rank * BATCH, (rank + 1) * BATCH)
    for step in range(2):
        kjts = [_batch(r, step) for r in range(world)]
        out = sharded(kjts[rank]).wait()
        ref = reference(_global(kjts))
        assert out.keys() == ref.keys() == ["f1@t1", "f2", "f1@t2"]
        values, ref_values = out.values(), ref.values()
        values.retain_grad()
        ref_values.retain_grad()
        torch.testing.assert_close(values, ref_values[rows].detach())
        target = torch.randn(world * BATCH, 16, generator=torch.Generator().manual_seed(step))
        (torch.tanh(values) * target[rows]).sum().backward()
        ref_opt.zero_grad()
        ((torch.tanh(ref_values) * target).sum() / world).backward()  # mean of the ranks' losses
        ref_opt.step()
        torch.testing.assert_close(values.grad, ref_values.grad[rows] * world)
    return {"tables": _tables(sharded), "reference": {k: v.detach() for k, v in reference.state_dict().items()}}


@pytest.mark.parametrize("kind", sorted(PLANS))
def test_sharded_ebc_with_shared_feature_equals_unsharded(kind: str) -> None:
    for result in run_gloo(2, bag_worker, kind):
        for (name, row, col), weight in result["tables"].items():
            full = result["reference"][f"embedding_bags.{name}.weight"]
            torch.testing.assert_close(weight, full[row : row + weight.shape[0], col : col + weight.shape[1]])


def seq_worker(rank: int, world: int, kind: str) -> dict:
    torch.manual_seed(0)
    ec = EmbeddingCollection(SEQ_TABLES)
    reference = copy.deepcopy(ec)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
    plan = construct_module_sharding_plan(ec, PLANS[kind], world)
    sharder = EmbeddingCollectionSharder(fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": LR})
    sharded = sharder.shard(ec, plan, ShardingEnv.from_process_group(dist.GroupMember.WORLD))
    for step in range(2):
        kjts = [_batch(r, step) for r in range(world)]
        out = sharded(kjts[rank]).wait()
        ref = reference(_global(kjts))
        assert list(out) == list(ref) == ["f1@t1", "f2", "f1@t2"]
        loss = 0.0
        ref_loss = 0.0
        for name, jt in out.items():
            feature = name.split("@")[0]
            # this rank's ids come first or second in the global batch's values of the feature
            before = sum(int(k.to_dict()[feature].lengths().sum()) for k in kjts[:rank])
            mine = int(kjts[rank].to_dict()[feature].lengths().sum())
            ref_rows = ref[name].values()
            torch.testing.assert_close(jt.values(), ref_rows[before : before + mine].detach())
            torch.testing.assert_close(jt.lengths(), kjts[rank].to_dict()[feature].lengths())
            weight = torch.randn(ref_rows.shape, generator=torch.Generator().manual_seed(step))
            loss = loss + (jt.values() * weight[before : before + mine]).sum()
            ref_loss = ref_loss + (ref_rows * weight).sum()
        loss.backward()
        ref_opt.zero_grad()
        (ref_loss / world).backward()  # the mean of the ranks' losses
        ref_opt.step()
    return {"tables": _tables(sharded), "reference": {k: v.detach() for k, v in reference.state_dict().items()}}


@pytest.mark.parametrize("kind", SEQUENCE_KINDS)
def test_sharded_ec_with_shared_feature_equals_unsharded(kind: str) -> None:
    for result in run_gloo(2, seq_worker, kind):
        for (name, row, col), weight in result["tables"].items():
            full = result["reference"][f"embeddings.{name}.weight"]
            torch.testing.assert_close(weight, full[row : row + weight.shape[0], col : col + weight.shape[1]])
