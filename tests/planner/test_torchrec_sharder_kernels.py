"""What TorchRec's planner accepts from a restrictive sharder (TorchRec's test sharders offer one
sharding type and one kernel), without changing the plans picked for our own sharders:

- a sharder that offers only a layout our enumerator drops as redundant (column-wise on one
  rank) still gets it; on one rank with ``min_partition`` the table is split in TorchRec's
  column blocks (the narrowest divisor of the dim >= min_partition, a multiple of 4);
- DENSE is chosen where the sharder offers it and no fused kernel (TorchRec's rule: DENSE only
  when FUSED is not also available).
"""

from __future__ import annotations

import pytest
import torch

from recsys_core import EmbeddingBagCollection, EmbeddingBagConfig
from recsys_core.distributed import (
    EmbeddingBagCollectionSharder,
    EmbeddingComputeKernel,
    ShardingType,
)
from recsys_core.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from recsys_core.planner.search.enumerate import torchrec_column_block


class OneWaySharder(EmbeddingBagCollectionSharder):
    """Offers one sharding type and the given kernels, like TorchRec's TestEBCSharder."""

    def __init__(self, sharding_type: ShardingType, kernels: list[EmbeddingComputeKernel]) -> None:
        super().__init__()
        self._type, self._kernels = sharding_type, kernels

    def sharding_types(self, compute_device_type: str) -> list[str]:
        return [self._type.value]

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        return [k.value for k in self._kernels]


def model(dims: tuple[int, ...] = (16, 8)) -> EmbeddingBagCollection:
    return EmbeddingBagCollection([
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=d, num_embeddings=40, feature_names=[f"f{i}"])
        for i, d in enumerate(dims)
    ], device=torch.device("meta"))


def test_torchrec_column_block() -> None:
    assert torchrec_column_block(16, 4) == 4
    assert torchrec_column_block(24, 5) == 8
    assert torchrec_column_block(10, 4) == 10  # no multiple of 4 divides it: one block
    assert torchrec_column_block(8, 8) == 8


def test_column_wise_only_sharder_on_one_rank_gets_torchrec_blocks() -> None:
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=1, compute_device="cpu"),
        constraints={"t0": ParameterConstraints(min_partition=4), "t1": ParameterConstraints(min_partition=4)},
    )
    sharder = OneWaySharder(ShardingType.COLUMN_WISE, [EmbeddingComputeKernel.FUSED])
    plan = planner.plan(model(), [sharder]).plan[""]
    for name, dim in (("t0", 16), ("t1", 8)):
        ps = plan[name]
        assert ps.sharding_type is ShardingType.COLUMN_WISE
        assert [m.shard_offsets for m in ps.shards] == [[0, c] for c in range(0, dim, 4)]
        assert {m.rank for m in ps.shards} == {0}


def test_column_wise_only_sharder_on_one_rank_without_min_partition() -> None:
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=1, compute_device="cpu"))
    sharder = OneWaySharder(ShardingType.COLUMN_WISE, [EmbeddingComputeKernel.FUSED])
    plan = planner.plan(model(), [sharder]).plan[""]
    assert all(len(ps.shards) == 1 for ps in plan.values())


@pytest.mark.parametrize("sharding_type", [ShardingType.DATA_PARALLEL, ShardingType.TABLE_WISE])
def test_dense_only_sharder_gets_dense(sharding_type: ShardingType) -> None:
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=2, compute_device="cpu"))
    sharder = OneWaySharder(sharding_type, [EmbeddingComputeKernel.DENSE])
    plan = planner.plan(model(), [sharder]).plan[""]
    assert {ps.compute_kernel for ps in plan.values()} == {EmbeddingComputeKernel.DENSE}
    assert {ps.sharding_type for ps in plan.values()} == {sharding_type}


def test_fused_wins_over_dense_when_both_are_offered() -> None:
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=2, compute_device="cpu"))
    sharder = OneWaySharder(ShardingType.TABLE_WISE,
                            [EmbeddingComputeKernel.DENSE, EmbeddingComputeKernel.FUSED])
    plan = planner.plan(model(), [sharder]).plan[""]
    assert {ps.compute_kernel for ps in plan.values()} == {EmbeddingComputeKernel.FUSED}


def test_dense_requested_by_constraints_is_accepted() -> None:
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=2, compute_device="cpu"),
        constraints={"t0": ParameterConstraints(compute_kernels=["dense"])},
    )
    sharder = OneWaySharder(ShardingType.DATA_PARALLEL, [EmbeddingComputeKernel.DENSE])
    plan = planner.plan(model(), [sharder]).plan[""]
    assert plan["t0"].compute_kernel is EmbeddingComputeKernel.DENSE


def test_default_sharder_plans_are_unchanged_on_one_rank() -> None:
    # our own sharder on one rank: still no redundant column split
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=1, compute_device="cpu"))
    plan = planner.plan(model(), [EmbeddingBagCollectionSharder()]).plan[""]
    assert {ps.sharding_type for ps in plan.values()} <= {ShardingType.TABLE_WISE, ShardingType.DATA_PARALLEL}
    assert {ps.compute_kernel for ps in plan.values()} == {EmbeddingComputeKernel.FUSED}


def test_default_sharder_plans_a_dense_constraint_data_parallel_on_dense() -> None:
    """TorchRec's golden data-parallel program: ``ParameterConstraints(compute_kernels=
    ["dense"])`` on one table with the default sharder makes that table a DENSE data-parallel
    replica; the others keep the fused kernels."""
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=2, compute_device="cpu"),
        constraints={"t0": ParameterConstraints(compute_kernels=["dense"])},
    )
    plan = planner.plan(model(), [EmbeddingBagCollectionSharder()]).plan[""]
    assert (plan["t0"].sharding_type, plan["t0"].compute_kernel) == (
        ShardingType.DATA_PARALLEL, EmbeddingComputeKernel.DENSE)
    assert plan["t1"].compute_kernel is EmbeddingComputeKernel.FUSED
