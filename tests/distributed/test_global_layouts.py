"""The global layouts of a sharded collection's exported tensors, gathered once: a state dict
holds the same ShardedTensors (metadata, local shards) as torch's ``init_from_local_shards``
builds; the one gather runs when the module is built (``_initialize_torch_state``), and
``state_dict()`` sends nothing between the ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from gloo_setup import counting_gathers, two_table_plans, world_env
from table_configs import one_feature_tables
from torch.distributed._shard.sharded_tensor import ShardedTensor, init_from_local_shards

from recsys_core import EmbeddingBagCollection, EmbeddingBagConfig, EmbOptimType
from recsys_core.distributed import (
    EmbeddingBagCollectionSharder,
    ShardingEnv,
    column_wise,
    construct_module_sharding_plan,
    row_wise,
    sharded_state,
    table_wise,
)
from recsys_core.testing import run_gloo

TABLES = one_feature_tables(EmbeddingBagConfig, {"a": (11, 8), "b": (7, 4)})


def _plans(world: int) -> dict[str, dict]:
    plans = two_table_plans("a", "b", world)
    plans["mixed"] = {"a": column_wise(ranks=[world - 1, 0], compute_kernel="fused"),
                      "b": row_wise(compute_kernel="fused")}
    plans["one_rank"] = {"a": table_wise(rank=0, compute_kernel="fused"),
                         "b": table_wise(rank=0, compute_kernel="fused")}
    return plans


def _collective_reference(value: ShardedTensor) -> ShardedTensor:
    """The same local shards through torch's collective constructor (a gather per tensor)."""
    return init_from_local_shards(value.local_shards(), list(value.size()),
                                  process_group=dist.group.WORLD)


def _same(value: object, reference: ShardedTensor, key: str) -> int:
    assert isinstance(value, ShardedTensor), key
    assert value.metadata() == reference.metadata(), key
    mine, theirs = value.local_shards(), reference.local_shards()
    assert [s.metadata for s in mine] == [s.metadata for s in theirs], key
    assert [s.tensor.data_ptr() for s in mine] == [s.tensor.data_ptr() for s in theirs], key
    return len(value.metadata().shards_metadata)


def _both(sharded):  # type: ignore[no-untyped-def]
    """The module's and its fused optimizer's state dicts."""
    return sharded.state_dict(), sharded.fused_optimizer.state_dict()


def layouts_worker(rank: int, world: int, optimizer: str) -> dict:
    out: dict = {}
    for kind, generators in _plans(world).items():
        torch.manual_seed(0)
        ebc = EmbeddingBagCollection(tables=TABLES)
        plan = construct_module_sharding_plan(ebc, generators, world)
        sharder = EmbeddingBagCollectionSharder(
            fused_params={"optimizer": EmbOptimType[optimizer], "learning_rate": 0.1})
        sharded, built = counting_gathers(
            lambda e=ebc, p=plan, s=sharder: s.shard(e, p, world_env(), torch.device("cpu")))
        (weights, states), first = counting_gathers(lambda s=sharded: _both(s))
        _, again = counting_gathers(lambda s=sharded: _both(s))
        exported = {k: v for k, v in weights.items() if k.endswith(".weight")}
        exported |= {k: v for per_table in states["state"].values() for k, v in per_table.items()}
        # the optimizer lists only the tables this rank holds a part of (TorchRec's layout):
        # the reference construction runs over every rank's keys, empty where a rank has none
        sizes: list = [None] * world
        dist.all_gather_object(sizes, {k: list(v.size()) for k, v in exported.items()})
        every = {k: size for part in sizes for k, size in part.items()}
        shards = 0
        for key in sorted(every):
            value = exported.get(key)
            if kind == "data_parallel":
                assert not isinstance(value, ShardedTensor), key
                continue
            if value is None:
                empty = init_from_local_shards([], every[key], process_group=dist.group.WORLD)
                shards += len(empty.metadata().shards_metadata)
                continue
            shards += _same(value, _collective_reference(value), f"{kind}: {key}")
        out[kind] = {"gathers_built": built, "gathers": first, "gathers_again": again, "tensors": len(every),
                     "global_shards": shards}
    return out


@pytest.mark.parametrize("optimizer", ["EXACT_ROWWISE_ADAGRAD", "ADAM"])
def test_state_dict_matches_the_collective_construction_with_one_gather(optimizer: str) -> None:
    results = run_gloo(2, layouts_worker, optimizer)
    assert results[0] == results[1]
    states = {"EXACT_ROWWISE_ADAGRAD": 1, "ADAM": 2}[optimizer]
    for kind, found in results[0].items():
        # two weights and their states; sharded kinds: one gather when the collection is
        # built, none on any export; data-parallel tables are plain tensors (no gather)
        assert found["tensors"] == 2 * (1 + states), kind
        assert found["gathers_built"] == (0 if kind == "data_parallel" else 1), kind
        assert found["gathers"] == 0, kind
        assert found["gathers_again"] == 0, kind
    # the global shard lists are the plans' (table a, table b; per tensor, over both ranks)
    shards_per_tensor = {"table_wise": 1 + 1, "row_wise": 2 + 2, "column_wise": 2 + 1,
                         "table_row_wise": 2 + 2, "table_column_wise": 2 + 1, "mixed": 2 + 2,
                         "one_rank": 1 + 1}
    for kind, per_tensor in shards_per_tensor.items():
        assert results[0][kind]["global_shards"] == per_tensor * (1 + states), kind


def test_layouts_gather_nothing_for_a_single_process_environment() -> None:
    # a plan-only / one-process environment exports plain tensors and never gathers
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(tables=TABLES)
    plan = construct_module_sharding_plan(ebc, {"a": table_wise(rank=0), "b": table_wise(rank=0)},
                                          1)
    sharded = EmbeddingBagCollectionSharder().shard(ebc, plan, ShardingEnv.from_local(1, 0),
                                                    torch.device("cpu"))
    state = sharded.state_dict()
    assert not isinstance(state["embedding_bags.a.weight"], ShardedTensor)
    assert sharded._core.layouts._metadata is None
    assert isinstance(sharded._core.layouts, sharded_state.GlobalLayouts)


def mc_worker(rank: int, world: int) -> dict:
    from test_mc_sharded import FUSED, batch, build_mc, plan_for

    from recsys_core.distributed.mc_embeddingbag import (
        ManagedCollisionEmbeddingBagCollectionSharder,
    )

    mc = build_mc({"t0": 48, "t1": 48})
    sharder = ManagedCollisionEmbeddingBagCollectionSharder(
        EmbeddingBagCollectionSharder(fused_params=FUSED))
    sharded, gathers_built = counting_gathers(lambda: sharder.shard(mc, plan_for(mc, world), world_env()))
    pooled, _ = sharded(batch(rank, 0))  # ids enter: the remapping state is not all empty
    pooled.wait().values().sum().backward()
    first, gathers_first = counting_gathers(sharded.state_dict)
    again, gathers_again = counting_gathers(sharded.state_dict)
    remap = [k for k in first if "_managed_collision_modules." in k
             and isinstance(first[k], ShardedTensor)]
    for key in remap:
        _same(first[key], _collective_reference(first[key]), key)
        assert again[key].metadata() == first[key].metadata(), key
        torch.testing.assert_close(again[key].local_shards()[0].tensor,
                                   first[key].local_shards()[0].tensor)
    return {"remap_tensors": len(remap), "gathers_built": gathers_built, "gathers": gathers_first, "gathers_again": gathers_again,
            "sharded_entries": sum(isinstance(v, ShardedTensor) for v in first.values())}


def test_managed_collision_state_dict_gathers_its_layouts_once() -> None:
    results = run_gloo(2, mc_worker)
    assert results[0] == results[1]
    found = results[0]
    # per table: sorted raw ids, the remapped-id mapping and the eviction metadata
    assert found["remap_tensors"] >= 2 * 3
    # the tables' weights gathered when built; the remapping state on the first export; none
    # the second time
    assert found["gathers_built"] >= 1
    assert found["gathers"] == 1 and found["gathers_again"] == 0
