"""Variable batch per key (VBE) KeyedJaggedTensors: TorchRec 1.8's semantics, hand values."""

import pytest
import torch
from torch.utils import _pytree as pytree

from recsys_core.sparse import JaggedTensor, KeyedJaggedTensor
from recsys_core.sparse.jagged_tensor_validator import validate_keyed_jagged_tensor


def weighted_vbe() -> KeyedJaggedTensor:
    """index_0 (2 bags): [1, 2], []     index_1 (4 bags): [3], [4], [5], [6, 7, 8]"""
    return KeyedJaggedTensor(
        keys=["index_0", "index_1"],
        values=torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]),
        weights=torch.tensor([1.0, 0.5, 1.5, 1.0, 0.5, 1.0, 1.0, 1.5]),
        offsets=torch.tensor([0, 2, 2, 3, 4, 5, 8], dtype=torch.int32),
        stride_per_key_per_rank=[[2], [4]],
    )


def three_key_vbe() -> KeyedJaggedTensor:
    """index_0 (2): [1], []   index_1 (4): [2], [3, 4, 5], [], [6]   index_2 (3): [], [7, 8], []"""
    return KeyedJaggedTensor.from_lengths_sync(
        keys=["index_0", "index_1", "index_2"],
        values=torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]),
        lengths=torch.tensor([1, 0, 1, 3, 0, 1, 0, 2, 0], dtype=torch.int32),
        stride_per_key_per_rank=[[2], [4], [3]],
    )


def test_accessors() -> None:
    kjt = weighted_vbe()
    assert kjt.variable_stride_per_key() is True
    assert kjt.stride_per_key_per_rank() == [[2], [4]]
    assert kjt.stride_per_key() == [2, 4]
    assert kjt.stride() == 4  # the largest per-key batch
    assert kjt.lengths().tolist() == [2, 0, 1, 1, 1, 3]
    assert kjt.length_per_key() == [2, 6]
    assert kjt.offset_per_key() == [0, 2, 8]
    assert kjt.lengths_offset_per_key() == [0, 2, 6]
    assert kjt.inverse_indices_or_none() is None
    with pytest.raises(ValueError, match="no inverse_indices"):
        kjt.inverse_indices()


def test_several_ranks_and_tensor_strides() -> None:
    # Per key: rank 0 sent 1 then 3 bags, rank 1 sent 2 then 0: still "variable" (TorchRec).
    kjt = KeyedJaggedTensor(
        keys=["a", "b"],
        values=torch.arange(6),
        lengths=torch.tensor([1, 1, 1, 1, 1, 1]),
        stride_per_key_per_rank=torch.tensor([[1, 2], [3, 0]]),
    )
    assert kjt.stride_per_key_per_rank() == [[1, 2], [3, 0]]
    assert kjt.stride_per_key() == [3, 3]
    assert kjt.stride() == 3
    assert kjt.variable_stride_per_key() is True
    assert kjt.length_per_key() == [3, 3]


def test_stride_comes_from_inverse_indices() -> None:
    inverse = torch.tensor([[0, 1, 0], [0, 0, 0]])
    kjt = KeyedJaggedTensor(
        keys=["f1", "f2", "f3"],
        values=torch.tensor([5, 6, 7, 1, 2, 3, 0, 1]),
        lengths=torch.tensor([3, 3, 2]),
        stride_per_key_per_rank=[[2], [1]],
        inverse_indices=(["f1", "f2"], inverse),
    )
    assert kjt.stride() == 3
    keys, tensor = kjt.inverse_indices()
    assert keys == ["f1", "f2"] and tensor is inverse


@pytest.mark.parametrize("access", ["getitem", "to_dict"])
def test_per_key_views(access: str) -> None:
    kjt = weighted_vbe()
    jts = {k: kjt[k] for k in kjt.keys()} if access == "getitem" else kjt.to_dict()
    j0, j1 = jts["index_0"], jts["index_1"]
    assert j0.lengths().tolist() == [2, 0]
    assert j0.offsets().tolist() == [0, 2, 2]
    assert j0.values().tolist() == [1.0, 2.0]
    assert j0.weights().tolist() == [1.0, 0.5]
    assert j1.lengths().tolist() == [1, 1, 1, 3]
    assert j1.offsets().tolist() == [0, 1, 2, 3, 6]
    assert j1.values().tolist() == [3.0, 4.0, 5.0, 6.0, 7.0, 8.0]
    assert j1.weights().tolist() == [1.5, 1.0, 0.5, 1.0, 1.0, 1.5]


def test_split() -> None:
    kjt = KeyedJaggedTensor(
        keys=["index_0", "index_1", "index_2", "index_3"],
        values=torch.arange(1.0, 11.0),
        lengths=torch.tensor([2, 0, 1, 1, 1, 3, 0, 2], dtype=torch.int32),
        stride_per_key_per_rank=[[3], [0], [1], [4]],
    )
    j0, j1, j2 = kjt.split([1, 1, 2])
    assert [j.keys() for j in (j0, j1, j2)] == [["index_0"], ["index_1"], ["index_2", "index_3"]]
    assert [j.stride() for j in (j0, j1, j2)] == [4, 4, 4]  # the parent's stride, as TorchRec
    assert [j.stride_per_key_per_rank() for j in (j0, j1, j2)] == [[[3]], [[0]], [[1], [4]]]
    assert j0.lengths().tolist() == [2, 0, 1] and j0.values().tolist() == [1.0, 2.0, 3.0]
    assert j1.lengths().tolist() == [] and j1.values().tolist() == []
    assert j2.lengths().tolist() == [1, 1, 3, 0, 2]
    assert j2.values().tolist() == [4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0]
    assert j2["index_3"].lengths().tolist() == [1, 3, 0, 2]

    e0, middle, e1, last = kjt.split([0, 3, 0, 1])
    assert e0.keys() == [] and e1.keys() == []
    assert e0.lengths().tolist() == [] and e0.values().tolist() == []
    assert middle.lengths().tolist() == [2, 0, 1, 1]
    assert middle.values().tolist() == [1.0, 2.0, 3.0, 4.0]
    assert last.lengths().tolist() == [1, 3, 0, 2]
    assert last.values().tolist() == [5.0, 6.0, 7.0, 8.0, 9.0, 10.0]
    assert kjt.split([4]) == [kjt]


def test_permute() -> None:
    permuted = three_key_vbe().permute([1, 0, 2])
    assert permuted.keys() == ["index_1", "index_0", "index_2"]
    assert permuted.stride_per_key_per_rank() == [[4], [2], [3]]
    assert permuted.stride_per_key() == [4, 2, 3]
    assert permuted.offset_per_key() == [0, 5, 6, 8]
    assert permuted.values().tolist() == [2.0, 3.0, 4.0, 5.0, 6.0, 1.0, 7.0, 8.0]
    assert permuted.lengths().tolist() == [1, 3, 0, 1, 1, 0, 0, 2, 0]
    assert permuted.weights_or_none() is None


def test_permute_with_duplicates_and_weights() -> None:
    permuted = weighted_vbe().permute([1, 0, 1])
    assert permuted.keys() == ["index_1", "index_0", "index_1"]
    assert permuted.stride_per_key() == [4, 2, 4]
    assert permuted.lengths().tolist() == [1, 1, 1, 3, 2, 0, 1, 1, 1, 3]
    assert permuted.values().tolist() == [3, 4, 5, 6, 7, 8, 1, 2, 3, 4, 5, 6, 7, 8]
    assert permuted.weights().tolist() == [
        1.5, 1.0, 0.5, 1.0, 1.0, 1.5, 1.0, 0.5, 1.5, 1.0, 0.5, 1.0, 1.0, 1.5,
    ]  # fmt: skip
    assert permuted.length_per_key() == [6, 2, 6]


def test_permute_drops_inverse_indices_and_concat_joins_them() -> None:
    a = KeyedJaggedTensor(
        keys=["a"],
        values=torch.tensor([1, 2]),
        lengths=torch.tensor([1, 1]),
        stride_per_key_per_rank=[[2]],
        inverse_indices=(["a"], torch.tensor([[0, 1, 1]])),
    )
    b = KeyedJaggedTensor(
        keys=["b"],
        values=torch.tensor([3]),
        lengths=torch.tensor([1]),
        stride_per_key_per_rank=[[1]],
        inverse_indices=(["b"], torch.tensor([[0, 0, 0]])),
    )
    assert a.permute([0]).inverse_indices_or_none() is None
    both = KeyedJaggedTensor.concat([a, b])
    assert both.keys() == ["a", "b"]
    assert both.stride_per_key_per_rank() == [[2], [1]]
    assert both.lengths().tolist() == [1, 1, 1]
    assert both.values().tolist() == [1, 2, 3]
    keys, inverse = both.inverse_indices()
    assert keys == ["a", "b"]
    assert inverse.tolist() == [[0, 1, 1], [0, 0, 0]]
    assert both.stride() == 3
    fixed = KeyedJaggedTensor(keys=["c"], values=torch.tensor([4]), lengths=torch.tensor([1]))
    with pytest.raises(ValueError, match="variable batch per key but KJT 0 does not"):
        KeyedJaggedTensor.concat([fixed, a])
    no_inverse = KeyedJaggedTensor(
        ["d"], torch.tensor([5]), lengths=torch.tensor([1]), stride_per_key_per_rank=[[1]]
    )
    with pytest.raises(ValueError, match="disagree on having inverse_indices"):
        KeyedJaggedTensor.concat([a, no_inverse])


def test_from_jt_dict_with_different_batch_sizes_is_vbe() -> None:
    kjt = KeyedJaggedTensor.from_jt_dict(
        {
            "a": JaggedTensor(values=torch.tensor([1, 2]), lengths=torch.tensor([1, 1])),
            "b": JaggedTensor(values=torch.tensor([3]), lengths=torch.tensor([1])),
        }
    )
    assert kjt.variable_stride_per_key() is True
    assert kjt.stride_per_key_per_rank() == [[2], [1]]
    assert kjt.stride() == 2
    assert kjt["b"].values().tolist() == [3]


def test_to_keeps_vbe_metadata_and_inverse_indices() -> None:
    kjt = KeyedJaggedTensor(
        keys=["a", "b"],
        values=torch.tensor([1, 2, 3]),
        lengths=torch.tensor([1, 1, 1]),
        weights=torch.tensor([0.5, 1.5, 2.5]),
        stride_per_key_per_rank=[[1], [2]],
        inverse_indices=(["a", "b"], torch.tensor([[0, 0], [0, 1]])),
    )
    moved = kjt.to(torch.device("cpu"), dtype=torch.float64)
    assert moved.stride_per_key_per_rank() == [[1], [2]]
    assert moved.weights().dtype == torch.float64
    assert moved.inverse_indices()[1].tolist() == [[0, 0], [0, 1]]
    assert moved["b"].values().tolist() == [2, 3]
    empty = KeyedJaggedTensor.empty_like(kjt)
    assert empty.keys() == [] and empty.stride_per_key_per_rank() == [[1], [2]]


def test_validate() -> None:
    assert validate_keyed_jagged_tensor(weighted_vbe())
    weighted_vbe().validate()
    bad = KeyedJaggedTensor(
        keys=["a", "b"],
        values=torch.arange(4),
        lengths=torch.tensor([1, 1, 1, 1]),
        stride_per_key_per_rank=[[1], [2]],
    )
    with pytest.raises(
        ValueError, match=r"Sum of stride_per_key_per_rank \(3\) must equal .*\(4\)"
    ):
        bad.validate()
    with pytest.raises(ValueError, match="stride_per_key_per_rank must be 2-dimensional"):
        KeyedJaggedTensor(
            ["a", "b"], torch.arange(4), lengths=[1, 1, 1, 1], stride_per_key_per_rank=[2, 2]
        )
    wrong_keys = KeyedJaggedTensor(
        ["a", "b"], torch.arange(4), lengths=[1, 1, 1, 1], stride_per_key_per_rank=[[2], [1], [1]]
    )
    with pytest.raises(ValueError, match=r"first dimension must equal num_features \(2\)"):
        validate_keyed_jagged_tensor(wrong_keys)
    # Several ranks per key (a KJT after input distribution) is valid.
    after_dist = KeyedJaggedTensor(
        ["a", "b"], torch.arange(4), lengths=[1, 1, 1, 1], stride_per_key_per_rank=[[1, 1], [2, 0]]
    )
    assert validate_keyed_jagged_tensor(after_dist)


def test_str_and_pytree() -> None:
    kjt = three_key_vbe()
    assert str(kjt) == (
        "KeyedJaggedTensor({\n"
        '    "index_0": [[1.0], []],\n'
        '    "index_1": [[2.0], [3.0, 4.0, 5.0], [], [6.0]],\n'
        '    "index_2": [[], [7.0, 8.0], []]\n'
        "})\n"
    )
    leaves, spec = pytree.tree_flatten(kjt)
    rebuilt = pytree.tree_unflatten(leaves, spec)
    assert rebuilt.stride_per_key_per_rank() == [[2], [4], [3]]
    assert rebuilt["index_1"].lengths().tolist() == [1, 3, 0, 1]


class VbeOps(torch.nn.Module):
    def forward(self, kjt: KeyedJaggedTensor) -> list[torch.Tensor]:
        permuted = kjt.permute([2, 0])
        d = kjt.to_dict()
        return [
            permuted.values(),
            permuted.lengths(),
            d["index_1"].offsets(),
            torch.tensor(kjt.stride_per_key()),
        ]


def test_scripted_vbe_ops_match_eager() -> None:
    scripted = torch.jit.script(VbeOps())
    out = scripted(three_key_vbe())
    assert [t.tolist() for t in out] == [
        [7.0, 8.0, 1.0],
        [0, 2, 0, 1, 0],
        [0, 1, 4, 4, 5],
        [2, 4, 3],
    ]
    for eager, compiled in zip(VbeOps()(three_key_vbe()), out, strict=True):
        assert torch.equal(eager, compiled)


def test_flatten_kjt_list_round_trip() -> None:
    from recsys_core.sparse.jagged_tensor import flatten_kjt_list, unflatten_kjt_list

    vbe = KeyedJaggedTensor(
        keys=["a", "b"], values=torch.arange(3), lengths=torch.tensor([1, 0, 2]),
        stride_per_key_per_rank=[[1], [2]],
        inverse_indices=(["a", "b"], torch.tensor([[0, 0], [1, 0]])),
    )
    fixed = weighted_vbe()
    data, contexts = flatten_kjt_list([vbe, fixed])
    # six entries per KJT in TorchRec's field order; None where a KJT has no such tensor
    assert len(data) == 12 and contexts == [["a", "b"], ["index_0", "index_1"]]
    assert data[4].tolist() == [[1], [2]] and data[4].dtype == torch.int32
    assert data[1] is None and data[3] is None  # vbe: no weights, built from lengths only
    back_vbe, back_fixed = unflatten_kjt_list(data, contexts)
    assert back_vbe.stride_per_key_per_rank() == [[1], [2]]
    assert back_vbe["b"].lengths().tolist() == [0, 2]
    assert back_vbe.inverse_indices()[1].tolist() == [[0, 0], [1, 0]]
    assert back_fixed["index_1"].weights().tolist() == [1.5, 1.0, 0.5, 1.0, 1.0, 1.5]
    with pytest.raises(ValueError, match="5 tensors for 1 KJTs"):
        unflatten_kjt_list(data[:5], contexts[:1])


def test_torchrec_private_names_resolve() -> None:
    from recsys_core.sparse import jagged_tensor as jt

    assert jt._sum_by_splits([1, 2, 3, 4], [1, 3]) == [1, 9]
    assert jt._cumsum([2, 0, 3]) == [0, 2, 2, 5]
    assert jt._to_offsets(torch.tensor([3, 0, 2])).tolist() == [0, 3, 3, 5]
    assert isinstance(KeyedJaggedTensor, jt.JaggedTensorMeta)
    assert jt._pin_and_move(torch.ones(2), torch.device("cpu")).tolist() == [1.0, 1.0]
    a = KeyedJaggedTensor(keys=["a"], values=torch.arange(2), lengths=torch.tensor([2]))
    b = KeyedJaggedTensor(keys=["b"], values=torch.arange(1), lengths=torch.tensor([1]))
    assert jt._kjt_concat([a, b]).lengths().tolist() == [2, 1]
