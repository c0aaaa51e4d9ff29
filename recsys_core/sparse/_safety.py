"""The memory-safety check of a KeyedJaggedTensor, made before its lengths/offsets reach native code.

Constructors store their inputs unchecked (TorchRec semantics), and the kernels behind
``permute``, ``split``, the embedding lookups and the input all-to-all trust them: a negative
length whose key totals still add up (``lengths=[1, 1, -1, 3]`` for 4 values) would make them
read or write outside their buffers. So every such entry point first calls
:func:`ensure_safe_layout`. It proves, in one host transfer (the one computing
``length_per_key``, which those ops need anyway), that

* the lengths have one entry per (key, bag): ``sum(stride_per_key)`` of them;
* every length lies in ``[0, len(values)]`` (one pass: read as unsigned, a negative length is
  larger than any count of values), so no sum can overflow;
* each key's values lie inside ``values`` and a given ``length_per_key`` matches the lengths;
* weights hold one entry per value (extra trailing weights are refused too: TorchRec accepts
  them in some operations, but the modules' kernels would not all agree on ignoring them);
* given offsets start at 0, end inside ``values`` and, if lengths were given too, agree with them.

The result is cached on the KJT; KJTs derived from a checked one (``permute``, ``split``) are
checked by construction. Errors are ``ValueError`` naming the key and batch position.
"""

from __future__ import annotations

import ctypes
from itertools import accumulate
from typing import TYPE_CHECKING

import numpy as np
import torch

from recsys_core.sparse import _jit_ops, _native_lib
from recsys_core.sparse._utils import check_values_cover
from recsys_core.sparse.jagged_tensor_validator import describe_position, raise_negative_length

if TYPE_CHECKING:
    from recsys_core.sparse.jagged import JaggedTensor
    from recsys_core.sparse.keyed_jagged_tensor import KeyedJaggedTensor

_OWNER = "KeyedJaggedTensor"
_UNSIGNED = {torch.int64: np.uint64, torch.int32: np.uint32}


def native_available() -> bool:
    """Whether the optional C helper (``_native.c``: the one-pass lengths proof, permute copies)
    was built with the package."""
    return _native_lib.available()


def ensure_safe_layout(kjt: KeyedJaggedTensor) -> list[int]:
    """Raise ``ValueError`` unless ``kjt``'s layout is safe to hand to kernels (see the module
    docstring); returns (and caches) ``length_per_key``. Free once a KJT is checked."""
    if kjt._checked:
        return kjt.length_per_key()
    fast = fixed_batch_fast_path(kjt)
    if fast is not None:
        return fast
    keys = kjt.keys()
    values = kjt.values()
    if len(keys) == 0 or values.is_meta:
        kjt._checked = True
        return kjt.length_per_key()
    given_offsets = kjt._offsets if kjt._lengths is not None else None
    only_offsets = kjt._lengths is None
    offsets = kjt._offsets
    stride_per_key = kjt.stride_per_key()
    lengths = kjt.lengths()
    if lengths.dim() != 1:
        lengths = lengths.reshape(-1)
    num_values = values.size(0)
    if lengths.numel() != sum(stride_per_key):
        raise ValueError(
            f"{_OWNER}: lengths has {lengths.numel()} entries but the batch sizes per key "
            f"{stride_per_key} for keys {keys} sum to {sum(stride_per_key)}; pass one length per "
            "(key, batch row) (0 for an empty bag), and stride= only if it matches."
        )
    if lengths.numel() == 0:
        sums = [0] * len(keys)
    else:
        fixed = kjt._stride_per_key_per_rank is None
        sums = _sums_in_range(keys, stride_per_key, fixed, lengths, num_values)
    if only_offsets and offsets is not None:
        _check_offset_ends(offsets, num_values)
    if given_offsets is not None and given_offsets.numel() > 0:
        _check_offsets_agree(given_offsets, lengths, num_values)
    cached = kjt._length_per_key
    if cached is not None and list(cached) != sums:
        bad = next((i for i, (a, b) in enumerate(zip(cached, sums, strict=False)) if a != b), 0)
        raise ValueError(
            f"{_OWNER}: length_per_key says key '{keys[bad]}' has "
            f"{cached[bad] if bad < len(cached) else 'no entry'} values but its lengths sum to "
            f"{sums[bad]}; drop length_per_key or fix it."
        )
    offset_per_key = list(accumulate(sums, initial=0))
    cached_opk = kjt._offset_per_key
    if cached_opk is not None and list(cached_opk) != offset_per_key:
        raise ValueError(
            f"{_OWNER}: offset_per_key {list(cached_opk)} does not match the lengths (expected "
            f"{offset_per_key}); drop it or fix it."
        )
    check_values_cover(keys, sums, offset_per_key, num_values)
    weights = kjt.weights_or_none()
    if weights is not None and weights.size(0) != num_values:
        raise ValueError(
            f"{_OWNER}: weights size must equal to values size, but weights has "
            f"{weights.size(0)} entries and values has {num_values}; pass one weight per value."
        )
    kjt._length_per_key = sums
    kjt._offset_per_key = offset_per_key
    kjt._checked = True
    return sums


def fixed_batch_fast_path(kjt: KeyedJaggedTensor) -> list[int] | None:
    """The common cases in one C call, or None for the general path below: a fixed batch given
    as 1-D contiguous host lengths, offsets, or both (same dtype; no cached counts to compare),
    at least one length, and one weight per value if any. The helper proves every length in
    ``[0, len(values)]`` while it sums them per key, and that given offsets start at 0 and
    agree with the lengths (offsets only: that they never decrease); the last offset must then
    fit the values. Anything else, a bad entry included, takes the general path, which names it.

    Every check here runs once per KJT on the hot path, so each is one attribute or call:
    ``stride() == (1,)`` is "1-D and contiguous" for the one or more entries the helper reads.
    """
    fn = _native_lib.key_sums_lists()
    if (
        fn is None
        or kjt._stride_per_key_per_rank is not None
        or kjt._length_per_key is not None
        or kjt._offset_per_key is not None
    ):
        return None
    lengths = kjt._lengths
    offsets = kjt._offsets
    if lengths is not None:
        if not (
            type(lengths) is torch.Tensor
            and lengths.is_cpu
            and lengths.dtype in _NATIVE_DTYPES
            and lengths.stride() == (1,)
        ):
            return None
        dtype = lengths.dtype
        numel = lengths.numel()
    elif offsets is not None:
        dtype = offsets.dtype
        if dtype not in _NATIVE_DTYPES:
            return None
        numel = offsets.numel() - 1
    else:
        return None
    if not isinstance(numel, int):  # torch.jit.trace: sizes are traced tensors, take the general path
        return None
    if offsets is not None and not (
        type(offsets) is torch.Tensor
        and offsets.is_cpu
        and offsets.dtype is dtype
        and offsets.stride() == (1,)
        and offsets.numel() == numel + 1
    ):
        return None
    num_keys = len(kjt._keys)
    if num_keys == 0 or numel <= 0:
        return None
    stride = kjt._stride
    if stride is None:
        stride, rest = divmod(numel, num_keys)
        if rest:
            return None
        kjt._stride = stride  # what stride() computes for a fixed batch
    elif stride * num_keys != numel:
        return None
    values = kjt._values
    weights = kjt._weights
    num_values = values.size(0)
    if (weights is not None and weights.size(0) != num_values) or values.is_meta:
        return None
    element_size = 8 if dtype is torch.int64 else 4
    if offsets is None:
        out = fn(lengths.data_ptr(), element_size, num_keys, stride, num_values)
    else:
        address = 0 if lengths is None else lengths.data_ptr()
        out = fn(address, element_size, num_keys, stride, num_values, offsets.data_ptr())
    if out is None:
        return None
    # the helper proved every sum >= 0 (no length < 0, and no int64 overflow: see key_sums)
    sums, key_offsets = out
    if key_offsets[-1] > num_values:
        return None
    kjt._length_per_key = sums
    kjt._offset_per_key = key_offsets
    kjt._checked = True
    return sums


_NATIVE_DTYPES = (torch.int64, torch.int32)


def _sums_in_range(
    keys: list[str], stride_per_key: list[int], fixed: bool, lengths: torch.Tensor,
    num_values: int,
) -> list[int]:
    """Per-key sums, after proving every length is in ``[0, num_values]``."""
    if fixed and lengths.device.type == "cpu" and lengths.is_contiguous():
        fn = _native_lib.key_sums(lengths.dtype)
        if fn is not None:  # both in one pass; out of range: the checks below name the entry
            out = (ctypes.c_int64 * len(keys))()  # cheaper to make and read than numpy's
            if fn(lengths.data_ptr(), len(keys), stride_per_key[0], num_values, out) == 0:
                return out[:]
    _check_in_range(_OWNER, keys, stride_per_key, lengths, num_values)
    if fixed:
        sums: list[int] = lengths.view(len(keys), stride_per_key[0]).sum(1).tolist()
        return sums
    return _jit_ops.sums_by_segments(lengths, stride_per_key)


def _check_in_range(owner: str, keys: list[str] | None, sizes: list[int], lengths: torch.Tensor,
                    num_values: int) -> None:
    """Raise, naming the entry, unless every length is in ``[0, num_values]``."""
    if _lengths_in_range(lengths, num_values):
        return
    if bool((lengths < 0).any()):
        raise_negative_length(owner, keys, sizes, lengths)
    position = int(torch.nonzero(lengths > num_values)[0, 0])
    raise ValueError(
        f"{owner}: length {int(lengths[position])} {'at' if keys is None else 'for'} "
        f"{describe_position(keys, sizes, position)} is larger than the {num_values} values "
        "there are; lengths must be >= 0 and sum to the number of values."
    )


def _lengths_in_range(lengths: torch.Tensor, num_values: int) -> bool:
    """All of ``lengths`` in ``[0, num_values]``: on the host one pass over the lengths read as
    unsigned integers (a negative one becomes huge); on a device one fused min/max."""
    unsigned = _UNSIGNED.get(lengths.dtype)
    if lengths.device.type == "cpu" and unsigned is not None and lengths.is_contiguous():
        return int(lengths.numpy().view(unsigned).max()) <= num_values
    low, high = torch.aminmax(lengths)
    return int(low) >= 0 and int(high) <= num_values


def ensure_safe_jagged(jt: JaggedTensor) -> None:
    """The same proof for a JaggedTensor before ``to_dense``/``to_padded_dense`` hand its
    lengths/offsets to kernels: lengths in ``[0, len(values)]`` summing to at most
    ``len(values)``, given offsets from 0 and agreeing with given lengths, one weight per
    value. Not cached (a JaggedTensor's ops are not on the training hot path)."""
    owner = "JaggedTensor"
    values, weights = jt.values(), jt.weights_or_none()
    if values.is_meta:
        return
    num_values = values.size(0)
    given_offsets = jt._offsets if jt._lengths is not None else None
    only_offsets = jt._lengths is None and jt._rows is None
    lengths = jt.lengths().reshape(-1)
    if lengths.numel():
        _check_in_range(owner, None, [lengths.numel()], lengths, num_values)
        total = int(lengths.sum())
        if total > num_values:
            raise ValueError(
                f"{owner}: Sum of lengths must equal the number of values: the bags need "
                f"values[0:{total}] but values has only {num_values} entries."
            )
    offsets = jt._offsets
    if only_offsets and offsets is not None:
        _check_offset_ends(offsets, num_values, owner)
    if given_offsets is not None and given_offsets.numel() > 0:
        _check_offsets_agree(given_offsets, lengths, num_values, owner)
    if weights is not None and weights.size(0) != num_values:
        raise ValueError(
            f"{owner}: weights size must equal to values size, but weights has "
            f"{weights.size(0)} entries and values has {num_values}; pass one weight per value."
        )


def _check_offset_ends(offsets: torch.Tensor, num_values: int, owner: str = _OWNER) -> None:
    """Offsets-only KJT: its lengths (the differences) were checked; its ends must fit too."""
    if offsets.numel() == 0:
        return
    first, last = (int(x) for x in torch.stack([offsets[0], offsets[-1]]).tolist())
    if first != 0:
        raise ValueError(
            f"{owner}: Expected first offset to be 0, but got {first}; subtract offsets[0] or "
            "pass lengths instead."
        )
    if last > num_values:
        raise ValueError(
            f"{owner}: the last offset is {last} but values has only {num_values} entries; "
            "offsets must end at the number of values."
        )


def _check_offsets_agree(
    offsets: torch.Tensor, lengths: torch.Tensor, num_values: int, owner: str = _OWNER
) -> None:
    """Both lengths and offsets were given: kernels may read either, so they must agree."""
    if offsets.numel() != lengths.numel() + 1:
        raise ValueError(
            f"{owner}: offsets has {offsets.numel()} entries but lengths has {lengths.numel()}; "
            "offsets needs len(lengths) + 1 entries (a leading 0), or pass only one of them."
        )
    _check_offset_ends(offsets, num_values, owner)
    disagree = int((offsets[1:] - offsets[:-1] != lengths).sum())
    if disagree:
        raise ValueError(
            f"{owner}: offsets is not equal to the cumulative sum of lengths (they disagree at "
            f"{disagree} position(s)); pass only one of them."
        )
