"""The cost/storage model against hand-computed values, and the enumerator's candidate set."""

from __future__ import annotations

import numpy as np
import pytest

from recsys_core import EmbeddingBagConfig, EmbOptimType
from recsys_core.distributed import (
    EmbeddingBagCollectionSharder,
    EmbeddingCollectionSharder,
    EmbeddingComputeKernel,
    ShardingType,
)
from recsys_core.distributed.sharding_plan import row_blocks
from recsys_core.planner import ParameterConstraints, PlannerError, Topology
from recsys_core.planner.search.cost import estimate_option, state_bytes_per_row
from recsys_core.planner.search.enumerate import column_counts, enumerate_options, row_block_sizes
from recsys_core.planner.search.types import Placement, TableSpec


def spec(rows: int = 1000, dim: int = 64, optimizer: EmbOptimType = EmbOptimType.EXACT_SGD,
         constraints: ParameterConstraints | None = None) -> TableSpec:
    config = EmbeddingBagConfig(name="t", embedding_dim=dim, num_embeddings=rows, feature_names=["f"])
    return TableSpec(path="", config=config, pooled=True, optimizer=optimizer,
                     constraints=constraints or ParameterConstraints(), ids_per_batch=10.0,
                     bags_per_batch=4.0, is_weighted=False)


def test_state_bytes_follow_the_optimizer() -> None:
    assert state_bytes_per_row(EmbOptimType.EXACT_SGD, 64) == 0
    assert state_bytes_per_row(EmbOptimType.EXACT_ROWWISE_ADAGRAD, 64) == 4
    assert state_bytes_per_row(EmbOptimType.EXACT_ADAGRAD, 64) == 256
    assert state_bytes_per_row(EmbOptimType.ADAM, 64) == 512
    assert state_bytes_per_row(EmbOptimType.PARTIAL_ROWWISE_ADAM, 64) == 260


def test_table_wise_storage_on_cpu_by_hand() -> None:
    # 2 ranks: the shard serves 2 x 10 ids and 2 x 4 bags per step
    topology = Topology(world_size=2, compute_device="cpu")
    option = estimate_option(
        spec(optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD), ShardingType.TABLE_WISE,
        EmbeddingComputeKernel.FUSED, Placement.ANY_RANKS, np.array([1000]), np.array([64]), topology,
    )
    weights, state = 1000 * 64 * 4, 1000 * 4
    buffers = 20 * 8 + 8 * 8 + 2 * (8 * 64 * 4)  # ids, lengths, outputs + their gradients
    assert option.hbm.tolist() == [0]
    assert option.ddr.tolist() == [weights + state + buffers]


def test_uvm_moves_weights_to_host_memory_and_costs_more() -> None:
    topology = Topology(world_size=2, compute_device="cuda")
    args = (ShardingType.TABLE_WISE, Placement.ANY_RANKS, np.array([1000]), np.array([64]), topology)
    fused = estimate_option(spec(), args[0], EmbeddingComputeKernel.FUSED, *args[1:])
    uvm = estimate_option(spec(), args[0], EmbeddingComputeKernel.FUSED_UVM, *args[1:])
    assert fused.ddr.tolist() == [0] and uvm.ddr.tolist() == [1000 * 64 * 4]
    assert uvm.cost[0] > fused.cost[0]
    caching = estimate_option(spec(), args[0], EmbeddingComputeKernel.FUSED_UVM_CACHING, *args[1:])
    assert caching.slot_bytes.tolist() == [64 * 4 + 16]  # FBGEMM's slot: weights + 16 B
    assert caching.cache_bytes(1.0).tolist() == [1000 * (64 * 4 + 16)]
    assert caching.cache_bytes(0.2).tolist() == [200 * (64 * 4 + 16)]
    assert caching.ddr.tolist() == [1000 * 64 * 4] and caching.ssd.tolist() == [0]
    assert caching.total_cost(1.0) == pytest.approx(fused.total_cost())
    assert caching.total_cost(0.0) == pytest.approx(uvm.total_cost())


def test_row_wise_splits_memory_but_repeats_output_traffic() -> None:
    topology = Topology(world_size=4, compute_device="cuda")
    s = spec(rows=1000)
    tw = estimate_option(s, ShardingType.TABLE_WISE, EmbeddingComputeKernel.FUSED,
                         Placement.ANY_RANKS, np.array([1000]), np.array([64]), topology)
    rw = estimate_option(s, ShardingType.ROW_WISE, EmbeddingComputeKernel.FUSED,
                         Placement.ALL_RANKS, np.full(4, 250), np.full(4, 64), topology)
    assert rw.hbm.max() < tw.hbm[0]
    assert rw.total_cost() > tw.total_cost()


def test_column_counts() -> None:
    assert column_counts(128, 32, 8) == [2, 4]
    assert column_counts(128, 32, 2) == [2]
    assert column_counts(24, 4, 8) == [2, 3, 6]  # widths 12, 8, 4: all multiples of 4
    assert column_counts(10, 1, 8) == [2, 5]  # no width is a multiple of 4: keep them all
    assert column_counts(16, 32, 8) == []


def test_enumerator_respects_sharder_and_topology() -> None:
    cpu = Topology(world_size=4, compute_device="cpu")
    options = enumerate_options(spec(rows=100_000), EmbeddingBagCollectionSharder(), cpu)
    types = {o.sharding_type for o in options}
    # one host: table-row/column-wise would repeat row/column-wise; 25 MB is too big for DP
    assert types == {ShardingType.TABLE_WISE, ShardingType.COLUMN_WISE, ShardingType.ROW_WISE}
    assert {o.compute_kernel for o in options} == {EmbeddingComputeKernel.FUSED}
    small = enumerate_options(spec(rows=100), EmbeddingCollectionSharder(), cpu)
    assert ShardingType.DATA_PARALLEL not in {o.sharding_type for o in small}  # EC has no DP
    small_bag = enumerate_options(spec(rows=100), EmbeddingBagCollectionSharder(), cpu)
    assert ShardingType.DATA_PARALLEL in {o.sharding_type for o in small_bag}


def test_enumerator_rejects_types_the_sharder_lacks() -> None:
    constraints = ParameterConstraints(sharding_types=["data_parallel"])
    with pytest.raises(PlannerError, match=r"'t'.*data_parallel.*EmbeddingCollectionSharder"):
        enumerate_options(spec(constraints=constraints), EmbeddingCollectionSharder(),
                          Topology(world_size=2, compute_device="cpu"))


def test_row_wise_optimizers_get_no_column_splits_unless_asked() -> None:
    # a column block's row-wise Adagrad state would cover only its columns: not the same training
    cpu = Topology(world_size=4, compute_device="cpu")
    rowwise = spec(rows=100_000, dim=128, optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD)
    types = {o.sharding_type for o in enumerate_options(rowwise, EmbeddingBagCollectionSharder(), cpu)}
    assert types == {ShardingType.TABLE_WISE, ShardingType.ROW_WISE}
    asked = spec(rows=100_000, dim=128, optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
                 constraints=ParameterConstraints(sharding_types=["column_wise"]))
    options = enumerate_options(asked, EmbeddingBagCollectionSharder(), cpu)
    assert {o.sharding_type for o in options} == {ShardingType.COLUMN_WISE}


@pytest.mark.parametrize(("rows", "shards"), [(10, 4), (2, 4), (4096, 8), (1, 1), (1000, 128)])
def test_row_block_sizes_match_the_plan_generator(rows: int, shards: int) -> None:
    assert row_block_sizes(rows, shards).tolist() == [size for _, size in row_blocks(rows, shards)]
