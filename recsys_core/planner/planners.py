"""TorchRec's ``planners`` module: the planner, its pluggable search (TorchRec's
enumerate -> propose -> partition -> rate loop), plan loading and plan validation.

``EmbeddingShardingPlanner`` (``planner.py``) runs this library's own search unless it is
given an enumerator, proposer, partitioner, performance model, stats, callbacks or a plan
loader: then :func:`search_plan` runs TorchRec's loop with them (the others defaulting to
TorchRec's: this library's EmbeddingEnumerator, GreedyProposer + GridSearchProposer,
GreedyPerfPartitioner, NoopPerfModel, EmbeddingStats).
"""

from __future__ import annotations

import copy
import logging
import time
from collections import deque
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
from recsys_core.planner.errors import PlannerError, PlannerErrorType
from recsys_core.planner.planner import EmbeddingShardingPlanner
from recsys_core.planner.sharding_option import ShardingOption
from recsys_core.planner.storage import Storage
from recsys_core.planner.topology import Topology
from recsys_core.planner.utils import (
    placement,
    reset_shard_rank,
    shardable_parameters,
    sharder_name,
)

logger: logging.Logger = logging.getLogger(__name__)

__all__ = [
    "EmbeddingShardingPlanner",
    "extract_plan",
    "search_plan",
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
    from recsys_core.planner.storage import Shard

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


def search_plan(planner: Any, module: nn.Module, sharders: list[Any],
                topology: Topology) -> tuple[ShardingPlan, list[ShardingOption]]:
    """TorchRec's search with ``planner``'s components: returns the plan and its options."""
    start = time.perf_counter()
    planner._num_proposals = planner._num_plans = 0
    storage_constraint = planner._storage_reservation.reserve(
        topology=topology, batch_size=planner._batch_size, module=module, sharders=sharders,
        constraints=planner._constraints)
    search_space = planner._enumerator.enumerate(module=module, sharders=sharders)
    if not search_space:
        return ShardingPlan({}), []
    best_plan: list[ShardingOption] | None = None
    loader = planner.plan_loader
    if loader is not None:
        planner._loader_plan_validation(planner.hash_planner_context_inputs_str(),
                                        loader.plan_context_hash())
        loaded = loader.load()
        if loaded is not None:
            best_plan = copy.deepcopy(extract_plan(search_space, loaded)) or None
    last_error: PlannerError | None = None
    lowest = Storage(MAX_SIZE, MAX_SIZE, MAX_SIZE)
    if best_plan is None:
        best_rating = float(MAX_SIZE)
        cache: dict[tuple[int, ...], tuple[bool, Any, float | None]] = {}
        for proposer in planner._proposers:
            proposer.load(search_space=search_space, enumerator=planner._enumerator)
        for proposer in planner._proposers:
            proposal = proposer.propose()
            while proposal:
                timeout = planner._timeout_seconds
                if timeout and time.perf_counter() - start > timeout:
                    break
                key = tuple(sorted(map(hash, proposal)))
                if key in cache:
                    ok, plan, rating = cache[key]
                    proposer.feedback(partitionable=ok, plan=plan, perf_rating=rating,
                                      storage_constraint=storage_constraint)
                    proposal = proposer.propose()
                    continue
                planner._num_proposals += 1
                try:
                    plan = planner._partitioner.partition(proposal=proposal,
                                                         storage_constraint=storage_constraint)
                    planner._num_plans += 1
                    rating = planner._perf_model.rate(plan=plan)
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
    if not best_plan:
        capacity = reduce(lambda x, y: x + y, [d.storage for d in storage_constraint.devices])
        detail = f" Last error: {last_error}" if last_error is not None else ""
        raise PlannerError(
            f"Unable to find a plan for this model: {planner._num_proposals} proposals, none "
            f"partitioned. Least storage of a proposal: {lowest}; storage available after "
            f"the reservation: {capacity}.{detail}",
            last_error.error_type if last_error is not None else PlannerErrorType.OTHER)
    for callback in planner._callbacks:
        best_plan = callback(best_plan)
    validate_compute_kernels(best_plan)
    sharding_plan = to_sharding_plan(best_plan, topology)
    validate_rank_assignment(sharding_plan, topology)
    validate_modules_inclusion_in_sharding_plan(sharding_plan, module, sharders)
    planner._stats_logger.log(
        sharding_plan=sharding_plan, topology=topology, batch_size=planner._batch_size,
        storage_reservation=planner._storage_reservation,
        num_proposals=planner._num_proposals, num_plans=planner._num_plans,
        run_time=time.perf_counter() - start, best_plan=best_plan,
        constraints=planner._constraints, sharders=sharders, enumerator=planner._enumerator,
        debug=planner._debug)
    return sharding_plan, best_plan
