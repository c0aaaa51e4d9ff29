"""TorchRec's pluggable planner internals, checked against values computed by hand from
TorchRec's documented rules."""

from __future__ import annotations

import math

import pytest
import torch

from recsys_core import EmbeddingBagCollection, EmbeddingBagConfig
from recsys_core.distributed import EmbeddingBagCollectionSharder
from recsys_core.planner import EmbeddingShardingPlanner, Topology
from recsys_core.planner.constants import HBM_MEM_BW, HBM_TO_DDR_MEM_BW, kernel_bw_lookup
from recsys_core.planner.enumerators import EmbeddingEnumerator
from recsys_core.planner.errors import PlannerError, PlannerErrorType
from recsys_core.planner.partitioners import GreedyPerfPartitioner
from recsys_core.planner.perf_models import NoopPerfModel, NoopStorageModel
from recsys_core.planner.planners import (
    extract_plan,
    validate_modules_inclusion_in_sharding_plan,
)
from recsys_core.planner.proposers import (
    EmbeddingOffloadScaleupProposer,
    GreedyProposer,
    UniformProposer,
)
from recsys_core.planner.sharding_option import ShardingOption
from recsys_core.planner.stats import _kl_divergence, _total_variation
from recsys_core.planner.storage import Perf, Shard, Storage
from recsys_core.planner.storage_reservations import FixedPercentageStorageReservation
from recsys_core.planner.types import PlanLoader
from recsys_core.planner.utils import BinarySearchPredicate

GIB = 1024**3


def model(rows: tuple[int, ...] = (10_000,), dim: int = 64) -> EmbeddingBagCollection:
    return EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=dim, num_embeddings=r,
                           feature_names=[f"f{i}"]) for i, r in enumerate(rows)], device="meta")


def test_kernel_bw_lookup_blends_hbm_and_uvm_link() -> None:
    # a quarter of lookups hit HBM, the rest cross the HBM<->DDR link; UVM reads at 1/10
    expected = (0.25 * 897 + 0.75 * 32) * GIB / 1000 / 10
    got = kernel_bw_lookup("cuda", "fused_uvm_caching", HBM_MEM_BW, 0.0, HBM_TO_DDR_MEM_BW, 0.25)
    assert got == pytest.approx(expected)
    assert kernel_bw_lookup("cuda", "fused_uvm_caching", HBM_MEM_BW, 0.0, HBM_TO_DDR_MEM_BW, 0.25,
                            prefetch_pipeline=True) == HBM_MEM_BW
    assert kernel_bw_lookup("cpu", "dense", 0.0, 10.0, 0.0) == 5.0


def test_row_wise_shard_storage_by_torchrecs_rule() -> None:
    options = EmbeddingEnumerator(Topology(2, "cuda"), batch_size=512).enumerate(
        model(), [EmbeddingBagCollectionSharder()])
    rw = next(o for o in options if o.sharding_type == "row_wise" and o.compute_kernel == "fused")
    # 5,000 x 64 fp32 rows; 512 ids x 8 bytes in; 512 samples x 2 ranks x 64 x 4 bytes out
    weights, ids, out = 5_000 * 64 * 4, 512 * 8, 512 * 2 * 64 * 4
    assert [s.storage for s in rw.shards] == [Storage(weights + ids + out, 0, 0)] * 2
    assert weights + ids + out == 1_546_240


def _option(name: str, hbm: list[int], perf: list[float], kind: str = "table_wise",
            by: str = "device") -> ShardingOption:
    shards = [Shard(size=[10, 4], offset=[0, 0], storage=Storage(h, 0, 0), perf=Perf(p, 0, 0, 0))
              for h, p in zip(hbm, perf, strict=True)]
    return ShardingOption(name, torch.empty(10, 4, device="meta"), ("m", torch.nn.Module()),
                          [1.0], 8, kind, by, "fused", shards)


def test_offload_scaleup_proposer_starts_from_the_first_caching_option_per_table(caplog) -> None:
    """TorchRec's rule: per table the first fused_uvm_caching option, else the first option;
    a warning names each table whose other options are dropped, an error each non-LRU cache."""
    from recsys_core.plan.params import CacheAlgorithm, CacheParams

    def option(name: str, caching: bool, lfu: bool = False) -> ShardingOption:
        so = _option(name, [10], [1.0])
        if caching:
            so.compute_kernel = "fused_uvm_caching"
            so.cache_params = CacheParams(load_factor=0.1)
            if lfu:
                so.cache_params.algorithm = CacheAlgorithm.LFU  # mutable, as TorchRec's
        return so

    by_fqn = {"one": [option("one", False)],
              "mixed": [option("mixed", False), option("mixed", True), option("mixed", True)],
              "plain": [option("plain", False), option("plain", False)],
              "lfu": [option("lfu", True, lfu=True)]}
    with caplog.at_level("WARNING", logger="recsys_core.planner.proposers"):
        chosen = EmbeddingOffloadScaleupProposer._build_proposal_from_sharding_options(by_fqn)
    assert [id(so) for so in chosen] == [id(by_fqn["one"][0]), id(by_fqn["mixed"][1]),
                                         id(by_fqn["plain"][0]), id(by_fqn["lfu"][0])]
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert [w.split(":")[0] for w in warnings] == [
        "EmbeddingOffloadScaleupProposer - ignored 2 sharding options for table mixed",
        "EmbeddingOffloadScaleupProposer - ignored 1 sharding options for table plain"]
    assert len(errors) == 1 and "table lfu uses" in errors[0] and "LFU" in errors[0]


def test_cache_params_are_mutable_and_hash_without_stats() -> None:
    from recsys_core.plan.params import CacheParams

    a, b = CacheParams(load_factor=0.1), CacheParams(load_factor=0.1)
    b.stats = object()  # type: ignore[assignment]  # statistics are not part of the identity
    assert a == b and hash(a) == hash(b)
    b.load_factor = 0.2
    assert a != b and hash(a) != hash(b)


def test_greedy_proposer_moves_the_largest_table_on() -> None:
    a1, a2 = _option("a", [100], [1.0]), _option("a", [50], [2.0])
    b1, b2 = _option("b", [30], [1.0]), _option("b", [10], [3.0])
    proposer = GreedyProposer()
    proposer.load([a2, b2, a1, b1])
    seen = []
    while (proposal := proposer.propose()) is not None:
        seen.append([so.shards[0].storage.hbm for so in proposal])
        proposer.feedback(partitionable=True)
    # fastest first; then "a" (100 > 30 bytes) moves on, then "b" (a has no option left)
    assert seen == [[100, 30], [50, 30], [50, 10]]


def test_uniform_proposer_one_proposal_per_common_type() -> None:
    opts = [_option("a", [1], [1.0]), _option("b", [1], [1.0]),
            _option("a", [1, 1], [1.0, 1.0], "row_wise", "uniform")]
    proposer = UniformProposer()
    proposer.load(opts)
    assert [so.sharding_type for so in proposer.propose()] == ["table_wise", "table_wise"]
    proposer.feedback(partitionable=True)
    assert proposer.propose() is None  # "b" has no row-wise option


def test_greedy_perf_partitioner_places_on_least_loaded_rank() -> None:
    topology = Topology(2, "cuda", hbm_cap=1000)
    plan = [_option("a", [600], [3.0]), _option("b", [500], [2.0]), _option("c", [300], [1.0])]
    GreedyPerfPartitioner().partition(plan, topology)
    # largest storage first: a -> rank 0; b -> rank 1 (less perf); c -> rank 1 (2 < 3)
    assert [so.shards[0].rank for so in plan] == [0, 1, 1]
    assert NoopPerfModel(topology).rate(plan) == 3.0
    assert NoopStorageModel(topology).rate(plan) == 800
    assert topology.devices[0].storage.hbm == 1000  # the topology is not modified
    with pytest.raises(PlannerError) as error:
        GreedyPerfPartitioner().partition([_option("d", [1001], [1.0])], topology)
    assert error.value.error_type is PlannerErrorType.PARTITION


def test_topology_accepts_torchrecs_arguments() -> None:
    t = Topology(world_size=2, compute_device="cuda", local_world_size=8, pod_size=2)
    assert (t.local_world_size, t.intra_group_size, t.local_size) == (8, 16, 2)
    reserved = FixedPercentageStorageReservation(0.25).reserve(t, 512, model(), [])
    assert [d.storage.hbm for d in reserved.devices] == [24 * GIB] * 2


def test_imbalance_measures_by_hand() -> None:
    assert _total_variation([0.5, 0.5]) == 0.0
    assert _total_variation([1.0, 0.0]) == 0.5
    assert _kl_divergence([1.0, 0.0]) == pytest.approx(math.log(2))


def test_binary_search_predicate_finds_largest_true() -> None:
    search = BinarySearchPredicate(0, 100, 0)
    probe, probes = search.next(True), []
    while probe is not None:
        probes.append(probe)
        probe = search.next(probe <= 37)
    assert probes[0] == 50 and search.right == 37


class _Loader(PlanLoader):
    def __init__(self, options: dict[int, ShardingOption], context: str | None) -> None:
        self.options, self.context = options, context

    def load(self) -> dict[int, ShardingOption]:
        return self.options

    def plan_context_hash(self) -> str | None:
        return self.context


def test_custom_components_plan_and_a_loaded_plan_is_reused() -> None:
    sharders = [EmbeddingBagCollectionSharder()]
    m = model((1_000, 2_000, 3_000))
    planner = EmbeddingShardingPlanner(topology=Topology(2, "cuda"),
                                       proposer=[GreedyProposer(), UniformProposer()])
    plan = planner.plan(m, sharders)
    assert set(plan.plan[""].keys()) == {"t0", "t1", "t2"}
    best = {so.storage_hash(): so for so in planner._best_plan}
    context = planner.hash_planner_context_inputs_str()
    loading = EmbeddingShardingPlanner(topology=Topology(2, "cuda"),
                                       plan_loader=_Loader(best, None))
    assert loading.plan(m, sharders).plan[""] == plan.plan[""]
    assert loading.hash_planner_context_inputs_str() == context
    stale = EmbeddingShardingPlanner(topology=Topology(2, "cuda"),
                                     plan_loader=_Loader(best, "other"))
    with pytest.raises(PlannerError) as error:
        stale.plan(m, sharders)
    assert error.value.error_type is PlannerErrorType.PLANNER_INPUT_CONTEXT_MISMATCH
    with pytest.raises(PlannerError) as error:
        extract_plan(planner._enumerator.last_stored_search_space[:1], best)
    assert error.value.error_type is PlannerErrorType.PLAN_LOADING_FAILED


def test_missing_module_in_plan_is_named() -> None:
    wrapper = torch.nn.ModuleDict({"ebc": model()})
    from recsys_core.plan.types import ShardingPlan

    with pytest.raises(PlannerError, match=r"\['ebc'\]") as error:
        validate_modules_inclusion_in_sharding_plan(ShardingPlan({}), wrapper,
                                                    [EmbeddingBagCollectionSharder()])
    assert error.value.error_type is PlannerErrorType.MISSING_MODULE_IN_PLAN


def test_offload_stats_miss_rate_from_the_histogram() -> None:
    from recsys_core.planner.shard_estimators import EmbeddingOffloadStats

    # 1000 rows, 4 bins of 250: half the reuses at distance 250-499, half at 500-749
    stats = EmbeddingOffloadStats(0.5, 100, torch.tensor([0.0, 1.0, 1.0, 0.0]), 1000)
    assert [stats.expected_miss_rate(c) for c in (0.0, 0.3, 0.6, 1.0)] == [1.0, 0.5, 0.0, 0.0]
