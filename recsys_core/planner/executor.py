"""Plans one target of a session (TorchRec 1.9's ``planner.executor``).

:class:`DefaultPlannerExecutor` ``run(sku, ctx, pg)``: builds the topology, reservation and
planner through its provider, plans ``ctx.request`` (collectively over ``pg``, else locally),
and returns a :class:`~recsys_core.planner.results.ShardingPlanResult` with the chosen options'
estimates: the largest per-rank HBM and host memory, the critical path, and the per-rank
estimated time's maximum, mean and their ratio. A ``PlannerError`` becomes an unsuccessful
result that carries the error's type; any other error propagates. Each phase's time (ms) is
recorded on ``ctx.timing`` under ``<phase>:<sku>``.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch.distributed as dist
from torch import nn

from recsys_core.planner.errors import PlannerError
from recsys_core.planner.model_arch import extract_model_arch
from recsys_core.planner.provider import DefaultPlannerProvider, PlannerProvider
from recsys_core.planner.results import (
    PlannerSessionContext,
    ShardingOptionDetail,
    ShardingPlanResult,
)

if TYPE_CHECKING:
    from recsys_core.planner.sharding_option import ShardingOption

__all__ = ["DefaultPlannerExecutor"]


def _materialize_model(model: nn.Module | Callable[[], nn.Module]) -> nn.Module:
    if isinstance(model, nn.Module):
        return model
    if not callable(model):
        raise TypeError(
            "ShardingPlanRequest.model must be an nn.Module or a factory returning one, got "
            f"{type(model).__name__}"
        )
    built = model()
    if not isinstance(built, nn.Module):
        raise TypeError(
            f"ShardingPlanRequest.model's factory must return an nn.Module, got "
            f"{type(built).__name__}"
        )
    return built


def _peak_per_rank(options: list[ShardingOption]) -> tuple[int, int]:
    """The largest per-rank sums of the shards' HBM and host memory."""
    hbm: dict[int, int] = defaultdict(int)
    ddr: dict[int, int] = defaultdict(int)
    for option in options:
        for shard in option.shards:
            if shard.storage is not None and shard.rank is not None:
                hbm[shard.rank] += shard.storage.hbm
                ddr[shard.rank] += shard.storage.ddr
    return max(hbm.values(), default=0), max(ddr.values(), default=0)


def _critical_path(options: list[ShardingOption]) -> tuple[float, float]:
    """TorchRec's critical path (comms, compute): ranks wait for each other after each
    (module, sharding type, direction) exchange and after each direction's compute, so each
    of these costs its slowest rank's sum."""
    comms: dict[tuple[object, str, str], dict[int, float]] = defaultdict(lambda: defaultdict(float))
    comp: dict[str, dict[int, float]] = defaultdict(lambda: defaultdict(float))
    for option in options:
        for shard in option.shards:
            rank, perf = int(shard.rank), shard.perf
            comms[(option.path, option.sharding_type, "fwd")][rank] += perf.fwd_comms
            comms[(option.path, option.sharding_type, "bwd")][rank] += perf.bwd_comms
            comp["fwd"][rank] += perf.fwd_compute
            comp["bwd"][rank] += perf.bwd_compute
    return (sum(max(v.values()) for v in comms.values()),
            sum(max(v.values()) for v in comp.values()))


def _plan_quality(options: list[ShardingOption]) -> dict[str, float | None]:
    """The result's critical-path and balance fields; None where the plan has no estimate (off
    the planning rank). Never raises: these are for reports, not for the plan."""
    quality: dict[str, float | None] = dict.fromkeys((
        "critical_path_ms", "comms_critical_path_ms", "comp_critical_path_ms",
        "max_rank_perf", "mean_rank_perf", "perf_imbalance_ratio"))
    if not options:
        return quality
    with contextlib.suppress(Exception):
        comms, comp = _critical_path(options)
        quality.update(critical_path_ms=comms + comp, comms_critical_path_ms=comms,
                       comp_critical_path_ms=comp)
    with contextlib.suppress(Exception):
        per_rank: dict[int, float] = defaultdict(float)
        for option in options:
            for shard in option.shards:
                if shard.rank is not None and shard.perf is not None:
                    per_rank[shard.rank] += shard.perf.total
        if per_rank:
            peak, mean = max(per_rank.values()), sum(per_rank.values()) / len(per_rank)
            quality.update(max_rank_perf=peak, mean_rank_perf=mean,
                           perf_imbalance_ratio=peak / mean if mean > 0 else None)
    return quality


class DefaultPlannerExecutor:
    """Plans one target with the pieces ``provider`` builds (default: TorchRec's open-source
    set, :class:`~recsys_core.planner.provider.DefaultPlannerProvider`)."""

    def __init__(self, provider: PlannerProvider | None = None) -> None:
        self._provider: PlannerProvider = provider or DefaultPlannerProvider()

    def run(
        self, sku: str, ctx: PlannerSessionContext, pg: dist.ProcessGroup | None = None
    ) -> ShardingPlanResult:
        request = ctx.request
        model = _materialize_model(request.model)
        if ctx.model_arch is None:
            with contextlib.suppress(Exception):  # for reports only
                ctx.model_arch = extract_model_arch(model, request.sharders)
        planning_rank = pg is None or pg.rank() == 0

        start = time.perf_counter()
        topology = self._provider.build_topology(sku, request, ctx)
        ctx.timing[f"topology_build:{sku}"] = _ms_since(start)
        ctx.topology_cache[(sku, topology.world_size, topology.local_world_size)] = topology
        start = time.perf_counter()
        reservation = self._provider.build_storage_reservation(sku, request)
        ctx.timing[f"storage_reservation:{sku}"] = _ms_since(start)
        ctx.storage_reservations_used[sku] = reservation
        start = time.perf_counter()
        planner = self._provider.build_planner(
            sku, topology=topology, storage_reservation=reservation, ctx=ctx)
        ctx.timing[f"planner_construction:{sku}"] = _ms_since(start)

        start = time.perf_counter()
        try:
            plan = (planner.collective_plan(model, request.sharders, pg) if pg is not None
                    else planner.plan(model, request.sharders))
        except PlannerError as error:
            ctx.timing[f"plan_call:{sku}"] = solve_ms = _ms_since(start)
            return ShardingPlanResult(
                sku=sku, success=False, sharding_plan=None, planner_failure_reason=str(error),
                planner_error_type=error.error_type, estimated_max_hbm_bytes=0,
                estimated_max_ddr_bytes=0, request_id=request.request_id,
                request_hash=request.request_hash, solve_time_ms=solve_ms,
                is_planning_rank=planning_rank,
            )
        ctx.timing[f"plan_call:{sku}"] = solve_ms = _ms_since(start)
        chosen = planner.get_selected_options()
        if request.capture_search_space:
            with contextlib.suppress(Exception):  # for reports only
                ctx.search_space[sku] = tuple(
                    ShardingOptionDetail.from_sharding_option(o)
                    for o in planner.get_search_space() or ())
        max_hbm, max_ddr = _peak_per_rank(chosen)
        return ShardingPlanResult(
            sku=sku, success=True, sharding_plan=plan, planner_failure_reason=None,
            estimated_max_hbm_bytes=max_hbm, estimated_max_ddr_bytes=max_ddr,
            request_id=request.request_id, request_hash=request.request_hash,
            sharding_options=tuple(ShardingOptionDetail.from_sharding_option(o) for o in chosen),
            solve_time_ms=solve_ms, is_planning_rank=planning_rank, **_plan_quality(chosen),
        )


def _ms_since(start: float) -> float:
    return (time.perf_counter() - start) * 1000.0
