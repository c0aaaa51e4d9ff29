"""DistributedModelParallel of a model holding a FusedEmbeddingBagCollection: the default
sharders give its sharded fused counterpart, whose optimizer is the fused module's own, and
training at world size 2 over gloo equals the unsharded fused module on the global batch."""

from __future__ import annotations

import copy

import pytest
import torch
from gloo_setup import concat_ranks, gather_to_rank0
from table_configs import one_feature_tables
from torch import nn

from recsys_core import (
    EmbeddingBagConfig,
    EmbOptimType,
    FusedEmbeddingBagCollection,
    KeyedJaggedTensor,
)
from recsys_core.distributed import (
    DistributedModelParallel,
    ShardingPlan,
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_wise,
)
from recsys_core.distributed.fused_embeddingbag import (
    FusedEmbeddingBagCollectionSharder,
    ShardedFusedEmbeddingBagCollection,
)
from recsys_core.testing import run_gloo

TABLES = one_feature_tables(EmbeddingBagConfig, {"a": (11, 8), "b": (5, 4)}, mean={"b"})
PLANS = {
    "table_wise": {"a": table_wise(rank=1, compute_kernel="fused"), "b": table_wise(rank=0, compute_kernel="fused")},
    "column_wise": {"a": column_wise(ranks=[1, 0], compute_kernel="fused"), "b": table_wise(rank=1, compute_kernel="fused")},
    "row_wise": {"a": row_wise(compute_kernel="fused"), "b": row_wise(compute_kernel="fused")},
    "data_parallel": {"a": data_parallel(compute_kernel="fused"), "b": data_parallel(compute_kernel="fused")},
}
OPTIMIZERS = {
    "adagrad": (EmbOptimType.EXACT_ADAGRAD, {"learning_rate": 0.1, "eps": 1e-3}, 0.1),
    "torch_sgd": (torch.optim.SGD, {"lr": 0.3}, 0.3),
}


class Model(nn.Module):
    def __init__(self, sparse: nn.Module) -> None:
        super().__init__()
        self.sparse = sparse

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        out = self.sparse(kjt)
        return out.wait().values() if hasattr(out, "wait") else out.values()


def _batch(rank: int, step: int) -> KeyedJaggedTensor:
    gen = torch.Generator().manual_seed(100 * step + rank)
    lengths = torch.randint(0, 3, (4,), generator=gen)
    values = torch.cat([
        torch.randint(0, 11, (int(lengths[:2].sum()),), generator=gen),
        torch.randint(0, 5, (int(lengths[2:].sum()),), generator=gen),
    ])
    return KeyedJaggedTensor(keys=["fa", "fb"], values=values, lengths=lengths)


def worker(rank: int, world: int, kind: str, optimizer: str) -> dict:
    opt_type, kwargs, lr = OPTIMIZERS[optimizer]
    torch.manual_seed(0)
    fused = FusedEmbeddingBagCollection(TABLES, optimizer_type=opt_type, optimizer_kwargs=kwargs)
    reference = copy.deepcopy(fused)
    plan = None if kind == "planner" else ShardingPlan(
        {"sparse": construct_module_sharding_plan(fused, PLANS[kind], world)})
    dmp = DistributedModelParallel(Model(fused), plan=plan)  # default sharders (and planner)
    sharded = dmp.module.sparse
    assert isinstance(sharded, ShardedFusedEmbeddingBagCollection)
    assert sharded.fused_optimizer.param_groups[0]["lr"] == pytest.approx(lr)
    for step in range(3):
        kjts = [_batch(r, step) for r in range(world)]
        target = torch.randn(2 * world, 12, generator=torch.Generator().manual_seed(step))
        out = dmp(kjts[rank])
        ref = reference(concat_ranks(kjts)).values()
        torch.testing.assert_close(out, ref[2 * rank : 2 * rank + 2].detach(), atol=1e-5, rtol=1e-5)
        (torch.tanh(out) * target[2 * rank : 2 * rank + 2]).sum().backward()
        # the fused reference updates in backward, on the mean of the ranks' losses
        ((torch.tanh(ref) * target).sum() / world).backward()
    full = {}
    for key, value in dmp.state_dict().items():
        if isinstance(value, torch.Tensor) and not hasattr(value, "local_shards"):
            full[key] = value.detach().clone()
            continue
        full[key] = gather_to_rank0(value, rank)
    return {"full": full, "reference": _tables_by_lookup(reference)}


def _tables_by_lookup(fused: FusedEmbeddingBagCollection) -> dict[str, torch.Tensor]:
    """Every row of every table, read through the module's forward (each id a bag of one)."""
    ids = torch.arange(11)
    both = KeyedJaggedTensor(
        keys=["fa", "fb"], values=torch.cat([ids, ids[:5]]),
        lengths=torch.cat([torch.ones(11, dtype=torch.long), torch.ones(5, dtype=torch.long), torch.zeros(6, dtype=torch.long)]),
    )
    out = fused(both).to_dict()
    return {"a": out["fa"].detach(), "b": out["fb"][:5].detach()}


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("kind", [*sorted(PLANS), "planner"])
@pytest.mark.slow
def test_dmp_shards_fused_ebc_and_trains_like_it(kind: str, optimizer: str) -> None:
    r0 = run_gloo(2, worker, kind, optimizer)[0]
    assert sorted(r0["full"]) == ["sparse.embedding_bags.a.weight", "sparse.embedding_bags.b.weight"]
    for table in ("a", "b"):
        torch.testing.assert_close(
            r0["full"][f"sparse.embedding_bags.{table}.weight"],
            r0["reference"][table], atol=1e-5, rtol=1e-5,
        )


def test_fused_sharder_types_follow_torchrec() -> None:
    sharder = FusedEmbeddingBagCollectionSharder()
    assert sharder.module_type is FusedEmbeddingBagCollection
    assert sharder.sharding_types("cpu") == ["data_parallel", "table_wise", "column_wise", "table_column_wise"]
    assert sharder.sharding_types("cuda")[-2:] == ["row_wise", "table_row_wise"]
    fused = FusedEmbeddingBagCollection(TABLES, optimizer_type=torch.optim.SGD, optimizer_kwargs={"lr": 0.1})
    params = sharder.shardable_parameters(fused)
    assert sorted(params) == ["a", "b"] and tuple(params["a"].shape) == (11, 8)
