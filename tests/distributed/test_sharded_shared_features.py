"""Shared features through the sharded modules (TorchRec's ``f@t`` naming), world size 2, gloo.

Feature ``f1`` is looked up in tables t1 and t2: the outputs are ``f1@t1`` and ``f1@t2``
(``f2`` is only in t1 and keeps its name). For every sharding type the sharded module's output,
the gradient reaching it and the tables after two SGD steps equal the unsharded module's on
the global batch.
"""

from __future__ import annotations

import pytest
import torch
from gloo_setup import (
    assert_blocks_of,
    concat_ranks,
    pooled_step,
    shard_beside_reference,
    shard_weights,
    table_weights,
    two_table_plans,
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
from recsys_core.distributed import column_wise, row_wise, table_wise
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
PLANS = two_table_plans("t1", "t2", 2)
PLANS["column_wise"] = {"t1": column_wise(ranks=[1, 0], compute_kernel="fused"), "t2": column_wise(ranks=[0], compute_kernel="fused")}
PLANS["table_column_wise"]["t2"] = table_wise(rank=1, compute_kernel="fused")
PLANS["mixed"] = {"t1": row_wise(compute_kernel="fused"), "t2": table_wise(rank=1, compute_kernel="fused")}
SEQUENCE_KINDS = ["column_wise", "mixed", "row_wise", "table_wise"]
BATCH, LR = 2, 0.5
SGD = {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": LR}


def _batch(rank: int, step: int) -> KeyedJaggedTensor:
    # key order differs from the tables' (f2 before f1): the input order must not matter
    gen = torch.Generator().manual_seed(10 * step + rank)
    lengths = torch.randint(0, 3, (2 * BATCH,), generator=gen)
    n2, n1 = int(lengths[:BATCH].sum()), int(lengths[BATCH:].sum())
    values = torch.cat([torch.randint(0, 9, (n2,), generator=gen), torch.randint(0, 6, (n1,), generator=gen)])
    return KeyedJaggedTensor(keys=["f2", "f1"], values=values, lengths=lengths)


def bag_worker(rank: int, world: int, kind: str) -> dict:
    torch.manual_seed(0)
    sharded, reference = shard_beside_reference(
        EmbeddingBagCollection(BAG_TABLES), PLANS[kind], world, fused_params=SGD)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
    rows = slice(rank * BATCH, (rank + 1) * BATCH)
    for step in range(2):
        kjts = [_batch(r, step) for r in range(world)]
        out = sharded(kjts[rank]).wait()
        ref = reference(concat_ranks(kjts))
        assert out.keys() == ref.keys() == ["f1@t1", "f2", "f1@t2"]
        target = torch.randn(world * BATCH, 16, generator=torch.Generator().manual_seed(step))
        # the mean of the ranks' losses; assert_close's default tolerances
        pooled_step(out.values(), ref.values(), rows, target, ref_opt, world, atol=None, rtol=None)
    return {"tables": shard_weights(sharded), "reference": table_weights(reference.embedding_bags)}


@pytest.mark.parametrize("kind", sorted(PLANS))
@pytest.mark.slow
def test_sharded_ebc_with_shared_feature_equals_unsharded(kind: str) -> None:
    for result in run_gloo(2, bag_worker, kind):
        assert_blocks_of(result["tables"], result["reference"])


def seq_worker(rank: int, world: int, kind: str) -> dict:
    torch.manual_seed(0)
    sharded, reference = shard_beside_reference(
        EmbeddingCollection(SEQ_TABLES), PLANS[kind], world, fused_params=SGD)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
    for step in range(2):
        kjts = [_batch(r, step) for r in range(world)]
        out = sharded(kjts[rank]).wait()
        ref = reference(concat_ranks(kjts))
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
    return {"tables": shard_weights(sharded), "reference": table_weights(reference.embeddings)}


@pytest.mark.parametrize("kind", SEQUENCE_KINDS)
@pytest.mark.slow
def test_sharded_ec_with_shared_feature_equals_unsharded(kind: str) -> None:
    for result in run_gloo(2, seq_worker, kind):
        assert_blocks_of(result["tables"], result["reference"])
