"""The one-pass C helper for KJT lengths (recsys_core/sparse/_native.c) against the numpy/torch
passes it replaces: the same per-key sums for lengths in range, the same error (naming the same
entry) for lengths out of range, for int64 and int32 lengths."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

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
