"""ParameterConstraints as TorchRec 1.8 has it: every field, positional order, mutability, and
the fields the planner honours (carried into the plan, or used by its estimates)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from recsys_core import DataType, EmbeddingBagCollection, EmbeddingBagConfig, EmbOptimType
from recsys_core.distributed import EmbeddingBagCollectionSharder, ShardingType
from recsys_core.distributed.types import EmbeddingComputeKernel, ParameterSharding
from recsys_core.planner import (
    BoundsCheckMode,
    CacheParams,
    EmbeddingShardingPlanner,
    KeyValueParams,
    ParameterConstraints,
    PlannerError,
    PlannerErrorType,
    Topology,
)
from recsys_core.planner.search.cost import estimate_option
from recsys_core.planner.search.types import Placement, TableSpec

TORCHREC_FIELDS = [
    "sharding_types", "compute_kernels", "min_partition", "pooling_factors", "num_poolings",
    "batch_sizes", "is_weighted", "cache_params", "enforce_hbm", "stochastic_rounding",
    "bounds_check_mode", "feature_names", "output_dtype", "device_group", "key_value_params",
    "use_virtual_table",
]


def model(features: list[str] | None = None) -> EmbeddingBagCollection:
    return EmbeddingBagCollection(tables=[EmbeddingBagConfig(
        name="t", embedding_dim=8, num_embeddings=100, feature_names=features or ["f"])],
        device=torch.device("meta"))


def plan_one(constraints: ParameterConstraints, world: int = 2,
             features: list[str] | None = None) -> ParameterSharding:
    planner = EmbeddingShardingPlanner(topology=Topology(world, "cpu"), constraints={"t": constraints})
    return planner.plan(model(features), [EmbeddingBagCollectionSharder()]).plan[""]["t"]


def test_fields_and_positional_order_are_torchrecs() -> None:
    assert [f.name for f in dataclasses.fields(ParameterConstraints)] == TORCHREC_FIELDS
    c = ParameterConstraints(["table_wise"], ["fused"], 32, [2.0], [1.0], [64], True,
                             CacheParams(load_factor=0.5), True, False, BoundsCheckMode.WARNING,
                             ["f"], DataType.FP16, "cpu", None, False)
    assert (c.min_partition, c.pooling_factors, c.batch_sizes, c.is_weighted) == (32, [2.0], [64], True)
    assert (c.enforce_hbm, c.stochastic_rounding, c.bounds_check_mode) == (True, False, BoundsCheckMode.WARNING)
    assert (c.feature_names, c.output_dtype, c.device_group) == (["f"], DataType.FP16, "cpu")
    assert ParameterConstraints().pooling_factors == [1.0]


def test_mutable_and_hashable_like_torchrecs() -> None:
    c = ParameterConstraints(sharding_types=["table_wise"])
    c.sharding_types = ["row_wise"]
    assert plan_one(c).sharding_type is ShardingType.ROW_WISE  # the planner reads the new value
    c.sharding_types = ["diagonal"]
    with pytest.raises(ValueError, match="'diagonal' is not a ShardingType"):
        plan_one(c)
    assert hash(ParameterConstraints(pooling_factors=[2.0])) == hash(ParameterConstraints(pooling_factors=[2.0]))


def test_kernel_parameters_are_carried_into_the_plan() -> None:
    ps = plan_one(ParameterConstraints(
        sharding_types=["table_wise"], stochastic_rounding=True,
        bounds_check_mode=BoundsCheckMode.IGNORE, output_dtype=DataType.FP16, enforce_hbm=True))
    assert (ps.stochastic_rounding, ps.bounds_check_mode, ps.output_dtype, ps.enforce_hbm) == (
        True, BoundsCheckMode.IGNORE, DataType.FP16, True)
    assert plan_one(ParameterConstraints()).output_dtype is None


def test_output_dtype_sizes_output_buffers() -> None:
    # 2 ranks, one table-wise shard serving 2 x 4 bags of 64 columns: outputs and their
    # gradients are 2 x 8 x 64 elements, 4 bytes each in FP32 and 2 in FP16.
    config = EmbeddingBagConfig(name="t", embedding_dim=64, num_embeddings=1000, feature_names=["f"])

    def ddr(output_bytes: float) -> float:
        table = TableSpec(path="", config=config, pooled=True, optimizer=EmbOptimType.EXACT_SGD,
                          constraints=ParameterConstraints(), ids_per_batch=10.0,
                          bags_per_batch=4.0, is_weighted=False, output_bytes=output_bytes)
        option = estimate_option(table, ShardingType.TABLE_WISE, EmbeddingComputeKernel.FUSED,
                                 Placement.ANY_RANKS, np.array([1000]), np.array([64]),
                                 Topology(2, "cpu"))
        return float(option.ddr[0])

    assert ddr(4.0) - ddr(2.0) == 2 * 8 * 64 * 2


def test_feature_names_order_the_per_feature_lists() -> None:
    # the same traffic as the lists in the config's order
    named = plan_one(ParameterConstraints(feature_names=["b", "a"], pooling_factors=[1.0, 9.0]),
                     features=["a", "b"])
    assert named == plan_one(ParameterConstraints(pooling_factors=[9.0, 1.0]), features=["a", "b"])
    with pytest.raises(PlannerError, match=r"feature_names \['a', 'x'\] but the table's features") as info:
        plan_one(ParameterConstraints(feature_names=["a", "x"]), features=["a", "b"])
    assert info.value.error_type is PlannerErrorType.INPUT_VALIDATION
    with pytest.raises(PlannerError, match="constraints give 3 pooling_factors but there are 2"):
        plan_one(ParameterConstraints(feature_names=["b", "a"], pooling_factors=[1.0, 2.0, 3.0]),
                 features=["a", "b"])


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"device_group": "cuda"}, "device_group 'cuda' but the topology is 'cpu'"),
    ({"key_value_params": KeyValueParams(ssd_storage_directory="ssd")}, "key-value"),
    ({"use_virtual_table": True}, "key-value"),
])
def test_what_the_planner_cannot_honour_is_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(PlannerError, match=message) as info:
        plan_one(ParameterConstraints(**kwargs))
    assert info.value.error_type is PlannerErrorType.STRICT_CONSTRAINTS


def test_bad_field_values_are_errors() -> None:
    with pytest.raises(ValueError, match="device_group 'tpu'"):
        ParameterConstraints(device_group="tpu")
    with pytest.raises(ValueError, match="feature_names must be a non-empty list"):
        ParameterConstraints(feature_names="f")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="is not a DataType"):
        ParameterConstraints(output_dtype="float7")  # type: ignore[arg-type]
