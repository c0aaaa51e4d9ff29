"""The ranks a model is sharded over (:class:`ShardingEnv`): plain data, no collectives."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import torch.distributed as dist


@dataclass
class ShardingEnv:
    """The ranks a model is sharded over.

    Attributes:
        world_size: number of ranks.
        rank: this process's rank.
        pg: the process group (None for a plan-only or single-process environment).
        local_world_size: ranks per host (table-row-wise keeps row traffic inside a host).
    """

    world_size: int
    rank: int
    pg: dist.ProcessGroup | None = None
    local_world_size: int = 0

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"ShardingEnv: world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"ShardingEnv: rank {self.rank} is outside [0, {self.world_size})")
        if self.local_world_size <= 0:
            self.local_world_size = _local_world_size(self.world_size)
        if self.world_size % self.local_world_size:
            raise ValueError(
                f"ShardingEnv: world_size {self.world_size} is not a multiple of "
                f"local_world_size {self.local_world_size}; set LOCAL_WORLD_SIZE correctly"
            )

    @classmethod
    def from_process_group(cls, pg: dist.ProcessGroup) -> ShardingEnv:
        return cls(world_size=pg.size(), rank=pg.rank(), pg=pg)

    @classmethod
    def from_local(cls, world_size: int, rank: int) -> ShardingEnv:
        return cls(world_size=world_size, rank=rank, pg=None)

    @property
    def num_hosts(self) -> int:
        return self.world_size // self.local_world_size

    def host_of(self, rank: int) -> int:
        return rank // self.local_world_size


def _local_world_size(world_size: int) -> int:
    value = os.environ.get("LOCAL_WORLD_SIZE")
    if value is not None and not value.isdigit():
        raise ValueError(f"LOCAL_WORLD_SIZE={value!r} is not a positive integer")
    if value is None:
        if world_size > 1:
            warnings.warn(
                "LOCAL_WORLD_SIZE is not set (torchrun sets it); treating all "
                f"{world_size} ranks as one host",
                stacklevel=3,
            )
        return world_size
    return int(value)
