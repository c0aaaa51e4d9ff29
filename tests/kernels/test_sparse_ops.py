"""sparse_ops: hand-computed cases, and the FBGEMM path against the torch path on random inputs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from jagged_examples import SIX_BAGS_OFFSETS, SIX_BAGS_PADDED_TO_2_WITH_10, SIX_BAGS_VALUES

from recsys_core.kernels import sparse_ops
from recsys_core.kernels._fbgemm import fbgemm_available

INDEX_DTYPES = [torch.int32, torch.int64]
NEEDS_FBGEMM = pytest.mark.skipif(not fbgemm_available(), reason="fbgemm_gpu is not importable")
PATHS = [pytest.param(True, marks=NEEDS_FBGEMM), False]  # use_fbgemm


def random_index_cases(test: Callable[..., None]) -> Callable[..., None]:
    """The random cases of a paths-agree test: seeds 0 to 3 x both index dtypes, with FBGEMM
    (the marks as ``@NEEDS_FBGEMM``, ``@parametrize("seed", ...)``, ``@parametrize("dtype",
    ...)`` written above the test, in that order)."""
    test = pytest.mark.parametrize("dtype", INDEX_DTYPES)(test)
    test = pytest.mark.parametrize("seed", range(4))(test)
    return NEEDS_FBGEMM(test)


def random_jagged(
    num_rows: int, max_len: int, seed: int, lengths_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, max_len + 1, (num_rows,), generator=gen).to(lengths_dtype)
    total = int(lengths.sum())
    values = torch.randint(0, 10_000, (total,), generator=gen)
    weights = torch.rand(total, generator=gen)
    return lengths, values, weights


def assert_paths_agree(op: Callable[..., Any], *args: Any) -> None:
    """``op(*args)`` gives the same outputs, exactly, on the FBGEMM path and the torch path."""
    fbgemm, plain = op(*args, use_fbgemm=True), op(*args, use_fbgemm=False)
    if isinstance(fbgemm, torch.Tensor):
        fbgemm, plain = [fbgemm], [plain]
    assert len(fbgemm) == len(plain)
    for a, b in zip(fbgemm, plain, strict=True):
        assert torch.equal(a, b)


# -- lengths_to_offsets / offsets_to_lengths ---------------------------------------------------


@pytest.mark.parametrize("dtype", INDEX_DTYPES)
@pytest.mark.parametrize("use_fbgemm", PATHS)
def test_lengths_to_offsets(dtype: torch.dtype, use_fbgemm: bool) -> None:
    offsets = sparse_ops.lengths_to_offsets(
        torch.tensor([3, 0, 2], dtype=dtype), use_fbgemm=use_fbgemm
    )
    assert offsets.dtype == dtype
    assert offsets.tolist() == [0, 3, 3, 5]
    empty = sparse_ops.lengths_to_offsets(torch.tensor([], dtype=dtype), use_fbgemm=use_fbgemm)
    assert empty.tolist() == [0]


@pytest.mark.parametrize("dtype", INDEX_DTYPES)
def test_offsets_to_lengths(dtype: torch.dtype) -> None:
    lengths = sparse_ops.offsets_to_lengths(torch.tensor([0, 3, 3, 5], dtype=dtype))
    assert lengths.tolist() == [3, 0, 2]
    assert lengths.dtype == dtype


@NEEDS_FBGEMM
@pytest.mark.parametrize("seed", range(3))
def test_lengths_to_offsets_paths_agree(seed: int) -> None:
    lengths, _, _ = random_jagged(1000, 7, seed, torch.int64)
    assert_paths_agree(sparse_ops.lengths_to_offsets, lengths)


def test_forcing_fbgemm_where_it_has_no_kernel_raises() -> None:
    lengths = torch.empty(4, dtype=torch.int64, device="meta")
    with pytest.raises(RuntimeError, match="no 'asynchronous_complete_cumsum' kernel for meta"):
        sparse_ops.lengths_to_offsets(lengths, use_fbgemm=True)
    # Automatic choice falls back to torch, which runs on meta tensors.
    assert sparse_ops.lengths_to_offsets(lengths).shape == (5,)


# -- permute_2d_sparse_data -------------------------------------------------------------------


@pytest.mark.parametrize("dtype", INDEX_DTYPES)
@pytest.mark.parametrize("use_fbgemm", PATHS)
def test_permute_2d_hand_example(dtype: torch.dtype, use_fbgemm: bool) -> None:
    # rows: r0 = bags [a], [b, c]; r1 = bags [], [d]; permute [1, 0, 1] (r1 twice)
    lengths = torch.tensor([[1, 2], [0, 1]], dtype=dtype)
    values = torch.tensor([10, 11, 12, 13])
    weights = torch.tensor([0.5, 1.5, 2.5, 3.5])
    out_lengths, out_values, out_weights = sparse_ops.permute_2d_sparse_data(
        torch.tensor([1, 0, 1]), lengths, values, weights, 5, use_fbgemm=use_fbgemm
    )
    assert out_lengths.tolist() == [[0, 1], [1, 2], [0, 1]]
    assert out_lengths.dtype == dtype
    assert out_values.tolist() == [13, 10, 11, 12, 13]
    assert out_weights is not None
    assert out_weights.tolist() == [3.5, 0.5, 1.5, 2.5, 3.5]


@pytest.mark.parametrize("use_fbgemm", PATHS)
def test_permute_2d_without_weights_and_empty_permute(use_fbgemm: bool) -> None:
    lengths = torch.tensor([[2], [1]])
    values = torch.tensor([1, 2, 3])
    out = sparse_ops.permute_2d_sparse_data(
        torch.tensor([1, 0], dtype=torch.int32), lengths, values, use_fbgemm=use_fbgemm
    )
    assert out[0].tolist() == [[1], [2]]
    assert out[1].tolist() == [3, 1, 2]
    assert out[2] is None
    empty = sparse_ops.permute_2d_sparse_data(
        torch.tensor([], dtype=torch.int32), lengths, values, use_fbgemm=use_fbgemm
    )
    assert empty[0].shape == (0, 1)
    assert empty[1].numel() == 0


@random_index_cases
def test_permute_2d_paths_agree(seed: int, dtype: torch.dtype) -> None:
    rows, batch = 7, 33
    lengths, values, weights = random_jagged(rows * batch, 9, seed, dtype)
    gen = torch.Generator().manual_seed(100 + seed)
    permute = torch.randint(0, rows, (11,), generator=gen, dtype=torch.int64)  # with repeats
    lengths_2d = lengths.view(rows, batch)
    assert_paths_agree(sparse_ops.permute_2d_sparse_data, permute, lengths_2d, values, weights)


# -- keyed_jagged_index_select_dim1 -----------------------------------------------------------


@pytest.mark.parametrize("dtype", INDEX_DTYPES)
@pytest.mark.parametrize("use_fbgemm", PATHS)
def test_keyed_index_select_hand_example(dtype: torch.dtype, use_fbgemm: bool) -> None:
    # 2 keys x batch 2: key0 bags [a], [b, c]; key1 bags [], [d]
    lengths = torch.tensor([1, 2, 0, 1], dtype=dtype)
    offsets = torch.tensor([0, 1, 3, 3, 4], dtype=dtype)
    values = torch.tensor([10, 11, 12, 13])
    weights = torch.tensor([0.1, 0.2, 0.3, 0.4])
    out_values, out_lengths, out_weights = sparse_ops.keyed_jagged_index_select_dim1(
        values, lengths, offsets, torch.tensor([1, 1, 0]), 2, weights, use_fbgemm=use_fbgemm
    )
    assert out_lengths.tolist() == [2, 2, 1, 1, 1, 0]
    assert out_values.tolist() == [11, 12, 11, 12, 10, 13, 13]
    assert out_weights is not None
    assert out_weights.tolist() == pytest.approx([0.2, 0.3, 0.2, 0.3, 0.1, 0.4, 0.4])


@random_index_cases
def test_keyed_index_select_paths_agree(seed: int, dtype: torch.dtype) -> None:
    keys, batch = 5, 17
    lengths, values, weights = random_jagged(keys * batch, 6, seed, dtype)
    offsets = sparse_ops.lengths_to_offsets(lengths)
    gen = torch.Generator().manual_seed(200 + seed)
    indices = torch.randint(0, batch, (23,), generator=gen)
    assert_paths_agree(sparse_ops.keyed_jagged_index_select_dim1, values, lengths, offsets,
                       indices, batch, weights)


# -- jagged_to_padded_dense -------------------------------------------------------------------


@pytest.mark.parametrize("dtype", INDEX_DTYPES)
@pytest.mark.parametrize("use_fbgemm", PATHS)
def test_jagged_to_padded_dense_pads_and_truncates(dtype: torch.dtype, use_fbgemm: bool) -> None:
    values = torch.tensor(SIX_BAGS_VALUES)
    offsets = torch.tensor(SIX_BAGS_OFFSETS, dtype=dtype)
    dense = sparse_ops.jagged_to_padded_dense(values, offsets, 2, 10.0, use_fbgemm=use_fbgemm)
    assert dense.tolist() == SIX_BAGS_PADDED_TO_2_WITH_10


@pytest.mark.parametrize("values_dtype", [torch.int32, torch.int64, torch.float32])
@pytest.mark.parametrize("use_fbgemm", PATHS)
def test_jagged_to_padded_dense_keeps_values_dtype(
    values_dtype: torch.dtype, use_fbgemm: bool
) -> None:
    values = torch.tensor([5, 7, 1], dtype=values_dtype)
    dense = sparse_ops.jagged_to_padded_dense(
        values, torch.tensor([0, 1, 3]), 3, use_fbgemm=use_fbgemm
    )
    assert dense.dtype == values_dtype
    assert dense.tolist() == [[5, 0, 0], [7, 1, 0]]


@pytest.mark.parametrize("use_fbgemm", PATHS)
def test_jagged_to_padded_dense_2d_values_and_empty(use_fbgemm: bool) -> None:
    values = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    dense = sparse_ops.jagged_to_padded_dense(
        values, torch.tensor([0, 0, 2]), 2, -1.0, use_fbgemm=use_fbgemm
    )
    assert dense.tolist() == [[[-1.0, -1.0], [-1.0, -1.0]], [[1.0, 2.0], [3.0, 4.0]]]
    empty = sparse_ops.jagged_to_padded_dense(
        torch.tensor([]), torch.tensor([0, 0]), 2, use_fbgemm=use_fbgemm
    )
    assert empty.tolist() == [[0.0, 0.0]]


@NEEDS_FBGEMM
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("max_length", [0, 1, 4, 12])
def test_jagged_to_padded_dense_paths_agree(seed: int, max_length: int) -> None:
    lengths, _, weights = random_jagged(50, 8, seed, torch.int64)
    offsets = sparse_ops.lengths_to_offsets(lengths)
    assert_paths_agree(sparse_ops.jagged_to_padded_dense, weights, offsets, max_length, 0.5)


# -- regroup_keyed_tensor ---------------------------------------------------------------------


@pytest.mark.parametrize("use_fbgemm", PATHS)
def test_regroup_hand_example(use_fbgemm: bool) -> None:
    # input 0: x (width 2) | y (width 1); input 1: z (width 1)
    a = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    b = torch.tensor([[7.0], [8.0]])
    out = sparse_ops.regroup_keyed_tensor(
        [a, b], [["x", "y"], ["z"]], [[2, 1], [1]], [["z", "x"], ["y"]], use_fbgemm=use_fbgemm
    )
    assert [t.tolist() for t in out] == [
        [[7.0, 1.0, 2.0], [8.0, 4.0, 5.0]],
        [[3.0], [6.0]],
    ]


@pytest.mark.parametrize("use_fbgemm", PATHS)
@pytest.mark.parametrize("seed", range(3))
def test_regroup_gradients_match_plain_cat(use_fbgemm: bool, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    widths = [[3, 2, 4], [1, 5]]
    names = [["a", "b", "c"], ["d", "e"]]
    groups = [["e", "a"], ["c", "b", "d"], ["a"]]  # "a" used twice: its gradient accumulates
    inputs = [torch.randn(4, sum(w), generator=gen, requires_grad=True) for w in widths]
    upstream = [torch.randn(4, n, generator=gen) for n in (8, 7, 3)]  # e+a, c+b+d, a

    out = sparse_ops.regroup_keyed_tensor(inputs, names, widths, groups, use_fbgemm=use_fbgemm)
    torch.autograd.backward(out, upstream)

    reference_inputs = [x.detach().clone().requires_grad_(True) for x in inputs]
    ref_a, ref_b = reference_inputs
    cols = {
        "a": ref_a[:, 0:3],
        "b": ref_a[:, 3:5],
        "c": ref_a[:, 5:9],
        "d": ref_b[:, 0:1],
        "e": ref_b[:, 1:6],
    }
    expected = [torch.cat([cols[k] for k in g], dim=1) for g in groups]
    torch.autograd.backward(expected, upstream)
    for got, want in zip(out, expected, strict=True):
        assert torch.equal(got, want)
    for x, ref in zip(inputs, reference_inputs, strict=True):
        assert x.grad is not None and ref.grad is not None
        torch.testing.assert_close(x.grad, ref.grad)


@NEEDS_FBGEMM
def test_regroup_fbgemm_and_torch_agree_on_random_inputs() -> None:
    gen = torch.Generator().manual_seed(7)
    names = [[f"k{i}" for i in range(6)], [f"m{i}" for i in range(4)]]
    widths = [[8, 16, 8, 4, 4, 8], [16, 8, 8, 4]]
    inputs = [torch.randn(32, sum(w), generator=gen) for w in widths]
    groups = [["m0", "k3", "k1"], ["k0", "m3", "k5", "m1"], ["k2", "k4", "m2"]]
    assert_paths_agree(sparse_ops.regroup_keyed_tensor, inputs, names, widths, groups)


def test_regroup_along_dim_0() -> None:
    a = torch.tensor([[1.0], [2.0], [3.0]])
    out = sparse_ops.regroup_keyed_tensor([a], [["x", "y"]], [[1, 2]], [["y", "x"]], dim=0)
    assert out[0].tolist() == [[2.0], [3.0], [1.0]]
    # forcing FBGEMM: its kernel concatenates along dim 1 only (or there is no FBGEMM)
    refusal = "only concatenates along dim 1" if fbgemm_available() else "no 'regroup_keyed_tensor'"
    with pytest.raises(RuntimeError, match=refusal):
        sparse_ops.regroup_keyed_tensor(
            [a], [["x", "y"]], [[1, 2]], [["y"]], dim=0, use_fbgemm=True
        )


def test_regroup_errors_name_the_key() -> None:
    a = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="group 1 asks for key 'nope'"):
        sparse_ops.regroup_keyed_tensor([a], [["x", "y"]], [[1, 2]], [["x"], ["nope"]])
    with pytest.raises(ValueError, match="group 0 is empty"):
        sparse_ops.regroup_keyed_tensor([a], [["x", "y"]], [[1, 2]], [[]])
    with pytest.raises(ValueError, match="key 'x' appears in keyed tensors 0 and 1"):
        sparse_ops.regroup_keyed_tensor([a, a], [["x", "y"], ["x", "z"]], [[1, 2], [1, 2]], [["x"]])
    with pytest.raises(ValueError, match="keyed tensor 0 has 2 keys but 1 lengths"):
        sparse_ops.regroup_keyed_tensor([a], [["x", "y"]], [[3]], [["x"]])
