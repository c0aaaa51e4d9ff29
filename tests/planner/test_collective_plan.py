"""collective_plan on 2 real gloo ranks: one identical plan everywhere, errors raised everywhere,
and a planner-made plan that shards and trains exactly like the unsharded module."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from gloo_setup import check_local_shards, concat_ranks, rank_batches, rank_rows, world_env

from recsys_core import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbOptimType,
    PoolingType,
)
from recsys_core.distributed import (
    EmbeddingBagCollectionSharder,
    get_default_sharders,
    validate_module_sharding_plan,
)
from recsys_core.planner import (
    EmbeddingShardingPlanner,
    ParameterConstraints,
    PlannerError,
    Topology,
)
from recsys_core.testing import run_gloo

TABLES = [
    EmbeddingBagConfig(name="t_big", embedding_dim=8, num_embeddings=1000, feature_names=["f0", "f1"]),
    EmbeddingBagConfig(name="t_mid", embedding_dim=8, num_embeddings=13, feature_names=["f2"]),
    EmbeddingBagConfig(name="t_mean", embedding_dim=4, num_embeddings=7, feature_names=["f3"],
                       pooling=PoolingType.MEAN),
    EmbeddingBagConfig(name="t_cw", embedding_dim=8, num_embeddings=11, feature_names=["f4"]),
    EmbeddingBagConfig(name="t_tw", embedding_dim=4, num_embeddings=5, feature_names=["f5"]),
]
KEYS, ROWS, BATCH = ["f0", "f1", "f2", "f3", "f4", "f5"], [1000, 1000, 13, 7, 11, 5], 3
DIMS = 8 + 8 + 8 + 4 + 8 + 4
# Adagrad, not row-wise Adagrad: a column block's row-wise state differs from the whole row's
FUSED = {"optimizer": EmbOptimType.EXACT_ADAGRAD, "learning_rate": 0.1, "eps": 1e-3}
# t_big is looked up 10x per bag (the planner splits it); the others are pinned so that every
# sharding type of one host trains in one plan
CONSTRAINTS = {
    "t_big": ParameterConstraints(pooling_factors=[10.0, 10.0]),
    "t_mean": ParameterConstraints(sharding_types=["data_parallel"]),
    "t_mid": ParameterConstraints(sharding_types=["row_wise"]),
    "t_cw": ParameterConstraints(sharding_types=["column_wise"], min_partition=4),
    "t_tw": ParameterConstraints(sharding_types=["table_wise"]),
}


def plan_worker(rank: int, world: int) -> dict[str, str]:
    ebc = EmbeddingBagCollection(TABLES, device="meta")
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=world, compute_device="cpu"),
                                       constraints=CONSTRAINTS)
    plan = planner.collective_plan(ebc, [EmbeddingBagCollectionSharder()], dist.group.WORLD)
    validate_module_sharding_plan(ebc, plan.plan[""], world, world)
    too_big = EmbeddingShardingPlanner(topology=Topology(world_size=world, compute_device="cpu",
                                                         ddr_cap=1024))
    try:
        too_big.collective_plan(ebc, [EmbeddingBagCollectionSharder()])
        error = ""
    except PlannerError as exc:
        error = str(exc)
    return {"plan": plan.to_json(), "stats": planner.stats_str(), "error": error}


def test_collective_plan_is_identical_on_every_rank() -> None:
    results = run_gloo(2, plan_worker)
    assert results[0]["plan"] == results[1]["plan"]
    assert results[0]["stats"] == results[1]["stats"]
    assert "share of total" in results[1]["stats"]  # rank 1 got rank 0's per-rank summary
    assert all("does not fit" in r["error"] for r in results)  # raised on both, no hang


def train_worker(rank: int, world: int) -> list[str]:
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(TABLES)
    reference = copy.deepcopy(ebc)
    ref_opt = torch.optim.Adagrad(list(reference.parameters()), lr=0.1, eps=1e-3)
    sharder = EmbeddingBagCollectionSharder(fused_params=dict(FUSED))
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=world, compute_device="cpu"),
                                       constraints=CONSTRAINTS)
    plan = planner.collective_plan(ebc, [sharder], dist.group.WORLD)
    sharded = sharder.shard(ebc, plan.plan[""], world_env(), torch.device("cpu"))
    kjts = rank_batches(7, world, KEYS, ROWS, BATCH)
    rows = rank_rows(rank, BATCH)
    target = torch.randn(world * BATCH, DIMS, generator=torch.Generator().manual_seed(3))
    out = sharded(kjts[rank]).wait().values()
    ref_out = reference(concat_ranks(kjts)).values()
    torch.testing.assert_close(out, ref_out[rows].detach(), atol=1e-5, rtol=1e-5)
    (torch.tanh(out) * target[rows]).sum().backward()  # the fused optimizer steps here
    ((torch.tanh(ref_out) * target).sum() / world).backward()  # mean of the ranks' losses
    ref_opt.step()
    check_local_shards(sharded, reference.embedding_bags)
    return [f"{name}:{ps.sharding_type.value}" for name, ps in plan.plan[""].items()]


def test_planner_plan_shards_and_trains_like_the_unsharded_module() -> None:
    layouts = run_gloo(2, train_worker)
    assert layouts[0] == layouts[1]
    assert {"t_mid:row_wise", "t_cw:column_wise", "t_tw:table_wise",
            "t_mean:data_parallel"} <= set(layouts[0])


def default_sharders_worker(rank: int, world: int) -> tuple[str, str]:
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=world, compute_device="cpu"),
                                       constraints=CONSTRAINTS)
    ebc = EmbeddingBagCollection(TABLES, device="meta")
    implicit = planner.collective_plan(ebc)  # TorchRec: sharders and pg are optional
    explicit = planner.collective_plan(ebc, get_default_sharders(), dist.group.WORLD)
    return implicit.to_json(), explicit.to_json()


def test_collective_plan_defaults_to_the_default_sharders() -> None:
    for implicit, explicit in run_gloo(2, default_sharders_worker):
        assert implicit == explicit and '"t_big"' in implicit
