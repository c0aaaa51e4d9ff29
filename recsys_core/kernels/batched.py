"""Tables batched into table-batched kernels: where a fused collection's tables live.

TorchRec splits this job between ``BatchedFusedEmbeddingBag`` (one kernel over a group of
tables) and the grouped lookups (``GroupedPooledEmbeddingsLookup``); :class:`BatchedTables` is
both. It owns

- the kernels, one per :class:`~recsys_core.kernels.packed.PackedKernelSpec` (FBGEMM or torch,
  cached or not: ``PackedKernelSpec.build``, or the caller's builder, e.g. the sharded
  collections' DENSE kernel), each table filled right after its kernel is built;
- the lookup of a KJT keyed in kernel order: its values and offsets split per kernel, pooled
  (:meth:`BatchedTables.lookup`) or one row per id (:meth:`BatchedTables.lookup_rows`), ids out
  of range reported by feature (``checked_lookup``), and the prefetch of cached kernels' rows;
- views of every table's weight and optimizer state, in the caller's table order.

:meth:`BatchedTables.grouped` packs a collection's tables, one kernel per pooling type::

    tables   a (SUM; f0)   b (MEAN; f1, f2)   c (SUM; f3)
    kernels  0: SUM  [a, c]  features f0 f3   members [0, 2]
             1: MEAN [b]     features f1 f2   members [1]
    lookup(KJT keyed f0 f3 f1 f2) -> [B, da + dc | db + db]   (kernel 0's columns first)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from recsys_core.kernels.cached_tbe import CachedTableBatchedEmbedding
from recsys_core.kernels.config import FusedOptimizerConfig, KernelBackend
from recsys_core.kernels.packed import PackedKernelSpec, PackedTable
from recsys_core.kernels.tbe import checked_lookup, kernel_backend

if TYPE_CHECKING:  # kernels sit below the sparse types; they only read a KJT's tensors
    from recsys_core.sparse import KeyedJaggedTensor

TableFill = Callable[[int, torch.Tensor], None]
"""``fill(table index, weight view)``: writes a table's initial weights into its kernel."""

RowFill = Callable[[int, torch.Tensor, int], None]
"""``fill_rows(table index, view of rows first_row:first_row + len(view), first_row)``: writes
some rows' initial weights (a table may come in several blocks, see :class:`BatchedTables`)."""

KernelBuilder = Callable[[PackedKernelSpec, torch.device], nn.Module]
"""Builds one kernel from its spec (zero-initialized, with ``split_embedding_weights()``,
``split_optimizer_states()`` and TBE's ``forward(indices, offsets, per_sample_weights)``)."""

FILL_BLOCK_ROWS = 65536
"""Rows per ``fill_rows`` block of a table kept in a backing file (bounds the resident memory)."""


class BatchedTables:
    """Some tables in table-batched kernels, and the lookups through them (see the module doc).

    Args:
        specs: one per kernel: its tables, features (``PackedKernelSpec.features``), pooling,
            optimizer and backend.
        device: where the kernels live.
        members: ``members[k][p]``, the caller's index of kernel ``k``'s table ``p`` (default:
            the tables numbered in kernel order).
        fill: called for each table right after its kernel is built, in kernel order (a meta
            module passes None: there is nothing to fill).
        fill_rows: instead of ``fill``, called with blocks of a table's rows: one block of all
            its rows, or for a table in a backing file (a cached kernel) blocks of
            :data:`FILL_BLOCK_ROWS` rows, each dropped from resident memory once written, so the
            table may be larger than the memory. A table of no rows gets no call.
        build: builds each kernel (default: ``PackedKernelSpec.build``, a fused kernel).

    The kernels are not ``nn.Module`` children of anything here: a collection decides whether
    they appear in its module tree (the fused collections keep them out, as TorchRec does).
    """

    def __init__(
        self,
        specs: Sequence[PackedKernelSpec],
        device: torch.device,
        *,
        members: Sequence[Sequence[int]] | None = None,
        fill: TableFill | None = None,
        fill_rows: RowFill | None = None,
        build: KernelBuilder | None = None,
    ) -> None:
        if fill is not None and fill_rows is not None:
            raise ValueError("BatchedTables: pass fill or fill_rows, not both")
        self.specs = list(specs)
        if members is None:
            sizes = [len(spec.tables) for spec in self.specs]
            starts = [sum(sizes[:k]) for k in range(len(sizes))]
            members = [range(start, start + n) for start, n in zip(starts, sizes, strict=True)]
        self.members = [list(m) for m in members]
        if [len(m) for m in self.members] != [len(s.tables) for s in self.specs]:
            raise ValueError(
                f"BatchedTables: members {self.members} do not match the kernels' table counts "
                f"{[len(s.tables) for s in self.specs]}"
            )
        self.kernels: list[nn.Module] = []
        for spec, indices in zip(self.specs, self.members, strict=True):
            kernel = spec.build(device) if build is None else build(spec, device)
            if fill is not None:
                for index, view in zip(indices, kernel.split_embedding_weights(), strict=True):
                    fill(index, view)
            if fill_rows is not None:
                _fill_in_blocks(kernel, spec, indices, fill_rows)
            self.kernels.append(kernel)
        self.features = [
            list(spec.features) or [spec.tables[t].name for t in spec.feature_table_map]
            for spec in self.specs
        ]
        """Each kernel's features, in kernel order (a feature of several tables repeats)."""
        self.feature_order = [f for names in self.features for f in names]
        """The keys :meth:`lookup` expects, in order."""
        self._rows = [[max(s.tables[t].rows, 1) for t in s.feature_table_map] for s in self.specs]
        self._dims = [[s.tables[t].dim for t in s.feature_table_map] for s in self.specs]
        self._orders: dict[tuple[str, ...], list[int] | None] = {}
        # the caller's table index -> (kernel, table within it)
        self._positions: dict[int, tuple[int, int]] = {
            index: (k, p) for k, indices in enumerate(self.members) for p, index in enumerate(indices)
        }

    @classmethod
    def grouped(
        cls,
        tables: Sequence[PackedTable],
        features: Sequence[Sequence[str]],
        pooling_mean: Sequence[bool],
        *,
        device: torch.device,
        optimizer: FusedOptimizerConfig,
        backend: KernelBackend = KernelBackend.AUTO,
        weighted: bool = False,
        fill: TableFill | None = None,
    ) -> BatchedTables:
        """One kernel per pooling type and weight dtype, in the order they first appear;
        tables keep their order within a kernel, each with its features (``features[i]`` for
        ``tables[i]``)."""
        groups: dict[tuple[bool, torch.dtype], list[int]] = {}
        for index, mean in enumerate(pooling_mean):
            groups.setdefault((bool(mean), tables[index].dtype), []).append(index)
        specs = [
            PackedKernelSpec(
                tables=tuple(tables[i] for i in indices),
                feature_table_map=tuple(p for p, i in enumerate(indices) for _ in features[i]),
                pooling_mean=mean,
                weighted=weighted,
                optimizer=optimizer,
                backend=backend,
                features=tuple(f for i in indices for f in features[i]),
            )
            for (mean, _), indices in groups.items()
        ]
        return cls(specs, device, members=list(groups.values()), fill=fill)

    # ---- lookups -------------------------------------------------------------------------------
    def in_kernel_order(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """``features`` keyed as :attr:`feature_order` (itself when it already is)."""
        keys = tuple(features.keys())
        if keys not in self._orders:
            if list(keys) == self.feature_order:
                self._orders[keys] = None
            else:
                index = {k: i for i, k in enumerate(keys)}
                self._orders[keys] = [index[f] for f in self.feature_order]
        order = self._orders[keys]
        return features if order is None else features.permute(order)

    def lookup(self, kjt: KeyedJaggedTensor, weighted: bool) -> torch.Tensor:
        """Pooled ``[kjt.stride(), sum of the features' dims]`` of a KJT keyed as
        :attr:`feature_order`; ``weighted``: pass its weights as per-sample weights."""
        if not self.kernels:
            return torch.zeros(kjt.stride(), 0)
        outs = []
        for k, part in enumerate(self._per_kernel(kjt)):
            values, offsets = part.values(), part.offsets()
            if offsets.dtype != values.dtype:
                offsets = offsets.to(values.dtype)
            outs.append(self._lookup(k, values, offsets, part.weights() if weighted else None))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)

    def lookup_rows(self, values: torch.Tensor, counts: Sequence[int]) -> list[torch.Tensor]:
        """One row per id: ``[counts[i], dim_i]`` for each feature ``i`` of :attr:`feature_order`,
        whose ids are ``values``, one feature after the other. The kernels pool, so each id is
        looked up as a bag of its own (a bag of one pools to the id's row, SUM or MEAN)::

            counts [2, 0, 1] -> 2 bags per feature, lengths [1 1 | 0 0 | 1 0]; feature i's rows
            are the first counts[i] rows of its column block of the pooled [2, sum(dims)]
        """
        if not self.kernels:
            return []
        device = values.device
        width = max(max(counts, default=0), 1)  # bags per feature; a kernel needs one at least
        n = torch.tensor(list(counts), device=device)
        lengths = (torch.arange(width, device=device) < n.unsqueeze(1)).reshape(-1)
        offsets = torch.zeros(lengths.numel() + 1, dtype=values.dtype, device=device)
        offsets[1:] = lengths.cumsum(0)
        rows: list[torch.Tensor] = []
        first = 0  # the kernel's first feature
        for k, names in enumerate(self.features):
            last = first + len(names)
            if len(self.kernels) == 1:
                ids, bags = values, offsets
            else:
                lo, hi = sum(counts[:first]), sum(counts[:last])
                bags = offsets[first * width : last * width + 1] - lo
                ids = values[lo:hi]
            pooled = self._lookup(k, ids, bags, None)
            column = 0
            for count, dim in zip(counts[first:last], self._dims[k], strict=True):
                rows.append(pooled[:count, column : column + dim])
                column += dim
            first = last
        return rows

    def prefetch(self, kjt: KeyedJaggedTensor) -> None:
        """Bring the rows a later :meth:`lookup` of ``kjt`` (keyed as :attr:`feature_order`)
        reads into the caches of cached kernels (the others have nothing to prefetch)."""
        if not any(isinstance(k, CachedTableBatchedEmbedding) for k in self.kernels):
            return
        for kernel, part in zip(self.kernels, self._per_kernel(kjt), strict=True):
            if isinstance(kernel, CachedTableBatchedEmbedding):
                kernel.prefetch(part.values(), part.offsets())

    def _per_kernel(self, kjt: KeyedJaggedTensor) -> list[KeyedJaggedTensor]:
        return kjt.split([len(f) for f in self.features]) if len(self.kernels) > 1 else [kjt]

    def _lookup(
        self, k: int, values: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None
    ) -> torch.Tensor:
        return checked_lookup(
            self.kernels[k], values, offsets, weights,
            feature_names=self.features[k], rows_per_feature=self._rows[k],
        )

    # ---- state ---------------------------------------------------------------------------------
    def split_embedding_weights(self) -> list[torch.Tensor]:
        """Each table's weight, in the caller's order: a view of its kernel's storage (of the
        backing store for a cached table: current after the kernel's ``flush()``)."""
        views = [kernel.split_embedding_weights() for kernel in self.kernels]
        return [views[k][p] for _, (k, p) in sorted(self._positions.items())]

    def split_optimizer_states(self) -> list[dict[str, torch.Tensor]]:
        """Each table's optimizer state views (``momentum1`` ...), in the caller's order."""
        states = [kernel.split_optimizer_states() for kernel in self.kernels]
        return [states[k][p] for _, (k, p) in sorted(self._positions.items())]

    def backends(self) -> list[KernelBackend]:
        """Which implementation runs each kernel."""
        return [kernel_backend(k) for k in self.kernels]

    def train(self, mode: bool = True) -> None:
        for kernel in self.kernels:
            kernel.train(mode)


def _fill_in_blocks(
    kernel: nn.Module, spec: PackedKernelSpec, indices: Sequence[int], fill_rows: RowFill
) -> None:
    cached = isinstance(kernel, CachedTableBatchedEmbedding)
    for position, (index, table, view) in enumerate(
        zip(indices, spec.tables, kernel.split_embedding_weights(), strict=True)
    ):
        step = FILL_BLOCK_ROWS if cached else max(table.rows, 1)
        for first in range(0, table.rows, step):
            last = min(table.rows, first + step)
            fill_rows(index, view[first:last], first)
            if cached:
                # checksummed while the block is in memory, then dropped from it
                kernel.record_filled(position, first, last)
                kernel.release_memory()
