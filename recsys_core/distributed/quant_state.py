"""TorchRec's ``torchrec.distributed.quant_state`` path: the description of one quantized weight
shard (:class:`WeightSpec`), as TorchRec's inference tooling records where each shard of a
sharded quantized table lives."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class WeightSpec:
    """Where a shard of a quantized table sits in its table.

    Example: the second row-wise half of a 1000 x 64 table,
    ``WeightSpec("ebc.embedding_bags.t.weight", [500, 0], [500, 64], "row_wise")``.
    """

    fqn: str
    """The weight's fully qualified name, e.g. ``"ebc.embedding_bags.table_0.weight"``."""
    shard_offsets: list[int]
    """Row and column of the shard's first element in the table."""
    shard_sizes: list[int]
    """Rows and columns of the shard."""
    sharding_type: str | None
    """``ShardingType`` value, e.g. ``"table_wise"``; None when unsharded."""
    virtual_table_dim_offsets: list[int] | None = None
    """For virtual (key-value) tables: where the embedding starts and ends in a stored row."""


__all__ = ["WeightSpec"]
