"""TorchRec 1.9's planning entry point: a request in, a result per target out.

    from recsys_core.planner.api import ProductionPlannerOrchestrator
    from recsys_core.planner.executor import DefaultPlannerExecutor
    from recsys_core.planner.types import PlannerSessionContext, ShardingPlanRequest

    request = ShardingPlanRequest(model=model, sharders=sharders, world_size=2,
                                  local_world_size=2, batch_size=512, compute_device="cpu")
    ctx = PlannerSessionContext(request=request, results={})
    results = ProductionPlannerOrchestrator(DefaultPlannerExecutor(), sku="cpu").plan(request, ctx)
    plan = results["cpu"].sharding_plan          # also ctx.results["cpu"]

In a process group (``torch.distributed`` initialized) rank 0 plans and every rank receives
the plan (on the given ``broadcast_pg``, else the default group); the estimates are rank 0's
alone (other ranks' results have ``is_planning_rank`` False and no per-table detail). A
``PlannerError`` is an unsuccessful result; any other error is raised.
"""

from __future__ import annotations

import abc
import dataclasses
import logging
import time
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

from recsys_core.planner.errors import PlannerErrorType
from recsys_core.planner.protocols import PlannerExecutor
from recsys_core.planner.reporter import DefaultPlanReporter, PlanReporter
from recsys_core.planner.requests import ShardingPlanRequest
from recsys_core.planner.results import PlannerSessionContext, ShardingPlanResult

logger: logging.Logger = logging.getLogger(__name__)

__all__ = ["ProductionPlannerOrchestrator", "ShardingPlannerAPI"]


def _plan_location(stats: list[Any] | None) -> str | None:
    """Where a stats sink saved the plan, if one did (Meta's sinks say so)."""
    for sink in stats or []:
        getter = getattr(sink, "get_most_recent_sharding_plan_dump_location", None)
        if callable(getter):
            location = getter()
            if location:
                return str(location)
    return None


class ShardingPlannerAPI(abc.ABC):
    """Plans a request for each of its targets (``_targets``) with ``executor``; subclasses
    say which targets. ``reporter`` builds each target's stats sinks (default: the console
    table); ``broadcast_pg`` carries a collective plan (default: the default group when
    ``torch.distributed`` is initialized, else plans locally)."""

    def __init__(
        self,
        executor: PlannerExecutor,
        reporter: PlanReporter | None = None,
        broadcast_pg: dist.ProcessGroup | None = None,
    ) -> None:
        self._executor = executor
        self._reporter: PlanReporter = reporter if reporter is not None else DefaultPlanReporter()
        self._broadcast_pg = broadcast_pg

    def plan(
        self, request: ShardingPlanRequest, ctx: PlannerSessionContext
    ) -> Mapping[str, ShardingPlanResult]:
        """Plan ``request`` (which must be ``ctx.request``) for every target, once each; the
        results also go to ``ctx.results``. ``ctx.timing["total_planner_time"]`` is the
        whole loop in ms."""
        if request is not ctx.request:
            raise ValueError(
                "ShardingPlannerAPI.plan: request must be the same object as ctx.request "
                "(build the context with PlannerSessionContext(request=request, results={}))"
            )
        pg = self._get_broadcast_pg()
        results: dict[str, ShardingPlanResult] = {}
        start = time.perf_counter()
        for sku in dict.fromkeys(self._targets(request)):
            try:
                try:
                    ctx.stats = self._reporter.build_stats(ctx, sku)
                except Exception:  # reports never stop a plan
                    logger.warning("planner: building the stats sinks for %s failed; planning "
                                   "without them", sku, exc_info=True)
                    ctx.stats = []
                result = self._executor.run(sku=sku, ctx=ctx, pg=pg)
                try:
                    location = _plan_location(ctx.stats)
                except Exception:
                    logger.warning("planner: reading where %s's plan was saved failed", sku,
                                   exc_info=True)
                    location = None
                if location:
                    result = dataclasses.replace(result, sharding_plan_manifold_url=location)
                result = self._finalize_result(sku, result, request)
            except Exception as error:
                if not self._isolate_target_errors():
                    raise
                logger.warning("planner: target %s failed; recorded as unsuccessful", sku,
                               exc_info=True)
                result = self._finalize_result(sku, self._failed_result(sku, ctx, error), request)
            ctx.results[sku] = result
            results[sku] = result
        ctx.timing["total_planner_time"] = (time.perf_counter() - start) * 1000.0
        return results

    def _isolate_target_errors(self) -> bool:
        """False: an unexpected error in one target is raised (True: recorded as an
        unsuccessful result and the other targets are planned)."""
        return False

    def _failed_result(
        self, sku: str, ctx: PlannerSessionContext, error: Exception
    ) -> ShardingPlanResult:
        return ShardingPlanResult(
            sku=sku, success=False, sharding_plan=None,
            planner_failure_reason=f"{type(error).__name__}: {error}",
            planner_error_type=PlannerErrorType.OTHER, estimated_max_hbm_bytes=0,
            estimated_max_ddr_bytes=0, request_hash=ctx.request.request_hash,
            request_id=ctx.request.request_id,
        )

    def _finalize_result(
        self, sku: str, result: ShardingPlanResult, request: ShardingPlanRequest
    ) -> ShardingPlanResult:
        """Post-processing of each target's result (for subclasses; unchanged here)."""
        return result

    @abc.abstractmethod
    def _targets(self, request: ShardingPlanRequest) -> list[str]:
        """The targets to plan for; each keys one result."""

    def _get_broadcast_pg(self) -> dist.ProcessGroup | None:
        if self._broadcast_pg is not None:
            return self._broadcast_pg
        if dist.is_available() and dist.is_initialized():
            return dist.group.WORLD
        return None


class ProductionPlannerOrchestrator(ShardingPlannerAPI):
    """Plans for the one target the job runs on (``sku``, resolved by the caller)."""

    def __init__(
        self,
        executor: PlannerExecutor,
        sku: str,
        reporter: PlanReporter | None = None,
        broadcast_pg: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(executor, reporter, broadcast_pg=broadcast_pg)
        self._sku = sku

    def _targets(self, request: ShardingPlanRequest) -> list[str]:
        return [self._sku]
