"""permute_parts (and select_columns, which now runs on it) is bit for bit
``index_select(cat(parts))`` forward and its zero fill + ``index_add`` backward: both are copies.
Every test runs through the C helper's column-run copy (recsys_core/sparse/_native.c) with its
vector builds, where it was built, and through the torch copies it falls back to."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from recsys_core.kernels.packed import (
    ColumnPermutation,
    column_permutation,
    permute_parts,
    permute_received,
    select_columns,
    select_columns_by_index,
)
from recsys_core.sparse import _native_lib
from tests.native_paths import native_path


# the C helper with its AVX-512 build and with memcpy (level 0), and the torch path
@pytest.fixture(autouse=True, params=[2, 0, None], ids=["native", "native_vec128", "torch_path"])
def copy_path(request: pytest.FixtureRequest) -> Iterator[int | None]:
    with native_path(request.param):
        yield request.param


def _reference(parts: list[torch.Tensor], columns: ColumnPermutation | None) -> torch.Tensor:
    return select_columns_by_index(torch.cat(parts, dim=1), columns)


def _random_columns(dims: list[int], block: int, gen: torch.Generator) -> list[int]:
    """A random order of ``block``-wide column groups of the concatenated parts (sometimes
    keeping neighbours together, so runs span several blocks and cross part boundaries)."""
    total = sum(dims)
    groups = [list(range(s, min(s + block, total))) for s in range(0, total, block)]
    order = torch.randperm(len(groups), generator=gen).tolist()
    return [c for g in order for c in groups[g]]


def _check(parts: list[torch.Tensor], columns: ColumnPermutation | None) -> None:
    mine = [p.detach().clone().requires_grad_(True) for p in parts]
    ref = [p.detach().clone().requires_grad_(True) for p in parts]
    out = permute_parts(mine, columns)
    expected = _reference(ref, columns)
    assert out.dtype == expected.dtype and out.shape == expected.shape
    assert torch.equal(out, expected)
    grad = torch.randn(out.shape, dtype=torch.float64).to(out.dtype)
    out.backward(grad)
    expected.backward(grad)
    for m, r in zip(mine, ref, strict=True):
        assert m.grad is not None and torch.equal(m.grad, r.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "dims, block",
    [
        ([8, 8], 4),  # two ranks, whole tables
        ([12, 4, 8], 4),  # three parts of different widths
        ([6, 10], 4),  # blocks and runs that cross the part boundary
        ([5, 3, 7], 1),  # single columns
        ([16], 4),  # one part: select_columns
        ([0, 12, 0, 4], 2),  # a rank with no columns
    ],
)
@pytest.mark.parametrize("rows", [0, 1, 5])
def test_equals_cat_and_index_select(
    dims: list[int], block: int, rows: int, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(sum(dims) * 31 + block * 7 + rows)
    for _ in range(5):
        columns = column_permutation(_random_columns(dims, block, gen))
        parts = [torch.randn(rows, d, generator=gen).to(dtype) for d in dims]
        _check(parts, columns)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dims, block", [([8, 8], 4), ([6, 10, 0], 2), ([16], 4), ([5, 3], 1)])
@pytest.mark.parametrize("rows", [0, 3])
def test_received_buffer_equals_split_cat_and_index_select(
    dims: list[int], block: int, rows: int, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(sum(dims) * 17 + rows)
    for _ in range(5):
        columns = column_permutation(_random_columns(dims, block, gen))
        flat = torch.randn(rows * sum(dims), generator=gen).to(dtype)
        mine, ref = flat.clone().requires_grad_(True), flat.clone().requires_grad_(True)
        out = permute_received(mine, rows, dims, columns)
        splits = ref.split([rows * d for d in dims])
        chunks = [c.view(rows, d) for c, d in zip(splits, dims, strict=True)]
        expected = _reference(chunks, columns)
        assert torch.equal(out, expected)
        grad = torch.randn(out.shape, generator=gen).to(dtype)
        out.backward(grad)
        expected.backward(grad)
        assert torch.equal(mine.grad, ref.grad)
        with torch.no_grad():
            assert torch.equal(permute_received(flat, rows, dims, columns), expected)


def test_one_received_chunk_without_permutation_is_a_view_of_the_buffer() -> None:
    # one rank: the all-to-all's output is the pooled buffer; its [rows, dim] view goes on,
    # and the buffer's gradient is the output's (no one-chunk split whose backward copies it)
    flat = torch.randn(3 * 8, requires_grad=True)
    out = permute_received(flat, 3, [8], None)
    assert out.data_ptr() == flat.data_ptr() and torch.equal(out, flat.detach().view(3, 8))
    nodes, todo = [], [out.grad_fn]
    while todo:
        node = todo.pop()
        nodes.append(type(node).__name__)
        todo += [f for f, _ in node.next_functions if f is not None]
    assert nodes == ["ViewBackward0", "AccumulateGrad"]
    grad = torch.randn(3, 8)
    out.backward(grad)
    assert torch.equal(flat.grad, grad.view(-1))


def test_received_buffer_of_the_wrong_size() -> None:
    with pytest.raises(ValueError, match=r"2 x 6 = 12 elements .* got shape \[10\]"):
        permute_received(torch.randn(10), 2, [4, 2], column_permutation([4, 5, 0, 1, 2, 3]))


def test_runs_are_one_copy_each() -> None:
    # two ranks dealt tables alternately (the reference DLRM layout, small): every table is a
    # run of its own; two tables adjacent in both orders are one run
    dims, width = [3 * 4, 2 * 4], 4
    # received [a c e | b d] -> output [a b c d e]; then [a b | c d e]-style runs merge
    perm = column_permutation([c for b in [0, 3, 1, 4, 2] for c in range(b * 4, b * 4 + 4)])
    assert perm is not None and perm.width == width
    assert len(perm.placement(dims).copies) == 5
    merged = column_permutation([c for b in [3, 4, 0, 1, 2] for c in range(b * 4, b * 4 + 4)])
    assert merged is not None
    assert len(merged.placement(dims).copies) == 2
    assert merged.placement(dims) is merged.placement(tuple(dims))  # cached by the widths


def test_one_part_is_select_columns() -> None:
    columns = column_permutation([4, 5, 6, 7, 0, 1, 2, 3])
    x = torch.randn(3, 8, requires_grad=True)
    y = select_columns(x, columns)
    assert torch.equal(y, x[:, [4, 5, 6, 7, 0, 1, 2, 3]])
    y.sum().backward()
    assert torch.equal(x.grad, torch.ones(3, 8))


def test_no_grad_and_parts_without_grad() -> None:
    columns = column_permutation([4, 5, 0, 1, 2, 3])
    a, b = torch.randn(2, 4), torch.randn(2, 2, requires_grad=True)
    with torch.no_grad():
        assert torch.equal(permute_parts([a, b], columns), _reference([a, b], columns))
    out = permute_parts([a, b], columns)
    out.backward(torch.arange(12.0).view(2, 6))
    assert a.grad is None
    assert torch.equal(b.grad, torch.tensor([[0.0, 1.0], [6.0, 7.0]]))


def test_no_permutation_is_the_cat_or_the_part() -> None:
    a, b = torch.randn(2, 3), torch.randn(2, 4)
    assert permute_parts([a], None) is a
    assert torch.equal(permute_parts([a, b], None), torch.cat([a, b], dim=1))


def test_mixed_dtypes_keep_cat_promotion() -> None:
    columns = column_permutation([3, 4, 0, 1, 2])
    a, b = torch.randn(2, 3, dtype=torch.bfloat16), torch.randn(2, 2)
    out = permute_parts([a, b], columns)
    assert out.dtype == torch.float32
    assert torch.equal(out, _reference([a, b], columns))


def test_repeated_blocks_fall_back_to_index_select() -> None:
    # not a permutation: the backward must sum the repeated block and zero the dropped one
    columns = ColumnPermutation(torch.tensor([1, 1, 0]), 2)
    parts = [torch.randn(3, 4), torch.randn(3, 2)]
    _check(parts, columns)


def test_wrong_width_names_both_layouts() -> None:
    columns = column_permutation([2, 3, 0, 1])
    with pytest.raises(ValueError, match=r"4 columns.*applied to 6 columns"):
        permute_parts([torch.randn(2, 4), torch.randn(2, 2)], columns)


def test_strided_rows_and_a_strided_gradient(copy_path: int | None) -> None:
    # parts that are column slices of wider tensors (row stride > width) and a gradient that
    # is itself a slice: the copies follow each tensor's row stride
    gen = torch.Generator().manual_seed(5)
    wide_a, wide_b = torch.randn(7, 20, generator=gen), torch.randn(7, 9, generator=gen)
    columns = column_permutation(_random_columns([12, 8], 4, gen))
    grad = torch.randn(7, 30, generator=gen)[:, 5:25]
    mine = [w.clone().requires_grad_(True) for w in (wide_a, wide_b)]
    ref = [w.clone().requires_grad_(True) for w in (wide_a, wide_b)]
    out = permute_parts([mine[0][:, 3:15], mine[1][:, 1:9]], columns)
    expected = _reference([ref[0][:, 3:15], ref[1][:, 1:9]], columns)
    assert torch.equal(out, expected)
    out.backward(grad)
    expected.backward(grad)
    for m, r in zip(mine, ref, strict=True):
        assert torch.equal(m.grad, r.grad)


def test_the_c_helper_copies_where_built(copy_path: int | None) -> None:
    # the helper takes the copies (not the torch fallback) on row-major host tensors
    a, b = torch.randn(4, 6), torch.randn(4, 2)
    wide = torch.empty(4, 8)
    runs = [(1, 0, 0, 2), (0, 0, 2, 6)]
    took = _native_lib.copy_column_runs(wide, [a, b], runs, to_parts=False)
    assert took == (copy_path is not None)
    if took:
        assert torch.equal(wide, torch.cat([b, a], dim=1))
        back = [torch.zeros(4, 6), None]
        assert _native_lib.copy_column_runs(wide * 2, back, runs, to_parts=True)
        assert torch.equal(back[0], a * 2)


@pytest.mark.parametrize("copy_path", [2, 0], indirect=True)  # the C helper checks the bounds
def test_a_run_outside_its_tensors_raises(copy_path: int | None) -> None:
    a, wide = torch.randn(3, 4), torch.empty(3, 4)
    with pytest.raises(ValueError, match="outside them"):
        _native_lib.copy_column_runs(wide, [a], [(0, 2, 0, 4)], to_parts=False)
    with pytest.raises(ValueError, match="outside them"):
        _native_lib.copy_column_runs(wide, [a], [(0, 0, 1, 4)], to_parts=True)
