"""TorchRec's helpers around the sparse types: equality checks, conversion modules, and the flat
form of a list of KJTs."""

from collections.abc import Callable
from typing import Any

import torch

from recsys_core.sparse.jagged import JaggedTensor
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


# A KJT's flat form: TorchRec's KeyedJaggedTensor._fields order, one tensor (or None) each.
_KJT_FIELDS = 6  # values, weights, lengths, offsets, stride_per_key_per_rank, inverse indices


def flatten_kjt_list(
    kjt_arr: list[KeyedJaggedTensor],
) -> tuple[list[torch.Tensor | None], list[list[str]]]:
    """Every KJT as six tensors (``values, weights, lengths, offsets, stride_per_key_per_rank``
    as an int32 ``[keys, ranks]`` tensor, the inverse-indices tensor; None where absent), all
    KJTs back to back, and each KJT's keys. :func:`unflatten_kjt_list` inverts it."""
    data: list[torch.Tensor | None] = []
    contexts: list[list[str]] = []
    for kjt in kjt_arr:
        spkpr = kjt._stride_per_key_per_rank
        inverse = kjt.inverse_indices_or_none()
        data.extend([
            kjt.values(),
            kjt.weights_or_none(),
            kjt.lengths_or_none(),
            kjt.offsets_or_none(),
            None if spkpr is None else torch.tensor(spkpr, dtype=torch.int32),
            None if inverse is None else inverse[1],
        ])
        contexts.append(kjt.keys())
    return data, contexts


def unflatten_kjt_list(
    values: list[torch.Tensor | None], contexts: list[list[str]]
) -> list[KeyedJaggedTensor]:
    """The KJTs of :func:`flatten_kjt_list` (inverse indices are keyed by the KJT's keys, as
    in TorchRec)."""
    if len(values) != _KJT_FIELDS * len(contexts):
        raise ValueError(
            f"unflatten_kjt_list: {len(values)} tensors for {len(contexts)} KJTs; each KJT has "
            f"{_KJT_FIELDS} entries (values, weights, lengths, offsets, stride_per_key_per_rank, "
            "inverse indices)"
        )
    out: list[KeyedJaggedTensor] = []
    for j, keys in enumerate(contexts):
        v, w, lengths, offsets, spkpr, inverse = values[j * _KJT_FIELDS : (j + 1) * _KJT_FIELDS]
        if v is None:
            raise ValueError(f"unflatten_kjt_list: KJT {j} (keys {keys}) has no values tensor")
        out.append(
            KeyedJaggedTensor(
                keys=list(keys), values=v, weights=w, lengths=lengths, offsets=offsets,
                stride_per_key_per_rank=None if spkpr is None else spkpr.tolist(),
                inverse_indices=None if inverse is None else (list(keys), inverse),
            )
        )
    return out
