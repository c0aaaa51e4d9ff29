"""Tables packed into one table-batched kernel: a typed spec, and the column order of its output.

A collection (sharded or fused) packs several tables (or shards of tables) into one kernel per
pooling type. The kernel's pooled output has one column block per feature in *kernel* order;
the collection returns them in its own order, which a :class:`ColumnPermutation` restores.

Example, features a (dim 2, MEAN table) and b (dim 3, SUM table): kernels run SUM first, so the
packed output is ``[b0 b1 b2 | a0 a1]``; the module wants ``[a | b]``, i.e. columns
``[3, 4, 0, 1, 2]``, a permutation of single-column blocks (width 1). With dims 4 and 8 the
blocks are 4 columns wide, which makes the copy and its backward cheaper.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from recsys_core.kernels.cached_tbe import TableCache
from recsys_core.kernels.config import FusedOptimizerConfig, KernelBackend
from recsys_core.kernels.tbe import build_table_batched_embedding


@dataclass(frozen=True, kw_only=True)
class PackedTable:
    """One table (or one shard of a table) held by a kernel."""

    name: str
    """The table's name in the collection (shards of one table share it)."""
    rows: int
    """Rows held (an empty shard holds 0; the kernel then keeps one spare row)."""
    dim: int
    """Columns held."""
    cache: TableCache | None = None
    """Held in a slower tier behind a cache of this many rows (None: all rows in the kernel)."""

    def __post_init__(self) -> None:
        if self.rows < 0 or self.dim < 1:
            raise ValueError(
                f"PackedTable {self.name!r}: rows must be >= 0 and dim >= 1, got rows "
                f"{self.rows}, dim {self.dim}"
            )


@dataclass(frozen=True, kw_only=True)
class PackedKernelSpec:
    """Everything needed to build one table-batched kernel for some packed tables."""

    tables: tuple[PackedTable, ...]
    """The tables in kernel order."""
    feature_table_map: tuple[int, ...]
    """For each feature the kernel looks up (in kernel order), the index of its table."""
    pooling_mean: bool
    """MEAN pooling (else SUM)."""
    weighted: bool
    """Per-sample weights will be passed."""
    optimizer: FusedOptimizerConfig
    """The optimizer fused into the kernel's backward."""
    backend: KernelBackend = KernelBackend.AUTO
    """FBGEMM, TORCH, or AUTO (FBGEMM where it is exact here, else torch)."""
    offload_dir: str | None = None
    """Where the backing files of cached tables go on CPU (None: the temporary directory)."""
    features: tuple[str, ...] = ()
    """The looked-up features' names, one per ``feature_table_map`` entry (errors name them);
    empty: unnamed."""

    def __post_init__(self) -> None:
        bad = [t for t in self.feature_table_map if not 0 <= t < len(self.tables)]
        if bad:
            raise ValueError(
                f"PackedKernelSpec: feature_table_map names table index(es) {bad}, but only "
                f"{len(self.tables)} table(s) are packed"
            )
        if self.features and len(self.features) != len(self.feature_table_map):
            raise ValueError(
                f"PackedKernelSpec: {len(self.features)} feature names for "
                f"{len(self.feature_table_map)} feature_table_map entries; give one per entry"
            )

    def build(self, device: torch.device) -> nn.Module:
        """The kernel (zero-initialized; fill it through ``split_embedding_weights()``)."""
        return build_table_batched_embedding(
            rows=[max(t.rows, 1) for t in self.tables],
            dims=[t.dim for t in self.tables],
            feature_table_map=list(self.feature_table_map),
            pooling_mean=self.pooling_mean,
            optimizer=self.optimizer,
            device=device,
            backend=self.backend,
            weighted=self.weighted,
            caches=[t.cache for t in self.tables],
            offload_dir=self.offload_dir,
            table_names=[t.name for t in self.tables],
        )


@dataclass(frozen=True)
class ColumnPermutation:
    """Reorders columns in blocks of ``width``: ``x.view(B, -1, width)[:, blocks]``.

    Moving whole blocks (a table's or shard's columns) instead of single columns makes the
    copy and its backward (an index_add over blocks) several times cheaper.
    """

    blocks: torch.Tensor
    width: int


def column_permutation(columns: Sequence[int]) -> ColumnPermutation | None:
    """The block permutation that gives column ``columns[i]`` at position ``i``, or None if the
    columns are already in order."""
    columns = list(columns)
    if columns == list(range(len(columns))):
        return None
    width = 0
    start = 0
    for i in range(1, len(columns) + 1):
        if i == len(columns) or columns[i] != columns[i - 1] + 1:
            width = math.gcd(width, i - start, columns[start])
            start = i
    width = max(width, 1)
    blocks = [columns[b] // width for b in range(0, len(columns), width)]
    return ColumnPermutation(torch.tensor(blocks, dtype=torch.long), width)


def select_columns(x: torch.Tensor, columns: ColumnPermutation | None) -> torch.Tensor:
    """``x`` with its columns reordered by ``columns`` (``x`` itself when None)."""
    if columns is None:
        return x
    rows, width = x.shape[0], columns.width
    blocks = x.reshape(rows, x.shape[1] // width, width)  # not -1: a batch may have no rows
    return blocks.index_select(1, columns.blocks.to(x.device)).reshape(rows, x.shape[1])
