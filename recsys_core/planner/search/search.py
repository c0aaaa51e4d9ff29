"""This library's search: every table's candidate layouts, one greedy placement with local
search (``placement.py``), the plan and its per-rank summary.

``EmbeddingShardingPlanner`` (``planners.py``) runs it unless it is given TorchRec components:

    collections = collections_of(module, sharders)           # plan_builder.py
    tables = table_specs(collections, constraints, batch_size, topology)
    plan, stats = plan_tables(collections, tables, topology, reserved, reservation, ...)

``reserved`` is the topology left after the storage reservation; ``reservation`` the fraction it
kept back (for messages).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from recsys_core.plan.types import ShardingPlan
from recsys_core.planner.search.cost import weights_and_state_bytes
from recsys_core.planner.search.enumerate import UVM_KERNELS, enumerate_options, planner_kernels
from recsys_core.planner.search.placement import GreedyPartitioner, Partition, TableKey
from recsys_core.planner.search.plan_builder import Collections, build_plan
from recsys_core.planner.search.shortfall import check_total, no_fit_error
from recsys_core.planner.search.stats import PlanStats
from recsys_core.planner.search.types import Candidate, TableSpec
from recsys_core.planner.topology import Topology

MEMORY_ONLY_FRACTION = 0.5
"""Memory clearly suffices when all tables, whole and with their optimizer state, take at most
this fraction of the fast memory (HBM on CUDA, host memory on CPU) of all ranks together."""


def plan_tables(
    collections: Collections,
    tables: Sequence[TableSpec],
    topology: Topology,
    reserved: Topology,
    reservation: float,
    *,
    batch_size: int,
    start: float,
    deadline: float | None = None,
) -> tuple[ShardingPlan, PlanStats]:
    """The plan of ``tables`` (of ``collections``) on ``topology`` within the memory
    ``reserved`` leaves, and its per-rank summary. Raises PlannerError when no layout fits.

    ``start``: when planning began (``time.perf_counter()``, for the summary's run time);
    ``deadline``: when the search's improvement phase stops (the greedy placement always
    completes)."""
    hbm_budget, ddr_budget = float(reserved.hbm_per_rank), float(reserved.ddr_per_rank)
    # disk is not reserved: dense parameters and activations live in memory
    ssd_budget = float(reserved.ssd_per_rank)
    specs = {spec.key: spec for spec in tables}
    partitioner = GreedyPartitioner(topology, hbm_budget, ddr_budget, ssd_budget)
    partition: Partition | None = None
    failed: TableKey | None = None
    options: dict[TableKey, list[Candidate]] = {}
    if (any(k in UVM_KERNELS for k in planner_kernels(topology))
            and _memory_clearly_suffices(tables, topology, hbm_budget, ddr_budget)):
        # Cached layouts cannot win where every table fits in memory with room to spare
        # (they cost more for the same geometry): plan without them, and with them only
        # if that fails. Half the candidates to estimate. (Without such kernels on the
        # topology both tries would be the same: one is made.)
        options = {
            spec.key: enumerate_options(spec, collections[spec.path][1], topology,
                                        memory_only=True)
            for spec in tables
        }
        partition, failed = partitioner.partition(options, deadline=deadline)
    if partition is None or failed is not None:
        options = {
            spec.key: enumerate_options(spec, collections[spec.path][1], topology)
            for spec in tables
        }
        check_total(specs, options, topology, hbm_budget, ddr_budget, reservation,
                    ssd_budget=ssd_budget)
        partition, failed = partitioner.partition(options, deadline=deadline)
    if failed is not None:
        raise no_fit_error(
            specs, options, failed, partition, topology, hbm_budget, ddr_budget, reservation,
            ssd_budget=ssd_budget,
        )
    plan = build_plan(collections, partition, topology)
    stats = PlanStats.from_partition(
        partition, topology, hbm_budget, ddr_budget, batch_size,
        time.perf_counter() - start, ssd_budget=ssd_budget,
    )
    return plan, stats


def _memory_clearly_suffices(tables: Sequence[TableSpec], topology: Topology,
                             hbm_budget: float, ddr_budget: float) -> bool:
    """Whether the search may first try kernels over fast memory only (no cache, no UVM)."""
    budget = hbm_budget if topology.is_cuda else ddr_budget
    total = sum(float(weights_and_state_bytes(t.config.num_embeddings, t.config.embedding_dim,
                                              t.config.data_type, t.optimizer))
                for t in tables)
    return total <= MEMORY_ONLY_FRACTION * budget * topology.world_size
