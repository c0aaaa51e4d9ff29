"""The shared skeleton of the sharded collections, at world size 2 over gloo: plan-independent
table initialization, the EC's state dict and fused-optimizer state, prefetch through the
library's train pipeline, and the one id check (same message for the pooled and the sequence
collection)."""

from __future__ import annotations

import copy

import pytest
import torch
from gloo_setup import gather_to_rank0, shard_weights, world_env
from table_configs import one_feature_tables

from recsys_core import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    EmbOptimType,
    KeyedJaggedTensor,
)
from recsys_core.distributed import (
    EmbeddingBagCollectionSharder,
    EmbeddingCollectionSharder,
    column_wise,
    construct_module_sharding_plan,
    row_wise,
    table_wise,
)
from recsys_core.distributed.table_init import SeededUniformInit, TableRegion
from recsys_core.distributed.train_pipeline import pipelined_batches
from recsys_core.kernels.id_check import IdOutOfRangeError
from recsys_core.testing import run_gloo

BAG_TABLES = one_feature_tables(EmbeddingBagConfig, {"a": (10, 8), "b": (6, 4)})
SEQ_TABLES = one_feature_tables(EmbeddingConfig, {"a": (10, 8), "b": (6, 8)})
PLANS = {
    "row_wise": {"a": row_wise(compute_kernel="fused"), "b": row_wise(compute_kernel="fused")},
    "column_wise": {"a": column_wise(ranks=[1, 0], compute_kernel="fused"), "b": table_wise(rank=1, compute_kernel="fused")},
}
SGD = {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.5}
ADAGRAD = {"optimizer": EmbOptimType.EXACT_ADAGRAD, "learning_rate": 0.5, "eps": 0.01}


def _kjt(rank: int, step: int = 0) -> KeyedJaggedTensor:
    gen = torch.Generator().manual_seed(7 * step + rank)
    return KeyedJaggedTensor(
        keys=["fa", "fb"],
        values=torch.cat([torch.randint(0, 10, (3,), generator=gen), torch.randint(0, 6, (2,), generator=gen)]),
        lengths=torch.tensor([2, 1, 1, 1]),
    )


def init_worker(rank: int, world: int, kind: str, sequence: bool) -> dict:
    # a meta module: only the initializer can give the shards their values
    if sequence:
        module = EmbeddingCollection(SEQ_TABLES, device="meta")
        sharder = EmbeddingCollectionSharder(table_init=SeededUniformInit(seed=5, block_rows=3))
    else:
        module = EmbeddingBagCollection(BAG_TABLES, device="meta")
        sharder = EmbeddingBagCollectionSharder(table_init=SeededUniformInit(seed=5, block_rows=3))
    plan = construct_module_sharding_plan(module, PLANS[kind], world)
    return shard_weights(sharder.shard(module, plan, world_env()))


@pytest.mark.parametrize("sequence", [False, True])
@pytest.mark.parametrize("kind", sorted(PLANS))
@pytest.mark.slow
def test_table_init_gives_every_shard_the_unsharded_rows(kind: str, sequence: bool) -> None:
    init = SeededUniformInit(seed=5, block_rows=3)
    tables = SEQ_TABLES if sequence else BAG_TABLES
    whole = {}
    for c in tables:
        whole[c.name] = torch.empty(c.num_embeddings, c.embedding_dim)
        init.fill(whole[c.name], TableRegion(table=c.name, num_rows=c.num_embeddings, dim=c.embedding_dim))
        bound = (1.0 / c.num_embeddings) ** 0.5
        assert whole[c.name].abs().max() <= bound and whole[c.name].std() > 0
    seen = 0
    for shards in run_gloo(2, init_worker, kind, sequence):
        for (name, row, col), weight in shards.items():
            rows, cols = weight.shape
            torch.testing.assert_close(weight, whole[name][row : row + rows, col : col + cols])
            seen += weight.numel()
    assert seen == sum(c.num_embeddings * c.embedding_dim for c in tables)


def ec_state_worker(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    ec = EmbeddingCollection(SEQ_TABLES)
    reference = copy.deepcopy(ec)
    plan = construct_module_sharding_plan(ec, {"a": row_wise(compute_kernel="fused"), "b": column_wise(ranks=[1, 0], compute_kernel="fused")}, world)
    sharded = EmbeddingCollectionSharder(fused_params=ADAGRAD).shard(ec, plan, world_env())
    for step in range(2):
        out = sharded(_kjt(rank, step)).wait()
        sum(jt.values().sum() for jt in out.values()).backward()
    state = sharded.state_dict()
    optim = sharded.fused_optimizer.state_dict()["state"]
    # full tables from the ShardedTensors (every rank gathers to its own rank 0 copy)
    full = {key: gather_to_rank0(state[key], rank)
            for key in ("embeddings.a.weight", "embeddings.b.weight")}
    sum_full = gather_to_rank0(optim["embeddings.a.weight"]["a.momentum1"], rank)
    # loading the start state back restores the unsharded rows
    sharded.load_state_dict(reference.state_dict())
    restored = sharded(_kjt(rank)).wait()
    expected = reference(_kjt(rank))
    for key in ("fa", "fb"):
        torch.testing.assert_close(restored[key].values(), expected[key].values().detach())
    return {"keys": sorted(state), "full": full, "sum": sum_full, "start": reference.state_dict()}


def test_sharded_ec_state_dict_and_optimizer_state_are_plan_independent() -> None:
    r0, _ = run_gloo(2, ec_state_worker)
    assert r0["keys"] == ["embeddings.a.weight", "embeddings.b.weight"]
    # replay the two steps on the unsharded module: the loss is the SUM of every looked-up row
    # per rank, and the tables step on the mean of the two ranks' losses (gradient division)
    ec = EmbeddingCollection(SEQ_TABLES)
    ec.load_state_dict(r0["start"])
    weights = {n: ec.embeddings[n].weight for n in ("a", "b")}
    state = {n: torch.zeros_like(w) for n, w in weights.items()}
    for step in range(2):
        grads = {n: torch.zeros_like(w) for n, w in weights.items()}
        for rank in range(2):
            kjt = _kjt(rank, step).to_dict()
            for feature, table in (("fa", "a"), ("fb", "b")):
                grads[table].index_add_(0, kjt[feature].values(), torch.ones(kjt[feature].values().numel(), weights[table].shape[1]))
        grads = {n: g / 2 for n, g in grads.items()}
        with torch.no_grad():
            for n, w in weights.items():
                state[n] += grads[n] ** 2
                w -= 0.5 * grads[n] / (state[n].sqrt() + 0.01)
    torch.testing.assert_close(r0["full"]["embeddings.a.weight"], weights["a"].detach())
    torch.testing.assert_close(r0["full"]["embeddings.b.weight"], weights["b"].detach())
    torch.testing.assert_close(r0["sum"], state["a"])


def pipeline_worker(rank: int, world: int, sequence: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    module = EmbeddingCollection(SEQ_TABLES) if sequence else EmbeddingBagCollection(BAG_TABLES)
    plan = construct_module_sharding_plan(module, PLANS["row_wise"], world)
    sharder = EmbeddingCollectionSharder(fused_params=SGD) if sequence else EmbeddingBagCollectionSharder(fused_params=SGD)
    plain = sharder.shard(copy.deepcopy(module), plan, world_env())
    piped = sharder.shard(module, plan, world_env())
    holder = torch.nn.ModuleDict({"sparse": piped})
    outs = []
    batches = [_kjt(rank, step) for step in range(3)]

    def values(out: object) -> torch.Tensor:
        return torch.cat([jt.values() for jt in out.values()]) if sequence else out.values()

    for kjt in pipelined_batches(batches, holder, to_device=lambda b: b, features=lambda b: b):
        got = values(piped(kjt).wait())
        want = values(plain(kjt).wait())
        torch.testing.assert_close(got, want)
        got.sum().backward()
        want.sum().backward()
        outs.append(got.detach())
    return outs


@pytest.mark.parametrize("sequence", [False, True])
def test_pipelined_batches_train_like_the_plain_loop(sequence: bool) -> None:
    # each rank compares the pipelined module with a plain one at every step (in the worker)
    per_rank = run_gloo(2, pipeline_worker, sequence)
    assert [len(outs) for outs in per_rank] == [3, 3]


def bad_id_worker(rank: int, world: int, sequence: bool) -> str:
    torch.manual_seed(0)
    module = EmbeddingCollection(SEQ_TABLES) if sequence else EmbeddingBagCollection(BAG_TABLES)
    sharder = EmbeddingCollectionSharder() if sequence else EmbeddingBagCollectionSharder()
    sharded = sharder.shard(module, construct_module_sharding_plan(module, PLANS["row_wise"], world), world_env())
    bad = KeyedJaggedTensor(keys=["fb", "fa"], values=torch.tensor([1, 2, 3, 10 + rank]), lengths=torch.tensor([1, 1, 1, 1]))
    with pytest.raises(IdOutOfRangeError) as info:
        sharded(bad)
    return str(info.value)


@pytest.mark.parametrize("sequence", [False, True])
def test_one_id_check_for_pooled_and_sequence(sequence: bool) -> None:
    name = "ShardedEmbeddingCollection" if sequence else "ShardedEmbeddingBagCollection"
    for rank, message in enumerate(run_gloo(2, bad_id_worker, sequence)):
        assert message == (
            f"feature 'fa': id {10 + rank} is outside [0, 10) of its table ({name}, rank {rank}); "
            "hash or clip ids to the table size before lookup"
        )
