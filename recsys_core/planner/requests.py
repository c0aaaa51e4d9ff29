"""TorchRec 1.9's planning request: what to plan (:class:`ShardingPlanRequest`) and how
(:class:`PlannerConfig`), as plain, hashable data. Importable from ``planner.types`` (TorchRec's
path); ``planner.api`` plans one.

    request = ShardingPlanRequest(model=model, sharders=get_default_sharders(),
                                  world_size=8, local_world_size=8, batch_size=512)
    request.request_hash   # 16 hex digits over every plan-affecting field

The dataclasses are frozen and positional (not keyword-only) as TorchRec's, whose new fields
are appended so that positional construction keeps its meaning. The enums are ``str`` enums:
a member equals, hashes and serializes as its value.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from torch import nn

from recsys_core.planner.constraints import ParameterConstraints
from recsys_core.planner.context_hash import hash_sha256_to_int
from recsys_core.planner.storage_reservations import StorageReservation

__all__ = [
    "EmoConfig",
    "PlannerConfig",
    "PlannerVariant",
    "ProposerConfig",
    "ProposerGroup",
    "ShardingPlanRequest",
    "StorageReservationPolicy",
    "TrainingFramework",
    "TuneClfConfig",
]


class TrainingFramework(str, Enum):
    """The training framework a plan is for (Meta's; ``UNSET``, falsy, for none)."""

    UNSET = ""
    APF = "apf"
    PYPER = "pyper"
    MVAI = "mvai"


class PlannerVariant(str, Enum):
    """The planner backend. ``UNSET`` and ``OSS`` run ``EmbeddingShardingPlanner``; the others
    are Meta-internal in TorchRec and refused by the default provider."""

    UNSET = ""
    OSS = "oss"
    LINEAR_PROGRAMMING = "linear_programming"
    MANIFOLD = "manifold"


class StorageReservationPolicy(str, Enum):
    """How memory for the dense part is reserved before planning (``UNSET``: heuristical)."""

    UNSET = ""
    HEURISTICAL = "heuristical"
    FIXED_PERCENTAGE = "fixed_percentage"
    INFERENCE = "inference"
    SKU_AWARE = "sku_aware"


@dataclass(frozen=True)
class TuneClfConfig:
    """Cache-load-factor search knobs of Meta's linear-programming planner (None: its default)."""

    increment_size: float | None = None
    max_clf: float | None = None
    min_clf: float | None = None
    min_prefetch_compute_decrease: float | None = None
    enable_clf_reduction: bool | None = None


@dataclass(frozen=True)
class EmoConfig:
    """Embedding-offload knobs of Meta's linear-programming planner (None: its default)."""

    integration_type: str | None = None
    prefetch_compute_limit_per_rank: float | None = None
    tune_clf_config: TuneClfConfig | None = None


@dataclass(frozen=True)
class ProposerGroup:
    """Dynamic-column-dim proposer arguments for the tables whose fqn matches ``regex``."""

    regex: str
    step_size: int = 10
    target: str = "perf"
    target_reshard_count: int | None = None
    min_col_dim: int = 20
    max_inferior_proposals: int = 2
    max_proposals: int = 10


@dataclass(frozen=True)
class ProposerConfig:
    """Which proposer to build and its arguments (None: the proposer's default).

    ``kind``: ``default`` (the planner's own set), ``greedy``, ``uniform``, ``grid_search``,
    ``embedding_offload_scaleup``; Meta's ``dynamic_col_dim``,
    ``embedding_offload_cache_scaling`` and ``grouped_dynamic_col_dim`` keep the default set.
    """

    kind: str = "default"
    step_size: int | None = None
    target: str | None = None
    target_reshard_count: int | None = None
    min_col_dim: int | None = None
    max_inferior_proposals: int | None = None
    max_proposals: int | None = None
    allow_scale_down: bool | None = None
    demote_clf_threshold: float | None = None
    use_depth: bool | None = None
    groups: tuple[ProposerGroup, ...] = ()


@dataclass(frozen=True)
class PlannerConfig:
    """How to plan, as data that is part of the request's hash (see ``planner.provider`` for
    what the default provider builds from each field)."""

    planner_variant: PlannerVariant = PlannerVariant.UNSET
    """``UNSET``/``OSS``: ``EmbeddingShardingPlanner``."""
    storage_reservation_policy: StorageReservationPolicy = StorageReservationPolicy.UNSET
    """``UNSET``/``HEURISTICAL``, ``FIXED_PERCENTAGE``; ``INFERENCE`` and ``SKU_AWARE`` are
    refused by the default provider here."""
    storage_reservation_percentage: float | None = None
    """The reserved fraction of memory, in [0, 1] (None: 0.15)."""
    proposer_type: str | None = None
    """``greedy``, ``grid_search`` or ``uniform`` (another value: the planner's default set).
    Not together with ``proposer_config``."""
    partitioner_type: str | None = None
    """``greedy_perf`` or ``memory_balanced`` (None: the planner's default)."""
    use_hardware_based_compute: bool = False
    """Meta's hardware-based perf estimates (not built by the default provider)."""
    use_hardware_based_bandwidth: bool = False
    """Meta's hardware-based bandwidths (not built by the default provider)."""
    bwd_compute_multiplier: float | None = None
    """Backward cost relative to forward (>= 0; None: the topology's)."""
    manifold_path: str | None = None
    """Where Meta's MANIFOLD variant loads a plan from."""
    debug: bool = False
    """Passed to the planner."""
    timeout_seconds: int | None = None
    """Passed to the planner."""
    pipeline_type: str | None = None
    """A ``PipelineType`` value for the storage estimator (None: no pipeline)."""
    dense_tensor_estimate: int | None = None
    """Dense bytes per rank for the heuristical reservation (None: measured)."""
    use_batch_inputs_for_expected_cache_fetches: bool = False
    use_linear_regression_prefetch_estimate: bool = False
    balance_modules: bool = False
    """Passed to the partitioner."""
    partitioner_sort_by: str | None = None
    """``perf`` or ``storage`` for ``greedy_perf`` (None: storage)."""
    memory_balanced_max_search_count: int | None = None
    memory_balanced_tolerance: float | None = None
    performance_model: str | None = None
    """``storage``: rate plans by their largest per-rank HBM (None: by estimated time)."""
    proposer_config: ProposerConfig | None = None
    """The structured proposer choice; not together with ``proposer_type``."""
    model_base_bytes: int | None = None
    """For the SKU-aware reservation (Meta's)."""
    parameter_multiplier: float | None = None
    """Dense-parameter multiplier of the heuristical reservation (finite, >= 0; None: 6.0)."""
    home_sku: str | None = None
    """For the SKU-aware reservation (Meta's)."""

    def request_hash_extension(self) -> tuple[object, ...] | None:
        """More data for the request's hash (for subclasses; None here)."""
        return None

    def __post_init__(self) -> None:
        if self.proposer_type is not None and self.proposer_config is not None:
            raise ValueError(
                "PlannerConfig: set proposer_type or proposer_config, not both "
                f"(got proposer_type={self.proposer_type!r} and a ProposerConfig)"
            )
        pct = self.storage_reservation_percentage
        if pct is not None and not 0.0 <= pct <= 1.0:
            raise ValueError(
                f"PlannerConfig: storage_reservation_percentage must be between 0.0 and 1.0, "
                f"got {pct}"
            )
        if self.bwd_compute_multiplier is not None and self.bwd_compute_multiplier < 0:
            raise ValueError(
                "PlannerConfig: bwd_compute_multiplier must be non-negative, got "
                f"{self.bwd_compute_multiplier}"
            )
        mult = self.parameter_multiplier
        if mult is not None and (not math.isfinite(mult) or mult < 0):
            raise ValueError(
                "PlannerConfig: parameter_multiplier must be a finite non-negative number, got "
                f"{mult}"
            )


def _new_request_id() -> str:
    return uuid.uuid4().hex


@dataclass(frozen=True)
class ShardingPlanRequest:
    """What to plan: the model (or a factory of it), its sharders, the cluster and the batch.

    Frozen fields; the ``sharders`` list and ``constraints`` dict are read, never changed."""

    model: nn.Module | Callable[[], nn.Module]
    """The model, or a zero-argument factory called when planning."""
    sharders: list[Any]
    """The sharders (e.g. ``get_default_sharders()``)."""
    world_size: int
    local_world_size: int
    """Ranks per host; divides ``world_size``."""
    batch_size: int
    """Samples per rank per step."""
    pod_size: int | None = None
    storage_reservation: StorageReservation | None = None
    """Wins over ``planner_config``'s reservation policy."""
    constraints: dict[str, ParameterConstraints] | None = None
    training_framework: TrainingFramework = TrainingFramework.UNSET
    """A member or its value (a string is converted; an unknown one is a ValueError)."""
    hbm_gb: float | None = None
    """HBM per rank in GiB (None: the topology's default)."""
    ddr_gb: float | None = None
    """Host memory per rank in GiB (None: the topology's default)."""
    launcher_hardware: str | None = None
    compute_device: str | None = None
    """``cuda``, ``cpu`` or ``mtia`` (None: ``KernelConfig``'s default, cuda)."""
    planner_config: PlannerConfig = field(default_factory=PlannerConfig)
    request_id: str = field(default_factory=_new_request_id)
    """Unique per request object (not hashed)."""
    capture_search_space: bool = False
    """Keep every enumerated option on the session context (not hashed)."""

    def __post_init__(self) -> None:
        if not isinstance(self.training_framework, TrainingFramework):
            try:
                framework = TrainingFramework(self.training_framework)
            except ValueError as error:
                raise ValueError(
                    "ShardingPlanRequest: training_framework must be a TrainingFramework or one "
                    f"of {[f.value for f in TrainingFramework]}, got "
                    f"{self.training_framework!r}"
                ) from error
            object.__setattr__(self, "training_framework", framework)
        for name in ("world_size", "local_world_size", "batch_size"):
            if getattr(self, name) <= 0:
                raise ValueError(
                    f"ShardingPlanRequest: {name} must be positive, got {getattr(self, name)}"
                )
        if self.pod_size is not None and self.pod_size <= 0:
            raise ValueError(f"ShardingPlanRequest: pod_size must be positive, got {self.pod_size}")
        for name in ("hbm_gb", "ddr_gb"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"ShardingPlanRequest: {name} must be non-negative, got {value}")
        if self.local_world_size > self.world_size:
            raise ValueError(
                f"ShardingPlanRequest: local_world_size ({self.local_world_size}) must not "
                f"exceed world_size ({self.world_size})"
            )
        if self.world_size % self.local_world_size != 0:
            raise ValueError(
                f"ShardingPlanRequest: world_size ({self.world_size}) must be divisible by "
                f"local_world_size ({self.local_world_size})"
            )
        if self.pod_size is not None and self.pod_size > self.world_size:
            raise ValueError(
                f"ShardingPlanRequest: pod_size ({self.pod_size}) must not exceed world_size "
                f"({self.world_size})"
            )

    @property
    def request_hash(self) -> str:
        """16 hex digits of SHA-256 over the plan-affecting fields: equal for equal requests
        (constraints in key order), whatever the model, sharders, reservation object and id."""
        cfg = self.planner_config
        pc = cfg.proposer_config
        proposer = None if pc is None else (
            pc.kind, pc.step_size, pc.target, pc.target_reshard_count, pc.min_col_dim,
            pc.max_inferior_proposals, pc.max_proposals, pc.allow_scale_down,
            pc.demote_clf_threshold, pc.use_depth,
            tuple((g.regex, g.step_size, g.target, g.target_reshard_count, g.min_col_dim,
                   g.max_inferior_proposals, g.max_proposals) for g in pc.groups),
        )
        constraints = (
            None if self.constraints is None
            else [(k, self.constraints[k]) for k in sorted(self.constraints)]
        )
        fields = [
            self.world_size, self.local_world_size, self.batch_size, self.pod_size, self.hbm_gb,
            self.ddr_gb, self.training_framework.value, self.launcher_hardware,
            self.compute_device, constraints, cfg.planner_variant.value,
            cfg.storage_reservation_policy.value, cfg.storage_reservation_percentage,
            cfg.parameter_multiplier, cfg.proposer_type, cfg.partitioner_type,
            cfg.use_hardware_based_compute, cfg.use_hardware_based_bandwidth,
            cfg.bwd_compute_multiplier, cfg.manifold_path, cfg.debug, cfg.timeout_seconds,
            cfg.pipeline_type, cfg.dense_tensor_estimate,
            cfg.use_batch_inputs_for_expected_cache_fetches,
            cfg.use_linear_regression_prefetch_estimate, cfg.balance_modules,
            cfg.partitioner_sort_by, cfg.memory_balanced_max_search_count,
            cfg.memory_balanced_tolerance, cfg.performance_model, proposer,
            cfg.request_hash_extension(),
        ]
        return format(hash_sha256_to_int(fields), "x")[:16]
