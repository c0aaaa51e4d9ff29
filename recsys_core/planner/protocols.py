"""The planner API's pluggable seam (TorchRec 1.9's ``planner.protocols``): a
:class:`PlannerExecutor` plans one target of a session (``planner.executor`` has the default).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch.distributed as dist

from recsys_core.planner.results import PlannerSessionContext, ShardingPlanResult

__all__ = ["PlannerExecutor"]


@runtime_checkable
class PlannerExecutor(Protocol):
    """Builds and runs the planner for one target (``sku``) of ``ctx.request``."""

    def run(
        self, sku: str, ctx: PlannerSessionContext, pg: dist.ProcessGroup | None = None
    ) -> ShardingPlanResult:
        """Plan ``ctx.request`` for ``sku``: collectively over ``pg`` (rank 0 plans, every rank
        gets the plan) when given, else on this process alone."""
        ...
