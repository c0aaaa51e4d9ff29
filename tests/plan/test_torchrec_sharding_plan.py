"""TorchRec 1.8's sharding-plan helpers: exact shard offsets, sizes, placements and default
kernels (the values of TorchRec's test_sharding_plan.py: DENSE unless an optimizer is applied in
backward), torch's EnumerableShardingSpec, and the helpers' TorchRec arguments."""

from __future__ import annotations

import pytest
import torch
from torch.distributed._shard.metadata import ShardMetadata as TorchShardMetadata
from torch.distributed._shard.sharding_spec import EnumerableShardingSpec as TorchSpec

from recsys_core import DataType, EmbeddingBagCollection, EmbeddingBagConfig
from recsys_core.distributed import EmbeddingCollectionSharder
from recsys_core.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_row_wise,
    table_wise,
)
from recsys_core.distributed.types import (
    BoundsCheckMode,
    CacheParams,
    EmbeddingComputeKernel,
    EmbeddingModuleShardingPlan,
    EnumerableShardingSpec,
    ParameterSharding,
    ShardingPlan,
    ShardingType,
    ShardMetadata,
)


def ebc(rows: int, dim: int, n: int) -> EmbeddingBagCollection:
    return EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name=f"table_{i}", feature_names=[f"feature_{i}"], embedding_dim=dim,
                           num_embeddings=rows) for i in range(n)
    ], device=torch.device("meta"))


def spec(*shards: tuple[list[int], list[int], str]) -> TorchSpec:
    return TorchSpec([TorchShardMetadata(o, s, p) for o, s, p in shards])


def test_construct_module_sharding_plan_values_of_torchrec() -> None:
    plan = construct_module_sharding_plan(
        ebc(32 * 32, 256, 5),
        per_param_sharding={
            "table_0": data_parallel(),
            "table_1": table_wise(rank=1),
            "table_2": row_wise(),
            "table_3": column_wise(ranks=[8, 9]),
            "table_4": table_row_wise(host_index=3),
        },
        local_size=8,
        world_size=32,
        device_type="cuda",
    )
    expected = {
        "table_0": ParameterSharding("data_parallel", "dense", list(range(32)), None),
        "table_1": ParameterSharding(
            "table_wise", "dense", [1], spec(([0, 0], [1024, 256], "rank:1/cuda:1"))),
        "table_2": ParameterSharding("row_wise", "dense", list(range(32)), spec(*[
            ([32 * r, 0], [32, 256], f"rank:{r}/cuda:{r % 8}") for r in range(32)
        ])),
        "table_3": ParameterSharding("column_wise", "dense", [8, 9], spec(
            ([0, 0], [1024, 128], "rank:8/cuda:0"), ([0, 128], [1024, 128], "rank:9/cuda:1"))),
        "table_4": ParameterSharding("table_row_wise", "dense", list(range(24, 32)), spec(*[
            ([128 * i, 0], [128, 256], f"rank:{24 + i}/cuda:{i}") for i in range(8)
        ])),
    }
    assert dict(plan) == expected
    assert isinstance(plan, EmbeddingModuleShardingPlan)
    shard = plan["table_3"].sharding_spec.shards[1]  # type: ignore[union-attr]
    assert isinstance(plan["table_3"].sharding_spec, TorchSpec)
    assert isinstance(shard, TorchShardMetadata)
    assert (shard.placement.rank(), shard.placement.device()) == (9, torch.device("cuda", 1))


def test_enum_fields_equal_torchrecs_strings() -> None:
    ps = ParameterSharding("table_wise", "fused", [0], [ShardMetadata([0, 0], [4, 2], "rank:0/cpu")])
    assert ps.sharding_type == "table_wise" and ps.sharding_type is ShardingType.TABLE_WISE
    assert ps.compute_kernel == "fused" and ps.compute_kernel is EmbeddingComputeKernel.FUSED
    assert isinstance(ps.sharding_spec, EnumerableShardingSpec)
    assert ps.sharding_spec == spec(([0, 0], [4, 2], "rank:0/cpu"))


def test_table_wise_device_overrides_the_plans_device_type() -> None:
    plan = construct_module_sharding_plan(
        ebc(4096, 64, 2), {"table_0": table_wise(rank=0, device="cpu"),
                           "table_1": table_wise(rank=1, device="cpu")},
        local_size=2, world_size=2, device_type="cuda")
    for rank, name in enumerate(("table_0", "table_1")):
        placement = plan[name].shards[0].placement
        assert placement.device().type == "cpu"
        assert placement.rank() == 0  # TorchRec's: every host shard is "rank:0/cpu"
        assert plan[name].ranks == [rank]


def test_column_wise_size_per_rank() -> None:
    model = EmbeddingBagCollection(tables=[EmbeddingBagConfig(
        name="table_0", feature_names=["feature_0"], embedding_dim=100, num_embeddings=1024)],
        device=torch.device("meta"))
    plan = construct_module_sharding_plan(
        model, {"table_0": column_wise(size_per_rank=[30, 40, 30])},
        local_size=3, world_size=3, device_type="cuda")
    assert plan["table_0"] == ParameterSharding("column_wise", "dense", [0, 1, 2], spec(
        ([0, 0], [1024, 30], "rank:0/cuda:0"), ([0, 30], [1024, 40], "rank:1/cuda:1"),
        ([0, 70], [1024, 30], "rank:2/cuda:2")))
    with pytest.raises(ValueError, match=r"table 'table_0': column sizes \[20, 30, 40\] cover 90 of its 100"):
        construct_module_sharding_plan(model, {"table_0": column_wise(size_per_rank=[20, 30, 40])},
                                       local_size=3, world_size=3, device_type="cuda")


def test_column_wise_device_types_and_uneven_division() -> None:
    plan = construct_module_sharding_plan(
        ebc(1024, 64, 1), {"table_0": column_wise(ranks=[0, 1], device_types=["cpu", "cuda"])},
        local_size=2, world_size=2, device_type="cuda")
    # TorchRec's: host shards on rank:0/cpu, device shards numbered in order of appearance
    assert [str(s.placement) for s in plan["table_0"].shards] == ["rank:0/cpu", "rank:0/cuda:0"]
    four = construct_module_sharding_plan(
        ebc(1024, 64, 1),
        {"table_0": column_wise(ranks=[0, 1, 2, 3], device_types=["cpu", "cuda", "cpu", "cuda"])},
        local_size=4, world_size=4, device_type="cuda")
    assert [str(s.placement) for s in four["table_0"].shards] == [
        "rank:0/cpu", "rank:0/cuda:0", "rank:0/cpu", "rank:1/cuda:1"]
    with pytest.raises(ValueError, match=r"column dim of 64 cannot be evenly divided across "
                                         r"\[0, 1, 2\]: .*embedding_dim 64 does not split"):
        construct_module_sharding_plan(ebc(1024, 64, 1), {"table_0": column_wise(ranks=[0, 1, 2])},
                                       local_size=3, world_size=3, device_type="cpu")


def test_row_wise_sizes_placement_is_uneven_and_quantized() -> None:
    plan = construct_module_sharding_plan(
        ebc(10, 8, 2), {"table_0": row_wise(sizes_placement=([6, 4], "cpu")),
                        "table_1": row_wise(sizes_placement=([8, 8], ["cpu", "cuda"]))},
        local_size=2, world_size=2, device_type="cpu")
    assert plan["table_0"] == ParameterSharding("row_wise", "quant", [0, 1], spec(
        ([0, 0], [6, 8], "rank:0/cpu"), ([6, 0], [4, 8], "rank:0/cpu")))
    # cut at 10 rows; TorchRec's placements: rank:0/cpu, then rank:<position>/cuda:<n-th device>
    assert plan["table_1"] == ParameterSharding("row_wise", "quant", [0, 1], spec(
        ([0, 0], [8, 8], "rank:0/cpu"), ([8, 0], [2, 8], "rank:1/cuda:0")))
    with pytest.raises(ValueError, match=r"row sizes \[3, 3\] cover 6 of its 10"):
        construct_module_sharding_plan(ebc(10, 8, 1), {"table_0": row_wise(sizes_placement=([3, 3], "cpu"))},
                                       local_size=2, world_size=2, device_type="cpu")


def test_this_librarys_earlier_positional_order_still_reads() -> None:
    gens = {"table_0": table_wise(rank=1), "table_1": row_wise()}
    keyword = construct_module_sharding_plan(ebc(10, 8, 2), gens, world_size=2, device_type="cpu")
    assert construct_module_sharding_plan(ebc(10, 8, 2), gens, 2, 2, "cpu") == keyword
    assert table_wise(1, EmbeddingComputeKernel.QUANT)(
        EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=3, feature_names=["f"]),
        2, 2, "cpu").compute_kernel is EmbeddingComputeKernel.QUANT


def test_sharder_and_world_size_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="EmbeddingCollectionSharder shards EmbeddingCollection, "
                                         "not EmbeddingBagCollection"):
        construct_module_sharding_plan(ebc(10, 8, 1), {"table_0": row_wise()},
                                       EmbeddingCollectionSharder(), world_size=2)
    with pytest.raises(ValueError, match="no world_size and no process group"):
        construct_module_sharding_plan(ebc(10, 8, 1), {"table_0": row_wise()})


def test_plan_json_round_trip_keeps_kernel_parameters() -> None:
    ps = ParameterSharding(
        "table_wise", "fused_uvm_caching", [0], [ShardMetadata([0, 0], [10, 8], "rank:0/cuda:0")],
        cache_params=CacheParams(load_factor=0.25), enforce_hbm=True, stochastic_rounding=False,
        bounds_check_mode=BoundsCheckMode.WARNING, output_dtype=DataType.FP16)
    plan = ShardingPlan({"": EmbeddingModuleShardingPlan({"t": ps})})
    back = ShardingPlan.from_json(plan.to_json())
    assert back == plan
    assert back.plan[""]["t"].output_dtype is DataType.FP16
    assert back.plan[""]["t"].cache_params == CacheParams(load_factor=0.25)


def test_spec_reads_like_the_earlier_shard_list_and_placements_accept_strings() -> None:
    plan = construct_module_sharding_plan(ebc(10, 8, 1), {"table_0": table_wise(rank=1)},
                                          world_size=2, device_type="cpu")
    spec_ = plan["table_0"].sharding_spec
    assert spec_ is not None and len(spec_) == 1 and list(spec_) == spec_.shards
    spec_[0].placement = "rank:0/cpu"  # a string is parsed into torch's _remote_device
    assert (spec_[0].rank, spec_[0].device, spec_[0].placement.rank()) == (0, "cpu", 0)
    assert repr(spec_[0].placement) == "'rank:0/cpu'"
