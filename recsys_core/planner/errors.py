"""The planner's error, and what it says as data when memory ran out.

A :class:`PlannerError` about memory carries a :class:`MemoryShortfall`: how much the tables
need (the largest by name), how much the ranks have and where that figure came from, so an
application can word its own remedies (its flags) instead of the library's.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, unique
from typing import Any

from recsys_core.modules.embedding_configs import DataType
from recsys_core.planner.topology import Topology
from recsys_core.planner.units import format_bytes

SHOWN_TABLES = 3  # the largest tables a message names


@unique
class PlannerErrorType(Enum):
    """What kind of failure a :class:`PlannerError` reports (TorchRec's values)."""

    INSUFFICIENT_STORAGE = "insufficient_storage"  # the tables need more memory than all ranks have
    STRICT_CONSTRAINTS = "strict_constraints"  # it would fit, but not with the allowed layouts
    PARTITION = "partition"
    OTHER = "other"
    PLANNER_INPUT_CONTEXT_MISMATCH = "planner_input_context_mismatch"
    PLAN_LOADING_FAILED = "plan_loading_failed"
    INVALID_RANK_ASSIGNMENT = "invalid_rank_assignment"
    INPUT_VALIDATION = "input_validation"  # e.g. constraints for tables the model does not have
    MISSING_MODULE_IN_PLAN = "missing_module_in_plan"
    INVALID_COMPUTE_KERNEL = "invalid_compute_kernel"


class PlannerError(ValueError):
    """The planner cannot produce a plan: nothing fits, or the constraints exclude every layout
    (a ValueError: the inputs, not the program, are what must change).

    ``error_type`` classifies it as TorchRec does (``PlannerError(message, error_type)``).
    ``shortfall`` says, as data, what did not fit where memory ran out (None for other errors),
    so an application can word its own remedies."""

    def __init__(
        self,
        message: str,
        error_type: PlannerErrorType = PlannerErrorType.OTHER,
        shortfall: MemoryShortfall | None = None,
    ) -> None:
        super().__init__(message)
        self.error_type = PlannerErrorType(error_type)
        self.shortfall = shortfall

    def __reduce__(self) -> tuple[Any, ...]:  # keep the type and shortfall across processes
        return (type(self), (str(self), self.error_type, self.shortfall))


class PlannerContextFingerprintError(RuntimeError):
    """TorchRec 1.9: the planner's inputs could not be fingerprinted (its planner then skips
    a stored plan and plans afresh)."""


@dataclass(frozen=True, kw_only=True)
class TableMemory:
    """The least memory one table needs (its most compact allowed layout)."""

    table: str
    """Table name."""
    module: str
    """Module path of its collection (``""`` at the top level)."""
    num_embeddings: int
    """Rows."""
    embedding_dim: int
    """Columns."""
    data_type: DataType
    """Weight data type."""
    needed_bytes: float
    """Weights, optimizer state and buffers, summed over its shards."""

    def __str__(self) -> str:
        return (f"{self.table!r} {self.num_embeddings} x {self.embedding_dim} {self.data_type}: "
                f"{format_bytes(self.needed_bytes)}")


@dataclass(frozen=True, kw_only=True)
class MemoryShortfall:
    """Why a plan failed for lack of memory, as data (for an application's own remedies)."""

    summary: str
    """What does not fit, how much it needs, how much each rank has and where that figure came
    from: the error message without its remedies."""
    memory: str
    """The memory that ran out: "host memory", "HBM" or "memory (HBM + host)"; on a CPU
    topology with disk (``ssd_cap``) also "disk" or "memory (host + disk)"."""
    needed_bytes: float
    """The least all tables need of that memory together (most compact allowed layouts)."""
    usable_bytes: float
    """What all ranks have of it together, after the storage reservation. When one table fits
    on no rank although the total would fit, needed_bytes <= usable_bytes."""
    reservation: float
    """Fraction of each rank's memory kept for dense parameters and activations."""
    topology: Topology
    """What was planned for (ranks, hosts, memory per rank and its source)."""
    tables: tuple[TableMemory, ...]
    """Every table, largest first."""

    @property
    def largest(self) -> tuple[TableMemory, ...]:
        return self.tables[:SHOWN_TABLES]
