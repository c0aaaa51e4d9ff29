"""TorchRec's planner components added in round 2 (TopologyFactory, the TorchRec enumerator,
TorchRec's views of this library's own search, static_logger), against hand-derived values."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from recsys_core import EmbeddingBagCollection, EmbeddingBagConfig
from recsys_core.distributed import EmbeddingBagCollectionSharder
from recsys_core.distributed.logger import static_logger
from recsys_core.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from recsys_core.planner.comms import CustomTopologyData
from recsys_core.planner.constants import CROSS_NODE_BANDWIDTH, HBM_MEM_BW, INTRA_NODE_BANDWIDTH
from recsys_core.planner.enumerators import EmbeddingEnumerator, get_partition_by_type
from recsys_core.planner.stats import EmbeddingStats
from recsys_core.planner.types import (
    HardwareConfig,
    KernelConfig,
    TopologyFactory,
    TrainerConfig,
)

GIB = 1024**3


def ebc(rows: tuple[int, ...] = (100, 100), dim: int = 256) -> EmbeddingBagCollection:
    return EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=dim, num_embeddings=r,
                           feature_names=[f"f{i}"]) for i, r in enumerate(rows)], device="meta")


class OnlyTables(EmbeddingBagCollectionSharder):
    """Shards the tables it names (TorchRec's shardable_params idea)."""

    def __init__(self, names: list[str]) -> None:
        super().__init__()
        self._names = names

    def shardable_parameters(self, module: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
        return {k: v for k, v in super().shardable_parameters(module).items() if k in self._names}


# ---- TopologyFactory ---------------------------------------------------------------------------
def test_factory_precedence_trainer_over_hardware_over_constants() -> None:
    t = TopologyFactory.create_topology(
        TrainerConfig(world_size=4, local_world_size=2, hbm_cap_bytes=40 * GIB),
        HardwareConfig(hbm_cap_bytes=80 * GIB, ddr_cap_bytes=64 * GIB, hbm_mem_bw=1.0),
        KernelConfig(compute_device="cuda", bwd_compute_multiplier=3.0),
    )
    # trainer's HBM, hardware's DDR, TorchRec's bandwidths (hardware bandwidths need the flag)
    assert (t.devices[3].storage.hbm, t.devices[3].storage.ddr) == (40 * GIB, 64 * GIB)
    assert (t.hbm_mem_bw, t.intra_host_bw, t.inter_host_bw) == (
        HBM_MEM_BW, INTRA_NODE_BANDWIDTH, CROSS_NODE_BANDWIDTH)
    assert (t.world_size, t.local_world_size, t.bwd_compute_multiplier) == (4, 2, 3.0)
    assert t._created_by_factory
    dry = TopologyFactory.create_topology(
        TrainerConfig(world_size=2, hbm_cap_bytes=40 * GIB, is_dry_run=True,
                      dry_run_hbm_bytes=8 * GIB))
    assert dry.devices[0].storage.hbm == 8 * GIB
    used = TopologyFactory.create_topology(
        TrainerConfig(world_size=2), HardwareConfig(hbm_mem_bw=7.0, intra_host_bw=9.0),
        KernelConfig(use_hardware_based_bandwidth=True))
    assert (used.hbm_mem_bw, used.intra_host_bw, used.inter_host_bw) == (
        7.0, 9.0, CROSS_NODE_BANDWIDTH)
    custom = CustomTopologyData({"hbm_cap": [GIB, 2 * GIB]}, world_size=2)
    per_rank = TopologyFactory.create_topology(
        TrainerConfig(world_size=2, additional_params={"custom_topology_data": custom}))
    assert [d.storage.hbm for d in per_rank.devices] == [GIB, 2 * GIB]


def test_factory_checks_and_warnings() -> None:
    with pytest.raises(ValueError, match="world_size must be provided"):
        TopologyFactory.create_topology(TrainerConfig())
    with pytest.raises(ValueError, match="pod_size \\(4\\) cannot be greater than world_size"):
        TrainerConfig(world_size=2, pod_size=4).validate()
    with pytest.raises(ValueError, match="compute_device must be one of"):
        KernelConfig(compute_device="tpu").validate()
    issues = HardwareConfig(hbm_cap_bytes=0, ssd_cap_bytes=0, intra_host_bw=1.0,
                            inter_host_bw=2.0).get_validation_issues("cuda")
    assert len(issues) == 2 and "hbm_cap_bytes=0" in issues[0] and "intra_host_bw" in issues[1]
    assert HardwareConfig(hbm_cap_bytes=0).get_validation_issues("cpu") == []  # no HBM there
    # 80 vs 40 GiB differs by 100% (> 5%): the trainer's value wins, with a warning
    with TestLogs.capture() as records:  # 1.3% apart: below the 5% threshold, nothing logged
        TopologyFactory.create_topology(TrainerConfig(world_size=2, hbm_cap_bytes=80 * GIB),
                                        HardwareConfig(hbm_cap_bytes=79 * GIB))
    assert records == []
    with TestLogs.capture() as records:
        TopologyFactory.create_topology(TrainerConfig(world_size=2, hbm_cap_bytes=80 * GIB),
                                        HardwareConfig(hbm_cap_bytes=40 * GIB))
    assert any("TrainerConfig hbm_cap (80.0 GiB)" in r and "by 100%" in r for r in records)


class TestLogs(logging.Handler):
    """Collects what static_logger emits (it does not propagate to the root logger)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record.getMessage())

    @classmethod
    def capture(cls) -> _Capture:
        return _Capture(cls())


class _Capture:
    def __init__(self, handler: TestLogs) -> None:
        self.handler = handler

    def __enter__(self) -> list[str]:
        static_logger.addHandler(self.handler)
        return self.handler.records

    def __exit__(self, *exc: object) -> None:
        static_logger.removeHandler(self.handler)


def test_static_logger_is_quiet_unless_a_handler_is_attached() -> None:
    assert static_logger.name == "SingleRankStaticLogger-NullHandler"
    assert static_logger.propagate is False and static_logger.level == logging.DEBUG


# ---- the TorchRec enumerator ---------------------------------------------------------------------
def test_enumerator_geometry_and_filters_by_hand() -> None:
    topology = Topology(4, "cuda", local_world_size=2)
    constraints = {"t1": ParameterConstraints(sharding_types=["column_wise", "row_wise"],
                                              pooling_factors=[2.0, 3.0])}
    options = EmbeddingEnumerator(topology, 8, constraints).enumerate(
        ebc(), [EmbeddingBagCollectionSharder()])
    # the stack pops the last child first; without constraints t0 gets every type but grid
    t0 = {(o.sharding_type, o.compute_kernel) for o in options if o.name == "t0"}
    sharder = EmbeddingBagCollectionSharder()
    assert t0 == {(t, k) for t in sharder.sharding_types("cuda") if t != "grid_shard"
                  for k in sharder.compute_kernels(t, "cuda") if k != "dense"}
    t1 = [o for o in options if o.name == "t1"]
    assert {o.sharding_type for o in t1} == {"column_wise", "row_wise"}
    cw = next(o for o in t1 if o.sharding_type == "column_wise")
    # 256 columns in blocks of MIN_CW_DIM = 128, any device; 100 rows over 4 ranks: 25 each
    assert [(s.size, s.offset) for s in cw.shards] == [([100, 128], [0, 0]), ([100, 128], [0, 128])]
    assert cw.partition_by == "device" and cw.input_lengths == [2.0, 3.0]
    rw = next(o for o in t1 if o.sharding_type == "row_wise")
    assert [s.size for s in rw.shards] == [[25, 256]] * 4 and rw.partition_by == "uniform"
    twrw = next(o for o in options if o.name == "t0" and o.sharding_type == "table_row_wise")
    assert [s.size for s in twrw.shards] == [[50, 256]] * 2  # 2 ranks per host
    assert all(s.storage is not None and s.perf is not None for o in options for s in o.shards)
    assert get_partition_by_type("table_column_wise") == "host"
    with pytest.raises(ValueError, match="Unrecognized or unsupported sharding type"):
        get_partition_by_type("diagonal")


def test_enumerator_names_a_table_left_without_options() -> None:
    enumerator = EmbeddingEnumerator(
        Topology(2, "cuda"), 8, {"t0": ParameterConstraints(compute_kernels=["fused_uvm"])})
    assert enumerator._filter_compute_kernels("t0", ["fused", "dense"], "table_wise") == []
    assert enumerator._filter_compute_kernels("t1", ["dense", "fused"], "data_parallel") == [
        "fused"]  # dense dropped where fused is offered
    with pytest.raises(RuntimeError, match="No available sharding type and compute kernel.*t0"):
        EmbeddingEnumerator(Topology(2, "cuda"), 8, {
            "t0": ParameterConstraints(sharding_types=["grid_shard"])}).enumerate(
            ebc(), [EmbeddingBagCollectionSharder()])


# ---- TorchRec's views of this library's own search ----------------------------------------------
def test_own_search_exposes_torchrecs_enumerator_best_plan_and_stats() -> None:
    planner = EmbeddingShardingPlanner(Topology(2, "cuda"), batch_size=8)
    plan = planner.plan(ebc(), [EmbeddingBagCollectionSharder()])
    assert planner._own_views.enumerator is None and planner._own_views.best_plan is None  # nothing built until read
    best = planner._best_plan
    assert best is not None and sorted(o.name for o in best) == ["t0", "t1"]
    for so in best:
        ps = plan.plan[""][so.name]
        assert (so.sharding_type, so.compute_kernel) == (ps.sharding_type.value,
                                                         ps.compute_kernel.value)
        assert [s.rank for s in so.shards] == ps.ranks
    space = planner._enumerator.last_stored_search_space  # type: ignore[union-attr]
    assert {so.storage_hash() for so in best} <= {so.storage_hash() for so in space}
    (stats,) = planner._stats
    assert isinstance(stats, EmbeddingStats)
    table = stats._stats_table
    assert table[0] == "#" * len(table[0])
    assert any("Hardcoded: 0, Auto-selected: 2" in row for row in table)
    assert planner.stats is not None  # this library's per-rank summary is still there


def test_own_search_plans_only_the_tables_a_sharder_lists() -> None:
    plan = EmbeddingShardingPlanner(Topology(2, "cuda")).plan(ebc(), [OnlyTables(["t1"])])
    assert list(plan.plan[""]) == ["t1"]
    assert EmbeddingShardingPlanner(Topology(2, "cuda")).plan(ebc(), [OnlyTables([])]).plan == {}


# ---- TorchRec's perf formulas -------------------------------------------------------------------
def test_torchrec_perf_of_row_wise_data_parallel_and_table_row_wise_by_hand() -> None:
    # 4 CUDA ranks on 2 hosts, a 100 x 128 fp32 table, batch 8, one id per sample; the
    # topology gives no bandwidths, so TorchRec's constants apply
    hbm, intra, inter = 897 * GIB / 1000, 600 * GIB / 1000, 12.5 * GIB / 1000
    options = EmbeddingEnumerator(Topology(4, "cuda", local_world_size=2), 8).enumerate(
        ebc((100,), 128), [EmbeddingBagCollectionSharder()])

    def perf(kind: str) -> Any:
        return next(o for o in options if o.sharding_type == kind and o.compute_kernel == "fused"
                    ).shards[0].perf

    rw = perf("row_wise")  # each rank gets 1/4 of the 32 ids; pooled rows reduce-scattered
    assert rw.fwd_compute == pytest.approx((64 + 8 / 4 * 4 * 128 * 4 + 16384) / hbm)
    assert rw.bwd_compute == pytest.approx(2 * rw.fwd_compute)
    assert rw.fwd_comms == pytest.approx(16384 / inter)  # 4 ranks span 2 hosts
    assert rw.bwd_comms == pytest.approx(16384 / inter + 16384 * 2.455 / hbm)
    assert rw.input_dist_comms == pytest.approx(256 / inter)
    # data-parallel: own batch only; the gradient all-reduced, the update elementwise (dense
    # reads at half the HBM bandwidth, TorchRec's kernel table)
    dp_option = next(o for o in options if o.sharding_type == "data_parallel")
    dp, bw = dp_option.shards[0].perf, hbm if dp_option.compute_kernel == "fused" else hbm / 2
    table = 100 * 128 * 4
    assert dp.fwd_compute == pytest.approx((64 + 4096 + 4096) / bw) and dp.fwd_comms == 0
    assert dp.bwd_comms == pytest.approx(table * 3 / 2 / (2 * inter) + table * 9.22 / bw)
    twrw = perf("table_row_wise")  # reduce-scatter in the host, all-to-all between the 2 hosts
    assert twrw.fwd_compute == pytest.approx((128 + 8192 + 16384) / hbm)
    assert twrw.fwd_comms == pytest.approx(16384 / intra + 8 * 2 * 128 * 4 / inter)


def test_data_parallel_all_reduce_counts_at_least_one_host() -> None:
    # local_world_size 8 > world_size 2 (TorchRec accepts it): TorchRec's formula would give
    # min(2 / 8, 2) = 0.25 hosts and a negative time; one host: table / (8 NICs x inter)
    inter, hbm = 12.5 * GIB / 1000, 897 * GIB / 1000
    options = EmbeddingEnumerator(Topology(2, "cuda", local_world_size=8), 8).enumerate(
        ebc((100,), 128), [EmbeddingBagCollectionSharder()])
    dp = next(o for o in options if o.sharding_type == "data_parallel")
    bw = hbm if dp.compute_kernel == "fused" else hbm / 2
    table = 100 * 128 * 4
    assert dp.shards[0].perf.bwd_comms == pytest.approx(table / (8 * inter) + table * 9.22 / bw)
