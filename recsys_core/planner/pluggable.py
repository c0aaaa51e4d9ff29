"""TorchRec's pluggable search (its enumerate -> propose -> partition -> rate loop,
:class:`PluggableSearch`), plan loading and plan validation; ``planners.py`` re-exports the
functions at TorchRec's module path.

``EmbeddingShardingPlanner`` (``planners.py``) runs this library's own search (``search/``)
unless it is given an enumerator, proposer, partitioner, performance model, stats, callbacks or
a plan loader: then a :class:`PluggableSearch` runs TorchRec's loop with them.
"""

from __future__ import annotations

import copy
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from functools import reduce
from typing import Any

from torch import nn

from recsys_core.plan.spec import EnumerableShardingSpec, ShardMetadata
from recsys_core.plan.types import (
    EmbeddingComputeKernel,
    EmbeddingModuleShardingPlan,
    ParameterSharding,
    ShardingPlan,
    ShardingType,
)
from recsys_core.planner.constants import MAX_SIZE
from recsys_core.planner.constraints import ParameterConstraints
from recsys_core.planner.enumerators import EmbeddingEnumerator
from recsys_core.planner.errors import PlannerError, PlannerErrorType
from recsys_core.planner.interfaces import (
    Enumerator,
    Partitioner,
    PerfModel,
    PlanLoader,
    Proposer,
    Stats,
)
from recsys_core.planner.partitioners import GreedyPerfPartitioner
from recsys_core.planner.perf_models import NoopPerfModel
from recsys_core.planner.proposers import GreedyProposer, GridSearchProposer, UniformProposer
from recsys_core.planner.sharding_option import ShardingOption
from recsys_core.planner.storage import Shard, Storage
from recsys_core.planner.storage_reservations import StorageReservation
from recsys_core.planner.topology import Topology
from recsys_core.planner.utils import (
    placement,
    reset_shard_rank,
    shardable_parameters,
    sharder_name,
)

logger: logging.Logger = logging.getLogger(__name__)

__all__ = [
    "PluggableSearch",
    "check_loaded_plan_hash",
    "extract_plan",
    "plan_as_sharding_options",
    "to_sharding_plan",
    "validate_compute_kernels",
    "validate_modules_inclusion_in_sharding_plan",
    "validate_rank_assignment",
]


def to_sharding_plan(sharding_options: list[ShardingOption], topology: Topology) -> ShardingPlan:
    """The :class:`ShardingPlan` of partitioned sharding options."""
    plan: dict[str, EmbeddingModuleShardingPlan] = {}
    for so in sharding_options:
        dp = so.sharding_type == ShardingType.DATA_PARALLEL.value
        spec = None if dp else EnumerableShardingSpec([
            ShardMetadata(shard_sizes=list(s.size), shard_offsets=list(s.offset),
                          placement=placement(topology.compute_device, int(s.rank),
                                              topology.local_world_size))
            for s in so.shards
        ])
        module_plan = plan.setdefault(so.path, EmbeddingModuleShardingPlan())
        module_plan[so.name] = ParameterSharding(
            sharding_type=so.sharding_type, compute_kernel=so.compute_kernel,
            ranks=[int(s.rank) for s in so.shards], sharding_spec=spec,
            cache_params=so.cache_params, enforce_hbm=so.enforce_hbm,
            stochastic_rounding=so.stochastic_rounding, bounds_check_mode=so.bounds_check_mode,
            output_dtype=so.output_dtype, key_value_params=so.key_value_params,
        )
    return ShardingPlan(plan)


def plan_as_sharding_options(plan: ShardingPlan,
                             search_space: list[ShardingOption]) -> list[ShardingOption]:
    """``plan`` as TorchRec's partitioned sharding options, in ``search_space`` order: for each
    planned table, a copy of its option of the same sharding type, kernel and shard sizes (or,
    when the enumerator has no such geometry, of the same type and kernel) with the plan's
    shards, ranks and cache parameters. Estimates are those of the copied option (run the
    enumerator's ``populate_estimates`` after a geometry change)."""
    chosen: dict[tuple[str, str], ShardingOption] = {}
    for so in search_space:
        ps = plan.plan.get(so.path, {}).get(so.name) if so.path in plan.plan else None
        if ps is None or (so.path, so.name) in chosen:
            continue
        kind = getattr(ps.sharding_type, "value", ps.sharding_type)
        kernel = getattr(ps.compute_kernel, "value", ps.compute_kernel)
        if (so.sharding_type, so.compute_kernel) != (kind, kernel):
            continue
        ranks = list(ps.ranks or [])
        if ps.sharding_spec is not None:
            shards = [Shard(size=list(m.shard_sizes), offset=list(m.shard_offsets), rank=r)
                      for m, r in zip(ps.sharding_spec.shards, ranks, strict=True)]
        else:
            shards = [Shard(size=list(so.tensor.shape), offset=[0, 0], rank=r) for r in ranks]
        same = [s.size for s in so.shards] == [s.size for s in shards]
        picked = chosen.get((so.path, so.name + "?"))
        if not same and picked is not None:
            continue
        option = copy.deepcopy(so)
        if same:
            for shard, planned in zip(option.shards, shards, strict=True):
                shard.rank = planned.rank
        else:
            option.shards = shards
        if ps.cache_params is not None:
            option.cache_params = ps.cache_params
        chosen[(so.path, so.name + ("" if same else "?"))] = option
    result = []
    for so in search_space:
        exact = chosen.pop((so.path, so.name), None)
        near = chosen.pop((so.path, so.name + "?"), None)
        if exact is not None or near is not None:
            result.append(exact if exact is not None else near)
    return result


def validate_modules_inclusion_in_sharding_plan(
    sharding_plan: ShardingPlan,
    module: nn.Module,
    sharders: list[Any],
    constraints: dict[str, Any] | None = None,
    device_group: str | None = None,
) -> None:
    """Raises PlannerError (MISSING_MODULE_IN_PLAN) naming every module that a sharder handles
    and has shardable parameters (in ``device_group``, when given) but the plan lacks."""
    if device_group is not None and constraints is None:
        raise ValueError("device_group is set but constraints is None; device_group filtering "
                         "requires constraints to be provided")
    by_type = {sharder_name(s.module_type): s for s in sharders}
    expected: set[str] = set()
    queue: deque[tuple[str, nn.Module]] = deque([("", module)])
    while queue:
        path, sub = queue.popleft()
        sharder = by_type.get(sharder_name(type(sub)))
        if sharder is not None:
            params = shardable_parameters(sharder, sub)
            if params:
                if device_group is None or any(
                    name in constraints and constraints[name].device_group == device_group
                    for name in params
                ):
                    expected.add(path)
                continue
        queue.extend((f"{path}.{n}" if path else n, m) for n, m in sub.named_children())
    missing = sorted(expected - set(sharding_plan.plan.keys()))
    if missing:
        where = f" for device group '{device_group}'" if device_group else ""
        raise PlannerError(
            f"The following shardable modules are not present in the sharding plan{where}: "
            f"{missing}.", PlannerErrorType.MISSING_MODULE_IN_PLAN)


def validate_rank_assignment(sharding_plan: ShardingPlan, topology: Topology) -> None:
    """Raises PlannerError (INVALID_RANK_ASSIGNMENT) for a shard without a rank in
    ``[0, world_size)``."""
    for module_name, module_plan in sharding_plan.plan.items():
        for param_name, param in module_plan.items():
            if param.sharding_spec is None:
                continue
            for shard in param.sharding_spec.shards:
                rank = shard.placement.rank()
                if rank is None or rank < 0 or rank >= topology.world_size:
                    raise PlannerError(
                        f"{module_name}.{param_name}: shard {shard} has rank {rank}, outside "
                        f"[0, {topology.world_size})", PlannerErrorType.INVALID_RANK_ASSIGNMENT)


_VALID_KERNELS = {k.value for k in EmbeddingComputeKernel} | {
    "fused_triton", "quant_uvm", "quant_uvm_caching", "key_value", "ssd_virtual_table",
    "dram_virtual_table", "dram_ssd_virtual_table", "custom_kernel"}
_CACHING_KERNELS = {"fused_uvm_caching", "quant_uvm_caching"}


def validate_compute_kernels(best_plan: list[ShardingOption]) -> None:
    """Raises PlannerError (INVALID_COMPUTE_KERNEL) listing every option with an unknown
    kernel, DENSE off data-parallel, a cache load factor outside (0, 1) or negative storage."""
    violations = []
    for so in best_plan:
        kernel = str(so.compute_kernel)
        if kernel not in _VALID_KERNELS:
            violations.append(f"{so.fqn}: unknown compute kernel '{kernel}'")
            continue
        if kernel == "dense" and so.sharding_type != ShardingType.DATA_PARALLEL.value:
            violations.append(f"{so.fqn}: DENSE kernel requires DATA_PARALLEL sharding, "
                              f"got '{so.sharding_type}'")
        clf = so.cache_load_factor
        if kernel in _CACHING_KERNELS and clf is not None and not 0 < clf < 1:
            violations.append(f"{so.fqn}: {kernel} requires cache_load_factor strictly between "
                              f"0 and 1, got {clf}")
        storage = so.total_storage
        for tier in ("hbm", "ddr"):
            if getattr(storage, tier) < 0:
                violations.append(f"{so.fqn}: {kernel} has negative {tier.upper()} storage "
                                  f"({getattr(storage, tier)})")
    if violations:
        raise PlannerError(
            f"Compute kernel validation failed with {len(violations)} violation(s):\n"
            + "\n".join(f"  - {v}" for v in violations), PlannerErrorType.INVALID_COMPUTE_KERNEL)


def extract_plan(
    search_space: list[ShardingOption], loaded_sharding_options: dict[int, ShardingOption]
) -> list[ShardingOption]:
    """The search space's options that a loaded plan holds (matched by ``storage_hash``), with
    the loaded shards (ranks, estimates). Raises PlannerError (PLAN_LOADING_FAILED) when two
    options share a hash or the loaded plan has options the search space lacks."""
    chosen, seen = [], set()
    for so in search_space:
        key = so.storage_hash()
        if key in seen:
            raise PlannerError(
                f"Found a duplicate storage hash {key} for FQNs {[s.fqn for s in search_space]}",
                PlannerErrorType.PLAN_LOADING_FAILED)
        seen.add(key)
        loaded = loaded_sharding_options.get(key)
        if loaded is not None:
            chosen.append(ShardingOption(
                name=so.name, tensor=so.tensor, module=so.module, input_lengths=so.input_lengths,
                batch_size=so.batch_size, compute_kernel=so.compute_kernel,
                sharding_type=so.sharding_type, partition_by=so.partition_by,
                shards=loaded.shards, cache_params=so.cache_params, enforce_hbm=so.enforce_hbm,
                stochastic_rounding=so.stochastic_rounding,
                bounds_check_mode=so.bounds_check_mode, dependency=so.dependency,
                is_pooled=so.is_pooled, feature_names=so.feature_names,
                output_dtype=so.output_dtype, key_value_params=so.key_value_params,
            ))
    if len(chosen) != len(loaded_sharding_options):
        raise PlannerError(
            "Loaded sharding options from Storage, but not all search space is covered. Merged "
            f"search space len {len(chosen)} != loaded Sharding options len "
            f"{len(loaded_sharding_options)}", PlannerErrorType.PLAN_LOADING_FAILED)
    return chosen


def check_loaded_plan_hash(current_planner_hash: str, loaded_plan_hash: str | None) -> None:
    """A loaded plan must be for these inputs (PLANNER_INPUT_CONTEXT_MISMATCH otherwise)."""
    if loaded_plan_hash is not None and current_planner_hash != loaded_plan_hash:
        raise PlannerError(
            "Planner input context mismatch (planner input mismatch): the stored plan was "
            f"planned for other inputs (hash {loaded_plan_hash}) than this planner's "
            f"({current_planner_hash}); "
            "re-plan, or load a plan made for this model, topology and constraints",
            PlannerErrorType.PLANNER_INPUT_CONTEXT_MISMATCH)


class PluggableSearch:
    """TorchRec's search with its components: enumerate every sharding option, ask each
    proposer for proposals, partition each on the reserved topology, rate the partitioned plans
    and keep the best (or load a stored plan), then run the callbacks, validate and log.

    Owns its components and what the last search counted (``num_proposals``, ``num_plans``,
    ``best_plan``); ``EmbeddingShardingPlanner`` shows them under TorchRec's attribute names.
    Components left None get TorchRec's defaults on the first :meth:`run` (they need the
    topology): :class:`EmbeddingEnumerator`, GridSearch + Greedy (by depth and by sum) +
    Uniform proposers, :class:`GreedyPerfPartitioner`, :class:`NoopPerfModel`.
    """

    def __init__(
        self,
        *,
        enumerator: Enumerator | None = None,
        proposers: Sequence[Proposer] | None = None,
        partitioner: Partitioner | None = None,
        perf_model: PerfModel | None = None,
        stats: Sequence[Stats] = (),
        callbacks: Sequence[Callable[[list[ShardingOption]], list[ShardingOption]]] = (),
        plan_loader: PlanLoader | None = None,
    ) -> None:
        self.enumerator = enumerator
        self.proposers = list(proposers) if proposers is not None else None
        self.partitioner = partitioner
        self.perf_model = perf_model
        self.stats = list(stats)
        self.callbacks = list(callbacks)
        self.plan_loader = plan_loader
        self.num_proposals = 0
        self.num_plans = 0
        self.best_plan: list[ShardingOption] | None = None

    def fill_defaults(self, topology: Topology, batch_size: int,
                      constraints: dict[str, ParameterConstraints]) -> None:
        """TorchRec's default components where none were given."""
        if self.enumerator is None:
            self.enumerator = EmbeddingEnumerator(topology, batch_size, constraints)
        if self.proposers is None:
            self.proposers = [GridSearchProposer(), GreedyProposer(),
                              GreedyProposer(use_depth=False), UniformProposer()]
        if self.partitioner is None:
            self.partitioner = GreedyPerfPartitioner()
        if self.perf_model is None:
            self.perf_model = NoopPerfModel(topology)

    def log_stats(self, **kwargs: Any) -> None:
        """Every stats logger's ``log(**kwargs)``."""
        for stats in self.stats:
            stats.log(**kwargs)

    def run(
        self,
        module: nn.Module,
        sharders: list[Any],
        topology: Topology,
        *,
        storage_reservation: StorageReservation,
        batch_size: int,
        constraints: dict[str, ParameterConstraints],
        timeout_seconds: float | None = None,
        debug: bool = False,
        context_hash: Callable[[], str] | None = None,
    ) -> ShardingPlan:
        """The plan of ``module``; its options are then :attr:`best_plan`. ``context_hash``
        gives this planner's input hash, checked against a plan loader's."""
        self.fill_defaults(topology, batch_size, constraints)
        assert self.enumerator is not None and self.proposers is not None
        start = time.perf_counter()
        self.num_proposals = self.num_plans = 0
        storage_constraint = storage_reservation.reserve(
            topology=topology, batch_size=batch_size, module=module, sharders=sharders,
            constraints=constraints)
        search_space = self.enumerator.enumerate(module=module, sharders=sharders)
        if not search_space:
            self.best_plan = []
            return ShardingPlan({})
        best_plan = self._loaded_plan(search_space, context_hash)
        last_error: PlannerError | None = None
        lowest = Storage(MAX_SIZE, MAX_SIZE, MAX_SIZE)
        if best_plan is None:
            best_plan, last_error, lowest = self._propose(search_space, storage_constraint,
                                                          start, timeout_seconds)
        if not best_plan:
            capacity = reduce(lambda x, y: x + y, [d.storage for d in storage_constraint.devices])
            detail = f" Last error: {last_error}" if last_error is not None else ""
            raise PlannerError(
                f"Unable to find a plan for this model: {self.num_proposals} proposals, none "
                f"partitioned. Least storage of a proposal: {lowest}; storage available after "
                f"the reservation: {capacity}.{detail}",
                last_error.error_type if last_error is not None else PlannerErrorType.OTHER)
        for callback in self.callbacks:
            best_plan = callback(best_plan)
        validate_compute_kernels(best_plan)
        sharding_plan = to_sharding_plan(best_plan, topology)
        validate_rank_assignment(sharding_plan, topology)
        validate_modules_inclusion_in_sharding_plan(sharding_plan, module, sharders)
        self.best_plan = best_plan
        self.log_stats(
            sharding_plan=sharding_plan, topology=topology, batch_size=batch_size,
            storage_reservation=storage_reservation,
            num_proposals=self.num_proposals, num_plans=self.num_plans,
            run_time=time.perf_counter() - start, best_plan=best_plan,
            constraints=constraints, sharders=sharders, enumerator=self.enumerator,
            debug=debug)
        return sharding_plan

    def _loaded_plan(self, search_space: list[ShardingOption],
                     context_hash: Callable[[], str] | None) -> list[ShardingOption] | None:
        loader = self.plan_loader
        if loader is None:
            return None
        if context_hash is not None:
            check_loaded_plan_hash(context_hash(), loader.plan_context_hash())
        loaded = loader.load()
        if loaded is None:
            return None
        return copy.deepcopy(extract_plan(search_space, loaded)) or None

    def _propose(
        self, search_space: list[ShardingOption], storage_constraint: Topology, start: float,
        timeout_seconds: float | None,
    ) -> tuple[list[ShardingOption] | None, PlannerError | None, Storage]:
        """The best-rated partitioned proposal, the last partitioning error and the least
        storage of a proposal that did not partition."""
        assert self.proposers is not None and self.partitioner is not None
        assert self.perf_model is not None
        best_plan: list[ShardingOption] | None = None
        best_rating = float(MAX_SIZE)
        last_error: PlannerError | None = None
        lowest = Storage(MAX_SIZE, MAX_SIZE, MAX_SIZE)
        cache: dict[tuple[int, ...], tuple[bool, Any, float | None]] = {}
        for proposer in self.proposers:
            proposer.load(search_space=search_space, enumerator=self.enumerator)
        for proposer in self.proposers:
            proposal = proposer.propose()
            while proposal:
                if timeout_seconds and time.perf_counter() - start > timeout_seconds:
                    break
                key = tuple(sorted(map(hash, proposal)))
                if key in cache:
                    ok, plan, rating = cache[key]
                    proposer.feedback(partitionable=ok, plan=plan, perf_rating=rating,
                                      storage_constraint=storage_constraint)
                    proposal = proposer.propose()
                    continue
                self.num_proposals += 1
                try:
                    plan = self.partitioner.partition(proposal=proposal,
                                                      storage_constraint=storage_constraint)
                    self.num_plans += 1
                    rating = self.perf_model.rate(plan=plan)
                    if rating < best_rating:
                        best_rating, best_plan = rating, copy.deepcopy(plan)
                    cache[key] = (True, plan, rating)
                    proposer.feedback(partitionable=True, plan=plan, perf_rating=rating,
                                      storage_constraint=storage_constraint)
                except PlannerError as error:
                    last_error = error
                    used = reduce(lambda x, y: x + y,
                                  [s.storage for so in proposal for s in so.shards])
                    lowest = min(lowest, used)
                    cache[key] = (False, proposal, None)
                    proposer.feedback(partitionable=False, plan=proposal,
                                      storage_constraint=storage_constraint)
                reset_shard_rank(proposal)
                proposal = proposer.propose()
        return best_plan, last_error, lowest
