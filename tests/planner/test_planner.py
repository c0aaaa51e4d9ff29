"""EmbeddingShardingPlanner.plan(): memory, balance, constraints, kernels, errors, determinism.

Every plan is checked with validate_module_sharding_plan, and every rank's estimated memory
against its usable budget (cap minus the storage reservation).
"""

from __future__ import annotations

import random

import pytest
from torch import nn

from recsys_core import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
)
from recsys_core.distributed import (
    EmbeddingBagCollectionSharder,
    EmbeddingCollectionSharder,
    EmbeddingComputeKernel,
    ShardingEnv,
    ShardingPlan,
    ShardingType,
    validate_module_sharding_plan,
)
from recsys_core.planner import (
    CacheParams,
    EmbeddingShardingPlanner,
    ParameterConstraints,
    PlannerError,
    Topology,
    plan_for_env,
)

GIB = 1024**3
MIB = 1024**2
UVM_KERNELS = {EmbeddingComputeKernel.FUSED_UVM, EmbeddingComputeKernel.FUSED_UVM_CACHING}


class UvmSharder:
    """The EBC sharder, advertising the CUDA UVM kernels (today's sharder runs FUSED only)."""

    def __init__(self) -> None:
        self._inner = EmbeddingBagCollectionSharder()

    @property
    def module_type(self) -> type[nn.Module]:
        return self._inner.module_type

    def sharding_types(self, compute_device_type: str) -> list[str]:
        return self._inner.sharding_types(compute_device_type)

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        if compute_device_type == "cuda":
            return [k.value for k in (EmbeddingComputeKernel.FUSED, *sorted(UVM_KERNELS, key=str))]
        return [EmbeddingComputeKernel.FUSED.value]


def ebc(rows: list[int], dim: int | list[int] = 64) -> EmbeddingBagCollection:
    dims = dim if isinstance(dim, list) else [dim] * len(rows)
    return EmbeddingBagCollection([
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=d, num_embeddings=r, feature_names=[f"f{i}"])
        for i, (r, d) in enumerate(zip(rows, dims, strict=True))
    ], device="meta")


def plan_checked(
    module: nn.Module, topology: Topology, sharders: list | None = None, **kwargs: object
) -> tuple[ShardingPlan, EmbeddingShardingPlanner]:
    planner = EmbeddingShardingPlanner(topology=topology, **kwargs)  # type: ignore[arg-type]
    plan = planner.plan(module, sharders or [EmbeddingBagCollectionSharder()])
    for path, module_plan in plan.plan.items():
        sub = module.get_submodule(path) if path else module
        validate_module_sharding_plan(sub, module_plan, topology.world_size, topology.local_size)
    stats = planner.stats
    assert stats is not None
    for r in stats.ranks:
        assert r.hbm_bytes <= stats.hbm_budget + 1 and r.ddr_bytes <= stats.ddr_budget + 1, r
    return plan, planner


def test_tutorial_plan_prints_like_torchrec(tutorial_tables: list[EmbeddingBagConfig],
                                           tutorial_plan_lines: dict[str, list[str]]) -> None:
    module = EmbeddingBagCollection(tutorial_tables, device="meta")
    plan, planner = plan_checked(module, Topology(world_size=1, compute_device="cuda"))
    # TorchRec 1.8's layout exactly (its str of the same plan): a blank line before each table
    assert str(plan).splitlines() == ["module: ", *tutorial_plan_lines["cuda"]]
    text = str(planner)
    assert "rank | HBM (GiB) | DDR (GiB) | est. cost (ms) | share of total" in text
    assert "100.0%" in text


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_table_larger_than_a_rank_is_split(device: str) -> None:
    # 2M x 64 fp32 = 488 MiB (+ buffers); a rank has 256 MiB, 218 MiB usable
    caps = {"hbm_cap": 256 * MIB} if device == "cuda" else {"ddr_cap": 256 * MIB}
    topology = Topology(world_size=4, compute_device=device, **caps)
    plan, planner = plan_checked(ebc([2_000_000, 1000]), topology)
    big = plan.plan[""]["t0"]
    assert big.sharding_type in (ShardingType.ROW_WISE, ShardingType.COLUMN_WISE)
    assert big.compute_kernel is EmbeddingComputeKernel.FUSED
    used = [r.hbm_bytes if device == "cuda" else r.ddr_bytes for r in planner.stats.ranks]
    assert max(used) <= 256 * MIB * 0.85


def test_many_small_tables_are_table_wise_and_balanced() -> None:
    rng = random.Random(0)
    rows = [rng.randint(10_000, 2_000_000) for _ in range(100)]
    dims = [rng.choice([32, 64, 128]) for _ in range(100)]
    constraints = {
        f"t{i}": ParameterConstraints(pooling_factors=[rng.choice([1, 2, 5, 10, 20])])
        for i in range(100)
    }
    plan, planner = plan_checked(ebc(rows, dims), Topology(world_size=8, compute_device="cuda"),
                                 constraints=constraints)
    assert {ps.sharding_type for ps in plan.plan[""].values()} == {ShardingType.TABLE_WISE}
    assert planner.stats.imbalance <= 1.1
    assert len({ps.ranks[0] for ps in plan.plan[""].values()}) == 8


def test_constraints_are_honoured() -> None:
    constraints = {
        "t0": ParameterConstraints(sharding_types=[ShardingType.COLUMN_WISE], min_partition=64),
        "t1": ParameterConstraints(sharding_types=["row_wise"]),
        "t2": ParameterConstraints(sharding_types=["table_wise"], compute_kernels=["fused_uvm"]),
        "t3": ParameterConstraints(sharding_types=["data_parallel"]),  # DP although not small
    }
    topology = Topology(world_size=4, compute_device="cuda")
    plan, _ = plan_checked(ebc([50_000] * 5, 128), topology, [UvmSharder()], constraints=constraints)
    p = plan.plan[""]
    assert p["t0"].sharding_type is ShardingType.COLUMN_WISE
    assert all(s.shard_sizes[1] >= 64 for s in p["t0"].shards) and len(p["t0"].shards) == 2
    assert p["t1"].sharding_type is ShardingType.ROW_WISE
    assert (p["t2"].sharding_type, p["t2"].compute_kernel) == (
        ShardingType.TABLE_WISE, EmbeddingComputeKernel.FUSED_UVM)
    assert p["t3"].sharding_type is ShardingType.DATA_PARALLEL
    assert p["t4"].compute_kernel is EmbeddingComputeKernel.FUSED  # HBM is plentiful


def test_multi_host_row_split_stays_on_one_host() -> None:
    constraints = {"t0": ParameterConstraints(sharding_types=["table_row_wise"])}
    topology = Topology(world_size=8, compute_device="cuda", local_world_size=4)
    plan, _ = plan_checked(ebc([100_000, 1000]), topology, constraints=constraints)
    ranks = plan.plan[""]["t0"].ranks
    assert ranks in ([0, 1, 2, 3], [4, 5, 6, 7])


def test_unknown_constraint_names_list_the_tables() -> None:
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=2, compute_device="cpu"),
        constraints={"nope": ParameterConstraints()},
    )
    with pytest.raises(PlannerError, match=r"\['nope'\].*\['t0', 't1'\]"):
        planner.plan(ebc([10, 10]), [EmbeddingBagCollectionSharder()])


def test_too_big_model_says_how_much_and_which_tables() -> None:
    topology = Topology(world_size=2, compute_device="cpu", ddr_cap=GIB)
    planner = EmbeddingShardingPlanner(topology=topology)
    with pytest.raises(PlannerError) as info:
        planner.plan(ebc([8_000_000, 4_000_000, 1000], 128), [EmbeddingBagCollectionSharder()])
    message = str(info.value)
    assert "does not fit" in message and "GiB" in message
    assert "'t0'" in message and "'t1'" in message  # the largest tables, by name
    assert "1.70 GiB usable" in message  # 2 ranks x 1 GiB x (1 - 0.15)


def test_one_table_that_fits_nowhere_names_the_rank() -> None:
    # The model fits in total, but t0 may only be table-wise and no rank can hold it
    topology = Topology(world_size=4, compute_device="cpu", ddr_cap=GIB)
    planner = EmbeddingShardingPlanner(
        topology=topology, constraints={"t0": ParameterConstraints(sharding_types=["table_wise"])}
    )
    with pytest.raises(PlannerError, match=r"table 't0' .*needs \d+\.\d+ GiB on a rank.*rank 0"):
        planner.plan(ebc([4_000_000, 1000], 128), [EmbeddingBagCollectionSharder()])


def test_small_hbm_chooses_uvm_caching_sized_to_free_hbm() -> None:
    topology = Topology(world_size=2, compute_device="cuda", hbm_cap=GIB)
    module = ebc([4_000_000, 1_000_000, 50_000], 128)  # t0 alone is 1.9 GiB
    plan, planner = plan_checked(module, topology, [UvmSharder()])
    t0 = plan.plan[""]["t0"]
    assert t0.compute_kernel is EmbeddingComputeKernel.FUSED_UVM_CACHING
    load_factor = t0.cache_params.load_factor
    assert 0.2 <= load_factor < 1.0  # grown into the free HBM, but the table does not fit
    assert max(r.hbm_bytes for r in planner.stats.ranks) == pytest.approx(0.85 * GIB, rel=0.01)
    assert all(r.ddr_bytes > 0 for r in planner.stats.ranks)  # the weights live in host memory


def test_uvm_caching_keeps_the_constraint_load_factor() -> None:
    topology = Topology(world_size=2, compute_device="cuda", hbm_cap=GIB)
    constraints = {"t0": ParameterConstraints(cache_params=CacheParams(load_factor=0.05))}
    plan, _ = plan_checked(ebc([4_000_000, 1_000_000], 128), topology, [UvmSharder()],
                           constraints=constraints)
    t0 = plan.plan[""]["t0"]
    assert t0.compute_kernel is EmbeddingComputeKernel.FUSED_UVM_CACHING
    assert t0.cache_params == CacheParams(load_factor=0.05)


def test_no_room_for_a_cache_falls_back_to_uvm() -> None:
    # 4 MiB HBM: the buffers fit, a 1% cache of a 4M-row table (20 MiB) does not
    topology = Topology(world_size=2, compute_device="cuda", hbm_cap=4 * MIB)
    plan, _ = plan_checked(ebc([4_000_000], 128), topology, [UvmSharder()], batch_size=64)
    assert plan.plan[""]["t0"].compute_kernel is EmbeddingComputeKernel.FUSED_UVM


def test_cpu_never_proposes_uvm_and_rejects_it_in_constraints() -> None:
    topology = Topology(world_size=2, compute_device="cpu", ddr_cap=GIB)
    plan, _ = plan_checked(ebc([1_000_000, 100_000], 128), topology, [UvmSharder()])
    assert {ps.compute_kernel for ps in plan.plan[""].values()} == {EmbeddingComputeKernel.FUSED}
    planner = EmbeddingShardingPlanner(
        topology=topology,
        constraints={"t1": ParameterConstraints(compute_kernels=["fused_uvm_caching"])},
    )
    with pytest.raises(PlannerError, match=r"'t1'.*fused_uvm_caching.*CPU topology.*FUSED"):
        planner.plan(ebc([1_000_000, 100_000], 128), [UvmSharder()])


def test_plans_are_deterministic() -> None:
    rng = random.Random(1)
    module = ebc([rng.randint(1000, 500_000) for _ in range(40)], 64)
    topology = Topology(world_size=16, compute_device="cuda", local_world_size=8)
    first = EmbeddingShardingPlanner(topology=topology).plan(module, [EmbeddingBagCollectionSharder()])
    second = EmbeddingShardingPlanner(topology=topology).plan(module, [EmbeddingBagCollectionSharder()])
    assert first.to_json() == second.to_json()
    assert ShardingPlan.from_json(first.to_json()).to_json() == first.to_json()


class TwoTowers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.user = nn.Sequential(ebc([1000, 2000]))
        self.item = EmbeddingCollection([
            EmbeddingConfig(name="t0", embedding_dim=16, num_embeddings=500, feature_names=["i"]),
        ], device="meta")
        self.dense = nn.Linear(4, 4)


def test_plans_every_collection_of_a_model() -> None:
    model = TwoTowers()
    topology = Topology(world_size=2, compute_device="cpu")
    plan, _ = plan_checked(model, topology, [EmbeddingBagCollectionSharder(), EmbeddingCollectionSharder()])
    assert list(plan.plan) == ["user.0", "item"]
    assert set(plan.plan["user.0"]) == {"t0", "t1"} and set(plan.plan["item"]) == {"t0"}
    assert plan.plan["item"]["t0"].sharding_type is not ShardingType.DATA_PARALLEL


def test_plan_for_env_without_process_group() -> None:
    module = ebc([1000, 2000, 3000])
    plans = [plan_for_env(module, ShardingEnv(world_size=2, rank=r, local_world_size=2),
                          [EmbeddingBagCollectionSharder()], "cpu") for r in (0, 1)]
    plan = plans[0].plan[""]
    validate_module_sharding_plan(module, plan, 2, 2)
    assert plans[0].to_json() == plans[1].to_json()  # every rank plans alike, no gather
    assert set(plan) == {"t0", "t1", "t2"}
    assert {r for ps in plan.values() for r in ps.ranks} == {0, 1}  # both ranks used


class _FusedOnlySharder(EmbeddingBagCollectionSharder):
    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        return ["fused"]


def test_fused_only_sharder_reports_missing_hbm() -> None:
    # a sharder that runs FUSED only: on CUDA the tables must fit in HBM, whatever DDR is free
    topology = Topology(world_size=2, compute_device="cuda", hbm_cap=GIB)
    with pytest.raises(PlannerError, match=r"3\.\d\d GiB of HBM.*1\.70 GiB usable.*'t0'"):
        EmbeddingShardingPlanner(topology=topology).plan(
            ebc([8_000_000], 128), [_FusedOnlySharder()]
        )


def test_sharder_runs_the_cached_kernel_when_hbm_is_short() -> None:
    # the same tables with the sharder that also runs fused_uvm_caching: a cache in HBM
    topology = Topology(world_size=2, compute_device="cuda", hbm_cap=GIB)
    plan = EmbeddingShardingPlanner(topology=topology).plan(
        ebc([8_000_000], 128), [EmbeddingBagCollectionSharder()]
    )
    ps = next(iter(plan.plan.values()))["t0"]
    assert ps.compute_kernel.value == "fused_uvm_caching"
    assert 0 < ps.cache_params.load_factor < 1
