"""Variable batch per feature (VBE) KJTs through the sharded EBC, world size 2, gloo.

Each rank's KJT has its own number of (deduplicated) bags per key and ``inverse_indices`` that
map its 3 batch rows to them. The reference is the unsharded EBC on each rank's KJT, trained
on the mean of both ranks' losses (TorchRec's gradient division): outputs, output gradients and the tables after two SGD steps
must be equal for every sharding type.
"""

from __future__ import annotations

import pytest
import torch
from gloo_setup import (
    assert_blocks_of,
    shard_beside_reference,
    shard_weights,
    table_weights,
    two_table_plans,
    world_env,
)

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
    EmbeddingCollectionSharder,
    column_wise,
    construct_module_sharding_plan,
    row_wise,
    table_wise,
)
from recsys_core.distributed.variable_batch import expand_variable_batch
from recsys_core.testing import run_gloo

TABLES = [
    EmbeddingBagConfig(name="t_sum", embedding_dim=4, num_embeddings=9, feature_names=["f0"]),
    EmbeddingBagConfig(name="t_mean", embedding_dim=8, num_embeddings=7, feature_names=["f1"], pooling=PoolingType.MEAN),
]
PLANS = two_table_plans("t_sum", "t_mean", 2)
PLANS["column_wise"]["t_mean"] = column_wise(ranks=[1, 0], compute_kernel="fused")
PLANS["table_column_wise"]["t_mean"] = table_wise(rank=1, compute_kernel="fused")
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
    sharded, reference = shard_beside_reference(
        EmbeddingBagCollection(TABLES), PLANS[kind], world,
        fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": LR})
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
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
    return {"tables": shard_weights(sharded), "reference": table_weights(reference.embedding_bags)}


@pytest.mark.parametrize("kind", sorted(PLANS))
@pytest.mark.slow
def test_sharded_ebc_takes_variable_batch_kjts(kind: str) -> None:
    for result in run_gloo(2, worker, kind):
        assert result["tables"]
        assert_blocks_of(result["tables"], result["reference"])


def ec_worker(rank: int, world: int) -> str:
    ec = EmbeddingCollection([EmbeddingConfig(name="t", embedding_dim=4, num_embeddings=9, feature_names=["f0", "f1"])])
    sharded = EmbeddingCollectionSharder().shard(
        ec, construct_module_sharding_plan(ec, {"t": row_wise(compute_kernel="fused")}, world), world_env()
    )
    with pytest.raises(ValueError) as info:
        sharded(vbe_kjt(rank, 0))
    return str(info.value)


def test_sharded_ec_refuses_variable_batch_with_a_clear_error() -> None:
    for message in run_gloo(2, ec_worker):
        assert message.startswith("ShardedEmbeddingCollection: variable-batch KeyedJaggedTensors")
        assert "give every key the same batch size" in message
