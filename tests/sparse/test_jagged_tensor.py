"""JaggedTensor: tutorial outputs, conversions, lazy lengths/offsets, validation errors."""

from __future__ import annotations

import pytest
import torch
from jagged_examples import SIX_BAGS_OFFSETS, SIX_BAGS_PADDED_TO_2_WITH_10, SIX_BAGS_VALUES
from torch.utils import _pytree as pytree

from recsys_core.sparse import JaggedTensor

INDEX_DTYPES = [torch.int32, torch.int64]


def test_tutorial_example() -> None:
    jt = JaggedTensor(values=torch.tensor([5, 7, 1]), lengths=torch.tensor([1, 2]))
    assert torch.equal(jt.offsets(), torch.tensor([0, 1, 3]))
    dense = jt.to_dense()
    assert len(dense) == 2
    assert torch.equal(dense[0], torch.tensor([5]))
    assert torch.equal(dense[1], torch.tensor([7, 1]))
    assert str(jt) == "JaggedTensor({\n    [[5], [7, 1]]\n})\n"


def test_notes_example_with_python_lists() -> None:
    values = torch.Tensor([101, 102, 201, 202, 203, 301])
    by_lengths = JaggedTensor(lengths=[2, 3, 1], values=values)
    by_offsets = JaggedTensor(offsets=[0, 2, 5, 6], values=values)
    assert by_lengths.lengths().dtype == torch.int64
    assert by_lengths.offsets().tolist() == [0, 2, 5, 6]
    assert by_offsets.lengths().tolist() == [2, 3, 1]
    assert [t.tolist() for t in by_offsets.to_dense()] == [
        [101.0, 102.0],
        [201.0, 202.0, 203.0],
        [301.0],
    ]


@pytest.mark.parametrize("dtype", INDEX_DTYPES)
def test_lengths_and_offsets_are_derived_lazily_and_cached(dtype: torch.dtype) -> None:
    jt = JaggedTensor(values=torch.arange(5), lengths=torch.tensor([2, 0, 3], dtype=dtype))
    assert jt.offsets_or_none() is None
    offsets = jt.offsets()
    assert offsets.tolist() == [0, 2, 2, 5]
    assert offsets.dtype == dtype
    assert jt.offsets_or_none() is offsets
    assert jt.offsets() is offsets

    jt = JaggedTensor(values=torch.arange(5), offsets=torch.tensor([0, 2, 2, 5], dtype=dtype))
    assert jt.lengths_or_none() is None
    assert jt.lengths().tolist() == [2, 0, 3]
    assert jt.lengths().dtype == dtype
    assert jt.lengths_or_none() is not None


def test_integer_weights_hold_ids_like_torchrec_embedding_collection() -> None:
    # EmbeddingCollection(need_indices=True) returns the looked-up ids as the JT's weights.
    jt = JaggedTensor(values=torch.zeros(3, 2), lengths=[1, 2], weights=torch.tensor([4, 0, 2]))
    assert jt.weights().tolist() == [4, 0, 2]
    dense_weights = jt.to_dense_weights()
    assert dense_weights is not None
    assert dense_weights[1].tolist() == [0, 2]


def test_weights_accessors() -> None:
    unweighted = JaggedTensor(values=torch.tensor([1, 2]), lengths=[2])
    assert unweighted.weights_or_none() is None
    with pytest.raises(ValueError, match="no weights"):
        unweighted.weights()
    weights = torch.tensor([0.5, 0.25])
    weighted = JaggedTensor(values=torch.tensor([1, 2]), lengths=[2], weights=weights)
    assert weighted.weights() is weights


def test_to_dense_with_empty_bags_and_weights() -> None:
    jt = JaggedTensor(
        values=torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]),
        weights=torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8]),
        offsets=torch.IntTensor([0, 2, 2, 3, 4, 5, 8]),
    )
    assert [t.tolist() for t in jt.to_dense()] == [
        [1.0, 2.0],
        [],
        [3.0],
        [4.0],
        [5.0],
        [6.0, 7.0, 8.0],
    ]
    dense_weights = jt.to_dense_weights()
    assert dense_weights is not None
    expected = [[0.1, 0.2], [], [0.3], [0.4], [0.5], [0.6, 0.7, 0.8]]
    for got, want in zip(dense_weights, expected, strict=True):
        torch.testing.assert_close(got, torch.tensor(want))
    # Views into values, not copies.
    assert jt.to_dense()[5].data_ptr() == jt.values()[5:].data_ptr()
    assert JaggedTensor(values=torch.tensor([1]), lengths=[1]).to_dense_weights() is None


@pytest.mark.parametrize("dtype", INDEX_DTYPES)
def test_to_padded_dense(dtype: torch.dtype) -> None:
    jt = JaggedTensor(
        values=torch.tensor(SIX_BAGS_VALUES),
        weights=torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8]),
        offsets=torch.tensor(SIX_BAGS_OFFSETS, dtype=dtype),
    )
    assert (jt.to_padded_dense(desired_length=2, padding_value=10.0).tolist()
            == SIX_BAGS_PADDED_TO_2_WITH_10)
    # Default length is the longest bag (3), default padding 0.
    assert jt.to_padded_dense().tolist() == [
        [1.0, 2.0, 0.0],
        [0.0, 0.0, 0.0],
        [3.0, 0.0, 0.0],
        [4.0, 0.0, 0.0],
        [5.0, 0.0, 0.0],
        [6.0, 7.0, 8.0],
    ]
    padded_weights = jt.to_padded_dense_weights(desired_length=2, padding_value=1.0)
    assert padded_weights is not None
    torch.testing.assert_close(
        padded_weights,
        torch.tensor([[0.1, 0.2], [1.0, 1.0], [0.3, 1.0], [0.4, 1.0], [0.5, 1.0], [0.6, 0.7]]),
    )


def test_to_padded_dense_of_empty_batch_and_bad_length() -> None:
    assert JaggedTensor.empty().to_padded_dense().shape == (0, 0)
    jt = JaggedTensor(values=torch.tensor([1]), lengths=[1])
    assert jt.to_padded_dense_weights() is None
    with pytest.raises(ValueError, match="desired_length must be >= 0"):
        jt.to_padded_dense(desired_length=-1)


def test_from_dense() -> None:
    jt = JaggedTensor.from_dense(
        values=[torch.tensor([1.0]), torch.tensor([]), torch.tensor([7.0, 8.0])],
        weights=[torch.tensor([0.5]), torch.tensor([]), torch.tensor([0.25, 0.75])],
    )
    assert jt.lengths().tolist() == [1, 0, 2]
    assert jt.lengths().dtype == torch.int32
    assert jt.values().tolist() == [1.0, 7.0, 8.0]
    assert jt.weights().tolist() == [0.5, 0.25, 0.75]
    with pytest.raises(ValueError, match="got no tensors"):
        JaggedTensor.from_dense([])
    with pytest.raises(ValueError, match="2 value tensors but 1 weight tensors"):
        JaggedTensor.from_dense([torch.tensor([1]), torch.tensor([2])], [torch.tensor([1.0])])


@pytest.mark.parametrize("dtype", INDEX_DTYPES)
def test_from_dense_lengths(dtype: torch.dtype) -> None:
    padded = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    weights = padded.float() / 10
    jt = JaggedTensor.from_dense_lengths(padded, torch.tensor([2, 0, 3], dtype=dtype), weights)
    assert jt.values().tolist() == [1, 2, 7, 8, 9]
    assert jt.weights().tolist() == pytest.approx([0.1, 0.2, 0.7, 0.8, 0.9])
    assert jt.lengths().tolist() == [2, 0, 3]
    with pytest.raises(ValueError, match=r"values must be \[B, L\] with B = len\(lengths\) = 2"):
        JaggedTensor.from_dense_lengths(padded, [1, 1])


def test_empty() -> None:
    jt = JaggedTensor.empty(is_weighted=True, values_dtype=torch.int64)
    assert jt.values().dtype == torch.int64
    assert jt.values().numel() == 0
    assert jt.weights().numel() == 0
    assert jt.lengths().dtype == torch.int32
    assert jt.lengths().numel() == 0
    assert jt.offsets().tolist() == []  # TorchRec's empty() has empty offsets
    assert jt.to_dense() == []
    assert str(jt) == 'JaggedTensor({\n    "values": [],\n    "weights": []\n})\n'
    unweighted = JaggedTensor.empty()
    assert unweighted.weights_or_none() is None
    assert str(unweighted) == "JaggedTensor({\n    []\n})\n"


def test_batch_size_one() -> None:
    jt = JaggedTensor(values=torch.tensor([4, 5, 6]), lengths=torch.tensor([3]))
    assert jt.offsets().tolist() == [0, 3]
    assert jt.to_padded_dense().tolist() == [[4, 5, 6]]
    assert str(jt) == "JaggedTensor({\n    [[4, 5, 6]]\n})\n"


def test_str_with_weights() -> None:
    jt = JaggedTensor(
        values=torch.tensor([5, 7, 1]),
        lengths=torch.tensor([1, 2]),
        weights=torch.tensor([0.5, 1.0, 2.0]),
    )
    assert str(jt) == (
        'JaggedTensor({\n    "values": [[5], [7, 1]],\n    "weights": [[0.5], [1.0, 2.0]]\n})\n'
    )


def test_to_device_keeps_data() -> None:
    jt = JaggedTensor(values=torch.tensor([1, 2, 3]), lengths=[1, 2], weights=torch.ones(3))
    moved = jt.to(torch.device("cpu"), non_blocking=True)
    assert moved.values().tolist() == [1, 2, 3]
    assert moved.lengths().tolist() == [1, 2]
    assert moved.weights().tolist() == [1.0, 1.0, 1.0]
    assert moved.offsets_or_none() is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="pin_memory needs a CUDA build")
def test_pin_memory_and_to_cuda() -> None:
    jt = JaggedTensor(values=torch.tensor([1, 2, 3]), lengths=[1, 2])
    pinned = jt.pin_memory()
    assert pinned.values().is_pinned()
    assert pinned.lengths().is_pinned()
    on_gpu = pinned.to(torch.device("cuda"), non_blocking=True)
    on_gpu.record_stream(torch.cuda.current_stream())
    assert on_gpu.offsets().cpu().tolist() == [0, 1, 3]


def test_pytree_round_trip() -> None:
    jt = JaggedTensor(values=torch.tensor([1, 2, 3]), lengths=[1, 2], weights=torch.ones(3))
    leaves, spec = pytree.tree_flatten(jt)
    assert len(leaves) == 4  # values, weights, lengths, offsets (not computed yet: None)
    assert [leaf.tolist() for leaf in leaves[:3]] == [[1, 2, 3], [1.0, 1.0, 1.0], [1, 2]]
    assert leaves[3] is None
    rebuilt = pytree.tree_unflatten(leaves, spec)
    assert isinstance(rebuilt, JaggedTensor)
    assert rebuilt.offsets().tolist() == [0, 1, 3]
    doubled = pytree.tree_map(lambda t: t * 2 if t is not None and t.is_floating_point() else t, jt)
    assert doubled.weights().tolist() == [2.0, 2.0, 2.0]


# -- validation -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lengths": torch.tensor([1.0, 2.0])}, "lengths must be an int32 or int64 tensor"),
        ({"offsets": torch.tensor([0, 1], dtype=torch.int16)}, "offsets must be"),
        ({}, "pass lengths or offsets"),
        ({"lengths": ["a"]}, "lengths must be a tensor or a list of ints"),
        ({"lengths": [1.5, 1.5]}, "lengths must be a list of ints, got torch.float32"),
    ],
)
def test_constructor_rejects_bad_metadata(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        JaggedTensor(values=torch.tensor([1, 2, 3]), **kwargs)


@pytest.mark.parametrize("dtype", INDEX_DTYPES)
def test_validate_accepts_consistent_tensor(dtype: torch.dtype) -> None:
    jt = JaggedTensor(
        values=torch.arange(3),
        lengths=torch.tensor([1, 0, 2], dtype=dtype),
        offsets=torch.tensor([0, 1, 1, 3], dtype=dtype),
    )
    assert jt.validate() is jt
    JaggedTensor.empty().validate()


@pytest.mark.parametrize("dtype", INDEX_DTYPES)
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lengths": [2, -1, 2]}, "negative length -1 for batch position 1"),
        (
            {"lengths": [1, 1]},
            "Sum of lengths must equal the number of values, but lengths sum to 2 and values has 3",
        ),
        ({"lengths": [2, 2, 2]}, r"the bags need values\[0:6\] but values has only 3 entries"),
        ({"offsets": [1, 2, 3]}, "Expected first offset to be 0, but got 1"),
        ({"offsets": [0, 2, 1, 3]}, "negative length -1 for batch position 1"),
        (
            {"lengths": [1, 2], "offsets": [0, 2, 3]},
            r"offsets is not equal to the cumulative sum of lengths \(they disagree at 2",
        ),
        ({"lengths": [1, 2], "offsets": [0, 3]}, "offsets has 2 entries and lengths has 2"),
        (
            {"lengths": [3], "weights": [1.0, 2.0]},
            "weights size must equal to values size, but weights has 2 entries and values has 3",
        ),
    ],
)
def test_validate_reports_what_is_wrong(kwargs: dict, message: str, dtype: torch.dtype) -> None:
    converted = {
        k: torch.tensor(v, dtype=torch.float32 if k == "weights" else dtype)
        for k, v in kwargs.items()
    }
    jt = JaggedTensor(values=torch.tensor([1, 2, 3]), **converted)
    with pytest.raises(ValueError, match=message):
        jt.validate()


def test_constructor_is_lazy_like_torchrec() -> None:
    # TorchRec's constructor stores what it gets; these only fail in validate().
    jt = JaggedTensor(values=torch.tensor([1, 2, 3]), lengths=[1, 1], weights=torch.ones(2))
    assert jt.lengths().tolist() == [1, 1]
    assert jt.offsets().tolist() == [0, 1, 2]
    with pytest.raises(
        ValueError,
        match="weights size must equal to values size, but weights has 2 entries and values has 3",
    ):
        jt.validate()
    # Any weights dtype is stored as given (bools included).
    flags = torch.tensor([True, False, True])
    assert (
        JaggedTensor(values=torch.tensor([1, 2, 3]), lengths=[3], weights=flags).weights() is flags
    )
    # 2-D lengths are kept as given; offsets come from the flattened lengths.
    two_d = JaggedTensor(values=torch.arange(4), lengths=torch.tensor([[1, 0], [2, 1]]))
    assert two_d.lengths().shape == (2, 2)
    assert two_d.offsets().tolist() == [0, 1, 1, 3, 4]


def test_empty_like_and_printing_limits() -> None:
    jt = JaggedTensor(
        values=torch.tensor([1.0, 2.0]),
        lengths=torch.tensor([2], dtype=torch.int32),
        weights=torch.tensor([0.5, 0.5], dtype=torch.float64),
    )
    empty = JaggedTensor.empty_like(jt)
    assert empty.values().dtype == torch.float32 and empty.values().numel() == 0
    assert empty.lengths().dtype == torch.int32 and empty.lengths().numel() == 0
    assert empty.weights().dtype == torch.float64 and empty.weights().numel() == 0
    three_d = JaggedTensor(values=torch.zeros(2, 1, 3), lengths=torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="prints 1-D or 2-D values, got 3-D"):
        str(three_d)
