"""KeyedJaggedTensor: tutorial outputs, key-major layout, key ops, caches, validation errors."""

from __future__ import annotations

import pytest
import torch
from torch.utils import _pytree as pytree

from recsys_core.sparse import JaggedTensor, KeyedJaggedTensor
from recsys_core.sparse.jagged_tensor_validator import validate_keyed_jagged_tensor

INDEX_DTYPES = [torch.int32, torch.int64]


def layout_kjt(
    lengths_dtype: torch.dtype = torch.int64,
    values_dtype: torch.dtype = torch.int64,
    weighted: bool = False,
) -> KeyedJaggedTensor:
    """The docstring layout: 2 keys x batch 3.

    product: [1, 2], [], [3]      user: [4], [5, 6], [7, 8, 9]
    """
    values = torch.arange(1, 10, dtype=values_dtype)
    return KeyedJaggedTensor(
        keys=["product", "user"],
        values=values,
        lengths=torch.tensor([2, 0, 1, 1, 2, 3], dtype=lengths_dtype),
        weights=values.double().float() * 0.5 if weighted else None,
    )


def zero_length_key_kjt(lengths_dtype: torch.dtype = torch.int64) -> KeyedJaggedTensor:
    """3 keys x batch 2; "empty" has only empty bags. a: [1], [2, 3]  empty: [], []  b: [4], []"""
    return KeyedJaggedTensor(
        keys=["a", "empty", "b"],
        values=torch.tensor([1, 2, 3, 4]),
        lengths=torch.tensor([1, 2, 0, 0, 1, 0], dtype=lengths_dtype),
    )


def assert_same_kjt(a: KeyedJaggedTensor, b: KeyedJaggedTensor) -> None:
    assert a.keys() == b.keys()
    assert a.stride() == b.stride()
    assert torch.equal(a.values(), b.values())
    assert torch.equal(a.lengths(), b.lengths())
    assert a.length_per_key() == b.length_per_key()
    wa, wb = a.weights_or_none(), b.weights_or_none()
    assert (wa is None) == (wb is None)
    if wa is not None and wb is not None:
        assert torch.equal(wa, wb)


# -- the tutorial and the notes ---------------------------------------------------------------


def test_tutorial_from_jt_dict() -> None:
    product_jt = JaggedTensor(values=torch.tensor([1, 2, 1, 5]), lengths=torch.tensor([3, 1]))
    user_jt = JaggedTensor(values=torch.tensor([2, 3, 4, 1]), lengths=torch.tensor([2, 2]))
    kjt = KeyedJaggedTensor.from_jt_dict({"product": product_jt, "user": user_jt})
    assert kjt.keys() == ["product", "user"]
    assert torch.equal(kjt.lengths(), torch.tensor([3, 1, 2, 2]))
    assert torch.equal(kjt.values(), torch.tensor([1, 2, 1, 5, 2, 3, 4, 1]))
    assert kjt.stride() == 2
    assert kjt.length_per_key() == [4, 4]
    as_dict = kjt.to_dict()
    assert list(as_dict) == ["product", "user"]
    assert all(isinstance(jt, JaggedTensor) for jt in as_dict.values())
    assert str(kjt) == (
        'KeyedJaggedTensor({\n    "product": [[1, 2, 1], [5]],\n    "user": [[2, 3], [4, 1]]\n})\n'
    )
    assert torch.equal(kjt.offsets(), torch.tensor([0, 3, 4, 6, 8]))


def test_notes_example_lists_and_float_values() -> None:
    kjt = KeyedJaggedTensor(
        keys=["user_features", "item_features"],
        lengths=[2, 3, 1, 2],
        values=torch.Tensor([11, 12, 21, 22, 23, 101, 102, 201]),
    )
    assert kjt.lengths().dtype == torch.int64
    assert kjt.stride() == 2
    user = kjt["user_features"]
    assert user.values().tolist() == [11.0, 12.0, 21.0, 22.0, 23.0]
    assert user.lengths().tolist() == [2, 3]
    item = kjt["item_features"]
    assert item.values().tolist() == [101.0, 102.0, 201.0]
    assert item.lengths().tolist() == [1, 2]
    assert str(item) == "JaggedTensor({\n    [[101.0], [102.0, 201.0]]\n})\n"


# -- layout and cached metadata ---------------------------------------------------------------


@pytest.mark.parametrize("lengths_dtype", INDEX_DTYPES)
@pytest.mark.parametrize("values_dtype", INDEX_DTYPES)
def test_layout_metadata(lengths_dtype: torch.dtype, values_dtype: torch.dtype) -> None:
    kjt = layout_kjt(lengths_dtype, values_dtype)
    assert kjt.stride() == 3
    assert kjt.stride_per_key() == [3, 3]
    assert kjt.stride_per_key_per_rank() == []  # TorchRec: empty for a fixed batch
    assert kjt.variable_stride_per_key() is False
    assert kjt.inverse_indices_or_none() is None
    assert kjt.offsets().tolist() == [0, 2, 2, 3, 4, 6, 9]
    assert kjt.offsets().dtype == lengths_dtype
    assert kjt.length_per_key() == [3, 6]
    assert kjt.offset_per_key() == [0, 3, 9]
    assert kjt.index_per_key() == {"product": 0, "user": 1}
    assert kjt.device() == torch.device("cpu")


def test_caches_are_lazy_and_sync_unsync() -> None:
    kjt = layout_kjt()
    assert kjt.length_per_key_or_none() is None
    assert kjt.offset_per_key_or_none() is None
    assert kjt.offsets_or_none() is None
    assert kjt.sync() is kjt
    assert kjt.length_per_key_or_none() == [3, 6]
    assert kjt.offset_per_key_or_none() == [0, 3, 9]
    assert kjt.unsync() is kjt
    assert kjt.length_per_key_or_none() is None
    assert kjt.offset_per_key_or_none() is None


@pytest.mark.parametrize("dtype", INDEX_DTYPES)
def test_from_offsets_only(dtype: torch.dtype) -> None:
    kjt = KeyedJaggedTensor(
        keys=["product", "user"],
        values=torch.arange(1, 10),
        offsets=torch.tensor([0, 2, 2, 3, 4, 6, 9], dtype=dtype),
    )
    assert kjt.lengths_or_none() is None
    assert kjt.stride() == 3
    assert kjt.length_per_key() == [3, 6]  # from every stride-th offset
    assert kjt.lengths().tolist() == [2, 0, 1, 1, 2, 3]
    assert kjt.lengths().dtype == dtype


@pytest.mark.parametrize("dtype", INDEX_DTYPES)
def test_from_lengths_sync_and_from_offsets_sync_cache_length_per_key(dtype: torch.dtype) -> None:
    by_lengths = KeyedJaggedTensor.from_lengths_sync(
        ["product", "user"], torch.arange(1, 10), torch.tensor([2, 0, 1, 1, 2, 3], dtype=dtype)
    )
    assert by_lengths.length_per_key_or_none() == [3, 6]
    by_offsets = KeyedJaggedTensor.from_offsets_sync(
        ["product", "user"], torch.arange(1, 10), torch.tensor([0, 2, 2, 3, 4, 6, 9], dtype=dtype)
    )
    assert by_offsets.length_per_key_or_none() == [3, 6]
    assert by_offsets.lengths().tolist() == [2, 0, 1, 1, 2, 3]


def test_str_weighted() -> None:
    assert str(layout_kjt(weighted=True)) == (
        "KeyedJaggedTensor({\n"
        '    "product": {\n'
        '        "values": [[1, 2], [], [3]],\n'
        '        "weights": [[0.5, 1.0], [], [1.5]]\n'
        "    },\n"
        '    "user": {\n'
        '        "values": [[4], [5, 6], [7, 8, 9]],\n'
        '        "weights": [[2.0], [2.5, 3.0], [3.5, 4.0, 4.5]]\n'
        "    }\n"
        "})\n"
    )


# -- per-key access ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", INDEX_DTYPES)
def test_getitem(dtype: torch.dtype) -> None:
    kjt = layout_kjt(dtype, weighted=True)
    user = kjt["user"]
    assert user.values().tolist() == [4, 5, 6, 7, 8, 9]
    assert user.weights().tolist() == [2.0, 2.5, 3.0, 3.5, 4.0, 4.5]
    assert user.lengths().tolist() == [1, 2, 3]
    assert user.offsets().tolist() == [0, 1, 3, 6]
    assert kjt["product"].lengths().tolist() == [2, 0, 1]
    with pytest.raises(KeyError, match="no key 'nope'"):
        kjt["nope"]


@pytest.mark.parametrize("dtype", INDEX_DTYPES)
def test_to_dict_gives_views_with_lengths_and_offsets(dtype: torch.dtype) -> None:
    kjt = layout_kjt(dtype, weighted=True)
    as_dict = kjt.to_dict()
    product, user = as_dict["product"], as_dict["user"]
    assert product.values().tolist() == [1, 2, 3]
    assert product.weights().tolist() == [0.5, 1.0, 1.5]
    assert product.lengths().tolist() == [2, 0, 1]
    assert product.offsets().tolist() == [0, 2, 2, 3]
    assert product.offsets().dtype == dtype
    assert user.values().tolist() == [4, 5, 6, 7, 8, 9]
    assert user.lengths().tolist() == [1, 2, 3]
    assert user.offsets().tolist() == [0, 1, 3, 6]
    # Views into the KJT's storage, not copies.
    assert user.values().data_ptr() == kjt.values()[3:].data_ptr()
    assert user.weights().data_ptr() == kjt.weights()[3:].data_ptr()
    assert user.lengths().data_ptr() == kjt.lengths()[3:].data_ptr()
    assert kjt.to_dict() is as_dict  # cached
    assert kjt["user"] is user


def test_to_dict_lengths_or_none_materializes_lazily_built_rows() -> None:
    as_dict = layout_kjt().to_dict()
    assert as_dict["user"].lengths_or_none() is not None
    assert as_dict["user"].offsets_or_none() is not None
    leaves, _ = pytree.tree_flatten(as_dict["product"])
    assert [leaf.tolist() for leaf in leaves if leaf is not None] == [
        [1, 2, 3],
        [2, 0, 1],
        [0, 2, 2, 3],
    ]


def test_zero_length_key() -> None:
    kjt = zero_length_key_kjt()
    assert kjt.length_per_key() == [3, 0, 1]
    assert kjt.offset_per_key() == [0, 3, 3, 4]
    empty = kjt.to_dict()["empty"]
    assert empty.values().numel() == 0
    assert empty.lengths().tolist() == [0, 0]
    assert empty.offsets().tolist() == [0, 0, 0]
    assert kjt["empty"].to_dense()[0].numel() == 0
    assert str(kjt) == (
        'KeyedJaggedTensor({\n    "a": [[1], [2, 3]],\n    "empty": [[], []],\n'
        '    "b": [[4], []]\n})\n'
    )


def test_zero_keys() -> None:
    kjt = KeyedJaggedTensor(keys=[], values=torch.tensor([]), lengths=torch.tensor([]))
    assert kjt.stride() == 0
    assert kjt.length_per_key() == []
    assert kjt.offset_per_key() == [0]
    assert kjt.to_dict() == {}
    assert str(kjt) == "KeyedJaggedTensor()\n"
    assert kjt.permute([]).keys() == []
    assert kjt.split([]) == []
    assert kjt.index_select_batch(torch.tensor([], dtype=torch.int64)).stride() == 0
    kjt.validate()


def test_batch_size_one() -> None:
    kjt = KeyedJaggedTensor(["a", "b"], torch.tensor([1, 2, 3]), lengths=torch.tensor([2, 1]))
    assert kjt.stride() == 1
    assert kjt["a"].values().tolist() == [1, 2]
    assert kjt["b"].offsets().tolist() == [0, 1]
    assert kjt.permute([1, 0]).values().tolist() == [3, 1, 2]
    assert str(kjt) == 'KeyedJaggedTensor({\n    "a": [[1, 2]],\n    "b": [[3]]\n})\n'


def test_explicit_stride_with_all_empty_bags() -> None:
    kjt = KeyedJaggedTensor(["a", "b"], torch.tensor([]), lengths=[0] * 6, stride=3)
    assert kjt.stride() == 3
    assert kjt.length_per_key() == [0, 0]
    assert kjt.to_dict()["b"].offsets().tolist() == [0, 0, 0, 0]
    kjt.validate()


# -- permute / split / concat -----------------------------------------------------------------


@pytest.mark.parametrize("dtype", INDEX_DTYPES)
@pytest.mark.parametrize("weighted", [False, True])
def test_permute_reverse(dtype: torch.dtype, weighted: bool) -> None:
    permuted = layout_kjt(dtype, weighted=weighted).permute([1, 0])
    assert permuted.keys() == ["user", "product"]
    assert permuted.stride() == 3
    assert permuted.lengths().tolist() == [1, 2, 3, 2, 0, 1]
    assert permuted.lengths().dtype == dtype
    assert permuted.values().tolist() == [4, 5, 6, 7, 8, 9, 1, 2, 3]
    assert permuted.length_per_key_or_none() == [6, 3]
    if weighted:
        assert permuted.weights().tolist() == [2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 0.5, 1.0, 1.5]
    else:
        assert permuted.weights_or_none() is None


def test_permute_with_duplicates_and_indices_tensor() -> None:
    kjt = layout_kjt()
    permuted = kjt.permute([1, 1, 0], indices_tensor=torch.tensor([1, 1, 0], dtype=torch.int32))
    assert permuted.keys() == ["user", "user", "product"]
    assert permuted.lengths().tolist() == [1, 2, 3, 1, 2, 3, 2, 0, 1]
    assert permuted.values().tolist() == [4, 5, 6, 7, 8, 9, 4, 5, 6, 7, 8, 9, 1, 2, 3]
    assert permuted.length_per_key() == [6, 6, 3]
    assert permuted.offsets().tolist()[-1] == 15


def test_permute_zero_length_key() -> None:
    permuted = zero_length_key_kjt().permute([1, 2, 0])
    assert permuted.keys() == ["empty", "b", "a"]
    assert permuted.lengths().tolist() == [0, 0, 1, 0, 1, 2]
    assert permuted.values().tolist() == [4, 1, 2, 3]


@pytest.mark.parametrize("dtype", INDEX_DTYPES)
def test_permute_large_matches_per_key_reference(dtype: torch.dtype) -> None:
    # Enough values for the torch.cat path (the small cases above take the FBGEMM kernel).
    gen = torch.Generator().manual_seed(0)
    keys = [f"f{i}" for i in range(6)]
    batch = 2000
    lengths = torch.randint(0, 10, (len(keys) * batch,), generator=gen).to(dtype)
    values = torch.randint(0, 1000, (int(lengths.sum()),), generator=gen)
    weights = torch.rand(values.numel(), generator=gen)
    kjt = KeyedJaggedTensor.from_lengths_sync(keys, values, lengths, weights=weights)
    order = [5, 0, 0, 3]
    permuted = kjt.permute(order)
    parts = [kjt[keys[i]] for i in order]
    assert torch.equal(permuted.values(), torch.cat([p.values() for p in parts]))
    assert torch.equal(permuted.weights(), torch.cat([p.weights() for p in parts]))
    assert torch.equal(permuted.lengths(), torch.cat([p.lengths() for p in parts]))


@pytest.mark.parametrize("segments", [[1, 1], [2, 0], [0, 2]])
@pytest.mark.parametrize("weighted", [False, True])
def test_split_concat_round_trip(segments: list[int], weighted: bool) -> None:
    kjt = layout_kjt(weighted=weighted)
    parts = kjt.split(segments)
    assert [p.keys() for p in parts] == [
        kjt.keys()[: segments[0]],
        kjt.keys()[segments[0] :],
    ]
    assert all(p.stride() == 3 for p in parts)
    assert_same_kjt(KeyedJaggedTensor.concat(parts), kjt)


def test_split_parts_are_views_with_hand_values() -> None:
    kjt = zero_length_key_kjt(torch.int32)
    first, rest = kjt.split([1, 2])
    assert first.keys() == ["a"]
    assert first.values().tolist() == [1, 2, 3]
    assert first.lengths().tolist() == [1, 2]
    assert rest.keys() == ["empty", "b"]
    assert rest.values().tolist() == [4]
    assert rest.lengths().tolist() == [0, 0, 1, 0]
    assert rest.lengths().dtype == torch.int32
    assert rest.length_per_key() == [0, 1]
    assert rest.values().data_ptr() == kjt.values()[3:].data_ptr()
    assert rest.lengths().data_ptr() == kjt.lengths()[2:].data_ptr()
    empty_part = kjt.split([0, 3])[0]
    assert empty_part.keys() == []
    assert empty_part.stride() == 2


def test_concat_three_and_keeps_length_per_key() -> None:
    a, b, c = zero_length_key_kjt().split([1, 1, 1])
    joined = KeyedJaggedTensor.concat([c, a, b])
    assert joined.keys() == ["b", "a", "empty"]
    assert joined.lengths().tolist() == [1, 0, 1, 2, 0, 0]
    assert joined.values().tolist() == [4, 1, 2, 3]
    assert joined.length_per_key_or_none() == [1, 3, 0]


def test_concat_joins_parts_whole_like_torchrec() -> None:
    # Values cut one entry after the lengths' boundary: part 0 has a spare trailing value,
    # part 1 is one short. Neither is consistent alone; TorchRec's concat joins them whole
    # and the result is (and passes every check).
    lengths = torch.tensor([0, 2, 1, 3, 0, 1])
    values = torch.arange(7)
    a = KeyedJaggedTensor(keys=["x"], values=values[:3], lengths=lengths[:2])
    b = KeyedJaggedTensor(keys=["y", "z"], values=values[3:], lengths=lengths[2:])
    joined = KeyedJaggedTensor.concat([a, b])
    assert joined.values().tolist() == list(range(7))
    assert joined.length_per_key_or_none() is None  # no part had its counts cached: no sync
    assert joined.validate().length_per_key() == [2, 4, 1]
    assert joined["y"].values().tolist() == [2, 3, 4, 5]
    # One part short and nothing after it: the joined KJT is refused where a kernel reads it.
    w = KeyedJaggedTensor(keys=["w"], values=torch.arange(1), lengths=torch.tensor([1, 1]))
    short = KeyedJaggedTensor.concat([b, w])
    with pytest.raises(ValueError, match="values has only 5 entries"):
        short.permute([1, 0])


def test_weights_must_match_the_values_one_for_one() -> None:
    # TorchRec's KJT lets some operations read views of a KJT with more weights than values; here
    # every operation refuses a weight count other than one per value (the modules' kernels would
    # not all agree on ignoring the extra ones: the sparse fuzz test found the quantized EBC's).
    extra = KeyedJaggedTensor(
        keys=["a", "b"], values=torch.tensor([5, 6, 7]), lengths=torch.tensor([2, 1]),
        weights=torch.arange(30, dtype=torch.float32),
    )
    with pytest.raises(ValueError, match="weights has 30 entries and values has 3"):
        extra["a"]
    with pytest.raises(ValueError, match="weights has 30 entries and values has 3"):
        extra.validate()
    too_few = KeyedJaggedTensor(
        keys=["a"], values=torch.tensor([5, 6]), lengths=torch.tensor([2]),
        weights=torch.tensor([1.0]),
    )
    with pytest.raises(ValueError, match="weights has 1 entries and values has 2"):
        too_few["a"]


# -- batch selection, movement, misc ----------------------------------------------------------


@pytest.mark.parametrize("dtype", INDEX_DTYPES)
@pytest.mark.parametrize("lengths_dtype", INDEX_DTYPES)
def test_index_select_batch(dtype: torch.dtype, lengths_dtype: torch.dtype) -> None:
    kjt = layout_kjt(lengths_dtype, weighted=True)
    picked = kjt.index_select_batch(torch.tensor([2, 0, 2], dtype=dtype))
    assert picked.keys() == ["product", "user"]
    assert picked.stride() == 3
    assert picked.lengths().tolist() == [1, 2, 1, 3, 1, 3]
    assert picked.values().tolist() == [3, 1, 2, 3, 7, 8, 9, 4, 7, 8, 9]
    assert picked.weights().tolist() == [1.5, 0.5, 1.0, 1.5, 3.5, 4.0, 4.5, 2.0, 3.5, 4.0, 4.5]
    single = kjt.index_select_batch([1])
    assert single.stride() == 1
    assert single.lengths().tolist() == [0, 2]
    assert single.values().tolist() == [5, 6]
    assert single.length_per_key() == [0, 2]


def test_index_select_batch_out_of_range() -> None:
    with pytest.raises(ValueError, match="index 3 is out of range for batch size 3"):
        layout_kjt().index_select_batch(torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="index -1 is out of range"):
        layout_kjt().index_select_batch([-1])


def test_to_device_and_weight_dtype_keep_caches() -> None:
    kjt = layout_kjt(weighted=True).sync()
    moved = kjt.to(torch.device("cpu"), non_blocking=True, dtype=torch.float64)
    assert moved.weights().dtype == torch.float64
    assert moved.weights().tolist() == [0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5]
    assert moved.values().dtype == torch.int64
    assert moved.length_per_key_or_none() == [3, 6]
    assert moved.keys() == ["product", "user"]
    assert moved.to("cpu").weights().dtype == torch.float64


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="pin_memory needs a CUDA build")
def test_pin_memory_and_to_cuda() -> None:
    kjt = layout_kjt(weighted=True)
    pinned = kjt.pin_memory()
    assert pinned.values().is_pinned() and pinned.weights().is_pinned()
    on_gpu = pinned.to(torch.device("cuda"), non_blocking=True)
    on_gpu.record_stream(torch.cuda.current_stream())
    assert on_gpu.permute([1, 0]).values().cpu().tolist() == [4, 5, 6, 7, 8, 9, 1, 2, 3]
    picked = on_gpu.index_select_batch(torch.tensor([2, 0], device="cuda"))
    assert picked.lengths().cpu().tolist() == [1, 2, 3, 1]


def test_empty_and_empty_like() -> None:
    empty = KeyedJaggedTensor.empty(is_weighted=True, values_dtype=torch.int64)
    assert empty.keys() == []
    assert empty.stride() == 0
    assert empty.lengths().dtype == torch.int32
    assert empty.weights().numel() == 0
    like = KeyedJaggedTensor.empty_like(layout_kjt(torch.int32, weighted=True))
    assert like.keys() == []
    assert like.stride() == 3
    assert like.lengths().dtype == torch.int32
    assert like.weights().dtype == torch.float32
    assert KeyedJaggedTensor.from_jt_dict({}).keys() == []


def test_flatten_lengths() -> None:
    kjt = layout_kjt().sync()
    flat = kjt.flatten_lengths()
    assert flat.lengths().tolist() == [2, 0, 1, 1, 2, 3]
    assert flat.length_per_key_or_none() == [3, 6]


def test_pytree_round_trip_and_export() -> None:
    kjt = layout_kjt(weighted=True)
    leaves, spec = pytree.tree_flatten(kjt)
    assert len(leaves) == 4  # values, weights, lengths, offsets
    rebuilt = pytree.tree_unflatten(leaves, spec)
    assert isinstance(rebuilt, KeyedJaggedTensor)
    assert_same_kjt(rebuilt, kjt)

    class SumIds(torch.nn.Module):
        def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
            return features.values().sum() + features.lengths().sum()

    exported = torch.export.export(SumIds(), (kjt,), strict=False)
    other = KeyedJaggedTensor(
        ["product", "user"],
        torch.arange(11, 20),
        lengths=torch.tensor([2, 0, 1, 1, 2, 3]),
        weights=torch.ones(9),
    )
    assert int(exported.module()(other)) == sum(range(11, 20)) + 9


# -- validation -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lengths": [1.0, 2.0, 3.0, 0.0]}, "lengths must be a list of ints, got torch.float32"),
        ({"lengths": "1230"}, "lengths must be a tensor or a list of ints, got str"),
        ({"lengths": torch.tensor([1.0, 2.0, 3.0, 0.0])}, "lengths must be an int32 or int64"),
        ({"offsets": torch.tensor([0.0, 3.0, 6.0])}, "offsets must be an int32 or int64"),
    ],
)
def test_constructor_rejects_what_torchrec_rejects(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KeyedJaggedTensor(keys=["a", "b"], values=torch.arange(6), **kwargs)


def test_constructor_rejects_string_keys() -> None:
    with pytest.raises(ValueError, match="keys must be a list of strings, got the string 'ab'"):
        KeyedJaggedTensor(keys="ab", values=torch.arange(2), lengths=[1, 1])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lengths": [1, 2, 3, 0], "stride": 3}, r"batch sizes per key \[3, 3\] .* sum to 6"),
        (
            {"lengths": [3, 0, 3, 0], "weights": torch.ones(5)},
            "weights size must equal to values size, but weights has 5",
        ),
        ({"lengths": [3, 0, 2, 0]}, "lengths sum to 5 and values has 6 entries"),
        ({"lengths": [3, 0, 3, 0], "keys": ["a", "a"]}, r"keys must be unique, but \['a'\]"),
        (
            {"lengths": [1, 1], "keys": []},
            r"keys is empty but lengths or offsets is not \(2 lengths\)",
        ),
        ({"lengths": [3, 0, 3, 0], "length_per_key": [6]}, "1 entries for 2 keys"),
        ({"lengths": [3, 0, 3, 0], "offset_per_key": [0, 6]}, r"offset_per_key \[0, 6\] does not"),
        (
            {"lengths": [3, 0, 3], "stride_per_key_per_rank": [[2], [2]]},
            r"Sum of stride_per_key_per_rank \(4\) must equal the number of lengths \(3\)",
        ),
    ],
)
def test_constructor_is_lazy_and_validate_rejects(kwargs: dict, message: str) -> None:
    # TorchRec's constructor stores these; the explicit validation names what is wrong.
    kwargs = {"keys": ["a", "b"], **kwargs}
    kjt = KeyedJaggedTensor(values=torch.arange(6), **kwargs)
    with pytest.raises(ValueError, match=message):
        kjt.validate()
    with pytest.raises(ValueError, match=message):
        validate_keyed_jagged_tensor(kjt)


def test_constructor_accepts_what_torchrec_accepts() -> None:
    # Integer weights, 2-D lengths, values longer than sum(lengths), offsets only.
    kjt = KeyedJaggedTensor(
        keys=["a", "b"],
        values=torch.tensor([10, 11, 12, 13, 99, 98]),
        lengths=torch.tensor([[1, 1], [0, 2]]),
        weights=torch.tensor([1, 2, 3, 4, 5, 6]),
    )
    assert kjt.stride() == 2
    assert kjt.length_per_key() == [2, 2]
    assert kjt.offset_per_key() == [0, 2, 4]
    assert kjt["b"].values().tolist() == [12, 13]
    assert kjt["b"].weights().tolist() == [3, 4]
    assert kjt.to_dict()["b"].lengths().tolist() == [0, 2]
    assert kjt.flatten_lengths().lengths().tolist() == [1, 1, 0, 2]
    permuted = kjt.permute([1, 0])
    assert permuted.values().tolist() == [12, 13, 10, 11]
    assert permuted.weights().tolist() == [3, 4, 1, 2]
    assert permuted.lengths().tolist() == [0, 2, 1, 1]
    # A lengths count that does not divide among the keys fails when the stride is needed.
    odd = KeyedJaggedTensor(keys=["a", "b"], values=torch.arange(5), lengths=[1, 1, 1, 1, 1])
    with pytest.raises(ValueError, match=r"5 entries, not a multiple of the 2 keys \['a', 'b'\]"):
        odd.stride()


def test_values_shorter_than_lengths_fail_when_used() -> None:
    # TorchRec stores and syncs such a KJT; using a key's bags then names the key.
    kjt = KeyedJaggedTensor.from_lengths_sync(
        ["product", "user"], torch.arange(1, 9), torch.tensor([2, 0, 1, 1, 2, 3])
    )
    assert kjt.length_per_key() == [3, 6]
    message = r"key 'user' needs values\[3:9\] but values has only 8"
    with pytest.raises(ValueError, match=message):
        kjt["product"]
    with pytest.raises(ValueError, match=message):
        kjt.to_dict()
    with pytest.raises(ValueError, match=message):
        kjt.split([1, 1])
    with pytest.raises(ValueError, match=message):
        kjt.permute([1, 0])


def test_no_lengths_nor_offsets_is_an_empty_kjt_as_in_torchrec() -> None:
    kjt = KeyedJaggedTensor([], torch.Tensor())
    assert str(kjt) == "KeyedJaggedTensor()\n"
    assert kjt.stride() == 0
    assert kjt.to_dict() == {}
    with pytest.raises(ValueError, match="has neither lengths nor offsets"):
        kjt.lengths()
    with pytest.raises(ValueError, match="has neither lengths nor offsets"):
        kjt.offsets()


def test_meta_device_has_no_data_but_works() -> None:
    # As TorchRec: length_per_key on meta values is an even split (remainder on key 0).
    meta = torch.device("meta")
    kjt = KeyedJaggedTensor(
        keys=["a", "b", "c"],
        values=torch.empty(10, device=meta),
        lengths=torch.empty(6, dtype=torch.int64, device=meta),
    )
    assert kjt.sync().length_per_key() == [4, 3, 3]
    jts = kjt.to_dict()
    assert jts["a"].values().shape == (4,) and jts["a"].values().is_meta
    assert KeyedJaggedTensor.from_jt_dict(jts).keys() == ["a", "b", "c"]


def test_clear_storage_frees_the_tensors() -> None:
    kjt = layout_kjt(weighted=True)
    values, weights, lengths = kjt.values(), kjt.weights(), kjt.lengths()
    kjt.clear_storage()
    assert values.untyped_storage().nbytes() == 0
    assert weights.untyped_storage().nbytes() == 0
    assert lengths.untyped_storage().nbytes() == 0


def test_to_dict_of_no_bags_has_offsets_zero() -> None:
    # TorchRec 1.9: empty lengths and offsets [0] per key (1.8: empty offsets)
    kjt = KeyedJaggedTensor(
        keys=["a", "b"],
        values=torch.tensor([]),
        lengths=torch.tensor([[], []]),
        length_per_key=[0, 0],
    )
    jts = kjt.to_dict()
    assert jts["a"].lengths().numel() == 0 and jts["a"].offsets().tolist() == [0]
    assert jts["b"].values().numel() == 0 and jts["b"].offsets().tolist() == [0]


def test_to_dict_without_offsets() -> None:
    jts = layout_kjt().to_dict(compute_offsets=False)
    assert jts["user"].lengths().tolist() == [1, 2, 3]
    assert jts["user"].offsets_or_none() is None
    assert jts["user"].offsets().tolist() == [0, 1, 3, 6]


@pytest.mark.parametrize("dtype", INDEX_DTYPES)
@pytest.mark.parametrize(
    ("lengths", "message"),
    [
        ([2, 0, 1, 1, -1, 3], "negative length -1 for key 'user' at batch position 1"),
        ([-2, 0, 1, 1, 2, 3], "negative length -2 for key 'product' at batch position 0"),
        ([5, 5, 1, 0, 0, 0], r"key 'product' needs values\[0:11\] but values has only 9"),
        ([2, 0, 1, 1, 2, 4], r"key 'user' needs values\[3:10\] but values has only 9"),
        (
            [2, 0, 1, 1, 2, 2],
            "lengths sum to 8 and values has 9 entries .after the last key 'user'",
        ),
    ],
)
def test_validate_names_the_key(lengths: list[int], message: str, dtype: torch.dtype) -> None:
    kjt = KeyedJaggedTensor(
        ["product", "user"], torch.arange(1, 10), lengths=torch.tensor(lengths, dtype=dtype)
    )
    with pytest.raises(ValueError, match=message):
        kjt.validate()


def test_validate_offsets_and_cached_metadata() -> None:
    with pytest.raises(ValueError, match="Expected first offset to be 0, but got 1"):
        KeyedJaggedTensor(
            ["product", "user"], torch.arange(1, 10), offsets=torch.tensor([1, 2, 2, 3, 4, 6, 9])
        ).validate()
    with pytest.raises(ValueError, match="negative length -1 for key 'user' at batch position 0"):
        KeyedJaggedTensor(
            ["product", "user"], torch.arange(1, 10), offsets=torch.tensor([0, 2, 2, 4, 3, 6, 9])
        ).validate()
    wrong_lpk = KeyedJaggedTensor(
        ["product", "user"], torch.arange(1, 10), lengths=[2, 0, 1, 1, 2, 3], length_per_key=[4, 5]
    )
    with pytest.raises(ValueError, match="key 'product' has 4 values but its lengths sum to 3"):
        wrong_lpk.validate()
    wrong_opk = KeyedJaggedTensor(
        ["product", "user"],
        torch.arange(1, 10),
        lengths=[2, 0, 1, 1, 2, 3],
        offset_per_key=[0, 4, 9],
    )
    with pytest.raises(ValueError, match=r"offset_per_key \[0, 4, 9\] does not match"):
        wrong_opk.validate()
    layout_kjt(torch.int32, torch.int32, weighted=True).validate()
    zero_length_key_kjt().validate()


def test_from_jt_dict_errors_name_the_key() -> None:
    a = JaggedTensor(values=torch.tensor([1, 2]), lengths=[1, 1])
    weighted = JaggedTensor(values=torch.tensor([3, 4]), lengths=[1, 1], weights=torch.ones(2))
    with pytest.raises(ValueError, match="key 'w' is weighted but key 'a' is unweighted"):
        KeyedJaggedTensor.from_jt_dict({"a": a, "w": weighted})


def test_key_op_errors() -> None:
    kjt = layout_kjt()
    with pytest.raises(
        ValueError, match=r"segments \[1\] must be non-negative and sum to .* \(2\)"
    ):
        kjt.split([1])
    with pytest.raises(
        ValueError, match=r"index 2 is out of range for 2 keys \['product', 'user'\]"
    ):
        kjt.permute([0, 2])
    other_stride = KeyedJaggedTensor(["x"], torch.tensor([1]), lengths=[1])
    with pytest.raises(ValueError, match=r"KJT 1 \(keys \['x'\]\) has stride 1 but KJT 0 has 3"):
        KeyedJaggedTensor.concat([kjt, other_stride])
    with pytest.raises(ValueError, match=r"KJT 1 \(keys \['product', 'user'\]\) is weighted"):
        KeyedJaggedTensor.concat([kjt, layout_kjt(weighted=True)])
    with pytest.raises(ValueError, match="empty list"):
        KeyedJaggedTensor.concat([])


def test_validator_checks_the_last_offset() -> None:
    kjt = KeyedJaggedTensor(
        ["a", "b"], torch.arange(5), lengths=torch.tensor([1, 1]), offsets=torch.tensor([0, 1, 2])
    )
    with pytest.raises(ValueError, match="last element of offsets must equal to the number of"):
        validate_keyed_jagged_tensor(kjt)
    with pytest.raises(ValueError, match="offsets cannot be empty"):
        KeyedJaggedTensor(["a"], torch.arange(0), lengths=[], offsets=torch.tensor([])).validate()


def test_non_integer_lengths_raise_what_torchrec_raises_too() -> None:
    # TorchRec asserts here; our error is a ValueError and an AssertionError.
    float_lengths = torch.tensor([3.0, 4.0], dtype=torch.float64)
    with pytest.raises(AssertionError, match="lengths must be an int32 or int64 tensor"):
        KeyedJaggedTensor.from_lengths_sync(["f1", "f2"], torch.rand(7, 3), float_lengths)
    with pytest.raises(ValueError, match="offsets must be an int32 or int64 tensor"):
        KeyedJaggedTensor.from_offsets_sync(
            ["f1", "f2"], torch.rand(7, 3), torch.tensor([0.0, 3.0, 7.0])
        )
    with pytest.raises(AssertionError, match="pass lengths or offsets"):
        JaggedTensor(values=torch.arange(3))


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("given", ["lengths", "offsets", "both"])
def test_split_parts_equal_slices_by_hand(seed: int, given: str) -> None:
    """Random segments (zeros and a full one included) over a weighted KJT with spare trailing
    values, built each way TorchRec users build one: every part's keys, lengths, values and
    weights equal slices cut at offsets computed here from the lengths."""
    gen = torch.Generator().manual_seed(seed)
    keys = [f"k{i}" for i in range(5)]
    batch = 3 + seed
    lengths = torch.randint(0, 4, (5 * batch,), generator=gen)
    total = int(lengths.sum())
    values = torch.arange(total + 2)  # two values past the last bag belong to no key
    weights = torch.rand(total + 2, generator=gen)
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    args = {"keys": keys, "values": values, "weights": weights}
    if given != "offsets":
        args["lengths"] = lengths
    if given != "lengths":
        args["offsets"] = offsets
    segments = [[2, 3], [0, 5], [5, 0], [1, 0, 4], [1, 1, 1, 1, 1], [5]][seed]
    kjt = KeyedJaggedTensor(**args)
    parts = kjt.split(segments)
    rows = lengths.tolist()
    start = 0
    for segment, part in zip(segments, parts, strict=True):
        end = start + segment
        if segment == len(keys):  # as TorchRec: the KJT itself, trailing values and all
            assert part is kjt
            continue
        lo = sum(rows[: start * batch])
        hi = sum(rows[: end * batch])
        assert part.keys() == keys[start:end]
        assert part.lengths().tolist() == rows[start * batch : end * batch]
        assert part.values().tolist() == list(range(lo, hi))
        assert torch.equal(part.weights(), weights[lo:hi])
        assert part.stride() == batch
        start = end


def test_split_parts_of_values_that_need_gradients() -> None:
    """Parts of weights that need gradients can be changed in place (as slices can; views from
    one multi-output op could not), and gradients flow back to the right entries."""
    lengths = torch.tensor([2, 0, 1, 1, 2, 3])
    weights = torch.arange(1.0, 10.0, requires_grad=True)
    kjt = KeyedJaggedTensor(["p", "u"], torch.arange(9), weights=weights * 1, lengths=lengths)
    first, rest = kjt.split([1, 1])
    part = rest.weights()
    part.mul_(2)  # in place on a view of a tensor in the graph
    (first.weights().sum() + part.sum()).backward()
    assert weights.grad.tolist() == [1.0, 1.0, 1.0] + [2.0] * 6


def test_split_parts_share_the_version_counter_of_their_tensors() -> None:
    """Parts are real views: an in-place change through one bumps the version of the KJT's
    tensor, so autograd still notices a tensor saved for backward being changed."""
    kjt = layout_kjt(weighted=True)
    _, user = kjt.split([1, 1])
    before = [t._version for t in (kjt.values(), kjt.lengths(), kjt.weights())]
    for t in (user.values(), user.lengths(), user.weights()):
        t.add_(1)
    after = [t._version for t in (kjt.values(), kjt.lengths(), kjt.weights())]
    assert after == [v + 1 for v in before]
    assert kjt.values().tolist() == [1, 2, 3, 5, 6, 7, 8, 9, 10]
