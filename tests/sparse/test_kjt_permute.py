"""KeyedJaggedTensor.permute against per-key slices + torch.cat written out here, on random
layouts (repeated and dropped keys, weights, int32/int64 lengths and values, empty keys, batch
0, a variable batch per key), through the C helper (recsys_core/sparse/_native.c) where it was
built and through the torch path it falls back to."""

from __future__ import annotations

import pytest
import torch

from recsys_core.sparse import KeyedJaggedTensor, _native_lib
from tests.native_paths import native_path

# the C helper with each of its vector builds (2: AVX-512, 1: AVX2, 0: 16-byte vectors and
# memcpy), and the torch path
NATIVE = [
    pytest.param(2, id="native"),
    pytest.param(1, id="native_avx2"),
    pytest.param(0, id="native_vec128"),
    pytest.param(None, id="torch_path"),
]


def _reference(
    keys: list[str],
    lengths: list[int],
    values: torch.Tensor,
    weights: torch.Tensor | None,
    strides: list[int],
    order: list[int],
) -> tuple[list[str], list[int], torch.Tensor, torch.Tensor | None]:
    """Each key's block found by walking the lengths on the host, then concatenated in order."""
    blocks, at, value_at = [], 0, 0
    for stride in strides:
        count = sum(lengths[at : at + stride])
        blocks.append((at, at + stride, value_at, value_at + count))
        at, value_at = at + stride, value_at + count
    new_lengths = [n for i in order for n in lengths[blocks[i][0] : blocks[i][1]]]
    new_values = torch.cat([values[:0]] + [values[blocks[i][2] : blocks[i][3]] for i in order])
    new_weights = None
    if weights is not None:
        new_weights = torch.cat([weights[:0]] + [weights[blocks[i][2] : blocks[i][3]] for i in order])
    return [keys[i] for i in order], new_lengths, new_values, new_weights


def _random_case(seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)

    def draw(low: int, high: int) -> int:
        return int(torch.randint(low, high, (1,), generator=gen))

    num_keys = draw(1, 7)
    variable = seed % 3 == 2
    # seed 0 is large enough (> 32768 values) for the torch path's split + cat instead of the
    # FBGEMM kernel it uses on small inputs
    batch = 0 if seed % 7 == 3 else 10000 if seed == 0 else draw(1, 40)
    strides = [draw(0, 12) for _ in range(num_keys)] if variable else [batch] * num_keys
    lengths_dtype = (torch.int32, torch.int64)[seed % 2]
    values_dtype = (torch.int64, torch.int32, torch.float32)[seed % 3]
    per_key = []
    for k in range(num_keys):
        high = 0 if draw(0, 4) == 0 else draw(1, 8)  # some keys have only empty bags
        per_key.append(torch.randint(0, high + 1, (strides[k],), generator=gen))
    lengths = torch.cat([torch.zeros(0, dtype=torch.int64), *per_key]).to(lengths_dtype)
    total = int(lengths.sum())
    values = torch.randint(-1000, 1000, (total + draw(0, 3),), generator=gen).to(values_dtype)
    weights = None
    if seed % 4 == 1:
        weights = torch.rand(values.numel(), generator=gen)
    elif seed % 4 == 3:
        weights = torch.randint(0, 9, (values.numel(),), generator=gen)  # integer weights
    # repeats, drops, any order; sometimes no key at all
    order = [draw(0, num_keys) for _ in range(draw(0, 2 * num_keys + 1))]
    return {
        "keys": [f"f{k}" for k in range(num_keys)],
        "values": values,
        "lengths": lengths,
        "weights": weights,
        "strides": strides,
        "variable": variable,
        "order": order,
    }


@pytest.mark.parametrize("native", NATIVE)
@pytest.mark.parametrize("seed", range(42))
def test_permute_equals_per_key_reference(seed: int, native: int | None) -> None:
    case = _random_case(seed)
    keys, values, lengths, weights = case["keys"], case["values"], case["lengths"], case["weights"]
    strides, order = case["strides"], case["order"]
    spkpr = [[s] for s in strides] if case["variable"] else None
    kjt = KeyedJaggedTensor(
        keys, values, weights=weights, lengths=lengths, stride_per_key_per_rank=spkpr
    )
    with native_path(native):
        permuted = kjt.permute(order)
    ref_keys, ref_lengths, ref_values, ref_weights = _reference(
        keys, lengths.tolist(), values, weights, strides, order
    )
    assert permuted.keys() == ref_keys
    assert permuted.lengths().dtype == lengths.dtype
    assert permuted.lengths().tolist() == ref_lengths
    assert permuted.values().dtype == values.dtype
    assert torch.equal(permuted.values(), ref_values)
    if ref_weights is None:
        assert permuted.weights_or_none() is None
    else:
        assert torch.equal(permuted.weights(), ref_weights)
    assert permuted.stride_per_key() == [strides[i] for i in order]
    assert permuted.length_per_key() == [kjt.length_per_key()[i] for i in order]
    if case["variable"]:
        assert permuted.stride_per_key_per_rank() == [[strides[i]] for i in order]
    else:
        assert permuted.stride() == kjt.stride()
    # the permuted KJT is a fresh copy: writing to it leaves the source alone
    if permuted.values().numel():
        before = values.clone()
        permuted.values().zero_()
        assert torch.equal(values, before)


@pytest.mark.parametrize("native", NATIVE)
def test_permute_indices_tensor_and_negative_indices(native: int | None) -> None:
    kjt = KeyedJaggedTensor.from_lengths_sync(
        ["a", "b", "c"], torch.arange(10, 17), torch.tensor([1, 2, 0, 1, 3, 0])
    )
    with native_path(native):
        permuted = kjt.permute([-1, 0, 2], indices_tensor=torch.tensor([2, 0, 2], dtype=torch.int32))
    assert permuted.keys() == ["c", "a", "c"]
    assert permuted.lengths().tolist() == [3, 0, 1, 2, 3, 0]
    assert permuted.values().tolist() == [14, 15, 16, 10, 11, 12, 14, 15, 16]


def test_non_contiguous_or_grad_inputs_take_the_torch_path_with_the_same_result() -> None:
    base = torch.arange(40)
    values = base[::2]  # a strided view: not handed to the C helper
    lengths = torch.tensor([3, 1, 0, 4, 2, 2, 5, 3])
    weights = torch.rand(20, requires_grad=True)
    kjt = KeyedJaggedTensor(["a", "b"], values, weights=weights, lengths=lengths)
    permuted = kjt.permute([1, 0, 1])
    assert permuted.values().tolist() == (
        values[8:20].tolist() + values[:8].tolist() + values[8:20].tolist()
    )
    permuted.weights().sum().backward()
    assert weights.grad is not None
    assert weights.grad.tolist() == [1.0] * 8 + [2.0] * 12


def test_the_helper_refuses_blocks_outside_their_source() -> None:
    if not _native_lib.available():
        pytest.skip("recsys_core/sparse/_native.c was not built")
    lengths, values = torch.tensor([1, 2, 1, 0]), torch.arange(4)
    ok = _native_lib.permute_blocks([1, 0], lengths, values, None, [2, 2], [3, 1])
    assert ok is not None and ok[1].tolist() == [3, 0, 1, 2]
    # a key's values past the end, a key's lengths past the end, an index the C side does not
    # take (callers pass indices made non-negative), a negative size
    assert _native_lib.permute_blocks([1, 0], lengths, values, None, [2, 2], [3, 2]) is None
    assert _native_lib.permute_blocks([1, 0], lengths, values, None, [2, 3], [3, 1]) is None
    assert _native_lib.permute_blocks([-1], lengths, values, None, [2, 2], [3, 1]) is None
    assert _native_lib.permute_blocks([0], lengths, values, None, [2, -1], [3, 1]) is None
