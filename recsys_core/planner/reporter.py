"""Where a planning session reports its plans (TorchRec 1.9's ``planner.reporter``): a
:class:`PlanReporter` builds the stats sinks the planner logs to, per target."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from recsys_core.planner.results import PlannerSessionContext
from recsys_core.planner.stats import EmbeddingStats

__all__ = ["DefaultPlanReporter", "PlanReporter"]


@runtime_checkable
class PlanReporter(Protocol):
    """Builds the stats sinks for the target ``sku`` about to be planned."""

    def build_stats(self, ctx: PlannerSessionContext, sku: str) -> list[Any]: ...


class DefaultPlanReporter:
    """The console table only (:class:`~recsys_core.planner.stats.EmbeddingStats`),
    a fresh one per target."""

    def build_stats(self, ctx: PlannerSessionContext, sku: str) -> list[Any]:
        return [EmbeddingStats()]
