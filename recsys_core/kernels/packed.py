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
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import nn
from torch.autograd.function import FunctionCtx, once_differentiable

from recsys_core.kernels.cached_tbe import TableCache
from recsys_core.kernels.config import FusedOptimizerConfig, KernelBackend
from recsys_core.kernels.tbe import build_table_batched_embedding
from recsys_core.sparse import _native_lib


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
    dtype: torch.dtype = torch.float32
    """The weights' dtype: float32, or float16 (an FP16 table; a cached table is float32)."""

    def __post_init__(self) -> None:
        if self.cache is not None and self.dtype != torch.float32:
            raise ValueError(f"PackedTable {self.name!r}: a cached table is kept in float32")
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

    @property
    def weights_dtype(self) -> torch.dtype:
        """The dtype of every table's weights (one per kernel, as FBGEMM's)."""
        return self.tables[0].dtype if self.tables else torch.float32

    def __post_init__(self) -> None:
        if len({t.dtype for t in self.tables}) > 1:
            raise ValueError(
                "PackedKernelSpec: tables of one kernel share a dtype, got "
                f"{[(t.name, t.dtype) for t in self.tables]}; pack each dtype in its own kernel"
            )
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
            weights_dtype=self.weights_dtype,
        )


class _Copy(NamedTuple):
    """Output columns ``[dst, dst + cols)`` are columns ``[src, src + cols)`` of part ``part``
    (a tuple in the order :func:`recsys_core.sparse._native_lib.copy_column_runs` takes)."""

    part: int
    src: int
    dst: int
    cols: int


@dataclass(frozen=True)
class _Placement:
    """How one ColumnPermutation places parts of given widths: the fewest slice copies."""

    copies: tuple[_Copy, ...]
    """Each maximal run of output columns that is a run of one part's columns."""
    bijective: bool
    """Every input column lands in exactly one output column (a true permutation): the
    backward is then copies too; otherwise it needs the zero fill and sum of index_add."""


@dataclass(frozen=True)
class ColumnPermutation:
    """Reorders columns in blocks of ``width``: ``x.view(B, -1, width)[:, blocks]``.

    Moving whole blocks (a table's or shard's columns) instead of single columns makes the
    copy and its backward cheaper; :func:`permute_parts` goes further and copies each run of
    consecutive blocks with one slice copy, straight from the parts the blocks arrive in.
    """

    blocks: torch.Tensor
    width: int
    _placements: dict[tuple[int, ...], _Placement] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def placement(self, dims: Sequence[int]) -> _Placement:
        """The slice copies that place parts of widths ``dims`` (cached per ``dims``)."""
        key = tuple(dims)
        found = self._placements.get(key)
        if found is None:
            found = self._placements[key] = _place_runs(self.blocks.tolist(), self.width, key)
        return found


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


def _place_runs(blocks: list[int], width: int, dims: tuple[int, ...]) -> _Placement:
    total = sum(dims)
    if total != len(blocks) * width or any(not 0 <= b < len(blocks) for b in blocks):
        raise ValueError(
            f"ColumnPermutation of {len(blocks)} block(s) of width {width} "
            f"({len(blocks) * width} columns, blocks {blocks}) applied to "
            f"{total} columns (parts of widths {list(dims)}); the permutation must be built "
            "for the same column layout (see column_permutation)"
        )
    # maximal runs in the concatenated input: (dst, src, cols)
    runs: list[list[int]] = []
    for j, b in enumerate(blocks):
        if runs and runs[-1][1] + runs[-1][2] == b * width:
            runs[-1][2] += width
        else:
            runs.append([j * width, b * width, width])
    starts = [sum(dims[:i]) for i in range(len(dims))]
    copies: list[_Copy] = []
    for dst, src, cols in runs:  # split runs at part boundaries
        while cols:
            part = max(i for i, s in enumerate(starts) if s <= src and dims[i] > 0)
            n = min(cols, starts[part] + dims[part] - src)
            copies.append(_Copy(part, src - starts[part], dst, n))
            dst, src, cols = dst + n, src + n, cols - n
    return _Placement(tuple(copies), sorted(blocks) == list(range(len(blocks))))


def copy_runs(
    wide: torch.Tensor,
    parts: Sequence[torch.Tensor | None],
    runs: Sequence[tuple[int, int, int, int]],
    to_parts: bool,
) -> None:
    """Copy column runs ``(part, part column, wide column, columns)`` between ``wide`` and
    ``parts`` (into the parts with ``to_parts``, else into ``wide``; runs of a None part are
    skipped): in C row by row where the helper takes the tensors
    (:func:`recsys_core.sparse._native_lib.copy_column_runs`), else one slice copy per run."""
    if _native_lib.copy_column_runs(wide, parts, runs, to_parts=to_parts):
        return
    for part, src, dst, cols in runs:
        p = parts[part]
        if p is None:
            continue
        if to_parts:
            p[:, src : src + cols].copy_(wide[:, dst : dst + cols])
        else:
            wide[:, dst : dst + cols].copy_(p[:, src : src + cols])


def _copy_out(parts: Sequence[torch.Tensor], copies: Sequence[_Copy], total: int) -> torch.Tensor:
    out = parts[0].new_empty(parts[0].shape[0], total)
    copy_runs(out, parts, copies, to_parts=False)
    return out


class _PermutePartsCtx(FunctionCtx):
    """The autograd context of :class:`_PermuteParts` as its methods use it (torch's
    ``FunctionCtx`` declares neither what forward stores nor ``needs_input_grad``)."""

    placement: _Placement
    dims: tuple[int, ...]
    needs_input_grad: tuple[bool, ...]


class _PermuteReceivedCtx(FunctionCtx):
    """The autograd context of :class:`_PermuteReceived` as its methods use it."""

    rows: int
    dims: tuple[int, ...]
    placement: _Placement


class _PermuteParts(torch.autograd.Function):
    """Forward: one slice copy per run. Backward: each part's gradient is the inverse copies
    (no zero fill, no index_add: the placement is a bijection, every column is written once)."""

    @staticmethod
    def forward(
        ctx: _PermutePartsCtx,
        placement: _Placement,
        dims: tuple[int, ...],
        *parts: torch.Tensor,
    ) -> torch.Tensor:
        ctx.placement, ctx.dims = placement, dims
        return _copy_out(parts, placement.copies, sum(dims))

    @staticmethod
    @once_differentiable
    def backward(
        ctx: _PermutePartsCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        needs = ctx.needs_input_grad[2:]
        grads: list[torch.Tensor | None] = [
            grad.new_empty(grad.shape[0], d) if need else None
            for d, need in zip(ctx.dims, needs, strict=True)
        ]
        copy_runs(grad, grads, ctx.placement.copies, to_parts=True)
        return (None, None, *grads)


def _chunks(flat: torch.Tensor, rows: int, dims: Sequence[int]) -> list[torch.Tensor]:
    if len(dims) == 1:  # a view: a one-chunk split's backward would copy the whole gradient
        return [flat.view(rows, dims[0])]
    return [c.view(rows, d) for c, d in zip(flat.split([rows * d for d in dims]), dims, strict=True)]


class _PermuteReceived(torch.autograd.Function):
    """:class:`_PermuteParts` whose parts are ``[rows, d]`` chunks of one flat buffer: the
    backward fills one gradient buffer of the same layout, so no split backward concatenates
    the parts' gradients again."""

    @staticmethod
    def forward(
        ctx: _PermuteReceivedCtx,
        flat: torch.Tensor,
        rows: int,
        dims: tuple[int, ...],
        placement: _Placement,
    ) -> torch.Tensor:
        ctx.rows, ctx.dims, ctx.placement = rows, dims, placement
        return _copy_out(_chunks(flat, rows, dims), placement.copies, sum(dims))

    @staticmethod
    @once_differentiable
    def backward(
        ctx: _PermuteReceivedCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        rows, dims = ctx.rows, ctx.dims
        flat = grad.new_empty(rows * sum(dims))
        copy_runs(grad, _chunks(flat, rows, dims), ctx.placement.copies, to_parts=True)
        return flat, None, None, None


def permute_received(
    flat: torch.Tensor, rows: int, dims: Sequence[int], columns: ColumnPermutation | None
) -> torch.Tensor:
    """:func:`permute_parts` of ``flat``'s consecutive ``[rows, dims[i]]`` chunks (an
    all-to-all's output, one chunk per source rank), its gradient one buffer like ``flat``.

    Example, ``rows`` 2, ``dims`` ``[2, 1]``: ``flat`` ``[a0 a1 a2 a3 | b0 b1]`` holds parts
    ``[[a0 a1], [a2 a3]]`` and ``[[b0], [b1]]``."""
    if flat.dim() != 1 or flat.numel() != rows * sum(dims):
        raise ValueError(
            f"permute_received: a flat buffer of {rows} x {sum(dims)} = {rows * sum(dims)} "
            f"elements (chunks of widths {list(dims)}) expected, got shape {list(flat.shape)}"
        )
    dims = tuple(dims)
    if columns is None or not columns.placement(dims).bijective:
        return permute_parts(_chunks(flat, rows, dims), columns)
    placement = columns.placement(dims)
    if torch.is_grad_enabled() and flat.requires_grad:
        return _PermuteReceived.apply(flat, rows, dims, placement)
    return _copy_out(_chunks(flat, rows, dims), placement.copies, sum(dims))


def permute_parts(
    parts: Sequence[torch.Tensor], columns: ColumnPermutation | None
) -> torch.Tensor:
    """``select_columns(torch.cat(parts, 1), columns)`` with one slice copy per run of
    consecutive blocks, each way, and no concatenated intermediate.

    Example, parts ``P = [p0 p1]`` (2 blocks) and ``Q = [q0]``, blocks ``[2, 0, 1]``: the
    output ``[q0 p0 p1]`` is two copies, ``Q`` to columns 0:1 and ``P`` to 1:3; the backward
    copies the gradient's column slices back the same way.
    """
    first = parts[0]
    uniform = all(
        p.dim() == 2 and p.shape[0] == first.shape[0] and p.dtype == first.dtype
        and p.device == first.device
        for p in parts
    )
    if columns is None or not uniform:  # cat's own type promotion and errors
        x = first if len(parts) == 1 else torch.cat(list(parts), dim=1)
        return select_columns_by_index(x, columns)
    dims = tuple(p.shape[1] for p in parts)
    placement = columns.placement(dims)
    if not placement.bijective:  # repeated or missing blocks: the backward must sum / zero
        return select_columns_by_index(torch.cat(list(parts), dim=1), columns)
    if torch.is_grad_enabled() and any(p.requires_grad for p in parts):
        return _PermuteParts.apply(placement, dims, *parts)
    return _copy_out(parts, placement.copies, sum(dims))


def select_columns_by_index(x: torch.Tensor, columns: ColumnPermutation | None) -> torch.Tensor:
    """:func:`select_columns` as one ``index_select`` over blocks (any block list, also one that
    repeats or drops blocks; its backward is a zero fill and an ``index_add``)."""
    if columns is None:
        return x
    rows, width = x.shape[0], columns.width
    blocks = x.reshape(rows, x.shape[1] // width, width)  # not -1: a batch may have no rows
    return blocks.index_select(1, columns.blocks.to(x.device)).reshape(rows, x.shape[1])


def select_columns(x: torch.Tensor, columns: ColumnPermutation | None) -> torch.Tensor:
    """``x`` with its columns reordered by ``columns`` (``x`` itself when None)."""
    if columns is None:
        return x
    return permute_parts([x], columns)
