"""What the planner API builds for one target (TorchRec 1.9's ``planner.provider``): the
Topology, the storage reservation and the planner, from the request's fields and its
:class:`~recsys_core.planner.requests.PlannerConfig`.

:class:`DefaultPlannerProvider` builds TorchRec's open-source set: the topology from the
request's world sizes and memory (``TopologyFactory``), the reservation named by the policy,
and an ``EmbeddingShardingPlanner`` with TorchRec's enumerator and estimators (so it runs
TorchRec's enumerate / propose / partition search, see ``planners.py``) and the proposer,
partitioner and performance model the config selects. What TorchRec leaves to Meta's provider
(the linear-programming and Manifold planners, the SKU-aware reservation, hardware-based
estimates, dynamic-column-dim proposers) is refused or left at the default, as in TorchRec;
``INFERENCE`` reservations are refused here (this library has no InferenceStorageReservation).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from recsys_core.planner.constants import PIPELINE_TYPES
from recsys_core.planner.enumerators import EmbeddingEnumerator
from recsys_core.planner.partitioners import (
    GreedyPerfPartitioner,
    MemoryBalancedPartitioner,
    SortBy,
)
from recsys_core.planner.perf_models import NoopStorageModel
from recsys_core.planner.planners import EmbeddingShardingPlanner
from recsys_core.planner.proposers import (
    EmbeddingOffloadScaleupProposer,
    GreedyProposer,
    GridSearchProposer,
    UniformProposer,
)
from recsys_core.planner.requests import (
    PlannerConfig,
    PlannerVariant,
    ShardingPlanRequest,
    StorageReservationPolicy,
)
from recsys_core.planner.results import PlannerSessionContext
from recsys_core.planner.shard_estimators import EmbeddingPerfEstimator, EmbeddingStorageEstimator
from recsys_core.planner.storage_reservations import (
    FixedPercentageStorageReservation,
    HeuristicalStorageReservation,
    StorageReservation,
)
from recsys_core.planner.topology import Topology
from recsys_core.planner.topology_factory import (
    HardwareConfig,
    KernelConfig,
    TopologyFactory,
    TrainerConfig,
)

__all__ = ["DefaultPlannerProvider", "PlannerProvider"]

_GIB = 1024**3
_DEFAULT_RESERVATION = 0.15  # EmbeddingShardingPlanner's own default
_DEFAULT_PARAMETER_MULTIPLIER = 6.0  # HeuristicalStorageReservation's
_PROPOSERS = {"greedy": GreedyProposer, "grid_search": GridSearchProposer,
              "uniform": UniformProposer}


@runtime_checkable
class PlannerProvider(Protocol):
    """Builds the per-target pieces of a plan."""

    def build_topology(
        self, sku: str, request: ShardingPlanRequest, ctx: PlannerSessionContext
    ) -> Topology: ...

    def build_storage_reservation(
        self, sku: str, request: ShardingPlanRequest
    ) -> StorageReservation: ...

    def build_planner(
        self, sku: str, *, topology: Topology, storage_reservation: StorageReservation,
        ctx: PlannerSessionContext,
    ) -> EmbeddingShardingPlanner: ...


class DefaultPlannerProvider:
    """TorchRec's open-source provider (see the module docstring)."""

    def build_topology(
        self, sku: str, request: ShardingPlanRequest, ctx: PlannerSessionContext
    ) -> Topology:
        """The request's ranks and per-rank memory (``hbm_gb`` / ``ddr_gb``, else the
        topology's defaults) on ``compute_device`` (else cuda, TorchRec's default)."""
        trainer = TrainerConfig(
            world_size=request.world_size, local_world_size=request.local_world_size,
            pod_size=request.pod_size,
            hbm_cap_bytes=None if request.hbm_gb is None else int(request.hbm_gb * _GIB),
            ddr_cap_bytes=None if request.ddr_gb is None else int(request.ddr_gb * _GIB),
        )
        kernel = (KernelConfig(compute_device=request.compute_device)
                  if request.compute_device else KernelConfig())
        hardware = HardwareConfig()
        ctx.hw_source[sku] = "request_caps"
        ctx.hw_overrides_applied[sku] = hardware
        return TopologyFactory.create_topology(
            trainer_config=trainer, hardware_config=hardware, kernel_config=kernel)

    def build_storage_reservation(
        self, sku: str, request: ShardingPlanRequest
    ) -> StorageReservation:
        """The request's reservation if it has one, else the config's policy."""
        if request.storage_reservation is not None:
            return request.storage_reservation
        cfg = request.planner_config
        pct = (_DEFAULT_RESERVATION if cfg.storage_reservation_percentage is None
               else cfg.storage_reservation_percentage)
        policy = cfg.storage_reservation_policy
        if policy in (StorageReservationPolicy.UNSET, StorageReservationPolicy.HEURISTICAL):
            return HeuristicalStorageReservation(
                percentage=pct,
                parameter_multiplier=(_DEFAULT_PARAMETER_MULTIPLIER
                                      if cfg.parameter_multiplier is None
                                      else cfg.parameter_multiplier),
                dense_tensor_estimate=cfg.dense_tensor_estimate,
            )
        if policy is StorageReservationPolicy.FIXED_PERCENTAGE:
            return FixedPercentageStorageReservation(percentage=pct)
        raise NotImplementedError(
            f"storage_reservation_policy {policy.value!r} ({policy.name}) is not built by "
            "DefaultPlannerProvider here: this library has no InferenceStorageReservation or "
            "SKUAwareStorageReservation. Use HEURISTICAL or FIXED_PERCENTAGE, or pass a "
            "storage_reservation in the request"
        )

    def _build_enumerator(self, topology: Topology, ctx: PlannerSessionContext) -> EmbeddingEnumerator:
        request, cfg = ctx.request, ctx.request.planner_config
        pipeline = cfg.pipeline_type or "none"
        if pipeline not in PIPELINE_TYPES:  # TorchRec's PipelineType values
            raise ValueError(
                f"planner_config.pipeline_type {pipeline!r} is not a pipeline the storage "
                f"estimator knows; use one of {list(PIPELINE_TYPES)} (PipelineType values)")
        return EmbeddingEnumerator(
            topology=topology, batch_size=request.batch_size, constraints=request.constraints,
            estimator=[
                EmbeddingPerfEstimator(topology=topology, constraints=request.constraints),
                EmbeddingStorageEstimator(topology=topology, constraints=request.constraints,
                                          pipeline_type=pipeline),
            ],
        )

    @staticmethod
    def _build_partitioner(cfg: PlannerConfig) -> Any | None:
        if cfg.partitioner_type == "greedy_perf":
            sort_by = SortBy(cfg.partitioner_sort_by) if cfg.partitioner_sort_by else SortBy.STORAGE
            return GreedyPerfPartitioner(sort_by=sort_by, balance_modules=cfg.balance_modules)
        if cfg.partitioner_type == "memory_balanced":
            kwargs: dict[str, Any] = {"balance_modules": cfg.balance_modules}
            if cfg.memory_balanced_max_search_count is not None:
                kwargs["max_search_count"] = cfg.memory_balanced_max_search_count
            if cfg.memory_balanced_tolerance is not None:
                kwargs["tolerance"] = cfg.memory_balanced_tolerance
            return MemoryBalancedPartitioner(**kwargs)
        return None

    @staticmethod
    def _build_proposer(cfg: PlannerConfig) -> Any | None:
        pc = cfg.proposer_config
        if pc is None:
            factory = _PROPOSERS.get(cfg.proposer_type or "")
            return None if factory is None else factory()
        if pc.kind in ("greedy", "uniform"):
            return _PROPOSERS[pc.kind]()
        if pc.kind == "grid_search":
            return (GridSearchProposer() if pc.max_proposals is None
                    else GridSearchProposer(max_proposals=pc.max_proposals))
        if pc.kind == "embedding_offload_scaleup":
            return (EmbeddingOffloadScaleupProposer() if pc.use_depth is None
                    else EmbeddingOffloadScaleupProposer(use_depth=pc.use_depth))
        return None  # "default", and Meta's proposers: the planner's default set

    def build_planner(
        self, sku: str, *, topology: Topology, storage_reservation: StorageReservation,
        ctx: PlannerSessionContext,
    ) -> EmbeddingShardingPlanner:
        """An ``EmbeddingShardingPlanner`` for ``UNSET`` / ``OSS``; other variants raise."""
        cfg = ctx.request.planner_config
        if cfg.planner_variant not in (PlannerVariant.UNSET, PlannerVariant.OSS):
            raise NotImplementedError(
                f"DefaultPlannerProvider does not build planner_variant "
                f"{cfg.planner_variant.value!r} ({cfg.planner_variant.name}): TorchRec's "
                "linear-programming and Manifold planners are Meta-internal. Use "
                "PlannerVariant.OSS"
            )
        return EmbeddingShardingPlanner(
            topology=topology,
            batch_size=ctx.request.batch_size,
            enumerator=self._build_enumerator(topology, ctx),
            storage_reservation=storage_reservation,
            proposer=self._build_proposer(cfg),
            partitioner=self._build_partitioner(cfg),
            performance_model=(NoopStorageModel(topology)
                               if cfg.performance_model == "storage" else None),
            constraints=ctx.request.constraints,
            stats=ctx.stats,
            debug=cfg.debug,
            timeout_seconds=cfg.timeout_seconds,
        )
