"""CPU topologies with a disk tier (``ssd_cap``): tables too large for memory are planned as
fused_uvm_caching, a cache in RAM over files on local disk, checked against hand-computed sizes.

The cached kernel's memory per shard of ``rows x cols`` at load factor ``lf`` (row-wise Adagrad:
4 bytes of state per row; fp32 weights):

    DDR   buffers + 8 * rows + ceil(lf * rows) * (cols * 4 + 4 + 24)
    disk  rows * (cols * 4 + 4)

where a table-wise shard's buffers, with 2 ranks of 512 samples and one id per bag, hold 1024
ids and 1024 lengths (8 bytes each) and 1024 pooled rows plus their gradients (cols * 4 bytes).
"""

from __future__ import annotations

import math
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist
from torch import nn

from recsys_core import EmbeddingBagCollection, EmbeddingBagConfig, EmbOptimType
from recsys_core.distributed import (
    EmbeddingBagCollectionSharder,
    EmbeddingComputeKernel,
    ShardingPlan,
    ShardingType,
)
from recsys_core.kernels import cached_tbe
from recsys_core.planner import (
    CacheParams,
    EmbeddingShardingPlanner,
    ParameterConstraints,
    PlannerError,
    Storage,
    Tier,
    Topology,
    detect_topology,
    smallest_over_ranks,
)
from recsys_core.planner.search.cost import estimate_option
from recsys_core.planner.search.enumerate import enumerate_options
from recsys_core.planner.search.types import Placement, TableSpec
from recsys_core.planner.topology import DEFAULT_SSD_MEM_BW
from recsys_core.testing import run_gloo

GIB = 1024**3
MIB = 1024**2
DIM = 64
ROW = DIM * 4 + 4  # fp32 weights + row-wise Adagrad's one float per row
SLOT = ROW + 24  # a cache slot: the row, and its bookkeeping
BUFFERS = 1024 * 8 + 1024 * 8 + 2 * 1024 * DIM * 4  # ids, lengths, outputs + their gradients
FUSED = EmbeddingComputeKernel.FUSED
CACHING = EmbeddingComputeKernel.FUSED_UVM_CACHING
ROWS = [8_000_000, 6_000_000, 100_000, 10_000]  # t0, t1 do not fit in 0.85 GiB; t2, t3 do


def sharder() -> EmbeddingBagCollectionSharder:
    return EmbeddingBagCollectionSharder(fused_params={
        "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1})


def ebc(rows: list[int]) -> EmbeddingBagCollection:
    return EmbeddingBagCollection([
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=r, feature_names=[f"f{i}"])
        for i, r in enumerate(rows)
    ], device="meta")


def table_wise(n: int, **extra: ParameterConstraints) -> dict[str, ParameterConstraints]:
    constraints = {f"t{i}": ParameterConstraints(sharding_types=["table_wise"]) for i in range(n)}
    return {**constraints, **extra}


def plan(
    rows: list[int], topology: Topology, constraints: dict | None = None,
    sharders: list | None = None,
) -> tuple[ShardingPlan, EmbeddingShardingPlanner]:
    planner = EmbeddingShardingPlanner(topology=topology, constraints=constraints)
    return planner.plan(ebc(rows), sharders or [sharder()]), planner


def hand_ddr(rows: int, kernel: EmbeddingComputeKernel, load_factor: float | None) -> int:
    """Host memory of a table-wise shard, by the formulas of the module docstring."""
    if kernel is FUSED:
        return rows * ROW + BUFFERS
    assert load_factor is not None
    return BUFFERS + 8 * rows + math.ceil(load_factor * rows) * SLOT


# ---- choosing the kernel -------------------------------------------------------------------------
def test_tables_larger_than_memory_are_cached_and_the_rest_fused() -> None:
    topology = Topology(world_size=2, compute_device="cpu", ddr_cap=GIB, ssd_cap=64 * GIB)
    sharding, planner = plan(ROWS, topology, table_wise(4))
    p = sharding.plan[""]
    assert [p[f"t{i}"].compute_kernel for i in range(4)] == [CACHING, CACHING, FUSED, FUSED]
    # less the 15% storage reservation and TorchRec's input-KJT estimate (4 features x batch
    # 512 x 8-byte ids x 20)
    budget = 0.85 * GIB - 4 * 512 * 8 * 20
    ddr, disk = [0, 0], [0, 0]
    for i, rows in enumerate(ROWS):
        ps = p[f"t{i}"]
        lf = ps.cache_params.load_factor if ps.compute_kernel is CACHING else None
        if lf is not None:
            assert ps.cache_params == CacheParams(load_factor=lf)
            assert 0.2 <= lf < 1.0 and lf * rows * ROW <= budget  # grown, yet within the budget
            assert cached_tbe.cache_slots(rows, lf) == math.ceil(lf * rows)  # as the kernel
            disk[ps.ranks[0]] += rows * ROW
        ddr[ps.ranks[0]] += hand_ddr(rows, ps.compute_kernel, lf)
    stats = planner.stats
    assert stats is not None
    for r in range(2):
        assert stats.ranks[r].ddr_bytes == pytest.approx(ddr[r], rel=1e-12)
        assert stats.ranks[r].ssd_bytes == pytest.approx(disk[r], rel=1e-12)
        assert stats.ranks[r].hbm_bytes == 0
        # the caches grew into the free memory: a load factor of 6 decimals and a spare slot
        # leave at most rows / 1e6 + 2 slots of it free
        assert budget - SLOT * (max(ROWS) / 1e6 + 2) <= ddr[r] <= budget <= topology.ddr_cap


def test_enough_memory_keeps_every_table_fused() -> None:
    topology = Topology(world_size=2, compute_device="cpu", ddr_cap=16 * GIB, ssd_cap=64 * GIB)
    sharding, planner = plan(ROWS, topology)
    assert {ps.compute_kernel for ps in sharding.plan[""].values()} == {FUSED}
    assert all(ps.cache_params is None for ps in sharding.plan[""].values())
    assert planner.stats is not None and all(r.ssd_bytes == 0 for r in planner.stats.ranks)


def test_without_disk_the_plan_is_as_before() -> None:
    small = [1_000_000, 100_000]
    with_disk = plan(small, Topology(world_size=2, compute_device="cpu", ddr_cap=GIB, ssd_cap=GIB))
    without = plan(small, Topology(world_size=2, compute_device="cpu", ddr_cap=GIB))
    assert with_disk[0].to_json() == without[0].to_json()


# ---- the estimate of one cached shard ------------------------------------------------------------
def spec(rows: int = 1000, constraints: ParameterConstraints | None = None) -> TableSpec:
    config = EmbeddingBagConfig(name="t", embedding_dim=DIM, num_embeddings=rows, feature_names=["f"])
    return TableSpec(path="", config=config, pooled=True,
                     optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
                     constraints=constraints or ParameterConstraints(), ids_per_batch=10.0,
                     bags_per_batch=4.0, is_weighted=False)


def test_cached_shard_storage_and_cost_by_hand() -> None:
    # 2 ranks: the shard serves 20 ids and 8 bags per step; the disk moves 2e5 bytes per ms
    topology = Topology(world_size=2, compute_device="cpu", ssd_cap=GIB, ssd_mem_bw=2e5)
    args = (ShardingType.TABLE_WISE, Placement.ANY_RANKS, np.array([1000]), np.array([DIM]),
            topology)
    cached = estimate_option(spec(), args[0], CACHING, *args[1:])
    fused = estimate_option(spec(), args[0], FUSED, *args[1:])
    buffers = 20 * 8 + 8 * 8 + 2 * (8 * DIM * 4)
    assert fused.ddr.tolist() == [1000 * ROW + buffers]
    # fast tier without slots: buffers + 8 bytes per row; slow tier: every row with its state
    assert (cached.hbm.tolist(), cached.ddr.tolist(), cached.ssd.tolist()) == (
        [0], [buffers + 8 * 1000], [1000 * ROW])
    assert (cached.cache_tier, cached.backing_tier) == (Tier.DDR, Tier.SSD)
    assert cached.slot_bytes.tolist() == [DIM * 4 + 4 + 24]
    assert cached.memory(0.25)[:, 0].tolist() == [0, buffers + 8000 + 250 * SLOT, 1000 * ROW]
    assert cached.memory(0.2501)[Tier.DDR, 0] == buffers + 8000 + 251 * SLOT  # ceil, as the kernel
    assert cached.memory(1e-9)[Tier.DDR, 0] == buffers + 8000 + SLOT  # at least one slot
    # hits cost what the fused table costs; each distinct row that misses is read from disk
    # and written back: 2 x rows x 260 bytes at 2e5 bytes/ms
    distinct = 1000 * (1 - math.exp(-20 / 1000))
    assert cached.miss_rows.tolist() == pytest.approx([distinct])
    assert cached.miss_cost.tolist() == pytest.approx([2 * distinct * ROW / 2e5])
    assert cached.total_cost(1.0) == pytest.approx(fused.total_cost())
    assert cached.total_cost(0.25) == pytest.approx(fused.total_cost() + 0.75 * 2 * distinct * ROW / 2e5)


def test_a_fixed_load_factor_is_used_exactly() -> None:
    constraints = ParameterConstraints(compute_kernels=["fused_uvm_caching"],
                                       cache_params=CacheParams(load_factor=0.3))
    topology = Topology(world_size=2, compute_device="cpu", ddr_cap=GIB, ssd_cap=GIB)
    sharding, planner = plan([10_000, 1000], topology, table_wise(2, t0=constraints))
    t0 = sharding.plan[""]["t0"]
    assert (t0.compute_kernel, t0.cache_params) == (CACHING, CacheParams(load_factor=0.3))
    assert planner.stats is not None
    assert planner.stats.cached[0].cache_bytes == 3000 * SLOT


def test_topology_takes_disk_on_cpu_only() -> None:
    cpu = Topology(2, "cpu", ddr_cap=GIB, ssd_cap=10 * GIB)
    assert (cpu.ssd_cap, cpu.ssd_mem_bw, DEFAULT_SSD_MEM_BW) == (10 * GIB, 1.6e5, 1.6e5)  # 0.16 GB/s
    assert cpu.devices[1].storage == Storage(0, GIB, 10 * GIB)
    assert Topology(2, "cpu").ssd_cap == 0  # None: no disk tier
    with pytest.raises(ValueError, match=r"ssd_cap must be a number >= 0"):
        Topology(2, "cpu", ssd_cap=-1)
    with pytest.raises(ValueError, match=r"ssd_mem_bw must be > 0"):
        Topology(2, "cpu", ssd_mem_bw=0.0)
    assert Topology(2, "cuda", ssd_cap=GIB).ssd_per_rank == 0  # reported, not planned with


# ---- when it does not fit ------------------------------------------------------------------------
def test_too_little_disk_in_all_names_the_disk_and_the_fix() -> None:
    # t0 needs 1.94 GiB of disk (more than 2 x 0.85 GiB of memory can hold); 2 x 0.5 GiB of disk
    topology = Topology(world_size=2, compute_device="cpu", ddr_cap=GIB, ssd_cap=GIB // 2)
    with pytest.raises(PlannerError) as info:
        plan([8_000_000, 1000], topology)
    message = str(info.value)
    assert "need at least 1.94 GiB of disk" in message and "1.00 GiB usable" in message
    assert "'t0'" in message and "ssd_cap" in message and "offload_dir" in message
    assert "more ranks" in message
    assert info.value.shortfall is not None and info.value.shortfall.memory == "disk"


def test_too_little_disk_on_any_one_rank_names_the_disk() -> None:
    # 3 GiB of disk in all, but t0 may only be table-wise: 1.94 GiB on one rank of 1.5 GiB
    topology = Topology(world_size=2, compute_device="cpu", ddr_cap=GIB, ssd_cap=3 * GIB // 2)
    with pytest.raises(PlannerError) as info:
        plan([8_000_000, 1000], topology, table_wise(2))
    message = str(info.value)
    assert re.search(r"table 't0' .*needs \d+\.\d\d MiB of host memory .* and 1\.94 GiB of disk "
                     r"on a rank.*1\.50 GiB of disk.*Short: disk\.", message), message
    assert "larger Topology ssd_cap" in message and "offload_dir" in message
    assert info.value.shortfall is not None and info.value.shortfall.memory == "disk"
    assert info.value.shortfall.usable_bytes == 2 * (3 * GIB // 2)  # the disk, not disk + memory


def test_a_table_short_of_memory_on_every_rank_reports_the_memory_alone() -> None:
    # t0 (16M rows) needs 128 MB of row bookkeeping in memory on whichever rank takes it;
    # each rank has 0.85 x 128 MiB: the shortfall is of memory, with the memory's figures
    topology = Topology(world_size=2, compute_device="cpu", ddr_cap=128 * MIB, ssd_cap=64 * GIB)
    with pytest.raises(PlannerError) as info:
        plan([16_000_000, 1000], topology, table_wise(2))
    shortfall = info.value.shortfall
    assert shortfall is not None and shortfall.memory == "host memory", str(info.value)
    kjt = 2 * 512 * 8 * 20  # TorchRec's input-KJT estimate: 2 features at batch 512
    assert shortfall.usable_bytes == pytest.approx(2 * (0.85 * 128 * MIB - kjt))


def test_too_little_memory_for_the_caches_names_the_memory() -> None:
    # 16M rows: 8 bytes of bookkeeping each (128 MB) and a 1% cache do not fit in 2 x 54 MiB
    topology = Topology(world_size=2, compute_device="cpu", ddr_cap=64 * MIB, ssd_cap=64 * GIB)
    with pytest.raises(PlannerError) as info:
        plan([16_000_000], topology)
    message = str(info.value)
    assert "of host memory" in message and "bookkeeping per row" in message
    assert "more ranks" in message
    assert info.value.shortfall is not None and info.value.shortfall.memory == "host memory"


def test_without_disk_the_memory_error_hints_at_ssd_cap() -> None:
    topology = Topology(world_size=2, compute_device="cpu", ddr_cap=GIB)
    with pytest.raises(PlannerError) as info:
        plan([8_000_000, 4_000_000], topology)
    message = str(info.value)
    assert "does not fit" in message and "1.70 GiB usable" in message  # today's error
    assert "give the Topology an ssd_cap" in message and "detect_topology(offload_dir=" in message


# ---- constraints ---------------------------------------------------------------------------------
def test_constraints_ask_for_the_cached_kernel() -> None:
    # a 256 KB table would also be a data-parallel candidate: replicas are never cached
    asked = ParameterConstraints(compute_kernels=["fused_uvm_caching"])
    with_disk = Topology(world_size=2, compute_device="cpu", ddr_cap=GIB, ssd_cap=GIB)
    sharding, _ = plan([1000, 1000], with_disk, {"t1": asked})
    t1 = sharding.plan[""]["t1"]
    assert t1.compute_kernel is CACHING and t1.sharding_type is not ShardingType.DATA_PARALLEL
    assert sharding.plan[""]["t0"].compute_kernel is FUSED

    without_disk = Topology(world_size=2, compute_device="cpu", ddr_cap=GIB)
    with pytest.raises(PlannerError, match=r"'t1'.*fused_uvm_caching on a CPU topology without "
                                           r"disk.*ssd_cap.*offload_dir"):
        plan([1000, 1000], without_disk, {"t1": asked})
    uvm = ParameterConstraints(compute_kernels=["fused_uvm"])
    with pytest.raises(PlannerError, match=r"'t1'.*fused_uvm on a CPU topology.*every lookup "
                                           r"would read the disk.*fused_uvm_caching"):
        plan([1000, 1000], with_disk, {"t1": uvm})


def test_enforce_hbm_and_data_parallel_keep_fused() -> None:
    topology = Topology(world_size=2, compute_device="cpu", ssd_cap=GIB)
    options = enumerate_options(spec(), sharder(), topology)
    assert {o.compute_kernel for o in options} == {FUSED, CACHING}
    assert {o.compute_kernel for o in options if o.sharding_type is ShardingType.DATA_PARALLEL} == {FUSED}
    pinned = enumerate_options(spec(constraints=ParameterConstraints(enforce_hbm=True)), sharder(),
                               topology)
    assert {o.compute_kernel for o in pinned} == {FUSED}


class _FusedOnly:
    """A sharder that runs only FUSED (as a sharder without the cached kernel would)."""

    module_type: type[nn.Module] = EmbeddingBagCollection

    def sharding_types(self, compute_device_type: str) -> list[str]:
        return ["table_wise", "row_wise"]

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        return ["fused"]


def test_the_sharder_must_run_the_cached_kernel() -> None:
    topology = Topology(world_size=2, compute_device="cpu", ddr_cap=GIB, ssd_cap=64 * GIB)
    sharding, _ = plan([100_000], topology, sharders=[_FusedOnly()])
    assert sharding.plan[""]["t0"].compute_kernel is FUSED
    asked = {"t0": ParameterConstraints(compute_kernels=["fused_uvm_caching"])}
    with pytest.raises(PlannerError, match=r"'t0'.*_FusedOnly runs only.*\['fused'\]"):
        plan([100_000], topology, asked, sharders=[_FusedOnly()])


# ---- the machine's disk --------------------------------------------------------------------------
def test_detect_topology_reads_the_offload_directory(tmp_path: Path) -> None:
    before = shutil.disk_usage(tmp_path).free
    topology = detect_topology(4, "cpu", local_world_size=2, memory_per_rank=GIB,
                               offload_dir=tmp_path)
    after = shutil.disk_usage(tmp_path).free
    assert min(before, after) // 2 - 8 * MIB <= topology.ssd_cap <= max(before, after) // 2 + 8 * MIB
    assert topology.ddr_cap == GIB
    assert str(tmp_path) in topology.memory_source and "shutil.disk_usage" in topology.memory_source
    assert detect_topology(4, "cpu", local_world_size=2, memory_per_rank=GIB).ssd_cap == 0
    with pytest.raises(ValueError, match=r"missing.*not an existing directory"):
        detect_topology(1, "cpu", memory_per_rank=GIB, offload_dir=tmp_path / "missing")
    with pytest.raises(ValueError, match=r"offload_dir .* on CUDA"):
        detect_topology(1, "cuda", memory_per_rank=GIB, offload_dir=tmp_path)


def _smallest_disk(rank: int, world: int) -> tuple[int, int, str]:
    mine = Topology(world, "cpu", ddr_cap=4 * GIB, ssd_cap=(10 - rank) * GIB,
                    memory_source=f"rank {rank}'s disk")
    agreed = smallest_over_ranks(mine, dist.group.WORLD)
    return agreed.ddr_cap, agreed.ssd_cap, agreed.memory_source or ""


def test_every_rank_plans_for_the_smallest_disk() -> None:
    results = run_gloo(2, _smallest_disk)
    assert results[0] == results[1]
    assert results[0][:2] == (4 * GIB, 9 * GIB) and "rank 1" in results[0][2]


# ---- the printed summary -------------------------------------------------------------------------
def test_summary_prints_memory_disk_and_misses_per_rank() -> None:
    topology = Topology(world_size=2, compute_device="cpu", ddr_cap=GIB, ssd_cap=64 * GIB)
    sharding, planner = plan(ROWS, topology, table_wise(4))
    text = str(planner)
    assert "usable per rank: DDR 0.85 GiB, disk 64.00 GiB" in text
    assert "rank | DDR (GiB) | disk (GiB) | est. cost (ms) | share of total | DDR used" in text
    p = sharding.plan[""]
    ddr, disk = [0, 0], [0, 0]
    for i, rows in enumerate(ROWS):
        ps = p[f"t{i}"]
        lf = ps.cache_params.load_factor if ps.compute_kernel is CACHING else None
        ddr[ps.ranks[0]] += hand_ddr(rows, ps.compute_kernel, lf)
        disk[ps.ranks[0]] += rows * ROW if lf is not None else 0
    for r in range(2):
        line = next(row for row in text.splitlines() if row.startswith(f"{r}    | "))
        cells = [c.strip() for c in line.split("|")]
        assert cells[1:3] == [f"{ddr[r] / GIB:.2f}", f"{disk[r] / GIB:.2f}"]
        assert cells[5:7] == [f"{100 * ddr[r] / (0.85 * GIB):.0f}% of 0.85 GiB",
                              f"{100 * disk[r] / (64 * GIB):.0f}% of 64.00 GiB"]
    assert "the cache in DDR, every row in the disk tier" in text
    # misses per step: 1024 ids over a table's rows touch rows * (1 - exp(-1024 / rows))
    # distinct rows; a fraction 1 - lf of them misses, and each reads its 260 bytes from disk
    for name in ("t0", "t1"):
        rows, lf = ROWS[int(name[1])], p[name].cache_params.load_factor
        misses = (1 - lf) * rows * -math.expm1(-1024 / rows)
        line = next(row for row in text.splitlines() if row.startswith(f"{name}    | table_wise"))
        cells = [c.strip() for c in line.split("|")]
        assert cells[2:] == [
            f"[{p[name].ranks[0]}]", f"{lf:.6g}", f"{math.ceil(lf * rows) * SLOT / GIB:.2f}",
            f"{rows * ROW / GIB:.2f}", f"{misses:.0f}", f"{misses * ROW / MIB:.2f}",
        ]


def test_memory_is_kept_for_the_tables_placed_last() -> None:
    # t0 (40k rows, 10.9 MB fused) would fit alone, but ten small tables (~0.8 MB each with
    # their buffers) need the memory too: 19 MB fused in all against 15 MB usable. Placing t0
    # fused first would leave the small ones short; the plan caches t0 and keeps them fused.
    rows = [40_000] + [1000] * 10
    topology = Topology(world_size=1, compute_device="cpu", ddr_cap=15e6 / 0.85, ssd_cap=GIB)
    sharding, planner = plan(rows, topology, table_wise(len(rows)))
    kernels = {name: ps.compute_kernel for name, ps in sharding.plan[""].items()}
    assert kernels == {"t0": CACHING, **{f"t{i}": FUSED for i in range(1, 11)}}


def test_a_cache_holds_two_batches_of_ids_and_a_quarter() -> None:
    # The kernel locks the rows of the batch in flight while the next one is brought in: with
    # 1024 one-hot ids per batch, a 40k-row table's cache gets at least 2.5 x 1024 slots
    # (load factor 0.064), not the 1% floor, even where memory is short.
    rows = [40_000] + [1000] * 10
    topology = Topology(world_size=1, compute_device="cpu", ddr_cap=15e6 / 0.85, ssd_cap=GIB)
    sharding, _ = plan(rows, topology, table_wise(len(rows)))
    load_factor = sharding.plan[""]["t0"].cache_params.load_factor
    assert load_factor >= 2.5 * 1024 / 40_000
    assert math.ceil(load_factor * 40_000) >= 2560


def test_caches_shrink_below_the_default_to_leave_memory_for_later_tables() -> None:
    # Three 4M-row tables must all be cached. At TorchRec's default load factor 0.2 a cache
    # takes 8 * 4M + 0.8M * 284 bytes, about 259 MB, and the least any of them can take (load
    # factor 0.01) about 43 MB: 320 MB usable hold one cache at 0.2 but then not the other two
    # at their least. The first caches are planned smaller so that every table gets one, and
    # what is left after the last table goes back to them.
    rows = [4_000_000] * 3
    usable = 320e6
    kjt = 3 * 512 * 8 * 20  # TorchRec's input-KJT estimate, as above
    topology = Topology(world_size=1, compute_device="cpu", ddr_cap=(usable + kjt) / 0.85,
                        ssd_cap=64 * GIB)
    sharding, planner = plan(rows, topology, table_wise(3))
    p = sharding.plan[""]
    assert [p[f"t{i}"].compute_kernel for i in range(3)] == [CACHING] * 3
    factors = [p[f"t{i}"].cache_params.load_factor for i in range(3)]
    assert all(0.01 <= lf < 0.2 for lf in factors), factors
    assert min(factors) >= 2.5 * 512 / 4_000_000
    stats = planner.stats
    assert stats is not None
    assert stats.ranks[0].ddr_bytes <= usable
    # the leftover went back to the caches: less than a few slots of each table stay free
    assert stats.ranks[0].ddr_bytes >= usable - 3 * SLOT * (4_000_000 / 1e6 + 2)
    assert stats.ranks[0].ddr_bytes == pytest.approx(
        sum(hand_ddr_one_rank(4_000_000, lf) for lf in factors), rel=1e-9)


def hand_ddr_one_rank(rows: int, load_factor: float) -> float:
    """A cached table-wise shard's host memory on one rank of 512 samples (one id per bag):
    512 ids and lengths (8 bytes each), 512 pooled rows and their gradients, the row index
    (8 bytes a row) and the slots."""
    buffers = 512 * 8 + 512 * 8 + 2 * 512 * DIM * 4
    return buffers + 8 * rows + math.ceil(load_factor * rows) * SLOT
