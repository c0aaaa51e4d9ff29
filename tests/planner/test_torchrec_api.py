"""TorchRec 1.8's planner surface: Topology's positional order, PlannerErrorType, no sharders,
Storage / Perf / Shard arithmetic, bwd_compute_multiplier."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from recsys_core import DataType, EmbeddingBagCollection, EmbeddingBagConfig, EmbOptimType
from recsys_core.distributed import (
    EmbeddingBagCollectionSharder,
    EmbeddingComputeKernel,
    ShardingPlan,
    ShardingType,
)
from recsys_core.planner import (
    CacheParams,
    DeviceHardware,
    EmbeddingShardingPlanner,
    HeuristicalStorageReservation,
    ParameterConstraints,
    Perf,
    PlannerError,
    PlannerErrorType,
    Shard,
    Storage,
    Topology,
)
from recsys_core.planner.search.cost import estimate_option
from recsys_core.planner.search.types import Placement, TableSpec

GIB = 1024**3
MIB = 1024**2


def ebc(rows: int, dim: int, n: int = 1) -> EmbeddingBagCollection:
    tables = [EmbeddingBagConfig(name=f"table_{i}", embedding_dim=dim, num_embeddings=rows,
                                 feature_names=[f"feature_{i}"]) for i in range(n)]
    return EmbeddingBagCollection(tables=tables, device=torch.device("meta"))


def test_topology_positional_order_is_torchrecs() -> None:
    # Topology(world_size, compute_device, hbm_cap, ddr_cap, ssd_cap, local_world_size, ...)
    t = Topology(4, "cuda", 2 * GIB, 64 * GIB, None, 2)
    assert (t.world_size, t.compute_device, t.hbm_cap, t.ddr_cap, t.local_world_size) == (
        4, "cuda", 2 * GIB, 64 * GIB, 2)
    assert (t.num_hosts, t.hbm_per_rank, t.ddr_per_rank) == (2, 2 * GIB, 64 * GIB)  # per rank
    assert t.bwd_compute_multiplier == 2.0


def test_cuda_topology_reports_disk_but_plans_without_it() -> None:
    # TorchRec accepts a disk tier on CUDA (its key-value tables); this planner's cached tables
    # live in host memory there, so its own search sees no disk.
    t = Topology(2, "cuda", ssd_cap=5 * GIB, ssd_mem_bw=7.0)
    assert (t.devices[1].storage.ssd, t.ssd_mem_bw, t.ssd_per_rank) == (5 * GIB, 7.0, 0)
    assert Topology(2, "cuda").ssd_mem_bw == 100 * 1024**2 / 1000  # TorchRec's SSD_MEM_BW


def test_topology_devices_are_per_rank_storage() -> None:
    t = Topology(2, "cuda", hbm_cap=3 * GIB, ddr_cap=8 * GIB)
    assert t.devices == [
        DeviceHardware(0, Storage(3 * GIB, 8 * GIB, 0), Perf(0, 0, 0, 0)),
        DeviceHardware(1, Storage(3 * GIB, 8 * GIB, 0), Perf(0, 0, 0, 0)),
    ]


def test_storage_arithmetic_and_order() -> None:
    assert Storage(hbm=2, ddr=5) + Storage(hbm=1, ddr=1, ssd=3) == Storage(3, 6, 3)
    assert Storage(hbm=2, ddr=5) - Storage(hbm=1, ddr=1) == Storage(1, 4, 0)
    assert Storage(1, 9) < Storage(2, 0)  # field by field, hbm first (TorchRec's dataclass order)
    assert Storage(1, 9).fits_in(Storage(2, 8)) is False
    assert Storage(1, 8).fits_in(Storage(2, 8)) is True
    assert sum([Storage(1, 2), Storage(3, 4)], Storage(0, 0)) == Storage(4, 6)
    assert len({Storage(1, 2), Storage(1, 2, 0)}) == 1


def test_perf_total_and_sum() -> None:
    a = Perf(fwd_compute=1.0, fwd_comms=2.0, bwd_compute=3.0, bwd_comms=4.0, input_dist_comms=0.5)
    b = Perf(0.5, 0.5, 0.5, 0.5, prefetch_compute=1.0)
    assert a.total == 10.0  # input_dist_comms is part of fwd_comms, not added again
    assert (a + b).total == 13.0
    assert (a + b).input_dist_comms == 0.5


def test_shard_fields_and_str() -> None:
    shard = Shard(size=[10, 4], offset=[0, 4], storage=Storage(0, 160), rank=1)
    assert str(shard) == ("Shard size: (10, 4), offset: (0, 4), storage: "
                          "Storage(hbm=0, ddr=160, ssd=0), perf: None, rank: 1")
    assert hash(shard) == hash(Shard([10, 4], [0, 4], Storage(0, 160), None, 1))


def test_no_sharders_gives_an_empty_plan() -> None:
    planner = EmbeddingShardingPlanner(topology=Topology(2, "cpu"))
    assert planner.plan(ebc(100, 64, 4), sharders=[]) == ShardingPlan({})


def test_planner_error_type_values_are_torchrecs() -> None:
    assert PlannerErrorType.INSUFFICIENT_STORAGE.value == "insufficient_storage"
    assert PlannerErrorType.STRICT_CONSTRAINTS.value == "strict_constraints"
    assert PlannerError("x").error_type is PlannerErrorType.OTHER
    assert PlannerError("x", PlannerErrorType.PARTITION).error_type is PlannerErrorType.PARTITION


def test_never_fit_is_insufficient_storage() -> None:
    planner = EmbeddingShardingPlanner(topology=Topology(2, "cuda", hbm_cap=2 * MIB, ddr_cap=0))
    with pytest.raises(PlannerError) as info:
        planner.plan(ebc(10_000_000, 10_000, 2), [EmbeddingBagCollectionSharder()])
    assert info.value.error_type is PlannerErrorType.INSUFFICIENT_STORAGE


def test_fits_in_total_but_not_table_wise_is_strict_constraints_then_replans() -> None:
    # 4096 x 128 fp32 is 2 MiB of weights: more than one rank's 2 MiB HBM (less the reservation)
    # (with optimizer state) but it fits split over both ranks (batch 1: small buffers). Table-wise only: strict constraints; row-wise allowed:
    # a plan on ranks [0, 1] (TorchRec's test_fail_then_rerun).
    topology = Topology(2, "cuda", hbm_cap=2 * MIB, ddr_cap=0)
    model = ebc(4096, 128)
    tw = {"table_0": ParameterConstraints(sharding_types=["table_wise"], compute_kernels=["fused"])}
    with pytest.raises(PlannerError) as info:
        EmbeddingShardingPlanner(topology=topology, batch_size=1, constraints=tw,
                                 storage_reservation=0.0).plan(
            model, [EmbeddingBagCollectionSharder()])
    assert info.value.error_type is PlannerErrorType.STRICT_CONSTRAINTS
    rw = {"table_0": ParameterConstraints(sharding_types=["table_wise", "row_wise"],
                                          compute_kernels=["fused"])}
    plan = EmbeddingShardingPlanner(topology=topology, batch_size=1, constraints=rw,
                                    storage_reservation=0.0).plan(
        model, [EmbeddingBagCollectionSharder()])
    assert plan.plan[""]["table_0"].ranks == [0, 1]
    assert plan.plan[""]["table_0"].sharding_type is ShardingType.ROW_WISE


def test_bwd_compute_multiplier_scales_the_backward_lookup_traffic() -> None:
    # One rank, one table of 1000 x 8 fp32, 100 ids in 100 bags: forward reads 100 rows
    # (3200 bytes) and writes 100 pooled rows (3200 bytes); the backward moves
    # multiplier x both. From multiplier 0 to 2 the cost grows by 2 x 6400 B / 51 GB/s.
    config = EmbeddingBagConfig(name="t", embedding_dim=8, num_embeddings=1000, feature_names=["f"])
    table = TableSpec(path="", config=config, pooled=True, optimizer=EmbOptimType.EXACT_SGD,
                      constraints=ParameterConstraints(), ids_per_batch=100.0,
                      bags_per_batch=100.0, is_weighted=False)

    def cost(multiplier: float) -> float:
        topology = Topology(1, "cpu", bwd_compute_multiplier=multiplier)
        option = estimate_option(table, ShardingType.TABLE_WISE, EmbeddingComputeKernel.FUSED,
                                 Placement.ANY_RANKS, np.array([1000]), np.array([8]), topology)
        return float(option.cost[0])

    assert cost(2.0) - cost(0.0) == pytest.approx(2 * 6400 / 51e9 * 1e3, rel=1e-9)


def test_heuristical_storage_reservation_sets_the_budgets() -> None:
    # CPU, 2 ranks of 4 GiB each: 25% kept back -> 3 GiB, less TorchRec's input-KJT estimate
    # (2 features x batch 64 x 8-byte ids x 20 = 20,480 bytes); the EBC is the whole model, so
    # no dense tensors
    topology = Topology(2, "cpu", ddr_cap=4 * GIB)
    reservation = HeuristicalStorageReservation(percentage=0.25)
    planner = EmbeddingShardingPlanner(topology, 64, None, reservation)  # TorchRec's order
    planner.plan(ebc(100, 64, 2), [EmbeddingBagCollectionSharder()])
    assert planner.stats is not None
    assert (planner.stats.ddr_budget, planner.stats.hbm_budget) == (3 * GIB - 20_480, 0)
    assert reservation.last_reserved_topology == Topology(2, "cpu", ddr_cap=3 * GIB - 20_480)
    assert (reservation._dense_storage, reservation._kjt_storage) == (
        Storage(0, 0, 0), Storage(0, 20_480, 0))
    # a float is the same reservation (batch 512: 163,840 bytes of KJTs)
    floats = EmbeddingShardingPlanner(topology, storage_reservation=0.25)
    floats.plan(ebc(100, 64, 2), [EmbeddingBagCollectionSharder()])
    assert floats.stats is not None and floats.stats.ddr_budget == 3 * GIB - 163_840
    with pytest.raises(ValueError, match="percentage 1.5 must be in"):
        HeuristicalStorageReservation(1.5)


def test_heuristical_storage_reservation_counts_dense_tensors_on_the_compute_device() -> None:
    # a 10 x 10 Linear (110 fp32 parameters, 440 bytes) next to the EBC: TorchRec's 6x
    # multiplier -> 2,640 bytes of HBM; KJTs: 1 feature x batch 8 x 8 x 20 = 1,280 bytes
    model = torch.nn.Sequential(ebc(100, 16), torch.nn.Linear(10, 10, device="meta"))
    reservation = HeuristicalStorageReservation(percentage=0.5)
    reserved = reservation.reserve(Topology(2, "cuda", hbm_cap=GIB), 8, model,
                                   [EmbeddingBagCollectionSharder()])
    assert (reservation._dense_storage, reservation._kjt_storage) == (
        Storage(2_640, 0, 0), Storage(1_280, 0, 0))
    assert reserved.hbm_cap == GIB // 2 - 3_920
    assert reserved.devices[1].storage.hbm == GIB // 2 - 3_920
    fixed = HeuristicalStorageReservation(0.5, dense_tensor_estimate=100)
    fixed.reserve(Topology(2, "cuda", hbm_cap=GIB), 8, model, [EmbeddingBagCollectionSharder()])
    assert fixed._dense_storage == Storage(100, 0, 0)
    with pytest.raises(PlannerError) as info:  # nothing left: TorchRec's INSUFFICIENT_STORAGE
        HeuristicalStorageReservation(1.0).reserve(Topology(1, "cuda"), 8, model,
                                                   [EmbeddingBagCollectionSharder()])
    assert info.value.error_type is PlannerErrorType.INSUFFICIENT_STORAGE


def test_default_batch_size_is_torchrecs_and_timeout_is_checked() -> None:
    planner = EmbeddingShardingPlanner(Topology(1, "cpu"), timeout_seconds=30)
    planner.plan(ebc(100, 8), [EmbeddingBagCollectionSharder()])
    assert planner.stats is not None and "batch 512 per rank" in planner.stats.topology
    with pytest.raises(ValueError, match="timeout_seconds must be > 0"):
        EmbeddingShardingPlanner(Topology(1, "cpu"), timeout_seconds=0)


def test_units_are_torchrecs_bytes_per_rank_and_bytes_per_ms() -> None:
    t = Topology(2, "cuda", local_world_size=2)
    assert (t.hbm_cap, t.ddr_cap, t.ddr_per_rank) == (32 * GIB, 128 * GIB, 128 * GIB)
    assert (t.hbm_mem_bw, t.ddr_mem_bw) == (897e9 / 1000, 51e9 / 1000)
    assert (t.intra_host_bw, t.inter_host_bw) == (600e9 / 1000, 12.5e9 / 1000)


def test_cache_params_positional_in_torchrecs_order() -> None:
    from recsys_core.planner import CacheAlgorithm

    params = CacheParams(CacheAlgorithm.LFU, 0.5, 1.0, DataType.FP16, True)
    assert (params.algorithm, params.load_factor, params.reserved_memory, params.precision,
            params.prefetch_pipeline) == (CacheAlgorithm.LFU, 0.5, 1.0, DataType.FP16, True)
    assert hash(params) == hash(CacheParams(CacheAlgorithm.LFU, 0.5, 1.0, DataType.FP16, True))
