"""TorchRec's helpers around the sparse types: equality checks and conversion modules."""

from collections.abc import Callable
from typing import Any

import torch

from recsys_core.sparse.jagged_tensor import JaggedTensor
from recsys_core.sparse.keyed_jagged_tensor import KeyedJaggedTensor


class ComputeKJTToJTDict(torch.nn.Module):
    """``kjt -> {key: JaggedTensor}`` as a module (scriptable; TorchRec's name)."""

    def forward(self, keyed_jagged_tensor: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        return keyed_jagged_tensor.to_dict()


class ComputeJTDictToKJT(torch.nn.Module):
    """``{key: JaggedTensor} -> kjt`` as a module (scriptable; TorchRec's name)."""

    def forward(self, jt_dict: dict[str, JaggedTensor]) -> KeyedJaggedTensor:
        return KeyedJaggedTensor.from_jt_dict(jt_dict)


def jt_is_equal(jt_1: JaggedTensor, jt_2: JaggedTensor) -> bool:
    """True if both are JaggedTensors with close values and equal weights/lengths/offsets
    (lengths and offsets are derived first, so one built from lengths equals one built from
    offsets); a field present on one side only makes them differ."""
    if not isinstance(jt_1, JaggedTensor) or not isinstance(jt_2, JaggedTensor):
        return False
    if not _same(jt_1.values(), jt_2.values(), torch.allclose):
        return False
    for jt in (jt_1, jt_2):
        _derive_lengths_offsets(jt)
    pairs = [
        (jt_1.weights_or_none(), jt_2.weights_or_none()),
        (jt_1.lengths_or_none(), jt_2.lengths_or_none()),
        (jt_1.offsets_or_none(), jt_2.offsets_or_none()),
    ]
    return all(_same(a, b, torch.allclose) for a, b in pairs)


def kjt_is_equal(kjt_1: KeyedJaggedTensor, kjt_2: KeyedJaggedTensor) -> bool:
    """True if both are KJTs with the same keys in the same order, close values, and equal
    lengths, weights, offsets, length_per_key, offset_per_key and stride (both are synced)."""
    if not isinstance(kjt_1, KeyedJaggedTensor) or not isinstance(kjt_2, KeyedJaggedTensor):
        return False
    if kjt_1.keys() != kjt_2.keys():
        return False
    if not _same(kjt_1.values(), kjt_2.values(), torch.allclose):
        return False
    for kjt in (kjt_1, kjt_2):
        _derive_lengths_offsets(kjt)
        kjt.sync()
    pairs: list[tuple[Any, Any]] = [
        (kjt_1.lengths_or_none(), kjt_2.lengths_or_none()),
        (kjt_1.weights_or_none(), kjt_2.weights_or_none()),
        (kjt_1.offsets_or_none(), kjt_2.offsets_or_none()),
        (kjt_1.length_per_key_or_none(), kjt_2.length_per_key_or_none()),
        (kjt_1.offset_per_key_or_none(), kjt_2.offset_per_key_or_none()),
        (kjt_1.stride(), kjt_2.stride()),
    ]
    return all(
        _same(a, b, torch.allclose if isinstance(a, torch.Tensor) else _equal) for a, b in pairs
    )


def _equal(a: Any, b: Any) -> bool:
    return a == b


def _derive_lengths_offsets(jt: JaggedTensor | KeyedJaggedTensor) -> None:
    if jt.offsets_or_none() is not None and jt.lengths_or_none() is None:
        jt.lengths()
    elif jt.lengths_or_none() is not None and jt.offsets_or_none() is None:
        jt.offsets()


def _same(a: Any, b: Any, compare: Callable[[Any, Any], bool]) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if isinstance(a, torch.Tensor) and (not isinstance(b, torch.Tensor) or a.shape != b.shape):
        return False
    return bool(compare(a, b))
