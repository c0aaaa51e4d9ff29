"""KeyedTensor: per-key views, regroup (values and gradients), printing, validation errors."""

from __future__ import annotations

import pytest
import torch
from torch.utils import _pytree as pytree

from recsys_core.sparse import KeyedTensor


def embedding_kt() -> KeyedTensor:
    """Three keys of widths 2, 3, 4 over a batch of 3 (TorchRec's KeyedTensor example)."""
    return KeyedTensor.from_tensor_list(
        ["Embedding A", "Embedding B", "Embedding C"],
        [
            torch.tensor([[1, 1]] * 3),
            torch.tensor([[2, 1, 2]] * 3),
            torch.tensor([[3, 1, 2, 3]] * 3),
        ],
    )


def two_kts() -> tuple[KeyedTensor, KeyedTensor]:
    """kt1: x (width 2) | y (width 1); kt2: z (width 1); batch of 2."""
    kt1 = KeyedTensor(["x", "y"], [2, 1], torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]))
    kt2 = KeyedTensor(["z"], [1], torch.tensor([[7.0], [8.0]]))
    return kt1, kt2


def test_from_tensor_list_layout() -> None:
    kt = embedding_kt()
    assert kt.keys() == ["Embedding A", "Embedding B", "Embedding C"]
    assert kt.key_dim() == 1
    assert kt.length_per_key() == [2, 3, 4]
    assert kt.offset_per_key() == [0, 2, 5, 9]
    assert kt.index_per_key() == {"Embedding A": 0, "Embedding B": 1, "Embedding C": 2}
    assert kt.values().tolist() == [[1, 1, 2, 1, 2, 3, 1, 2, 3]] * 3
    assert kt["Embedding B"].tolist() == [[2, 1, 2]] * 3
    assert kt.device() == torch.device("cpu")


def test_to_dict_views() -> None:
    kt = embedding_kt()
    as_dict = kt.to_dict()
    assert list(as_dict) == ["Embedding A", "Embedding B", "Embedding C"]
    assert as_dict["Embedding C"].tolist() == [[3, 1, 2, 3]] * 3
    assert as_dict["Embedding B"].data_ptr() == kt.values()[:, 2:].data_ptr()
    with pytest.raises(KeyError, match="no key 'Embedding D'"):
        kt["Embedding D"]


def test_key_dim_zero() -> None:
    kt = KeyedTensor.from_tensor_list(
        ["a", "b"], [torch.tensor([[1, 2]]), torch.tensor([[3, 4], [5, 6]])], key_dim=0, cat_dim=0
    )
    assert kt.length_per_key() == [1, 2]
    assert kt["b"].tolist() == [[3, 4], [5, 6]]
    assert KeyedTensor.regroup([kt], [["b", "a"]])[0].tolist() == [[3, 4], [5, 6], [1, 2]]


def test_str() -> None:
    kt1, _ = two_kts()
    assert str(kt1) == (
        'KeyedTensor({\n    "x": [[1.0, 2.0], [4.0, 5.0]],\n    "y": [[3.0], [6.0]]\n})\n'
    )
    assert str(KeyedTensor([], [], torch.zeros(2, 0))) == "KeyedTensor()\n"


def test_regroup_hand_example() -> None:
    kt1, kt2 = two_kts()
    out = KeyedTensor.regroup([kt1, kt2], [["z", "x"], ["y"], ["x", "z"]])
    assert [t.tolist() for t in out] == [
        [[7.0, 1.0, 2.0], [8.0, 4.0, 5.0]],
        [[3.0], [6.0]],
        [[1.0, 2.0, 7.0], [4.0, 5.0, 8.0]],
    ]
    named = KeyedTensor.regroup_as_dict([kt1, kt2], [["y", "z"], ["x"]], ["yz", "x_only"])
    assert list(named) == ["yz", "x_only"]
    assert named["yz"].tolist() == [[3.0, 7.0], [6.0, 8.0]]
    assert named["x_only"].tolist() == [[1.0, 2.0], [4.0, 5.0]]


@pytest.mark.parametrize("seed", range(3))
def test_regroup_gradients_match_plain_cat(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    widths = [4, 8, 2, 6]
    keys = ["a", "b", "c", "d"]
    values = torch.randn(5, sum(widths), generator=gen, requires_grad=True)
    kt = KeyedTensor(keys, widths, values)
    groups = [["d", "a"], ["b", "a", "c"]]  # "a" twice: gradients from both groups add up
    upstream = [torch.randn(5, 10, generator=gen), torch.randn(5, 14, generator=gen)]
    torch.autograd.backward(KeyedTensor.regroup([kt], groups), upstream)

    reference = values.detach().clone().requires_grad_(True)
    a, b, c, d = reference[:, 0:4], reference[:, 4:12], reference[:, 12:14], reference[:, 14:20]
    expected = [torch.cat([d, a], dim=1), torch.cat([b, a, c], dim=1)]
    torch.autograd.backward(expected, upstream)

    for got, want in zip(KeyedTensor.regroup([kt], groups), expected, strict=True):
        assert torch.equal(got, want)
    assert values.grad is not None and reference.grad is not None
    torch.testing.assert_close(values.grad, reference.grad)
    # Column block of "a" got both upstream slices, "c" only one.
    torch.testing.assert_close(values.grad[:, 0:4], upstream[0][:, 6:10] + upstream[1][:, 8:12])
    torch.testing.assert_close(values.grad[:, 12:14], upstream[1][:, 12:14])


def test_regroup_errors() -> None:
    kt1, kt2 = two_kts()
    with pytest.raises(ValueError, match="group 0 asks for key 'w'"):
        KeyedTensor.regroup([kt1, kt2], [["w"]])
    with pytest.raises(ValueError, match="key 'x' appears in keyed tensors 0 and 1"):
        KeyedTensor.regroup([kt1, kt1], [["x"]])
    with pytest.raises(ValueError, match="got no keyed tensors"):
        KeyedTensor.regroup([], [["x"]])
    rows = KeyedTensor(["r"], [2], torch.zeros(2, 1), key_dim=0)
    with pytest.raises(ValueError, match=r"keyed tensor 1 \(keys \['r'\]\) has key_dim 0"):
        KeyedTensor.regroup([kt1, rows], [["x"]])
    with pytest.raises(ValueError, match="2 groups but 1 names"):
        KeyedTensor.regroup_as_dict([kt1], [["x"], ["y"]], ["only"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((["a", "b"], [3]), "2 keys but 1 entries in length_per_key"),
        ((["a", "b"], [1, 1]), r"size 3 along key_dim 1 but length_per_key \[1, 1\] sums to 2"),
        (("ab", [1, 2]), "keys must be a list of strings, got the string 'ab'"),
    ],
)
def test_constructor_errors(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KeyedTensor(*args, values=torch.zeros(2, 3))


def test_constructor_errors_key_dim_and_offsets() -> None:
    with pytest.raises(ValueError, match="key_dim 2 is out of range"):
        KeyedTensor(["a"], [3], torch.zeros(2, 3), key_dim=2)
    with pytest.raises(ValueError, match=r"offset_per_key needs len\(keys\) \+ 1 = 2 entries"):
        KeyedTensor(["a"], [3], torch.zeros(2, 3), offset_per_key=[0])
    with pytest.raises(ValueError, match="2 keys but 1 tensors"):
        KeyedTensor.from_tensor_list(["a", "b"], [torch.zeros(2, 3)])


def test_to_device() -> None:
    kt1, _ = two_kts()
    moved = kt1.to(torch.device("cpu"), non_blocking=True)
    assert moved.keys() == ["x", "y"]
    assert moved["y"].tolist() == [[3.0], [6.0]]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_to_cuda_and_regroup_there() -> None:
    kt1, kt2 = two_kts()
    on_gpu = [kt1.to("cuda"), kt2.to("cuda")]
    on_gpu[0].record_stream(torch.cuda.current_stream())
    out = KeyedTensor.regroup(on_gpu, [["z", "x"], ["y"]])
    assert out[0].cpu().tolist() == [[7.0, 1.0, 2.0], [8.0, 4.0, 5.0]]


def test_pytree_round_trip() -> None:
    kt1, _ = two_kts()
    leaves, spec = pytree.tree_flatten(kt1)
    assert len(leaves) == 1
    assert leaves[0] is kt1.values()
    rebuilt = pytree.tree_unflatten([leaves[0] * 2], spec)
    assert isinstance(rebuilt, KeyedTensor)
    assert rebuilt.keys() == ["x", "y"]
    assert rebuilt.length_per_key() == [2, 1]
    assert rebuilt["y"].tolist() == [[6.0], [12.0]]


def test_torchrec_free_function_regroups() -> None:
    from recsys_core.sparse.jagged_tensor import permute_multi_embedding, regroup_kts

    a = KeyedTensor(["x", "y"], [1, 2], torch.tensor([[1.0, 2.0, 3.0]]))
    b = KeyedTensor(["z"], [1], torch.tensor([[4.0]]))
    groups = [["z", "x"], ["y"]]
    for regroup in (regroup_kts, permute_multi_embedding):
        first, second = regroup([a, b], groups)
        assert first.tolist() == [[4.0, 1.0]]
        assert second.tolist() == [[2.0, 3.0]]


def test_flatten_to_an_exported_spec_reorders_keys() -> None:
    from torch.fx._pytree import tree_flatten_spec

    kt = KeyedTensor(["a", "b"], [1, 2], torch.tensor([[1.0, 2.0, 3.0]]))
    _, spec = pytree.tree_flatten(kt)
    swapped = KeyedTensor(["b", "a"], [2, 1], torch.tensor([[2.0, 3.0, 1.0]]))
    (values,) = tree_flatten_spec(swapped, spec)
    assert values.tolist() == [[1.0, 2.0, 3.0]]
    rebuilt = pytree.tree_unflatten([values], spec)
    assert rebuilt.keys() == ["a", "b"] and rebuilt["b"].tolist() == [[2.0, 3.0]]


def test_empty_keyed_tensor() -> None:
    kt = KeyedTensor([], [], torch.Tensor())
    assert str(kt) == "KeyedTensor()\n"
    assert kt.keys() == [] and kt.to_dict() == {}


# -- TorchRec's private regroup helpers (its tests and benchmarks import them) -----------------


def test_kt_regroup_arguments_chains_repeated_keys() -> None:
    from recsys_core.sparse.jagged_tensor import _kt_regroup_arguments

    # a (width 2) and b (1) in tensor 0, c (3) in tensor 1; a is used three times.
    permutes, in_shapes, out_shapes, out_lengths = _kt_regroup_arguments(
        torch.empty(0), [["a", "b"], ["c"]], [[2, 1], [3]], [["a", "c"], ["b", "a"], ["a"]]
    )
    # [in_tensor, out_tensor, in_start, out_start, length, jump]: a's first row points to its
    # next use (3), the middle one to minus the next (-4), the last one to -len(rows) (-5).
    assert permutes.dtype == torch.int32
    assert permutes.tolist() == [
        [0, 0, 0, 0, 2, 3],
        [1, 0, 0, 2, 3, 0],
        [0, 1, 2, 0, 1, 0],
        [0, 1, 0, 1, 2, -4],
        [0, 2, 0, 0, 2, -5],
    ]
    assert in_shapes.tolist() == [3, 3]
    assert out_shapes.tolist() == [5, 3, 2]
    assert out_lengths == [5, 3, 2]
    on_meta = _kt_regroup_arguments(torch.empty(0, device="meta"), [["a"]], [[2]], [["a"]])
    assert on_meta[0].is_meta and on_meta[0].shape == (1, 6) and on_meta[3] == [2]
    with pytest.raises(ValueError, match="group 0 asks for key 'zz'"):
        _kt_regroup_arguments(torch.empty(0), [["a"]], [[2]], [["zz"]])


def test_regroup_function_spellings_agree() -> None:
    from recsys_core.sparse.jagged_tensor import (
        _fbgemm_permute_pooled_embs,
        _regroup_keyed_tensors,
        permute_multi_embedding,
        regroup_kts,
    )

    kt0 = KeyedTensor(["a", "b"], [2, 1], torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]))
    kt1 = KeyedTensor(["c"], [1], torch.tensor([[7.0], [8.0]]))
    groups = [["c", "a"], ["b"]]
    expected = [[[7.0, 1.0, 2.0], [8.0, 4.0, 5.0]], [[3.0], [6.0]]]
    for fn in (_fbgemm_permute_pooled_embs, _regroup_keyed_tensors, permute_multi_embedding,
               regroup_kts):
        assert [t.tolist() for t in fn([kt0, kt1], groups)] == expected, fn.__name__


def test_safe_tolist_on_cpu() -> None:
    from recsys_core.sparse.jagged_tensor import _safe_tolist

    assert _safe_tolist(torch.tensor([3, 5, 7])) == [3, 5, 7]
    assert _safe_tolist(torch.tensor([], dtype=torch.int64)) == []
