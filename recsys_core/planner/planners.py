"""TorchRec's ``planners`` module: ``EmbeddingShardingPlanner`` (tables + Topology +
constraints -> ShardingPlan), ``plan_for_env``, and TorchRec's plan helpers (from
``pluggable.py``).

    planner = EmbeddingShardingPlanner(topology=Topology(world_size=2, compute_device="cpu"))
    plan = planner.collective_plan(model, [EmbeddingBagCollectionSharder()], pg)  # or .plan()
    print(plan)      # TorchRec's two tables
    print(planner)   # per rank: estimated memory per tier, cost and share of the total

Planning is pure: ``plan()`` needs no process group. ``collective_plan()`` plans on rank 0 and
broadcasts the plan's JSON, so every rank shards with the identical plan.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from recsys_core.plan.env import ShardingEnv
from recsys_core.plan.sharder import Sharder, default_sharders
from recsys_core.plan.types import ShardingPlan
from recsys_core.planner.constraints import ParameterConstraints
from recsys_core.planner.context_hash import (
    hash_planner_context_inputs,
    hash_planner_context_inputs_str,
)
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
from recsys_core.planner.machine import detect_topology, smallest_over_ranks
from recsys_core.planner.pluggable import (
    PluggableSearch,
    check_loaded_plan_hash,
    extract_plan,
    plan_as_sharding_options,
    to_sharding_plan,
    validate_compute_kernels,
    validate_modules_inclusion_in_sharding_plan,
    validate_rank_assignment,
)
from recsys_core.planner.search.plan_builder import collections_of
from recsys_core.planner.search.search import plan_tables
from recsys_core.planner.search.shortfall import ReservedFraction
from recsys_core.planner.search.stats import PlanStats
from recsys_core.planner.search.table_specs import table_specs
from recsys_core.planner.sharding_option import ShardingOption
from recsys_core.planner.stats import EmbeddingStats
from recsys_core.planner.storage_reservations import (
    DEFAULT_STORAGE_RESERVATION,
    HeuristicalStorageReservation,
    StorageReservation,
)
from recsys_core.planner.topology import Topology

DEFAULT_BATCH_SIZE = 512  # TorchRec's BATCH_SIZE: samples per rank per step

__all__ = [
    "EmbeddingShardingPlanner",
    "extract_plan",
    "plan_for_env",
    "to_sharding_plan",
    "validate_compute_kernels",
    "validate_modules_inclusion_in_sharding_plan",
    "validate_rank_assignment",
]


@dataclass
class _OwnViews:
    """TorchRec's views of the last plan this library's search made (built when first read)."""

    enumerator: EmbeddingEnumerator | None = None
    best_plan: list[ShardingOption] | None = None


class EmbeddingShardingPlanner:
    """Plans how every embedding collection of a model is sharded.

    Args:
        topology: ranks, memory and bandwidths (default: ``detect_topology(world_size)``, the
            memory this machine has free, with the process group's size, CUDA when available;
            ``collective_plan`` takes the smallest reading of all ranks).
        batch_size: samples per rank per step (sets input/output traffic and buffers).
        constraints: ``{table name: ParameterConstraints}``.
        storage_reservation: what each rank keeps free for dense parameters, activations and
            allocator slack: a ``StorageReservation`` (default
            ``HeuristicalStorageReservation(0.15)``) or the fraction as a float.
        debug: print the plan and the per-rank summary after each plan.
        timeout_seconds: bounds the search's improvement phase (the greedy placement always
            completes); None: no bound.

    TorchRec's argument order. Without ``enumerator``, ``proposer``, ``partitioner``,
    ``performance_model``, ``stats``, ``callbacks`` or ``plan_loader`` it runs this library's
    search (every candidate layout, one greedy placement with local search, see
    ``search/``). Given any of them, it runs TorchRec's search (``pluggable.PluggableSearch``:
    enumerate, propose, partition, rate, keep the best) with them,
    TorchRec's defaults for the others: :class:`EmbeddingEnumerator`, GridSearch + Greedy (by
    depth and by sum) + Uniform proposers, :class:`GreedyPerfPartitioner`,
    :class:`NoopPerfModel`, :class:`EmbeddingStats`. TorchRec's search also runs for
    topologies this library's search does not model (MTIA, hosts of unequal size, per-rank
    capacities).
    """

    def __init__(
        self,
        topology: Topology | None = None,
        batch_size: int | None = None,
        enumerator: Enumerator | None = None,
        storage_reservation: StorageReservation | float | None = None,
        proposer: Proposer | Sequence[Proposer] | None = None,
        partitioner: Partitioner | None = None,
        performance_model: PerfModel | None = None,
        stats: Stats | Sequence[Stats] | None = None,
        constraints: Mapping[str, ParameterConstraints] | None = None,
        debug: bool = False,
        callbacks: Sequence[Callable[[list[ShardingOption]], list[ShardingOption]]] | None = None,
        timeout_seconds: float | None = None,
        plan_loader: PlanLoader | None = None,
    ) -> None:
        batch_size = DEFAULT_BATCH_SIZE if batch_size is None else batch_size
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"EmbeddingShardingPlanner: batch_size must be an int >= 1, got {batch_size!r}")
        # One component or a list of them (duck-typed components too: anything but a list or
        # tuple is one).
        proposers = proposer if isinstance(proposer, list | tuple) or proposer is None else [proposer]
        stats_list = stats if isinstance(stats, list | tuple) or stats is None else [stats]
        # TorchRec's search and its components; any component given selects it.
        self._torchrec_search = PluggableSearch(
            enumerator=enumerator, proposers=proposers, partitioner=partitioner,
            perf_model=performance_model,
            stats=list(stats_list) if stats_list is not None else [EmbeddingStats()],
            callbacks=list(callbacks or []), plan_loader=plan_loader)
        self._pluggable = any(x is not None for x in (
            enumerator, proposer, partitioner, performance_model, stats, callbacks, plan_loader))
        if timeout_seconds is not None and not timeout_seconds > 0:
            raise ValueError(f"EmbeddingShardingPlanner: timeout_seconds must be > 0, got {timeout_seconds!r}")
        if storage_reservation is None or isinstance(storage_reservation, int | float):
            storage_reservation = HeuristicalStorageReservation(
                DEFAULT_STORAGE_RESERVATION if storage_reservation is None else storage_reservation
            )
        constraints = dict(constraints or {})
        for name, value in constraints.items():
            if not isinstance(value, ParameterConstraints):
                raise ValueError(
                    f"EmbeddingShardingPlanner: constraints[{name!r}] is a "
                    f"{type(value).__name__}; give a ParameterConstraints"
                )
        self._topology = topology
        self._batch_size = batch_size
        self._constraints = constraints
        self._storage_reservation = storage_reservation
        self._debug = debug
        self._timeout_seconds = timeout_seconds
        self._plan_stats: PlanStats | None = None
        # What this library's own search last planned, for TorchRec's views of it (built only
        # when read: _enumerator, _best_plan, the stats loggers' tables).
        self._own_search: tuple[nn.Module, list[Sharder], Topology, ShardingPlan] | None = None
        self._own_views = _OwnViews()

    # ---- API ------------------------------------------------------------------------------------
    def plan(self, module: nn.Module, sharders: Sequence[Sharder]) -> ShardingPlan:
        """Plan every collection of ``module`` that one of ``sharders`` handles (no process group)."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        return self._plan(module, sharders, self._topology or detect_topology(world))

    def collective_plan(
        self,
        module: nn.Module,
        sharders: Sequence[Sharder] | None = None,
        pg: dist.ProcessGroup | None = None,
    ) -> ShardingPlan:
        """Rank 0 plans and broadcasts the plan; every rank returns the identical plan.
        ``sharders`` default to TorchRec's default list (``get_default_sharders()``); ``pg`` to
        the default process group.

        A planning error on rank 0 is raised on every rank (no rank is left waiting)."""
        if sharders is None:
            sharders = default_sharders()
        if not dist.is_initialized():
            raise RuntimeError(
                "collective_plan needs an initialized process group; call "
                "torch.distributed.init_process_group first, or use plan() on one process"
            )
        pg = pg if pg is not None else dist.group.WORLD
        world = dist.get_world_size(pg)
        topology = self._topology or smallest_over_ranks(detect_topology(world), pg)
        if topology.world_size != world:
            raise PlannerError(
                f"collective_plan: the topology has world_size {topology.world_size} but the "
                f"process group has {world} ranks; plan for the group's size"
            )
        payload: list[Any] = [None]
        failure: BaseException | None = None
        if dist.get_rank(pg) == 0:
            try:
                plan = self._plan(module, sharders, topology)
                payload = [("ok", plan.to_json(), self._plan_stats)]
            except Exception as exc:  # every rank must leave the broadcast, then raise
                failure = exc
                extra = (exc.error_type, exc.shortfall) if isinstance(exc, PlannerError) else None
                payload = [("error", f"{type(exc).__name__} on rank 0: {exc}", extra)]
        dist.broadcast_object_list(payload, group=pg, group_src=0)
        status, text, extra = payload[0]  # extra: stats, or (error type, shortfall)
        if failure is not None:
            raise failure
        if status == "error":
            error_type, shortfall = extra or (PlannerErrorType.OTHER, None)
            raise PlannerError(text, error_type, shortfall)
        self._plan_stats = extra
        return ShardingPlan.from_json(text)

    def get_selected_options(self) -> list[ShardingOption]:
        """The chosen sharding options of the last plan, with their ranks and estimates
        (TorchRec 1.9); empty before a plan, and on the ranks of a collective plan that
        only received it."""
        return self._best_plan or []

    def get_search_space(self) -> list[ShardingOption] | None:
        """Every option the enumerator offered for the last plan (TorchRec 1.9); None before a
        plan (and where this rank only received a collective plan)."""
        if self._own_search is None and self._torchrec_search.best_plan is None:
            return None
        enumerator = self._enumerator
        return None if enumerator is None else enumerator.last_stored_search_space

    @property
    def stats(self) -> PlanStats | None:
        """Per-rank estimates of the last plan (None before the first)."""
        return self._plan_stats

    def stats_str(self) -> str:
        if self._plan_stats is None:
            return "EmbeddingShardingPlanner: no plan yet (call plan() or collective_plan())"
        return str(self._plan_stats)

    # ---- TorchRec's attributes: the TorchRec search's components and counters -------------------
    @property
    def _enumerator(self) -> EmbeddingEnumerator | None:
        """The enumerator (TorchRec's attribute): the one given or TorchRec's default; after this
        library's own search, a TorchRec :class:`EmbeddingEnumerator` that has enumerated the
        last planned module (built on first read)."""
        given = self._torchrec_search.enumerator
        if given is not None or self._own_search is None:
            return given  # type: ignore[return-value]  # a user's Enumerator, duck-typed as TorchRec's
        if self._own_views.enumerator is None:
            module, sharders, topology, _ = self._own_search
            enumerator = EmbeddingEnumerator(topology, self._batch_size, self._constraints)
            enumerator.enumerate(module, sharders)
            self._own_views.enumerator = enumerator
        return self._own_views.enumerator

    @_enumerator.setter
    def _enumerator(self, value: Enumerator | None) -> None:
        self._torchrec_search.enumerator = value

    @property
    def _best_plan(self) -> list[ShardingOption] | None:
        """The chosen plan as TorchRec's sharding options with their ranks (TorchRec's
        attribute); after this library's own search, its plan matched to the enumerator's
        options (built on first read)."""
        if self._torchrec_search.best_plan is not None or self._own_search is None:
            return self._torchrec_search.best_plan
        if self._own_views.best_plan is None:
            enumerator = self._enumerator
            assert enumerator is not None  # built above for the own search
            space = enumerator.last_stored_search_space
            best = plan_as_sharding_options(self._own_search[3], space or [])
            enumerator.populate_estimates(best)
            self._own_views.best_plan = best
        return self._own_views.best_plan

    @_best_plan.setter
    def _best_plan(self, value: list[ShardingOption] | None) -> None:
        self._torchrec_search.best_plan = value

    @property
    def _proposers(self) -> list[Proposer] | None:
        return self._torchrec_search.proposers

    @property
    def _partitioner(self) -> Partitioner | None:
        return self._torchrec_search.partitioner

    @property
    def _perf_model(self) -> PerfModel | None:
        return self._torchrec_search.perf_model

    @property
    def _stats(self) -> list[Stats]:
        return self._torchrec_search.stats

    @property
    def _callbacks(self) -> list[Callable[[list[ShardingOption]], list[ShardingOption]]]:
        return self._torchrec_search.callbacks

    @property
    def plan_loader(self) -> PlanLoader | None:
        return self._torchrec_search.plan_loader

    @plan_loader.setter
    def plan_loader(self, value: PlanLoader | None) -> None:
        self._torchrec_search.plan_loader = value

    @property
    def _num_proposals(self) -> int:
        return self._torchrec_search.num_proposals

    @property
    def _num_plans(self) -> int:
        return self._torchrec_search.num_plans

    def _own_search_done(self, module: nn.Module, sharders: Sequence[Sharder], topology: Topology,
                         plan: ShardingPlan, run_time: float) -> None:
        self._own_search = (module, list(sharders), topology, plan)
        self._own_views = _OwnViews()
        self._torchrec_search.num_proposals = self._torchrec_search.num_plans = 1

        def inputs() -> dict[str, object]:
            return dict(sharding_plan=plan, topology=topology, batch_size=self._batch_size,
                        storage_reservation=self._storage_reservation, num_proposals=1,
                        num_plans=1, run_time=run_time, best_plan=self._best_plan or [],
                        constraints=self._constraints, sharders=list(sharders),
                        enumerator=self._enumerator)

        for stats in self._stats:
            defer = getattr(stats, "defer", None)
            if callable(defer):
                defer(inputs)

    def __str__(self) -> str:
        return self.stats_str()

    # ---- planning -------------------------------------------------------------------------------
    def _plan(self, module: nn.Module, sharders: Sequence[Sharder], topology: Topology) -> ShardingPlan:
        if self._pluggable or _needs_torchrec_search(topology):
            return self._search(module, sharders, topology)
        start = time.perf_counter()
        collections = collections_of(module, sharders)
        if not collections:  # as TorchRec: no sharder handles any module, nothing to shard
            return ShardingPlan({})
        tables = table_specs(collections, self._constraints, self._batch_size, topology)
        reserved = self._storage_reservation.reserve(
            topology, self._batch_size, module, sharders, self._constraints
        )
        deadline = None if self._timeout_seconds is None else start + self._timeout_seconds
        plan, self._plan_stats = plan_tables(
            collections, tables, topology, reserved,
            _reserved_fraction(topology, reserved, self._storage_reservation),
            batch_size=self._batch_size, start=start, deadline=deadline,
        )
        if self._debug:
            print(plan)
            print(self._plan_stats)
        self._own_search_done(module, sharders, topology, plan, time.perf_counter() - start)
        return plan


    # ---- TorchRec's search ----------------------------------------------------------------------
    def _search(self, module: nn.Module, sharders: Sequence[Sharder], topology: Topology) -> ShardingPlan:
        self._topology = topology
        plan = self._torchrec_search.run(
            module, list(sharders), topology, storage_reservation=self._storage_reservation,
            batch_size=self._batch_size, constraints=self._constraints,
            timeout_seconds=self._timeout_seconds, debug=self._debug,
            context_hash=self.hash_planner_context_inputs_str)
        if self._debug:
            print(plan)
        return plan

    @property
    def _stats_logger(self) -> PluggableSearch:
        """What logs to every stats logger (TorchRec's attribute: ``.log(**kwargs)``)."""
        return self._torchrec_search

    def hash_planner_context_inputs(self) -> int:
        """TorchRec's hash of this planner's inputs (after a plan: it needs the enumerator's
        search space and the reservation's topology)."""
        return hash_planner_context_inputs(self._topology, self._batch_size, self._enumerator,
                                           self._storage_reservation, self._constraints)

    def hash_planner_context_inputs_str(self) -> str:
        """As :meth:`hash_planner_context_inputs`, as hex."""
        return hash_planner_context_inputs_str(self._topology, self._batch_size,
                                               self._enumerator, self._storage_reservation,
                                               self._constraints)

    def _loader_plan_validation(self, current_planner_hash: str, loaded_plan_hash: str | None) -> None:
        """A loaded plan must be for these inputs (PLANNER_INPUT_CONTEXT_MISMATCH otherwise)."""
        check_loaded_plan_hash(current_planner_hash, loaded_plan_hash)


def _needs_torchrec_search(topology: Topology) -> bool:
    """Topologies this library's search does not model: MTIA, hosts of unequal size, per-rank
    capacities."""
    local = topology.local_world_size or topology.world_size
    return (topology.compute_device == "mtia"
            or (local < topology.world_size and topology.world_size % local != 0)
            or topology.custom_topology_data is not None)


def plan_for_env(
    module: nn.Module,
    env: ShardingEnv,
    sharders: Sequence[Sharder],
    device: torch.device | str = "cpu",
    *,
    batch_size: int = 512,
    constraints: Mapping[str, ParameterConstraints] | None = None,
    topology: Topology | None = None,
) -> ShardingPlan:
    """The plan DistributedModelParallel uses when none is given: the planner on ``env``'s ranks.

    The topology (default: :func:`detect_topology` for ``env`` and ``device``) is what this
    machine has free now: host memory, and on CUDA the device's free memory. With a process
    group every rank reads its own machine and the plan is for the smallest reading (it must fit
    on every host); rank 0 plans and broadcasts. Without one, every process plans (the planner
    is deterministic)."""
    device = torch.device(device)
    if topology is None:
        topology = detect_topology(
            env.world_size, device.type, local_world_size=env.local_world_size,
            device=device if device.type == "cuda" else None,
        )
    if env.pg is not None and env.world_size > 1:
        topology = smallest_over_ranks(topology, env.pg)
    planner = EmbeddingShardingPlanner(topology=topology, batch_size=batch_size, constraints=constraints)
    if env.pg is not None and env.world_size > 1:
        return planner.collective_plan(module, sharders, env.pg)
    return planner.plan(module, sharders)


def _reserved_fraction(topology: Topology, reserved: Topology, reservation: object = None) -> float:
    """The fraction of memory a reservation kept back (for messages): of HBM on CUDA, of host
    memory on CPU; a fixed absolute reservation says its GB per device."""
    full, left = (
        (topology.hbm_per_rank, reserved.hbm_per_rank) if topology.is_cuda
        else (topology.ddr_per_rank, reserved.ddr_per_rank)
    )
    fraction = 1.0 - left / full if full > 0 else 0.0
    absolute = getattr(reservation, "_hbm_reserved_bytes", None)
    if absolute is None:
        return fraction
    return ReservedFraction(fraction, f"the storage_reservation of {round(absolute / 1024**3, 3)} "
                            "GB per device (FixedAbsoluteStorageReservation)")
