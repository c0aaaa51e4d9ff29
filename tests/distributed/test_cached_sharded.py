"""Tables planned as fused_uvm_caching (a cache of row slots over a backing file) train exactly
like the unsharded module, sharded over 2 real gloo ranks, with the pipeline's prefetch; their
checkpoints reload across plans and world sizes."""

from __future__ import annotations

import os

import pytest
import torch
from gloo_setup import (
    SUM_MEAN_KEYS,
    check_local_shards,
    concat_ranks,
    pooled_step,
    random_batch,
    rank_rows,
    sum_and_mean_tables,
    world_env,
)

from recsys_core import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbOptimType,
    KeyedJaggedTensor,
    PoolingType,
)
from recsys_core.distributed import (
    EmbeddingBagCollectionSharder,
    ShardingEnv,
    construct_module_sharding_plan,
    row_wise,
    table_wise,
)
from recsys_core.distributed import checkpoint as dcp_checkpoint
from recsys_core.distributed.table_init import SeededUniformInit, TableRegion
from recsys_core.distributed.train_pipeline import pipelined_batches
from recsys_core.kernels.cached_tbe import CachedTableBatchedEmbedding
from recsys_core.optim import RowWiseAdagrad
from recsys_core.plan.params import CacheParams
from recsys_core.testing import run_gloo

TABLES = sum_and_mean_tables((1000, 200), ("big", "mid"))
KEYS, ROWS, BATCH, STEPS = SUM_MEAN_KEYS, [1000, 1000, 200], 3, 6
FUSED = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1, "eps": 1e-3}


def batches(world: int, steps: int, seed: int = 100) -> list[list[KeyedJaggedTensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [[random_batch(gen, KEYS, ROWS, BATCH) for _ in range(world)] for _ in range(steps)]


def shard(world: int, cached: bool, kind: str, tmp: str) -> torch.nn.Module:
    ebc = EmbeddingBagCollection(TABLES, device=torch.device("meta"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    kernel = "fused_uvm_caching" if cached else "fused"
    generators = (
        {"big": row_wise(compute_kernel=kernel), "mid": table_wise(rank=world - 1, compute_kernel=kernel)}
        if kind == "row_wise" else
        {"big": table_wise(rank=0, compute_kernel=kernel), "mid": table_wise(rank=0, compute_kernel=kernel)}
    )
    plan = construct_module_sharding_plan(ebc, generators, world, local)
    if cached:
        # a batch needs at most 36 rows of a 500-row shard of "big" and 18 of "mid"; the
        # pipeline holds two batches: 75 and 40 slots, far fewer than the rows trained
        plan["big"].cache_params = CacheParams(load_factor=0.15)
        plan["mid"].cache_params = CacheParams(load_factor=0.2)
    env = world_env() if world > 1 else ShardingEnv.from_local(1, 0)
    sharder = EmbeddingBagCollectionSharder(
        fused_params=dict(FUSED), table_init=SeededUniformInit(seed=3), offload_dir=tmp,
    )
    return sharder.shard(ebc, plan, env, torch.device("cpu"))


def train_worker(rank: int, world: int, tmp: str) -> dict[str, float]:
    torch.manual_seed(0)
    sharded = shard(world, True, "row_wise", tmp)
    assert any(isinstance(k, CachedTableBatchedEmbedding) for lk in sharded.lookups for k in lk.kernels)
    reference = EmbeddingBagCollection(TABLES)
    for c in TABLES:
        SeededUniformInit(seed=3).fill(
            reference.embedding_bags[c.name].weight.data,
            TableRegion(table=c.name, num_rows=c.num_embeddings, dim=c.embedding_dim),
        )
    ref_opt = RowWiseAdagrad(list(reference.parameters()), lr=0.1, eps=1e-3)
    data = batches(world, STEPS)
    stream = pipelined_batches(
        [(step, kjts) for step, kjts in enumerate(data)], sharded,
        to_device=lambda b: b, features=lambda b: b[1][rank],
    )
    for step, kjts in stream:
        target = torch.randn(world * BATCH, 20, generator=torch.Generator().manual_seed(step))
        # the oracle steps on the mean of the ranks' losses
        pooled_step(sharded(kjts[rank]).wait().values(), reference(concat_ranks(kjts)).values(),
                    rank_rows(rank, BATCH), target, ref_opt, world, atol=1e-5, rtol=0.0)
    state = sharded.state_dict()  # flushes the caches
    assert check_local_shards(sharded, reference.embedding_bags, ref_opt, ("sum", "momentum1"),
                              atol=1e-5, rtol=0.0) > 0
    stats = [k.stats for lk in sharded.lookups for k in lk.cached_kernels()]
    assert state
    return {
        "misses": sum(s.misses for s in stats), "evictions": sum(s.evictions for s in stats),
        "writebacks": sum(s.writebacks for s in stats),
        "prefetched": sum(s.prefetched for s in stats),
    }


def test_cached_row_and_table_wise_equal_unsharded_at_world_size_2(tmp_path) -> None:
    results = run_gloo(2, train_worker, str(tmp_path))
    # each rank checked its outputs, gradients, shards and optimizer state against the oracle
    assert sum(r["evictions"] for r in results) > 0 and sum(r["writebacks"] for r in results) > 0
    assert all(r["prefetched"] >= STEPS for r in results)  # every batch's rows came in early


def save_worker(rank: int, world: int, tmp: str, cached: bool) -> None:
    sharded = shard(world, cached, "row_wise", tmp)
    for kjts in batches(world, 4):
        sharded(kjts[rank]).wait().values().sum().backward()
    dcp_checkpoint.save(
        os.path.join(tmp, "cached" if cached else "plain"), model=sharded,
        optimizer=sharded.fused_optimizer,
    )


def load_and_continue(tmp: str, name: str, cached: bool) -> tuple[dict, list[torch.Tensor]]:
    module = shard(1, cached, "table_wise", tmp)
    dcp_checkpoint.load(os.path.join(tmp, name), model=module, optimizer=module.fused_optimizer)
    loaded = {k: v.detach().clone() for k, v in module.state_dict().items()}
    loaded.update({
        f"opt/{k}": v.clone()
        for table in module.fused_optimizer.state_dict()["state"].values() for k, v in table.items()
    })
    outs = []
    for kjts in batches(1, 3, seed=7):
        out = module(kjts[0]).wait().values()
        out.sum().backward()
        outs.append(out.detach())
    return loaded, outs


@pytest.mark.slow
def test_cached_checkpoint_reloads_across_plans_and_world_sizes(tmp_path) -> None:
    # saved by 2 ranks (row-wise, cached and uncached); loaded by 1 rank (table-wise)
    run_gloo(2, save_worker, str(tmp_path), True)
    run_gloo(2, save_worker, str(tmp_path), False)
    plain, plain_outs = load_and_continue(str(tmp_path), "plain", cached=False)
    for source in ("cached",):
        for into_cached in (False, True):
            got, outs = load_and_continue(str(tmp_path), source, cached=into_cached)
            assert got.keys() == plain.keys()
            for k in plain:
                torch.testing.assert_close(got[k], plain[k], rtol=0, atol=1e-6, msg=k)
            for a, b in zip(outs, plain_outs, strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    # and the trained values really moved away from the initial ones
    fresh = shard(1, False, "table_wise", str(tmp_path)).state_dict()
    assert not torch.allclose(fresh["embedding_bags.big.weight"], plain["embedding_bags.big.weight"])


def reload_worker(rank: int, world: int, tmp: str, cached: bool) -> dict[str, list[torch.Tensor]]:
    """Train (with the pipeline's prefetch), save, train on, load the saved checkpoint back into
    the same module (DCP writes it in place, into the backing files of a cached table), train
    on: what the app does when it reloads its best checkpoint at the end of a run."""
    sharded = shard(world, cached, "row_wise", tmp)
    data = batches(world, 3 * STEPS)
    outs = []

    def train(steps: list[list[KeyedJaggedTensor]]) -> None:
        for kjts in pipelined_batches(steps, sharded, to_device=lambda b: b,
                                      features=lambda b: b[rank]):
            values = sharded(kjts[rank]).wait().values()
            outs.append(values.detach().clone())
            torch.tanh(values).sum().backward()

    ckpt = os.path.join(tmp, "ckpt_cached" if cached else "ckpt_plain")
    train(data[:STEPS])
    dcp_checkpoint.save(ckpt, model=sharded, optimizer=sharded.fused_optimizer)
    train(data[STEPS : 2 * STEPS])
    dcp_checkpoint.load(ckpt, model=sharded, optimizer=sharded.fused_optimizer)
    train(data[2 * STEPS :])
    # flushes (and checks) the caches again
    state = [sharded.state_dict(), sharded.fused_optimizer.state_dict()["state"]]
    tensors = [state[0][k] for k in sorted(state[0])] + [
        t for k in sorted(state[1]) for _, t in sorted(state[1][k].items())]
    stats = [k.stats for lk in sharded.lookups for k in lk.cached_kernels()]
    return {"outs": outs, "state": [s.tensor.clone() for t in tensors for s in t.local_shards()],
            "writebacks": sum(s.writebacks for s in stats)}


@pytest.mark.slow
def test_a_checkpoint_loaded_into_a_trained_cached_module_is_not_reported_corrupt(tmp_path) -> None:
    # The save flushed and checked the backing files; DCP's load then writes the checkpoint
    # into them in place, before the load hook flushes again and invalidates the caches: that
    # flush must not take the loaded rows for damage, and training goes on from them exactly
    # as in memory.
    cached = run_gloo(2, reload_worker, str(tmp_path), True)
    plain = run_gloo(2, reload_worker, str(tmp_path), False)
    assert sum(r["writebacks"] for r in cached) > 0  # trained rows went through the files
    for got, want in zip(cached, plain, strict=True):
        assert len(got["outs"]) == len(want["outs"]) == 3 * STEPS
        assert len(got["state"]) == len(want["state"]) > 0
        for a, b in zip(got["outs"] + got["state"], want["outs"] + want["state"], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


OTHER = [EmbeddingBagConfig(name="other", embedding_dim=4, num_embeddings=1000,
                            feature_names=["f0"], pooling=PoolingType.SUM)]


def two_collections_worker(rank: int, world: int, tmp: str) -> list[float]:
    """Two sharded collections fed by one pipeline: the first's tables cached on rank 0 only,
    the second's in memory on rank 1. The prefetches' collectives must match on both ranks."""
    cached = shard(world, True, "table_wise", tmp)  # every table of it on rank 0, cached
    other = EmbeddingBagCollection(OTHER, device=torch.device("meta"))
    plan = construct_module_sharding_plan(other, {"other": table_wise(rank=1)}, world, world)
    sharder = EmbeddingBagCollectionSharder(fused_params=dict(FUSED),
                                            table_init=SeededUniformInit(seed=4))
    model = torch.nn.Module()
    model.cached = cached
    model.other = sharder.shard(other, plan, world_env(), torch.device("cpu"))
    reference = EmbeddingBagCollection(TABLES + OTHER)
    for c in TABLES + OTHER:
        SeededUniformInit(seed=4 if c in OTHER else 3).fill(
            reference.embedding_bags[c.name].weight.data,
            TableRegion(table=c.name, num_rows=c.num_embeddings, dim=c.embedding_dim))
    data = batches(world, 4)
    lo, hi = rank * BATCH, (rank + 1) * BATCH
    errors = []
    for kjts in pipelined_batches(data, model, to_device=lambda b: b, features=lambda b: b[rank]):
        got = torch.cat([model.cached(kjts[rank]).wait().values(),
                         model.other(kjts[rank]).wait().values()], dim=1)
        with torch.no_grad():
            want = reference(concat_ranks(kjts)).values()[lo:hi]
        errors.append(float((got.detach() - want).abs().max()))
    return errors


def test_two_collections_with_caches_on_some_ranks_prefetch_in_step(tmp_path) -> None:
    for errors in run_gloo(2, two_collections_worker, str(tmp_path)):
        assert len(errors) == 4 and max(errors) < 1e-6, errors


def test_sharder_cache_load_factor_sizes_the_caches_the_plan_leaves_unsized(tmp_path) -> None:
    """TorchRec's ``fused_params["cache_load_factor"]``: the cache size of each
    fused_uvm_caching table whose plan gives no load factor; a planned load factor wins."""
    ebc = EmbeddingBagCollection(TABLES, device=torch.device("meta"))
    plan = construct_module_sharding_plan(ebc, {
        "big": table_wise(rank=0, compute_kernel="fused_uvm_caching"),
        "mid": table_wise(rank=0, compute_kernel="fused_uvm_caching"),
    }, 1, 1)
    plan["mid"].cache_params = CacheParams(load_factor=0.2)
    sharder = EmbeddingBagCollectionSharder(
        fused_params={**FUSED, "cache_load_factor": 0.05}, offload_dir=str(tmp_path))
    sharded = sharder.shard(ebc, plan, ShardingEnv.from_local(1, 0), torch.device("cpu"))
    slots = {rows: c.slots for k in (k for lk in sharded.lookups for k in lk.cached_kernels())
             for rows, c in zip(k.rows, k.caches, strict=True)}
    assert slots == {1000: 50, 200: 40}  # "big": 5% of its 1000 rows; "mid": 20% of 200
    assert plan["big"].cache_params is None  # the user's plan is left as given


def test_sharder_refuses_a_cache_load_factor_outside_0_1() -> None:
    with pytest.raises(ValueError, match=r"cache_load_factor 1.5 must be a fraction of the rows in \(0, 1\]"):
        EmbeddingBagCollectionSharder(fused_params={**FUSED, "cache_load_factor": 1.5})
