"""The one-pass C helper for KJT lengths (recsys_core/sparse/_native.c) against the numpy/torch
passes it replaces: the same per-key sums for lengths in range, the same error (naming the same
entry) for lengths out of range, for int64 and int32 lengths."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest
import torch
from native_paths import native_path

from recsys_core import KeyedJaggedTensor
from recsys_core.sparse import _native_lib, _safety

KEYS = ["a", "b", "c"]


def _sums(lengths: torch.Tensor, num_values: int, native: bool) -> list[int] | str:
    try:
        with contextlib.nullcontext() if native else _native_lib.torch_path_only():
            return _safety._sums_in_range(
                KEYS, [lengths.numel() // 3] * 3, True, lengths, num_values
            )
    except ValueError as e:
        return f"ValueError: {e}"


@pytest.fixture(params=[2, 1, 0], ids=["avx512", "avx2", "vec128"])
def vector_build(request: pytest.FixtureRequest) -> Iterator[int]:
    """Each vector build of the helper's loops (64-, 32-, 16-byte vectors) that this CPU runs."""
    with native_path(request.param):
        yield request.param


def test_the_helper_is_built_where_ci_runs() -> None:
    if os.environ.get("CI") == "true":
        assert _safety.native_available()


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("seed", range(40))
def test_native_pass_equals_the_torch_passes(dtype: torch.dtype, seed: int) -> None:
    if not _safety.native_available():
        pytest.skip("recsys_core/sparse/_native.c was not built")
    gen = torch.Generator().manual_seed(seed)
    stride = int(torch.randint(1, 50, (1,), generator=gen))
    lengths = torch.randint(0, 6, (3 * stride,), generator=gen, dtype=dtype)
    num_values = int(lengths.sum())
    if seed % 4 == 1:  # a negative length whose key still sums right ([1, 1, -1, 3] style)
        i = int(torch.randint(0, 3 * stride - 1, (1,), generator=gen))
        lengths[i] -= 7
        lengths[i + 1] += 7
    elif seed % 4 == 2:  # a length above the number of values
        lengths[int(torch.randint(0, 3 * stride, (1,), generator=gen))] = num_values + 1
    elif seed % 4 == 3:  # the most negative value there is
        lengths[-1] = torch.iinfo(dtype).min
    native = _sums(lengths, num_values, True)
    reference = _sums(lengths, num_values, False)
    assert native == reference
    if seed % 4 == 0:
        assert native == lengths.view(3, stride).sum(1).tolist()
    else:
        assert isinstance(native, str) and native.startswith("ValueError: KeyedJaggedTensor")


def test_from_lengths_sync_by_hand() -> None:
    # the tutorial's shape: keys a, b, c over a batch of 2
    kjt = KeyedJaggedTensor.from_lengths_sync(
        KEYS, torch.arange(7), torch.tensor([1, 2, 0, 1, 3, 0]))
    assert kjt.length_per_key() == [3, 1, 3] and kjt.offset_per_key() == [0, 3, 4, 7]
    with pytest.raises(ValueError, match="negative|-1"):
        KeyedJaggedTensor.from_lengths_sync(KEYS, torch.arange(4), torch.tensor([1, 1, -1, 3, 0, 0])).permute([1, 0, 2])


def _plant(lengths: torch.Tensor, case: str, position: int, num_values: int) -> None:
    if case == "negative":  # the key's sum stays right: only the range proof catches it
        lengths[(position + 1) % lengths.numel()] += int(lengths[position]) + 1
        lengths[position] = -1
    elif case == "too_large":
        lengths[position] = num_values + 1
    elif case == "most_negative":
        lengths[position] = torch.iinfo(lengths.dtype).min


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("num_keys", [1, 3, 26])
@pytest.mark.parametrize("stride", [1, 7, 31, 32, 33, 64, 65, 100, 1031])
def test_key_sums_lists_by_hand_in_the_vector_loop_and_its_tail(
    dtype: torch.dtype, num_keys: int, stride: int, vector_build: int
) -> None:
    """``_native.key_sums`` (the per-key sums and running offsets as lists, int64 lengths in
    blocks of 32 plus a scalar tail) against sums by hand; None for a bad length in the vector
    part or in the tail of any key."""
    fn = _native_lib.key_sums_lists()
    if fn is None:
        pytest.skip("recsys_core/sparse/_native.c was not built")
    gen = torch.Generator().manual_seed(stride * 100 + num_keys)
    lengths = torch.randint(0, 9, (num_keys * stride,), generator=gen, dtype=dtype)
    num_values = int(lengths.sum())
    rows = lengths.tolist()
    sums = [sum(rows[k * stride:(k + 1) * stride]) for k in range(num_keys)]
    offsets = [0]
    for s in sums:
        offsets.append(offsets[-1] + s)
    assert fn(lengths.data_ptr(), lengths.element_size(), num_keys, stride, num_values) == (
        sums, offsets)
    # a bound below the largest length: not proven
    largest = max(rows)
    if largest > 0:
        assert fn(lengths.data_ptr(), lengths.element_size(), num_keys, stride, largest - 1) is None
    last_key = (num_keys - 1) * stride
    positions = {0, last_key + stride - 1, last_key + min(stride - 1, 31), last_key + stride // 2}
    for case in ("negative", "too_large", "most_negative"):
        for position in positions:
            bad = lengths.clone()
            _plant(bad, case, position, num_values)
            assert fn(bad.data_ptr(), bad.element_size(), num_keys, stride, num_values) is None, (
                case, position)


@pytest.mark.parametrize("case", ["good", "negative", "too_large", "most_negative", "weights",
                                  "stride", "values_short"])
def test_from_lengths_sync_fast_path_equals_the_general_path(case: str) -> None:
    """The fixed-batch fast path of ``ensure_safe_layout`` (one C call) and the general path
    (with the helper switched off) give the same counts, offsets and stride, and the same
    error for every malformed input."""
    gen = torch.Generator().manual_seed(5)
    keys = [f"f{i}" for i in range(26)]
    lengths = torch.randint(0, 5, (26 * 70,), generator=gen)
    num_values = int(lengths.sum())
    values = torch.arange(num_values)
    weights = None
    stride = None
    if case in ("negative", "too_large", "most_negative"):
        _plant(lengths, case, 26 * 70 - 3, num_values)
    elif case == "weights":
        weights = torch.ones(num_values - 1)
    elif case == "stride":
        stride = 69
    elif case == "values_short":
        values = values[:-1]

    def build() -> tuple | str:
        try:
            kjt = KeyedJaggedTensor.from_lengths_sync(
                keys, values, lengths, weights=weights, stride=stride)
            kjt.permute(list(range(25, -1, -1)))
            return kjt.length_per_key(), kjt.offset_per_key(), kjt.stride()
        except (ValueError, RuntimeError) as e:  # a stride that does not fit: as TorchRec's view
            return f"{type(e).__name__}: {e}"

    fast = build()
    with _native_lib.torch_path_only():
        general = build()
    assert fast == general
    if case == "good":
        sums = lengths.view(26, 70).sum(1).tolist()
        assert fast[0] == sums and fast[1][-1] == num_values and fast[2] == 70
    else:
        assert isinstance(fast, str)


def _layout(kjt_args: dict, native: bool) -> tuple[list[int], list[int]] | str:
    """length_per_key and offset_per_key of a KJT, or the error its safety check raises."""
    try:
        with contextlib.nullcontext() if native else _native_lib.torch_path_only():
            kjt = KeyedJaggedTensor(**kjt_args)
            return kjt._ensure_safe(), kjt.offset_per_key()
    except ValueError as e:
        return f"ValueError: {e}"


def _offsets_of(lengths: torch.Tensor) -> torch.Tensor:
    offsets = torch.zeros(lengths.numel() + 1, dtype=lengths.dtype)
    offsets[1:] = torch.cumsum(lengths, 0)
    return offsets


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("seed", range(48))
@pytest.mark.parametrize("given", ["both", "offsets"])
def test_lengths_and_offsets_proven_in_one_pass_like_the_torch_checks(
    dtype: torch.dtype, seed: int, given: str, vector_build: int
) -> None:
    """KJTs built with lengths AND offsets, or offsets only (as TorchRec users build them): the
    C pass gives the torch path's sums, or the torch path's error, for agreeing offsets, an
    offset that disagrees with its length, a nonzero first offset, decreasing offsets (a
    negative implied length), and a last offset past the values. Strides 1-70 cover the
    16-wide vector loop and its tail."""
    if not _safety.native_available():
        pytest.skip("recsys_core/sparse/_native.c was not built")
    gen = torch.Generator().manual_seed(seed)
    stride = int(torch.randint(1, 70, (1,), generator=gen))
    lengths = torch.randint(0, 6, (3 * stride,), generator=gen, dtype=dtype)
    offsets = _offsets_of(lengths)
    num_values = int(lengths.sum())
    case = seed % 6
    position = int(torch.randint(1, 3 * stride + 1, (1,), generator=gen))
    if case == 1:  # one offset off by one: disagrees with two lengths (or decreases)
        offsets[position] += 1 if position < 3 * stride else -1
    elif case == 2:  # everything shifted: the first offset is not 0
        offsets += 1
    elif case == 3:  # offsets that decrease once, lengths unchanged
        offsets[position] = -5
    elif case == 4:  # the last offset past the values
        offsets[-1] = num_values + 3
    elif case == 5 and given == "both":  # lengths changed, offsets not
        lengths[position - 1] += 1
    args = {"keys": KEYS, "values": torch.arange(num_values + 8)[:num_values], "offsets": offsets}
    if given == "both":
        args["lengths"] = lengths
    native = _layout(args, True)
    reference = _layout(args, False)
    assert native == reference
    implied = offsets[1:] - offsets[:-1]  # what an offsets-only KJT's lengths are
    valid = case == 0 or (
        given == "offsets"
        and int(offsets[0]) == 0 and bool((implied >= 0).all()) and int(offsets[-1]) <= num_values
    )
    if valid:
        sums = (lengths if given == "both" else implied).view(3, stride).sum(1).tolist()
        assert native == (sums, [0, sums[0], sums[0] + sums[1], sum(sums)])
    else:
        assert isinstance(native, str) and native.startswith("ValueError:"), (case, native)


def test_lengths_and_offsets_by_hand() -> None:
    """keys a, b; B = 2; lengths [2, 0, 1, 3]; offsets [0, 2, 2, 3, 6]: key sums 2 and 4."""
    values = torch.arange(6)
    lengths = torch.tensor([2, 0, 1, 3])
    kjt = KeyedJaggedTensor(["a", "b"], values, lengths=lengths, offsets=torch.tensor([0, 2, 2, 3, 6]))
    assert kjt.length_per_key() == [2, 4] and kjt.offset_per_key() == [0, 2, 6]
    assert kjt["b"].values().tolist() == [2, 3, 4, 5]
    bad = KeyedJaggedTensor(["a", "b"], values, lengths=lengths, offsets=torch.tensor([0, 2, 3, 3, 6]))
    with pytest.raises(ValueError, match="not equal to the cumulative sum of lengths"):
        bad.permute([1, 0])
    only = KeyedJaggedTensor(["a", "b"], values, offsets=torch.tensor([0, 2, 2, 1, 6]))
    with pytest.raises(ValueError, match="negative|-1"):
        only.split([1, 1])
    # offsets whose difference overflows int64 (2^62 then -2^63): refused, not summed
    wrapped = KeyedJaggedTensor(["a"], torch.zeros(0, dtype=torch.int64),
                                offsets=torch.tensor([0, 2**62, -(2**63)]))
    with pytest.raises(ValueError, match="larger than the 0 values"):
        wrapped.permute([0])


def _key_sums_or_skip():
    fn = _native_lib.key_sums_lists()
    if fn is None:
        pytest.skip("recsys_core/sparse/_native.c was not built")
    return fn


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("n", [1, 7, 22, 23, 24, 25, 39, 40, 41, 56, 100])
def test_offsets_passes_catch_a_bad_entry_at_every_position(
    dtype: torch.dtype, n: int, vector_build: int
) -> None:
    """The lengths + offsets pass and the offsets-only pass (one key of ``n`` lengths: the int64
    loops step 16 entries while 24 offsets remain, then a scalar tail) against sums by hand, and
    None for an offset or a length changed at every single position, vector part and tail."""
    fn = _key_sums_or_skip()
    gen = torch.Generator().manual_seed(n)
    lengths = torch.randint(0, 5, (n,), generator=gen, dtype=dtype)
    offsets = _offsets_of(lengths)
    total = int(lengths.sum())
    size = lengths.element_size()
    expect = ([total], [0, total])
    assert fn(lengths.data_ptr(), size, 1, n, total, offsets.data_ptr()) == expect
    assert fn(0, size, 1, n, total, offsets.data_ptr()) == expect
    for j in range(n + 1):
        bad = offsets.clone()
        bad[j] += 1  # disagrees with one or two lengths
        assert fn(lengths.data_ptr(), size, 1, n, total + 1, bad.data_ptr()) is None, j
        # offsets only: a decrease after j (or a nonzero start), or the end past the values
        bad[j] = offsets[j + 1] + 1 if j < n else total + 2
        assert fn(0, size, 1, n, total + 1, bad.data_ptr()) is None, j
        bad[j] = -1  # a negative offset (a decrease before it, or a nonzero start)
        assert fn(0, size, 1, n, total + 1, bad.data_ptr()) is None, j
    for j in range(n):
        bad = lengths.clone()
        bad[j] += 1
        assert fn(bad.data_ptr(), size, 1, n, total + 1, offsets.data_ptr()) is None, j


@pytest.mark.parametrize("n", [4, 40])
def test_offsets_that_wrap_around_are_refused(n: int, vector_build: int) -> None:
    """Four lengths of 2^62 (in range of a huge bound): their running sum passes 2^63, so the
    offsets wrap to negative values and back to 0 at the end, while every difference still
    equals its length. The key's sum from its bounding offsets would be 0, so both passes
    refuse (the proof needs every offset >= 0; n = 40 puts the negative ones in the vector
    loop), and so does the lengths-only pass (its sums could wrap: n * bound >= 2^63)."""
    fn = _key_sums_or_skip()
    bound = 2**62
    rows = [bound] * 4 + [0] * (n - 4)
    lengths = torch.tensor(rows, dtype=torch.int64)
    wrapped = [0]
    for x in rows:
        wrapped.append((wrapped[-1] + x + 2**63) % 2**64 - 2**63)  # int64 arithmetic
    assert wrapped[2] == -(2**63) and wrapped[-1] == 0
    offsets = torch.tensor(wrapped, dtype=torch.int64)
    assert torch.equal(offsets[1:] - offsets[:-1], lengths)  # they agree, modulo 2^64
    assert fn(lengths.data_ptr(), 8, 1, n, bound, offsets.data_ptr()) is None
    assert fn(0, 8, 1, n, bound, offsets.data_ptr()) is None
    assert fn(lengths.data_ptr(), 8, 1, n, bound) is None
    # below the bound where n lengths could wrap, the same pass sums
    small = torch.tensor([1] * n, dtype=torch.int64)
    assert fn(small.data_ptr(), 8, 1, n, 2**63 // (n + 1)) == ([n], [0, n])


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("n", [1, 2, 3, 17, 64, 1000])
def test_offsets_to_lengths_in_c_equals_the_subtraction(dtype: torch.dtype, n: int) -> None:
    """An offsets-only KJT's (and JaggedTensor's) lengths: the C loop against torch's
    ``offsets[1:] - offsets[:-1]`` (with the helper switched off), including differences that
    wrap around (as torch's do)."""
    gen = torch.Generator().manual_seed(n)
    offsets = torch.cumsum(torch.randint(0, 4, (n + 1,), generator=gen), 0).to(dtype)
    offsets[0] = 0
    if n > 2:
        offsets[n // 2] = torch.iinfo(dtype).min  # wraps in both directions
        offsets[n // 2 + 1] = torch.iinfo(dtype).max
    reference = offsets[1:] - offsets[:-1]
    keys = ["k"]
    native = KeyedJaggedTensor(keys, torch.zeros(0), offsets=offsets).lengths()
    with _native_lib.torch_path_only():
        torch_path = KeyedJaggedTensor(keys, torch.zeros(0), offsets=offsets).lengths()
    assert native.dtype == dtype and torch.equal(native, reference)
    assert torch.equal(torch_path, reference)
    rows, half = offsets.tolist(), 2 ** (8 * offsets.element_size() - 1)
    by_hand = [(rows[j + 1] - rows[j] + half) % (2 * half) - half for j in range(n)]  # wraps
    assert native.tolist() == by_hand
    strided = offsets[::2]  # not contiguous: the torch op runs, same result
    assert torch.equal(
        KeyedJaggedTensor(keys, torch.zeros(0), offsets=strided).lengths(),
        strided[1:] - strided[:-1],
    )


def test_a_traced_offsets_only_kjt_computes_its_lengths_from_the_new_offsets() -> None:
    """``torch.jit.trace`` records torch ops only: the C loop would leave an uninitialized
    tensor in the trace, so under tracing the subtraction runs (the trace then gives the
    lengths of whatever offsets it is called with)."""

    def lengths_of(values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return KeyedJaggedTensor(["a", "b"], values, offsets=offsets).lengths() * 1

    traced = torch.jit.trace(
        lengths_of, (torch.arange(6), torch.tensor([0, 1, 3, 3, 6])), check_trace=False
    )
    assert traced(torch.arange(6), torch.tensor([0, 2, 2, 5, 6])).tolist() == [2, 0, 3, 1]


def test_a_traced_module_building_a_kjt_from_offsets_serves_other_batch_sizes() -> None:
    """Under ``torch.jit.trace`` (strict=False, as TorchRec's users trace) a KJT built with
    ``from_offsets_sync`` has traced sizes: the validation takes its general path (the fast
    path needs plain ints) and the trace answers for another batch size."""

    def first_key_offsets(offsets: torch.Tensor, values: torch.Tensor,
                          weights: torch.Tensor) -> torch.Tensor:
        kjt = KeyedJaggedTensor.from_offsets_sync(
            offsets=offsets, values=values, weights=weights, keys=["a", "b"])
        return kjt["a"].offsets()

    traced = torch.jit.trace(first_key_offsets, (torch.tensor([0, 2, 2]), torch.arange(2),
                                                 torch.rand(2)), strict=False, check_trace=False)
    out = traced(torch.tensor([0, 2, 2, 3, 4, 6, 8]), torch.arange(8), torch.rand(8))
    assert out.tolist() == [0, 2, 2, 3]  # batch 3: key "a" has bags of 2, 0 and 1 ids
