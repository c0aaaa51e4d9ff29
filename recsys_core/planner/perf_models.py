"""TorchRec's trivial plan ratings: the busiest rank's estimated time (:class:`NoopPerfModel`)
or HBM (:class:`NoopStorageModel`). "Noop": estimated, nothing is run."""

from __future__ import annotations

from recsys_core.planner.interfaces import PerfModel
from recsys_core.planner.sharding_option import ShardingOption
from recsys_core.planner.topology import Topology


class NoopPerfModel(PerfModel):
    """The largest per-rank sum of shard ``perf.total``."""

    def __init__(self, topology: Topology) -> None:
        self._topology = topology

    def rate(self, plan: list[ShardingOption]) -> float:
        perfs = [0.0] * self._topology.world_size
        for sharding_option in plan:
            for shard in sharding_option.shards:
                perfs[shard.rank] += shard.perf.total
        return max(perfs)


class NoopStorageModel(PerfModel):
    """The largest per-rank sum of shard ``storage.hbm``."""

    def __init__(self, topology: Topology) -> None:
        self._topology = topology

    def rate(self, plan: list[ShardingOption]) -> float:
        hbms = [0] * self._topology.world_size
        for sharding_option in plan:
            for shard in sharding_option.shards:
                hbms[shard.rank] += shard.storage.hbm
        return max(hbms)
