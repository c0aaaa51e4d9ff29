"""Plan-independent table initialization: a hook the sharded collections apply to each shard.

A sharder given ``table_init=`` calls it once per local shard with the shard's place in its
table; an initializer that computes values from (table, row, column) alone gives every shard
the rows the unsharded table would have, whatever the plan or world size::

    init = SeededUniformInit(seed=3)
    sharder = EmbeddingBagCollectionSharder(fused_params=..., table_init=init)
    init.fill(whole, TableRegion(table="t", num_rows=9000, dim=6))     # unsharded table
    # rows 3000:6000, columns 4:6 of "t" on some rank == whole[3000:6000, 4:6]
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True, kw_only=True)
class TableRegion:
    """Where a tensor lies in its table: rows ``row_offset:+rows``, columns ``col_offset:+cols``
    of table ``table`` of shape ``[num_rows, dim]`` (rows and cols come from the tensor)."""

    table: str
    """The table's name."""
    num_rows: int
    """Rows of the whole table."""
    dim: int
    """Columns of the whole table."""
    row_offset: int = 0
    """First table row of the region."""
    col_offset: int = 0
    """First table column of the region."""


class TableInitializer(Protocol):
    """Fills a region of a table in place; the values must depend only on (table, row, column)
    for sharded and unsharded tables to agree."""

    def fill(self, weight: torch.Tensor, region: TableRegion) -> None: ...


@dataclass(frozen=True)
class SeededUniformInit:
    """``U(-sqrt(1/num_rows), sqrt(1/num_rows))`` from ``seed``, in independently seeded blocks
    of ``block_rows`` rows: a shard draws only the blocks it overlaps."""

    seed: int
    block_rows: int = 4096

    def fill(self, weight: torch.Tensor, region: TableRegion) -> None:
        rows, cols = weight.shape
        if rows == 0 or cols == 0:
            return
        bound = math.sqrt(1.0 / region.num_rows)
        first = region.row_offset // self.block_rows
        last = (region.row_offset + rows - 1) // self.block_rows
        with torch.no_grad():
            for block in range(first, last + 1):
                start = block * self.block_rows
                count = min(self.block_rows, region.num_rows - start)
                gen = torch.Generator().manual_seed(_block_seed(self.seed, region.table, block))
                values = torch.empty(count, region.dim).uniform_(-bound, bound, generator=gen)
                lo = max(start, region.row_offset)
                hi = min(start + count, region.row_offset + rows)
                weight[lo - region.row_offset : hi - region.row_offset].copy_(
                    values[lo - start : hi - start, region.col_offset : region.col_offset + cols]
                )


def _block_seed(seed: int, table: str, block: int) -> int:
    digest = hashlib.sha256(f"{seed}/{table}/{block}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)
