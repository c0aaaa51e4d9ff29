"""TorchRec 1.9's planning results and session: what a plan cost (:class:`ShardingPlanResult`
with a :class:`ShardingOptionDetail` per table), the model's sparse surface
(:class:`ModelArch`) and the mutable :class:`PlannerSessionContext` one planning session fills
in. Importable from ``planner.types`` (TorchRec's path); ``planner.api`` produces them.

A result of a 2-rank plan of one row-wise table (bytes, per shard)::

    ShardingPlanResult(sku="cpu", success=True, sharding_plan=<plan>,
                       planner_failure_reason=None,
                       estimated_max_hbm_bytes=<largest rank's sum of shard HBM>, ...,
                       sharding_options=(ShardingOptionDetail(fqn="ebc.t", "row_wise",
                           "fused", shards=(ShardDetail(rank=0, ...), ShardDetail(rank=1, ...))),))
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from recsys_core.plan.types import ShardingPlan
from recsys_core.planner.errors import PlannerErrorType
from recsys_core.planner.requests import ShardingPlanRequest

if TYPE_CHECKING:
    from recsys_core.planner.sharding_option import ShardingOption

__all__ = [
    "ModelArch",
    "PlanReportMetadata",
    "PlannerSessionContext",
    "ShardDetail",
    "ShardingOptionDetail",
    "ShardingPlanResult",
    "SharderArch",
    "TableArch",
]


def _non_negative(owner: str, **values: float | None) -> None:
    for name, value in values.items():
        if value is not None and value < 0:
            raise ValueError(f"{owner}: {name} must be non-negative, got {value}")


@dataclass(frozen=True)
class ShardDetail:
    """One shard of a chosen option: where it is, its size and its estimates (bytes, ms)."""

    rank: int | None
    size: tuple[int, ...]
    offset: tuple[int, ...]
    hbm_bytes: int
    ddr_bytes: int
    ssd_bytes: int
    perf_total: float | None = None

    def __post_init__(self) -> None:
        _non_negative("ShardDetail", hbm_bytes=self.hbm_bytes, ddr_bytes=self.ddr_bytes,
                      ssd_bytes=self.ssd_bytes, perf_total=self.perf_total)


@dataclass(frozen=True)
class ShardingOptionDetail:
    """One table of a plan with its shards' estimates (a ShardingOption without the tensor and
    module, so it serializes). ``total_perf`` is None unless every shard has an estimate."""

    fqn: str
    sharding_type: str
    compute_kernel: str
    shards: tuple[ShardDetail, ...] = ()
    total_hbm_bytes: int = 0
    total_ddr_bytes: int = 0
    total_ssd_bytes: int = 0
    total_perf: float | None = None

    def __post_init__(self) -> None:
        _non_negative("ShardingOptionDetail", total_hbm_bytes=self.total_hbm_bytes,
                      total_ddr_bytes=self.total_ddr_bytes, total_ssd_bytes=self.total_ssd_bytes)

    @classmethod
    def from_sharding_option(cls, sharding_option: ShardingOption) -> ShardingOptionDetail:
        shards = tuple(
            ShardDetail(
                rank=s.rank, size=tuple(s.size), offset=tuple(s.offset),
                hbm_bytes=s.storage.hbm if s.storage is not None else 0,
                ddr_bytes=s.storage.ddr if s.storage is not None else 0,
                ssd_bytes=s.storage.ssd if s.storage is not None else 0,
                perf_total=s.perf.total if s.perf is not None else None,
            )
            for s in sharding_option.shards
        )
        perfs = [s.perf_total for s in shards]
        complete = bool(shards) and all(p is not None for p in perfs)
        return cls(
            fqn=sharding_option.fqn, sharding_type=sharding_option.sharding_type,
            compute_kernel=sharding_option.compute_kernel, shards=shards,
            total_hbm_bytes=sum(s.hbm_bytes for s in shards),
            total_ddr_bytes=sum(s.ddr_bytes for s in shards),
            total_ssd_bytes=sum(s.ssd_bytes for s in shards),
            total_perf=sum(p for p in perfs if p is not None) if complete else None,
        )


@dataclass(frozen=True)
class ShardingPlanResult:
    """The outcome of planning for one target (``sku``): the plan, or why there is none, and
    its estimates. Peak figures are the largest per-rank sums of the chosen shards (embedding
    tables only, the reservation not added back). Off the planning rank of a collective plan
    the estimates are empty (``is_planning_rank`` False)."""

    sku: str
    success: bool
    sharding_plan: ShardingPlan | None
    planner_failure_reason: str | None
    """None exactly when ``success``."""
    estimated_max_hbm_bytes: int
    estimated_max_ddr_bytes: int
    estimated_qps: float | None = None
    critical_path_ms: float | None = None
    """TorchRec's critical path: per (module, sharding type, direction) the slowest rank's
    comms, plus per direction the slowest rank's compute."""
    comms_critical_path_ms: float | None = None
    comp_critical_path_ms: float | None = None
    max_rank_perf: float | None = None
    mean_rank_perf: float | None = None
    perf_imbalance_ratio: float | None = None
    """``max_rank_perf / mean_rank_perf`` (1.0: balanced)."""
    planner_error_type: PlannerErrorType | None = None
    validation_warnings: tuple[str, ...] = ()
    sharding_plan_manifold_url: str | None = None
    request_hash: str = ""
    request_id: str = ""
    solve_time_ms: float | None = None
    sharding_options: tuple[ShardingOptionDetail, ...] = ()
    is_planning_rank: bool = True

    def __post_init__(self) -> None:
        if not self.sku:
            raise ValueError("ShardingPlanResult: sku must not be empty")
        _non_negative(
            "ShardingPlanResult", estimated_max_hbm_bytes=self.estimated_max_hbm_bytes,
            estimated_max_ddr_bytes=self.estimated_max_ddr_bytes,
            estimated_qps=self.estimated_qps, critical_path_ms=self.critical_path_ms,
            solve_time_ms=self.solve_time_ms,
        )
        if self.success and self.planner_failure_reason is not None:
            raise ValueError(
                "ShardingPlanResult: planner_failure_reason must be None when success is True")
        if not self.success and self.planner_failure_reason is None:
            raise ValueError(
                "ShardingPlanResult: planner_failure_reason is required when success is False")


@dataclass(frozen=True)
class PlanReportMetadata:
    """Provenance for plan reports (Meta's sinks read it; not plan-affecting, not hashed)."""

    trainer: str | None = None
    pipeline: str | None = None
    total_model_param_size: int | None = None
    total_sparse_param_size: int | None = None
    embedding_hash: str | None = None
    proposer_types: tuple[str, ...] | None = None
    num_parallel_worlds: int | None = None
    embedding_stats_source: str | None = None
    feature_stats_summary_str: str | None = None
    resgen_config_json: str | None = None
    log_plan: bool = True
    manifold_path: str | None = None


@dataclass(frozen=True)
class TableArch:
    """One table the planner shards (enough to rebuild it on meta and plan again)."""

    name: str
    num_embeddings: int
    embedding_dim: int
    feature_names: tuple[str, ...]
    pooling: str | None = None
    data_type: str | None = None
    sharder_type: str | None = None


@dataclass(frozen=True)
class SharderArch:
    """A sharder's plan-affecting optimizer settings (from its ``fused_params``)."""

    sharder_type: str
    optimizer: str | None = None
    learning_rate: float | None = None
    eps: float | None = None
    weight_decay: float | None = None
    weight_decay_mode: str | None = None
    beta1: float | None = None
    beta2: float | None = None


@dataclass(frozen=True)
class ModelArch:
    """The model's sparse surface: its tables and sharders (``planner.model_arch``)."""

    tables: tuple[TableArch, ...]
    sharder_types: tuple[str, ...]
    sharders: tuple[SharderArch, ...] = ()


_EXTERNAL_FAILURE_PREFIX = "external_failure"


def _new_session_id() -> str:
    return str(uuid.uuid4())


@dataclass
class PlannerSessionContext:
    """What one planning session accumulates: the request, a result per target, and what the
    executor recorded on the way (timings in ms, topologies, reservations, the model's sparse
    surface, the enumerated options when the request asks for them). Mutable."""

    request: ShardingPlanRequest
    results: dict[str, ShardingPlanResult]
    session_id: str = field(default_factory=_new_session_id)
    topology_cache: dict[tuple[str, int, int], Any] = field(default_factory=dict)
    """Topology per (sku, world_size, local_world_size)."""
    timing: dict[str, float] = field(default_factory=dict)
    storage_reservations_used: dict[str, Any] = field(default_factory=dict)
    hw_overrides_applied: dict[str, Any] = field(default_factory=dict)
    cached_plans: dict[str, ShardingPlan] = field(default_factory=dict)
    client_metadata: dict[str, str] = field(default_factory=dict)
    cache_hit: dict[str, bool] = field(default_factory=dict)
    hw_source: dict[str, str] = field(default_factory=dict)
    resolved_hw_config: dict[str, str] = field(default_factory=dict)
    search_space: dict[str, tuple[ShardingOptionDetail, ...]] = field(default_factory=dict)
    search_space_urls: dict[str, str] = field(default_factory=dict)
    input_context_hash: dict[str, str] = field(default_factory=dict)
    external_trace_id: str | None = None
    report_metadata: PlanReportMetadata | None = None
    stats: list[Any] | None = None
    """Stats sinks for the planner (set by the orchestrator's reporter per target)."""
    warnings: list[str] = field(default_factory=list)
    persistence_enabled: bool | None = None
    model_arch: ModelArch | None = None
    content_urls: dict[str, str] = field(default_factory=dict)
    plan_persist_failures: dict[str, str] = field(default_factory=dict)

    def record_plan_persist_failure(self, operation: str, exc: BaseException) -> None:
        """Note that saving a plan failed (as data and as a warning); never raises."""
        try:
            self.plan_persist_failures[operation] = f"{type(exc).__name__}: {exc}"
        except BaseException:  # noqa: BLE001 - recording must never fail planning
            pass
        self.record_external_failure("manifold", operation, exc)

    def record_external_failure(self, system: str, operation: str, exc: BaseException) -> None:
        """Note, as a warning, that a best-effort call to ``system`` failed; never raises."""
        try:
            self.warnings.append(
                f"{_EXTERNAL_FAILURE_PREFIX} {system}:{operation}: {type(exc).__name__}: {exc}"
            )
        except BaseException:  # noqa: BLE001 - recording must never fail planning
            pass
