"""TorchRec 1.9's planner additions: the request / result API (``planner.types``'
``ShardingPlanRequest``, ``PlannerConfig``, ``ShardingPlanResult``, ...; ``planner.api``'s
orchestrator, ``planner.executor``, ``planner.provider``, ``planner.model_arch``), the
planner's ``get_selected_options`` / ``get_search_space`` and ``ShardingOption.stash_weights``.

The model: one EmbeddingBagCollection of three tables (1000, 2000, 3000 rows x 16, FP32) on
meta, planned for 2 CPU ranks: TorchRec's search puts each table row-wise, half the rows per
rank.
"""

from __future__ import annotations

import math

import pytest
from torch import nn

from recsys_core import EmbeddingBagCollection, EmbeddingBagConfig
from recsys_core.distributed import EmbeddingBagCollectionSharder
from recsys_core.planner import EmbeddingEnumerator, EmbeddingShardingPlanner, Topology
from recsys_core.planner.api import ProductionPlannerOrchestrator
from recsys_core.planner.errors import PlannerErrorType
from recsys_core.planner.executor import DefaultPlannerExecutor
from recsys_core.planner.model_arch import (
    extract_model_arch,
    model_arch_hash,
    total_sparse_param_bytes,
)
from recsys_core.planner.proposers import UniformProposer
from recsys_core.planner.provider import DefaultPlannerProvider
from recsys_core.planner.storage_reservations import (
    FixedPercentageStorageReservation,
    HeuristicalStorageReservation,
)
from recsys_core.planner.types import (
    ParameterConstraints,
    PlannerConfig,
    PlannerSessionContext,
    PlannerVariant,
    ProposerConfig,
    ShardingPlanRequest,
    ShardingPlanResult,
    StorageReservationPolicy,
    TrainingFramework,
)
from recsys_core.testing import run_gloo

ROWS = (1000, 2000, 3000)
DIM = 16


class _Model(nn.Module):
    def __init__(self, stash: bool = False) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection([
            EmbeddingBagConfig(name=f"t{i}", feature_names=[f"f{i}"], num_embeddings=rows,
                               embedding_dim=DIM, stash_weights=stash and i == 1)
            for i, rows in enumerate(ROWS)
        ], device="meta")


def _request(**kwargs: object) -> ShardingPlanRequest:
    args: dict[str, object] = dict(
        model=_Model(), sharders=[EmbeddingBagCollectionSharder()], world_size=2,
        local_world_size=2, batch_size=64, compute_device="cpu")
    args.update(kwargs)
    return ShardingPlanRequest(**args)  # type: ignore[arg-type]


def _plan(request: ShardingPlanRequest) -> tuple[ShardingPlanResult, PlannerSessionContext]:
    ctx = PlannerSessionContext(request=request, results={})
    results = ProductionPlannerOrchestrator(DefaultPlannerExecutor(), sku="cpu").plan(request, ctx)
    assert list(results) == ["cpu"] and ctx.results["cpu"] is results["cpu"]
    return results["cpu"], ctx


def test_a_request_is_planned_with_per_table_estimates() -> None:
    request = _request(capture_search_space=True)
    result, ctx = _plan(request)
    assert result.success and result.planner_failure_reason is None
    assert result.request_id == request.request_id and result.request_hash == request.request_hash
    assert result.is_planning_rank
    module_plan = result.sharding_plan.plan["ebc"]
    assert {t: (p.sharding_type, p.ranks) for t, p in module_plan.items()} == {
        f"t{i}": ("row_wise", [0, 1]) for i in range(3)}
    details = {d.fqn: d for d in result.sharding_options}
    assert list(details) == ["ebc.t0", "ebc.t1", "ebc.t2"]
    for i, rows in enumerate(ROWS):
        shards = details[f"ebc.t{i}"].shards
        assert [(s.rank, s.size, s.offset) for s in shards] == [
            (0, (rows // 2, DIM), (0, 0)), (1, (rows // 2, DIM), (rows // 2, 0))]
        assert details[f"ebc.t{i}"].total_ddr_bytes == sum(s.ddr_bytes for s in shards) > 0
    # the peak is the largest per-rank sum; both ranks hold the same here
    rank0 = sum(s.ddr_bytes for d in details.values() for s in d.shards if s.rank == 0)
    assert result.estimated_max_ddr_bytes == rank0 and result.estimated_max_hbm_bytes == 0
    assert result.perf_imbalance_ratio == pytest.approx(1.0)
    assert result.max_rank_perf == pytest.approx(result.mean_rank_perf)
    assert result.critical_path_ms == pytest.approx(
        result.comms_critical_path_ms + result.comp_critical_path_ms)
    assert set(ctx.timing) == {"topology_build:cpu", "storage_reservation:cpu",
                               "planner_construction:cpu", "plan_call:cpu", "total_planner_time"}
    assert isinstance(ctx.storage_reservations_used["cpu"], HeuristicalStorageReservation)
    assert ctx.topology_cache[("cpu", 2, 2)].compute_device == "cpu"
    assert len(ctx.search_space["cpu"]) > len(result.sharding_options)


def test_the_plan_is_the_planners_with_torchrecs_components() -> None:
    result, ctx = _plan(_request())
    topology = ctx.topology_cache[("cpu", 2, 2)]
    direct = EmbeddingShardingPlanner(
        topology=topology, batch_size=64, enumerator=EmbeddingEnumerator(topology, 64),
        stats=[],
    ).plan(_Model(), [EmbeddingBagCollectionSharder()])
    assert result.sharding_plan.to_json() == direct.to_json()


def test_a_plan_that_does_not_fit_is_an_unsuccessful_result() -> None:
    result, _ = _plan(_request(ddr_gb=1e-5))
    assert not result.success and result.sharding_plan is None
    assert result.planner_error_type in (PlannerErrorType.INSUFFICIENT_STORAGE,
                                         PlannerErrorType.PARTITION, PlannerErrorType.OTHER)
    assert result.planner_failure_reason
    assert result.estimated_max_hbm_bytes == 0 and result.solve_time_ms >= 0


def test_model_factory_and_bad_model() -> None:
    result, ctx = _plan(_request(model=_Model))
    assert result.success
    assert [t.num_embeddings for t in ctx.model_arch.tables] == list(ROWS)
    with pytest.raises(TypeError, match="nn.Module"):
        _plan(_request(model=5))


def test_the_request_must_be_the_contexts() -> None:
    ctx = PlannerSessionContext(request=_request(), results={})
    with pytest.raises(ValueError, match="ctx.request"):
        ProductionPlannerOrchestrator(DefaultPlannerExecutor(), sku="cpu").plan(_request(), ctx)


def test_request_hash_covers_plan_data_only() -> None:
    a = _request(constraints={"t0": ParameterConstraints(), "t1": ParameterConstraints()})
    b = _request(model=nn.Linear(1, 1),
                 constraints={"t1": ParameterConstraints(), "t0": ParameterConstraints()})
    assert a.request_id != b.request_id
    assert a.request_hash == b.request_hash and len(a.request_hash) == 16
    assert _request(batch_size=65).request_hash != a.request_hash
    assert _request(planner_config=PlannerConfig(proposer_type="uniform")).request_hash != (
        _request().request_hash)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"world_size": 0}, "world_size must be positive"),
    ({"world_size": 6, "local_world_size": 4}, "divisible"),
    ({"local_world_size": 4}, "must not exceed"),
    ({"pod_size": 4}, "pod_size"),
    ({"hbm_gb": -1.0}, "hbm_gb"),
    ({"training_framework": "keras"}, "training_framework"),
])
def test_request_checks(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _request(**kwargs)


def test_training_framework_string_is_converted() -> None:
    assert _request(training_framework="apf").training_framework is TrainingFramework.APF
    assert TrainingFramework.UNSET == "" and not TrainingFramework.UNSET


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"proposer_type": "greedy", "proposer_config": ProposerConfig()}, "not both"),
    ({"storage_reservation_percentage": 1.5}, "between 0.0 and 1.0"),
    ({"bwd_compute_multiplier": -1.0}, "non-negative"),
    ({"parameter_multiplier": math.nan}, "finite"),
])
def test_planner_config_checks(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PlannerConfig(**kwargs)


def test_result_checks() -> None:
    with pytest.raises(ValueError, match="must be None"):
        ShardingPlanResult("cpu", True, None, "why", 0, 0)
    with pytest.raises(ValueError, match="required"):
        ShardingPlanResult("cpu", False, None, None, 0, 0)
    with pytest.raises(ValueError, match="sku"):
        ShardingPlanResult("", True, None, None, 0, 0)


def test_provider_builds_what_the_config_names() -> None:
    provider = DefaultPlannerProvider()
    reserve = provider.build_storage_reservation
    default = reserve("cpu", _request())
    assert isinstance(default, HeuristicalStorageReservation) and default.percentage == 0.15
    fixed = reserve("cpu", _request(planner_config=PlannerConfig(
        storage_reservation_policy=StorageReservationPolicy.FIXED_PERCENTAGE,
        storage_reservation_percentage=0.3)))
    assert isinstance(fixed, FixedPercentageStorageReservation) and fixed._percentage == 0.3
    given = FixedPercentageStorageReservation(0.5)
    assert reserve("cpu", _request(storage_reservation=given)) is given
    with pytest.raises(NotImplementedError, match="inference"):
        reserve("cpu", _request(planner_config=PlannerConfig(
            storage_reservation_policy=StorageReservationPolicy.INFERENCE)))
    request = _request(planner_config=PlannerConfig(proposer_type="uniform"), ddr_gb=1.5)
    ctx = PlannerSessionContext(request=request, results={})
    topology = provider.build_topology("cpu", request, ctx)
    assert topology.ddr_per_rank == 1.5 * 1024**3 and ctx.hw_source == {"cpu": "request_caps"}
    planner = provider.build_planner("cpu", topology=topology, storage_reservation=default, ctx=ctx)
    assert [type(p) for p in planner._proposers] == [UniformProposer]
    lp = _request(planner_config=PlannerConfig(planner_variant=PlannerVariant.LINEAR_PROGRAMMING))
    with pytest.raises(NotImplementedError, match="linear_programming"):
        provider.build_planner("cpu", topology=topology, storage_reservation=default,
                               ctx=PlannerSessionContext(request=lp, results={}))


def test_model_arch_and_its_hash() -> None:
    sharders = [EmbeddingBagCollectionSharder(fused_params={"learning_rate": 0.1})]
    arch = extract_model_arch(_Model(), sharders)
    assert [(t.name, t.num_embeddings, t.embedding_dim, t.feature_names, t.pooling,
             t.data_type) for t in arch.tables] == [
        (f"t{i}", rows, DIM, (f"f{i}",), "SUM", "FP32") for i, rows in enumerate(ROWS)]
    assert arch.sharder_types == ("EmbeddingBagCollectionSharder",)
    assert arch.sharders[0].learning_rate == 0.1
    assert total_sparse_param_bytes(arch) == sum(ROWS) * DIM * 4
    assert model_arch_hash(arch) == model_arch_hash(extract_model_arch(_Model(), sharders))
    assert len(model_arch_hash(arch)) == 16


def test_planner_exposes_its_choice_and_search_space() -> None:
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=2, compute_device="cpu"))
    assert planner.get_selected_options() == [] and planner.get_search_space() is None
    plan = planner.plan(_Model(), [EmbeddingBagCollectionSharder()])
    chosen = planner.get_selected_options()
    assert [(o.name, o.sharding_type, [s.rank for s in o.shards]) for o in chosen] == [
        (name, p.sharding_type, p.ranks) for name, p in plan.plan["ebc"].items()]
    space = planner.get_search_space()
    assert {o.name for o in space} == {"t0", "t1", "t2"} and len(space) > len(chosen)


def test_enumerator_reads_each_tables_stash_weights() -> None:
    options = EmbeddingEnumerator(Topology(world_size=2, compute_device="cpu"), 64).enumerate(
        _Model(stash=True), [EmbeddingBagCollectionSharder()])
    assert {o.name: o.stash_weights for o in options} == {"t0": False, "t1": True, "t2": False}


def _collective(rank: int, world: int) -> tuple[bool, str, int, bool]:
    result, _ = _plan(_request(world_size=world, local_world_size=world))
    return result.is_planning_rank, result.sharding_plan.to_json(), len(result.sharding_options), \
        result.critical_path_ms is None


def test_collective_plan_only_rank0_has_estimates() -> None:
    (p0, plan0, n0, cp0), (p1, plan1, n1, cp1) = run_gloo(2, _collective)
    assert (p0, p1) == (True, False) and plan0 == plan1
    assert (n0, n1) == (3, 0) and (cp0, cp1) == (False, True)
