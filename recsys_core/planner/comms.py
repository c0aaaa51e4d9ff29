"""What a :class:`~recsys_core.planner.topology.Topology` is built of beyond numbers: collective
bandwidths (:class:`GeneralizedCommsBandwidth`, TorchRec's :class:`BasicCommsBandwidths`) and
per-rank capacities (:class:`CustomTopologyData`). Part of the planner's floor (both searches
stand on it); TorchRec names these in ``planner.types``.
"""

from __future__ import annotations

import abc
from enum import Enum

from recsys_core.planner.constants import CROSS_NODE_BANDWIDTH, INTRA_NODE_BANDWIDTH

__all__ = ["BasicCommsBandwidths", "CollectiveType", "CustomTopologyData",
           "GeneralizedCommsBandwidth"]


class CollectiveType(Enum):
    ALL_TO_ALL = "all_to_all"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_GATHER = "all_gather"
    ALL_REDUCE = "all_reduce"


class GeneralizedCommsBandwidth(abc.ABC):
    """Bandwidth (bytes/ms) of a collective over ``world_size`` ranks, ``local_world_size`` per
    host."""

    @abc.abstractmethod
    def get_bw(
        self, local_world_size: int, world_size: int, collective_type: CollectiveType
    ) -> float: ...

    @property
    @abc.abstractmethod
    def intra_host_bw(self) -> float: ...

    @property
    @abc.abstractmethod
    def inter_host_bw(self) -> float: ...


class BasicCommsBandwidths(GeneralizedCommsBandwidth):
    """Intra-host links inside one host, the NICs across hosts; an all-reduce uses one NIC per
    local rank."""

    def __init__(
        self,
        inter_host_bw: float = CROSS_NODE_BANDWIDTH,
        intra_host_bw: float = INTRA_NODE_BANDWIDTH,
    ) -> None:
        self.name = "BasicCommsBandwidths"
        self._inter_host_bw = inter_host_bw
        self._intra_host_bw = intra_host_bw

    @property
    def inter_host_bw(self) -> float:
        return self._inter_host_bw

    @property
    def intra_host_bw(self) -> float:
        return self._intra_host_bw

    def get_bw(
        self, local_world_size: int, world_size: int, collective_type: CollectiveType
    ) -> float:
        if collective_type == CollectiveType.ALL_REDUCE:
            return self.inter_host_bw * local_world_size
        return self.intra_host_bw if world_size <= local_world_size else self.inter_host_bw

    def __str__(self) -> str:
        return f"{self.name}: inter_host_bw={self.inter_host_bw}, intra_host_bw={self.intra_host_bw}"

    def __hash__(self) -> int:
        return hash((self._inter_host_bw, self._intra_host_bw))

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, BasicCommsBandwidths)
            and self._inter_host_bw == other._inter_host_bw
            and self._intra_host_bw == other._intra_host_bw
        )


class CustomTopologyData:
    """Per-rank capacities (``hbm_cap``, ``ddr_cap``, ``ssd_cap``: one value per rank)."""

    supported_fields = ["ddr_cap", "hbm_cap", "ssd_cap"]

    def __init__(self, data: dict[str, list[int]], world_size: int) -> None:
        unknown = [k for k in data if k not in self.supported_fields]
        if unknown:
            raise ValueError(f"CustomTopologyData: fields {unknown} are not supported; "
                             f"use {self.supported_fields}")
        wrong = {k: len(v) for k, v in data.items() if len(v) != world_size}
        if wrong:
            raise ValueError(f"CustomTopologyData: {wrong} values given; each field needs one "
                             f"per rank ({world_size})")
        self._data = data
        self._world_size = world_size

    def get_data(self, key: str) -> list[int]:
        if key not in self.supported_fields:
            raise ValueError(f"CustomTopologyData: {key!r} is not one of {self.supported_fields}")
        return self._data[key]

    def has_data(self, key: str) -> bool:
        return key in self._data
