"""TorchRec 1.9's additions to the modules, with hand-computed values: ``sorted_index_select``
(the same gather, a sorted float32 segment sum in backward), ``construct_jagged_tensors(...,
use_sorted_select=...)``, ``EmbeddingCollection.use_sorted_select`` and
``ManagedCollisionModule.read_only_suffix`` (1.9's name of ``readable_suffix``)."""

from __future__ import annotations

import pytest
import torch

from recsys_core import EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor
from recsys_core.modules.mc_modules import LFU_EvictionPolicy, MCHManagedCollisionModule
from recsys_core.modules.sorted_index_select import (
    maybe_sorted_index_select,
    sorted_index_select,
)
from recsys_core.modules.utils import construct_jagged_tensors

ROWS = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])


def _backward_name(out: torch.Tensor) -> str:
    return type(out.grad_fn).__name__


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sorted_index_select_gathers_and_sums_each_rows_gradients(dtype: torch.dtype) -> None:
    # 7 indices into 3 rows: the sorted segment path (rows * 2 < indices)
    indices = torch.tensor([2, 0, 2, 2, 1, 2, 2])
    emb = ROWS.to(dtype).clone().requires_grad_()
    out = sorted_index_select(emb, indices)
    assert out.tolist() == [[5, 6], [1, 2], [5, 6], [5, 6], [3, 4], [5, 6], [5, 6]]
    assert _backward_name(out) == "_SortedIndexSelectBackward"
    grad = torch.arange(14, dtype=dtype).view(7, 2)
    out.backward(grad)
    # row 0: g[1]; row 1: g[4]; row 2: g[0] + g[2] + g[3] + g[5] + g[6]
    assert emb.grad.dtype == dtype
    assert emb.grad.tolist() == [[2, 3], [8, 9], [0 + 4 + 6 + 10 + 12, 1 + 5 + 7 + 11 + 13]]


def test_sorted_index_select_few_duplicates_and_untouched_rows() -> None:
    # 2 indices into 3 rows: index_add, as TorchRec when duplication is low
    emb = ROWS.clone().requires_grad_()
    sorted_index_select(emb, torch.tensor([2, 2])).backward(torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    assert emb.grad.tolist() == [[0, 0], [0, 0], [4, 6]]


def test_sorted_index_select_sums_in_float32() -> None:
    # 256 then 1000 x 0.5 in bf16: 756 is exact in float32 and representable in bf16
    emb = torch.zeros(3, 2, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.full((1001, 2), 0.5, dtype=torch.bfloat16)
    grad[0] = 256
    sorted_index_select(emb, torch.zeros(1001, dtype=torch.long)).backward(grad)
    assert emb.grad[0].tolist() == [756, 756] and emb.grad[1:].abs().sum() == 0


def test_maybe_sorted_index_select_chooses_the_method() -> None:
    indices = torch.tensor([1, 0, 1, 1, 1, 1, 1])
    plain = maybe_sorted_index_select(ROWS.clone().requires_grad_(), indices, False)
    chosen = maybe_sorted_index_select(ROWS.clone().requires_grad_(), indices, True)
    assert _backward_name(plain) == "IndexSelectBackward0"
    assert _backward_name(chosen) == "_SortedIndexSelectBackward"
    assert torch.equal(plain, chosen)


def test_sorted_index_select_refuses_a_1d_table() -> None:
    with pytest.raises(ValueError, match="2-D"):
        sorted_index_select(torch.zeros(3), torch.tensor([0]))


@pytest.mark.parametrize("use_sorted_select", [False, True])
def test_construct_jagged_tensors_expands_dedup_rows_either_way(use_sorted_select: bool) -> None:
    # ids f: [[7, 7], [9]], g: [[7]]; deduplicated rows [r7, r9], reverse_indices [0, 0, 1, 0]
    features = KeyedJaggedTensor(
        keys=["f", "g"], values=torch.tensor([7, 7, 9, 7]), lengths=torch.tensor([2, 1, 1, 0])
    )
    unique_rows = torch.tensor([[1.0, 1.0], [2.0, 3.0]], requires_grad=True)
    out = construct_jagged_tensors(
        unique_rows, features, ["f", "g"], need_indices=True,
        reverse_indices=torch.tensor([0, 0, 1, 0]), use_sorted_select=use_sorted_select,
    )
    assert out["f"].values().tolist() == [[1, 1], [1, 1], [2, 3]]
    assert out["f"].lengths().tolist() == [2, 1] and out["f"].weights().tolist() == [7, 7, 9]
    assert out["g"].values().tolist() == [[1, 1]] and out["g"].lengths().tolist() == [1, 0]
    expected = "_SortedIndexSelectBackward" if use_sorted_select else "IndexSelectBackward0"
    assert type(out["f"].values().grad_fn.next_functions[0][0]).__name__ == expected
    (out["f"].values().sum() + 10 * out["g"].values().sum()).backward()
    assert unique_rows.grad.tolist() == [[12, 12], [1, 1]]


def test_embedding_collection_use_sorted_select_switch() -> None:
    ec = EmbeddingCollection(
        [EmbeddingConfig(name="t", feature_names=["f"], num_embeddings=4, embedding_dim=2)]
    )
    assert ec.use_sorted_select() is False
    ec.set_use_sorted_select(True)
    assert ec.use_sorted_select() is True


def test_read_only_suffix_is_readable_suffix() -> None:
    module = MCHManagedCollisionModule(
        zch_size=4, device=torch.device("cpu"), eviction_policy=LFU_EvictionPolicy(),
        eviction_interval=1,
    )
    assert module.read_only_suffix == "_readonly" == module.readable_suffix
