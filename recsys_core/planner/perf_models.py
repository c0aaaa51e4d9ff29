"""TorchRec's trivial plan ratings: the busiest rank's estimated time (:class:`NoopPerfModel`)
or HBM (:class:`NoopStorageModel`). "Noop": estimated, nothing is run."""

from __future__ import annotations

from collections.abc import Callable

from recsys_core.planner.interfaces import PerfModel
from recsys_core.planner.sharding_option import ShardingOption
from recsys_core.planner.storage import Shard
from recsys_core.planner.topology import Topology


class NoopPerfModel(PerfModel):
    """The largest per-rank sum of shard ``perf.total``."""

    def __init__(self, topology: Topology) -> None:
        self._topology = topology

    def rate(self, plan: list[ShardingOption]) -> float:
        return _busiest_rank(plan, self._topology.world_size, lambda s: s.perf.total, 0.0)


class NoopStorageModel(PerfModel):
    """The largest per-rank sum of shard ``storage.hbm``."""

    def __init__(self, topology: Topology) -> None:
        self._topology = topology

    def rate(self, plan: list[ShardingOption]) -> float:
        return _busiest_rank(plan, self._topology.world_size, lambda s: s.storage.hbm, 0)


def _busiest_rank(
    plan: list[ShardingOption], world_size: int, amount: Callable[[Shard], float], zero: float,
) -> float:
    """The largest per-rank sum of ``amount`` over the plan's shards (``zero`` for a rank with
    none)."""
    per_rank = [zero] * world_size
    for sharding_option in plan:
        for shard in sharding_option.shards:
            per_rank[shard.rank] += amount(shard)
    return max(per_rank)
