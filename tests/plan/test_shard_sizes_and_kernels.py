"""TorchRec's shard geometry helpers, grid sharding, default kernels and the kernel checks.

Every expected value is worked out by hand from TorchRec's documented rules (ceil row blocks,
whole buckets, memory shares rounded down, MIN_CW_DIM column blocks, host shards on rank 0)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from recsys_core import EmbeddingBagCollection, EmbeddingBagConfig
from recsys_core.distributed.sharding_plan import (
    _calculate_cw_shard_sizes_and_offsets,
    _calculate_grid_shard_sizes_and_offsets,
    _calculate_rw_shard_sizes_and_offsets,
    _calculate_uneven_rw_shard_sizes_and_offsets,
    calculate_shard_sizes_and_offsets,
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    get_sharding_constructor_from_type,
    grid_shard,
    placement,
    placement_helper,
    row_wise,
    table_row_wise,
    table_wise,
)
from recsys_core.distributed.types import (
    CacheParams,
    EmbeddingComputeKernel,
    EmbeddingModuleShardingPlan,
    ShardingType,
)
from recsys_core.optim import apply_optimizer_in_backward
from recsys_core.plan.kernels import (
    check_runnable_kernel,
    compute_kernel_violations,
    validate_compute_kernels,
)
from recsys_core.plan.shard_sizes import ShardSizeError
from recsys_core.plan.validation import validate_module_sharding_plan

K = EmbeddingComputeKernel


def test_row_blocks_ceil_buckets_and_memory_shares() -> None:
    assert _calculate_rw_shard_sizes_and_offsets(10, 4, 8) == (
        [[3, 8], [3, 8], [3, 8], [1, 8]], [[0, 0], [3, 0], [6, 0], [9, 0]])
    # 5 rows on 4: blocks of 2 -> 2, 2, 1 and an empty last one at row 5
    assert _calculate_rw_shard_sizes_and_offsets(5, 4, 2) == (
        [[2, 2], [2, 2], [1, 2], [0, 2]], [[0, 0], [2, 0], [4, 0], [5, 0]])
    # 12 rows in 6 buckets of 2 over 4 ranks: buckets 2, 2, 1, 1 -> rows 4, 4, 2, 2
    assert _calculate_rw_shard_sizes_and_offsets(12, 4, 3, num_buckets=6) == (
        [[4, 3], [4, 3], [2, 3], [2, 3]], [[0, 0], [4, 0], [8, 0], [10, 0]])
    # memory 3 : 1 : 1 of 10 rows: int(10 * 3/5) = 6, int(10 * 1/5) = 2, the rest 2
    assert _calculate_uneven_rw_shard_sizes_and_offsets(10, 3, 4, [3, 1, 1]) == (
        [[6, 4], [2, 4], [2, 4]], [[0, 0], [6, 0], [8, 0]])
    # 20 rows in 4 buckets of 5, memory 1 : 1 : 2: int(4/4) = 1 bucket, 1 bucket, rest 10
    assert _calculate_uneven_rw_shard_sizes_and_offsets(20, 3, 4, [1, 1, 2], num_buckets=4) == (
        [[5, 4], [5, 4], [10, 4]], [[0, 0], [5, 0], [10, 0]])


def test_bad_bucket_arguments_raise_value_and_assertion_errors() -> None:
    with pytest.raises(ShardSizeError, match="10 rows do not split into 3 equal buckets"):
        _calculate_rw_shard_sizes_and_offsets(10, 2, 4, num_buckets=3)
    assert issubclass(ShardSizeError, ValueError) and issubclass(ShardSizeError, AssertionError)
    with pytest.raises(ValueError, match=r"Number of buckets \(3\) must be >= the number of ranks"):
        calculate_shard_sizes_and_offsets(torch.empty(12, 8), 4, 4, "row_wise", num_buckets=3)
    with pytest.raises(ValueError, match="Unrecognized or unsupported sharding type"):
        calculate_shard_sizes_and_offsets(torch.empty(12, 8), 4, 4, "diagonal")


def test_column_and_grid_blocks() -> None:
    # 256 columns: blocks of MIN_CW_DIM = 128
    assert _calculate_cw_shard_sizes_and_offsets(256, 10) == (
        [[10, 128], [10, 128]], [[0, 0], [0, 128]])
    # asked width 16 of 64 -> 4 blocks; width 6 of 8 does not divide: the smallest multiple of 4
    # >= 6 dividing 8 is none below 8 -> one block
    assert _calculate_cw_shard_sizes_and_offsets(64, 3, 16)[1] == [
        [0, 0], [0, 16], [0, 32], [0, 48]]
    assert _calculate_cw_shard_sizes_and_offsets(8, 3, 6) == ([[3, 8]], [[0, 0]])
    # grid: 10 rows over 2 ranks (5, 5) for each of two 128-column blocks
    sizes, offsets = _calculate_grid_shard_sizes_and_offsets(10, 2, 256)
    assert sizes == [[5, 128], [5, 128], [5, 128], [5, 128]]
    assert offsets == [[0, 0], [5, 0], [0, 128], [5, 128]]
    t = torch.empty(10, 256)
    assert calculate_shard_sizes_and_offsets(t, 4, 2, "data_parallel") == (
        [[10, 256]] * 4, [[0, 0]] * 4)
    assert calculate_shard_sizes_and_offsets(t, 4, 2, "table_wise") == ([[10, 256]], [[0, 0]])
    assert calculate_shard_sizes_and_offsets(t, 4, 2, "table_row_wise")[0] == [[5, 256]] * 2


def test_placements() -> None:
    assert placement("cuda", 9, 8) == "rank:9/cuda:1"
    assert placement("cpu", 9, 8) == "rank:9/cpu"
    assert placement_helper("cpu", 3, 3) == "rank:0/cpu"  # host memory: rank 0's process
    assert placement_helper("cuda", 1, 2) == "rank:2/cuda:1"


def _ebc(rows: int, dim: int, n: int = 1) -> EmbeddingBagCollection:
    return EmbeddingBagCollection([
        EmbeddingBagConfig(name=f"t{i}", feature_names=[f"f{i}"], num_embeddings=rows,
                           embedding_dim=dim) for i in range(n)
    ], device="meta")


def test_grid_shard_generator_by_hand() -> None:
    plan = construct_module_sharding_plan(
        _ebc(10, 256), {"t0": grid_shard(host_indexes=[1, 0])}, local_size=2, world_size=4,
        device_type="cpu")
    ps = plan["t0"]
    assert ps.sharding_type is ShardingType.GRID_SHARD and ps.ranks == [2, 3, 0, 1]
    assert [(s.shard_offsets, s.shard_sizes, str(s.placement)) for s in ps.shards] == [
        ([0, 0], [5, 128], "rank:2/cpu"), ([5, 0], [5, 128], "rank:3/cpu"),
        ([0, 128], [5, 128], "rank:0/cpu"), ([5, 128], [5, 128], "rank:1/cpu"),
    ]
    with pytest.raises(ValueError, match="makes 2 column block"):
        construct_module_sharding_plan(_ebc(10, 256), {"t0": grid_shard(host_indexes=[0])},
                                       local_size=2, world_size=4, device_type="cpu")
    assert get_sharding_constructor_from_type(ShardingType.GRID_SHARD) is grid_shard
    assert get_sharding_constructor_from_type(ShardingType.ROW_WISE) is row_wise


def test_default_kernel_is_dense_unless_an_optimizer_is_applied_in_backward() -> None:
    ebc = EmbeddingBagCollection([
        EmbeddingBagConfig(name="a", feature_names=["fa"], num_embeddings=8, embedding_dim=4),
        EmbeddingBagConfig(name="b", feature_names=["fb"], num_embeddings=8, embedding_dim=4),
    ])
    gens = {"a": table_wise(rank=0), "b": data_parallel()}
    plain = construct_module_sharding_plan(ebc, gens, world_size=2, device_type="cpu")
    assert (plain["a"].compute_kernel, plain["b"].compute_kernel) == (K.DENSE, K.DENSE)
    apply_optimizer_in_backward(torch.optim.SGD, ebc.parameters(), {"lr": 0.1})
    fused = construct_module_sharding_plan(ebc, gens, world_size=2, device_type="cpu")
    # TorchRec: FUSED once an optimizer is applied in backward; data-parallel stays DENSE
    assert (fused["a"].compute_kernel, fused["b"].compute_kernel) == (K.FUSED, K.DENSE)
    given = construct_module_sharding_plan(
        ebc, {"a": table_row_wise(0, compute_kernel="fused_uvm_caching")}, world_size=2,
        device_type="cpu")
    assert given["a"].compute_kernel is K.FUSED_UVM_CACHING


def test_kernel_members_and_runnable_ones() -> None:
    assert [k.value for k in K] == [
        "dense", "fused", "fused_uvm", "fused_uvm_caching", "quant", "quant_uvm",
        "quant_uvm_caching", "key_value", "customized_kernel", "ssd_virtual_table",
        "dram_virtual_table", "dram_ssd_virtual_table", "fused_triton"]
    for kernel in (K.DENSE, K.FUSED, K.FUSED_UVM, K.FUSED_UVM_CACHING):
        check_runnable_kernel("t", kernel, inference=False)
    check_runnable_kernel("t", K.QUANT, inference=True)
    with pytest.raises(ValueError, match="t: compute kernel ssd_virtual_table is not available"):
        check_runnable_kernel("t", K.SSD_VIRTUAL_TABLE, inference=False)
    with pytest.raises(ValueError, match="quant_uvm is not available.*use quant"):
        check_runnable_kernel("t", K.QUANT_UVM, inference=True)
    with pytest.raises(ValueError, match="table 't0' .*key_value is not available"):
        construct_module_sharding_plan(
            _ebc(10, 8), {"t0": table_wise(0, compute_kernel="key_value")}, world_size=1,
            device_type="cpu")


def _option(kernel: str, sharding: str = "table_wise", clf: float | None = None,
            hbm: int = 1, ddr: int = 1) -> SimpleNamespace:
    return SimpleNamespace(fqn="m.t", compute_kernel=kernel, sharding_type=sharding,
                           cache_load_factor=clf, total_storage=SimpleNamespace(hbm=hbm, ddr=ddr))


def test_compute_kernel_violations_follow_torchrecs_planner_rules() -> None:
    assert compute_kernel_violations([
        _option("fused"), _option("dense", "data_parallel"), _option("key_value"),
        _option("fused_uvm_caching", clf=None), _option("fused_uvm_caching", clf=0.5),
    ]) == []
    assert compute_kernel_violations([
        _option("nope"), _option("dense"), _option("fused_uvm_caching", clf=0.0),
        _option("quant_uvm_caching", clf=1.0), _option("fused", hbm=-1, ddr=-2),
    ]) == [
        "m.t: unknown compute kernel 'nope'",
        "m.t: DENSE kernel requires DATA_PARALLEL sharding, got 'table_wise'",
        "m.t: fused_uvm_caching requires cache_load_factor strictly between 0 and 1, got 0.0",
        "m.t: quant_uvm_caching requires cache_load_factor strictly between 0 and 1, got 1.0",
        "m.t: fused has negative HBM storage (-1)",
        "m.t: fused has negative DDR storage (-2)",
    ]
    with pytest.raises(KeyError, match="2 violation"):
        validate_compute_kernels([_option("nope"), _option("dense")], error=KeyError)
    # accepted at construction (TorchRec's planner check above refuses it)
    assert CacheParams(load_factor=0.0).load_factor == 0.0
    with pytest.raises(ValueError, match=r"must be in \[0, 1\]"):
        CacheParams(load_factor=-0.1)


def test_mixed_device_plans_build_but_do_not_execute_on_several_ranks() -> None:
    plan = construct_module_sharding_plan(
        _ebc(10, 8), {"t0": column_wise(ranks=[0, 1], device_types=["cpu", "cpu"])},
        local_size=2, world_size=2, device_type="cpu")
    assert [str(s.placement) for s in plan["t0"].shards] == ["rank:0/cpu", "rank:0/cpu"]
    with pytest.raises(ValueError, match=r"ranks \[0, 1\] do not match the shard placements"):
        validate_module_sharding_plan(_ebc(10, 8), EmbeddingModuleShardingPlan(plan), 2, 2)
