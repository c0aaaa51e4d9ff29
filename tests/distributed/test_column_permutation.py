"""Output columns are reordered in whole blocks; the result must equal plain column indexing."""

from __future__ import annotations

import pytest
import torch

from recsys_core.kernels.packed import column_permutation, select_columns


@pytest.mark.parametrize(
    "columns, width",
    [
        ([4, 5, 6, 7, 0, 1, 2, 3], 4),  # two tables swapped
        ([0, 1, 4, 5, 2, 3, 6, 7], 2),  # column shards of two tables interleaved
        ([8, 9, 10, 11, 0, 1, 2, 3, 4, 5, 6, 7], 4),  # blocks of different lengths
        ([2, 0, 1], 1),  # no common block: single columns
    ],
)
def test_block_permutation_equals_index_select(columns: list[int], width: int) -> None:
    perm = column_permutation(columns)
    assert perm is not None and perm.width == width
    x = torch.randn(3, len(columns), requires_grad=True)
    y = select_columns(x, perm)
    torch.testing.assert_close(y, x[:, columns])
    grad = torch.randn_like(y)
    y.backward(grad)
    expected = torch.zeros_like(x).index_add_(1, torch.tensor(columns), grad)
    torch.testing.assert_close(x.grad, expected)


def test_identity_is_none() -> None:
    assert column_permutation([0, 1, 2]) is None
    x = torch.randn(2, 3)
    assert select_columns(x, None) is x
