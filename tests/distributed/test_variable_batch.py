"""Variable batch per feature (VBE) KJTs through the sharded EBC, world size 2, gloo.

Each rank's KJT has its own number of (deduplicated) bags per key and ``inverse_indices`` that
map its 3 batch rows to them. The reference is the unsharded EBC on each rank's KJT, trained
on the mean of both ranks' losses (TorchRec's gradient division): outputs, output gradients and the tables after two SGD steps
must be equal for every sharding type.
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
from recsys_core.distributed.variable_batch import expand_variable_batch
from recsys_core.testing import run_gloo

TABLES = [
    EmbeddingBagConfig(name="t_sum", embedding_dim=4, num_embeddings=9, feature_names=["f0"]),
    EmbeddingBagConfig(name="t_mean", embedding_dim=8, num_embeddings=7, feature_names=["f1"], pooling=PoolingType.MEAN),
]
PLANS = {
    "table_wise": {"t_sum": table_wise(rank=1, compute_kernel="fused"), "t_mean": table_wise(rank=0, compute_kernel="fused")},
    "row_wise": {"t_sum": row_wise(compute_kernel="fused"), "t_mean": row_wise(compute_kernel="fused")},
    "column_wise": {"t_sum": column_wise(ranks=[0, 1], compute_kernel="fused"), "t_mean": column_wise(ranks=[1, 0], compute_kernel="fused")},
    "table_row_wise": {"t_sum": table_row_wise(host_index=0, compute_kernel="fused"), "t_mean": table_row_wise(host_index=0, compute_kernel="fused")},
    "table_column_wise": {"t_sum": table_column_wise(host_index=0, compute_kernel="fused"), "t_mean": table_wise(rank=1, compute_kernel="fused")},
    "data_parallel": {"t_sum": data_parallel(compute_kernel="fused"), "t_mean": data_parallel(compute_kernel="fused")},
}
BATCH, LR = 3, 0.5


def vbe_kjt(rank: int, step: int) -> KeyedJaggedTensor:
    """f0: 2 bags (rank 0) or 3 (rank 1); f1: 1 bag; both expanded to 3 batch rows."""
    gen = torch.Generator().manual_seed(10 * step + rank)
    strides = [2 + rank, 1]
    lengths = torch.randint(1, 4, (sum(strides),), generator=gen)
    n0 = int(lengths[: strides[0]].sum())
    values = torch.cat([
        torch.randint(0, 9, (n0,), generator=gen),
        torch.randint(0, 7, (int(lengths.sum()) - n0,), generator=gen),
    ])
    inverse = torch.stack([torch.tensor([1, 0, 1]) if rank == 0 else torch.tensor([2, 0, 1]), torch.zeros(BATCH, dtype=torch.long)])
    return KeyedJaggedTensor(
        keys=["f0", "f1"], values=values, lengths=lengths,
        stride_per_key_per_rank=[[strides[0]], [strides[1]]], inverse_indices=(["f0", "f1"], inverse),
    )


def test_expansion_by_hand() -> None:
    kjt = KeyedJaggedTensor(
        keys=["a", "b"], values=torch.tensor([1, 2, 3, 4, 5, 6]), lengths=torch.tensor([1, 2, 3]),
        stride_per_key_per_rank=[[2], [1]], inverse_indices=(["a", "b"], torch.tensor([[0, 1, 1], [0, 0, 0]])),
    )
    full = expand_variable_batch(kjt, "test")
    assert full.stride() == 3 and full.keys() == ["a", "b"]
    assert full.lengths().tolist() == [1, 2, 2, 3, 3, 3]
    assert full.values().tolist() == [1, 2, 3, 2, 3, 4, 5, 6, 4, 5, 6, 4, 5, 6]
    no_inverse = KeyedJaggedTensor(keys=["a", "b"], values=kjt.values(), lengths=kjt.lengths(), stride_per_key_per_rank=[[2], [1]])
    with pytest.raises(ValueError, match="needs inverse_indices"):
        expand_variable_batch(no_inverse, "ShardedEmbeddingBagCollection")


def worker(rank: int, world: int, kind: str) -> dict:
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(TABLES)
    reference = copy.deepcopy(ebc)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
    plan = construct_module_sharding_plan(ebc, PLANS[kind], world)
    sharder = EmbeddingBagCollectionSharder(fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": LR})
    sharded = sharder.shard(ebc, plan, ShardingEnv.from_process_group(dist.GroupMember.WORLD))
    for step in range(2):
        kjts = [vbe_kjt(r, step) for r in range(world)]
        targets = [torch.randn(BATCH, 12, generator=torch.Generator().manual_seed(100 * step + r)) for r in range(world)]
        out = sharded(kjts[rank]).wait().values()
        out.retain_grad()
        refs = [reference(k).values() for k in kjts]
        for ref in refs:
            ref.retain_grad()
        torch.testing.assert_close(out, refs[rank].detach())
        (torch.tanh(out) * targets[rank]).sum().backward()
        ref_opt.zero_grad()
        (sum((torch.tanh(r) * t).sum() for r, t in zip(refs, targets, strict=True)) / world).backward()
        ref_opt.step()
        torch.testing.assert_close(out.grad, refs[rank].grad * world)
    tables = {
        (name, s.spec.row_offset, s.spec.col_offset): s.weight.clone()
        for name, shards in sharded.table_shards().items() for s in shards
    }
    return {"tables": tables, "reference": {k: v.detach() for k, v in reference.state_dict().items()}}


@pytest.mark.parametrize("kind", sorted(PLANS))
def test_sharded_ebc_takes_variable_batch_kjts(kind: str) -> None:
    for result in run_gloo(2, worker, kind):
        assert result["tables"]
        for (name, row, col), weight in result["tables"].items():
            full = result["reference"][f"embedding_bags.{name}.weight"]
            torch.testing.assert_close(weight, full[row : row + weight.shape[0], col : col + weight.shape[1]])


def ec_worker(rank: int, world: int) -> str:
    ec = EmbeddingCollection([EmbeddingConfig(name="t", embedding_dim=4, num_embeddings=9, feature_names=["f0", "f1"])])
    sharded = EmbeddingCollectionSharder().shard(
        ec, construct_module_sharding_plan(ec, {"t": row_wise(compute_kernel="fused")}, world), ShardingEnv.from_process_group(dist.GroupMember.WORLD)
    )
    with pytest.raises(ValueError) as info:
        sharded(vbe_kjt(rank, 0))
    return str(info.value)


def test_sharded_ec_refuses_variable_batch_with_a_clear_error() -> None:
    for message in run_gloo(2, ec_worker):
        assert message.startswith("ShardedEmbeddingCollection: variable-batch KeyedJaggedTensors")
        assert "give every key the same batch size" in message
