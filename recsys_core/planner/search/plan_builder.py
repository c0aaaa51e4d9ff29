"""From a model to the planner's inputs and from a partition back to a plan: which collections
a sharder handles (and their tables), and the ``ShardingPlan`` of a partition, built with the
plan generators and carrying each table's kernel parameters from its constraints."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from torch import nn

from recsys_core.modules.embedding_configs import BaseEmbeddingConfig
from recsys_core.plan.generators import (
    ParameterShardingGenerator,
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_column_wise,
    table_row_wise,
    table_wise,
)
from recsys_core.plan.sharder import Sharder, shardable_parameters_of
from recsys_core.plan.types import EmbeddingComputeKernel, ShardingPlan, ShardingType
from recsys_core.planner.constraints import CacheParams
from recsys_core.planner.errors import PlannerError
from recsys_core.planner.search.placement import Assignment, Partition
from recsys_core.planner.topology import Topology

Collections = dict[str, tuple[nn.Module, Sharder, list[BaseEmbeddingConfig]]]


def collections_of(
    module: nn.Module, sharders: Sequence[Sharder]
) -> Collections:
    """``{path: (collection, its sharder, its table configs)}`` in ``named_modules`` order."""
    found: Collections = {}
    for path, sub in module.named_modules():
        if any(path.startswith(p + ".") or (not p and path) for p in found):
            continue  # inside a collection already planned
        sharder = next((s for s in sharders if isinstance(sub, s.module_type)), None)
        if sharder is None:
            continue
        # Plain and fused collections alike declare their tables through these two methods.
        if callable(getattr(sub, "embedding_bag_configs", None)):
            configs: list[BaseEmbeddingConfig] = list(sub.embedding_bag_configs())
        elif callable(getattr(sub, "embedding_configs", None)):
            configs = list(sub.embedding_configs())
        else:
            raise PlannerError(
                f"module {path!r} is a {type(sub).__name__}, which {type(sharder).__name__} "
                "handles but the planner cannot read tables from (it has neither "
                "embedding_bag_configs() nor embedding_configs()); plan embedding (bag) "
                "collections"
            )
        listed = shardable_parameters_of(sharder, sub)
        if listed is not None:  # TorchRec: a sharder may shard only some tables (shardable_params)
            names = set(listed)
            configs = [c for c in configs if c.name in names]
            if not configs:
                continue
        found[path] = (sub, sharder, configs)
    return found


def _generator(a: Assignment, topology: Topology) -> ParameterShardingGenerator:
    kind, kernel = a.option.sharding_type, a.option.compute_kernel
    ranks = [int(r) for r in a.ranks]
    if kind is ShardingType.TABLE_WISE:
        return table_wise(rank=ranks[0], compute_kernel=kernel)
    if kind is ShardingType.COLUMN_WISE:
        return column_wise(ranks=ranks, compute_kernel=kernel)
    if kind is ShardingType.ROW_WISE:
        return row_wise(compute_kernel=kernel)
    if kind is ShardingType.TABLE_ROW_WISE:
        return table_row_wise(host_index=a.host_index(topology.local_size), compute_kernel=kernel)
    if kind is ShardingType.TABLE_COLUMN_WISE:
        return table_column_wise(
            host_index=a.host_index(topology.local_size), compute_kernel=kernel,
            ranks_per_table=len(ranks),
        )
    return data_parallel(compute_kernel=kernel)


def build_plan(
    collections: Collections,
    partition: Partition,
    topology: Topology,
) -> ShardingPlan:
    plans = {}
    for path, (sub, _, configs) in collections.items():
        chosen = {c.name: partition.assignments[(path, c.name)] for c in configs}
        module_plan = construct_module_sharding_plan(
            sub,  # type: ignore[arg-type]
            {name: _generator(a, topology) for name, a in chosen.items()},
            local_size=topology.local_size, world_size=topology.world_size,
            device_type=topology.compute_device,
        )
        for name, a in chosen.items():
            constraints = a.option.table.constraints
            sharding = module_plan[name]
            sharding.cache_params = constraints.cache_params
            if a.option.compute_kernel is EmbeddingComputeKernel.FUSED_UVM_CACHING:
                # The load factor as estimated: the constraints' own, or one the partitioner
                # chose with at most 6 decimals (its slots are ceil(load_factor * shard rows),
                # as the kernel counts them).
                base = constraints.cache_params or CacheParams()
                params = dataclasses.replace(base, load_factor=float(a.load_factor or 0))
                sharding.cache_params = params
            sharding.enforce_hbm = constraints.enforce_hbm
            sharding.stochastic_rounding = constraints.stochastic_rounding
            sharding.bounds_check_mode = constraints.bounds_check_mode
            sharding.output_dtype = constraints.output_dtype
        plans[path] = module_plan
    return ShardingPlan(plans)
