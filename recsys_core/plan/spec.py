"""Where a table's shards live: torch's ``ShardMetadata`` and ``EnumerableShardingSpec`` (the types
TorchRec's ``ParameterSharding.sharding_spec`` holds), with this library's accessors.

Both are subclasses of torch's classes (``isinstance`` and equality with torch's instances hold),
with two differences:

- ``ShardMetadata`` adds ``rank`` and ``device`` (read from its ``placement``, a
  ``torch.distributed._remote_device``), and accepts any offsets/sizes at construction;
- ``EnumerableShardingSpec`` does not check its shards at construction:
  :func:`~recsys_core.plan.validation.validate_module_sharding_plan` checks them against the
  table (every sharder runs it), with a message that names the table and the fix.

Example: ``ShardMetadata([0, 4], [10, 4], "rank:1/cuda:1")`` is columns 4..7 of a 10-row table,
on rank 1's ``cuda:1``: ``.rank == 1``, ``.device == "cuda:1"``,
``.placement.device() == torch.device("cuda:1")``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from torch.distributed._shard.metadata import ShardMetadata as _TorchShardMetadata
from torch.distributed._shard.sharding_spec import (
    EnumerableShardingSpec as _TorchEnumerableShardingSpec,
)
from torch.distributed.remote_device import _remote_device

_PLACEMENT_FIX = "write it as 'rank:<r>/<device>', e.g. 'rank:0/cpu'"
_PLACEMENT_SLOT = _TorchShardMetadata.__dict__["placement"]  # torch's __slots__ member


class Placement(_remote_device):
    """torch's ``_remote_device`` ("rank:<r>/<device>") whose repr is its quoted string, so
    messages show ``'rank:1/cuda:1'``."""

    def __repr__(self) -> str:
        return repr(_remote_device.__repr__(self))

    def __str__(self) -> str:
        return _remote_device.__repr__(self)


class ShardMetadata(_TorchShardMetadata):
    """One shard: ``shard_offsets`` and ``shard_sizes`` ([row, col]) and its ``placement``."""

    __slots__ = ()

    def __init__(
        self,
        shard_offsets: Sequence[int],
        shard_sizes: Sequence[int],
        placement: str | _remote_device | None = None,
    ) -> None:
        # No checks here (torch's would raise without naming the table); see the module docstring.
        self.shard_offsets = list(shard_offsets)
        self.shard_sizes = list(shard_sizes)
        self.placement = placement  # the setter parses strings

    @property
    def placement(self) -> Placement | None:
        """Where the shard lives; a string assigned here is parsed ("rank:1/cuda:1")."""
        return _PLACEMENT_SLOT.__get__(self)

    @placement.setter
    def placement(self, value: str | _remote_device | None) -> None:
        if isinstance(value, _remote_device) and not isinstance(value, Placement):
            value = str(value)
        _PLACEMENT_SLOT.__set__(self, Placement(value) if isinstance(value, str) else value)

    @classmethod
    def of(cls, shard: _TorchShardMetadata) -> ShardMetadata:
        """This class's view of a torch ``ShardMetadata`` (itself if it already is one)."""
        if isinstance(shard, cls):
            return shard
        return cls(shard.shard_offsets, shard.shard_sizes, shard.placement)

    @property
    def rank(self) -> int:
        rank = None if self.placement is None else self.placement.rank()
        if rank is None:
            raise ValueError(f"shard placement {str(self.placement)!r} names no rank; {_PLACEMENT_FIX}")
        return int(rank)

    @property
    def device(self) -> str:
        """The placement's device, e.g. ``"cpu"`` or ``"cuda:1"``."""
        if self.placement is None:
            raise ValueError(f"shard has no placement; {_PLACEMENT_FIX}")
        return str(self.placement.device())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _TorchShardMetadata):
            return NotImplemented
        return (
            list(self.shard_offsets) == list(other.shard_offsets)
            and list(self.shard_sizes) == list(other.shard_sizes)
            and self.placement == other.placement
        )

    __hash__ = _TorchShardMetadata.__hash__

    def to_dict(self) -> dict[str, Any]:
        return {
            "shard_offsets": list(self.shard_offsets),
            "shard_sizes": list(self.shard_sizes),
            "placement": None if self.placement is None else str(self.placement),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ShardMetadata:
        return cls(list(data["shard_offsets"]), list(data["shard_sizes"]), data["placement"])


class EnumerableShardingSpec(_TorchEnumerableShardingSpec):
    """The shards of one table, in order (torch's spec; checked by the plan validator)."""

    # This class's shards (__post_init__ converts torch's); torch declares list[its own
    # ShardMetadata], and list is invariant, hence the one ignore here instead of at each read.
    shards: list[ShardMetadata]  # type: ignore[assignment]

    def __post_init__(self) -> None:
        self.shards = [ShardMetadata.of(s) for s in self.shards]

    @classmethod
    def of(
        cls, spec: _TorchEnumerableShardingSpec | Iterable[_TorchShardMetadata]
    ) -> EnumerableShardingSpec:
        """This class's view of a torch spec or of a list of shards."""
        if isinstance(spec, cls):
            return spec
        shards = spec.shards if isinstance(spec, _TorchEnumerableShardingSpec) else list(spec)
        return cls(list(shards))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _TorchEnumerableShardingSpec):
            return NotImplemented
        return list(self.shards) == list(other.shards)

    # This library's plans held a plain list of shards: index, iterate and count as before.
    def __getitem__(self, index: int) -> ShardMetadata:
        return self.shards[index]

    def __iter__(self) -> Iterator[ShardMetadata]:
        return iter(self.shards)

    def __len__(self) -> int:
        return len(self.shards)

    __hash__ = None  # type: ignore[assignment]  # mutable, as torch's
