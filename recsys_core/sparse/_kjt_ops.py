"""KeyedJaggedTensor algorithms: per-key views and new key/batch layouts from existing ones.

Layout functions return the parts of the result (:class:`KJTParts`); ``KeyedJaggedTensor``
wraps them without re-checking, since they derive from already-checked inputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

from recsys_core.kernels import sparse_ops
from recsys_core.sparse._utils import as_index_tensor
from recsys_core.sparse.jagged_tensor import BatchedRows, JaggedTensor

if TYPE_CHECKING:
    from recsys_core.sparse.keyed_jagged_tensor import KeyedJaggedTensor

_OWNER = "KeyedJaggedTensor"


class KJTParts(NamedTuple):
    keys: list[str]
    values: torch.Tensor
    weights: torch.Tensor | None
    lengths: torch.Tensor
    stride: int
    length_per_key: list[int] | None


def check_layout(
    keys: list[str],
    num_bags: int,
    stride: int | None,
    length_per_key: Sequence[int] | None,
    offset_per_key: Sequence[int] | None,
) -> int:
    """Constructor checks on host metadata only; returns the stride."""
    num_keys = len(keys)
    if length_per_key is not None and len(length_per_key) != num_keys:
        raise ValueError(
            f"{_OWNER}: length_per_key has {len(length_per_key)} entries for {num_keys} keys; "
            "pass one count per key or leave it out."
        )
    if offset_per_key is not None and len(offset_per_key) != num_keys + 1:
        raise ValueError(
            f"{_OWNER}: offset_per_key has {len(offset_per_key)} entries for {num_keys} keys; "
            "it needs len(keys) + 1 (a leading 0) or leave it out."
        )
    if stride is not None:
        if stride < 0 or num_bags != num_keys * stride:
            raise ValueError(
                f"{_OWNER}: lengths has {num_bags} entries but {num_keys} keys x stride "
                f"{stride} = {num_keys * stride}; lengths needs one entry per (key, batch row)."
            )
        return stride
    if num_keys == 0:
        if num_bags:
            raise ValueError(
                f"{_OWNER}: got {num_bags} lengths but no keys; pass the feature names in keys."
            )
        return 0
    if num_bags % num_keys:
        raise ValueError(
            f"{_OWNER}: lengths has {num_bags} entries, not a multiple of the {num_keys} keys "
            f"{keys}; every key needs one length per batch row (0 for an empty bag)."
        )
    return num_bags // num_keys


def _weighted(flag: bool) -> str:
    return "weighted" if flag else "unweighted"


def from_jt_dict(jt_dict: dict[str, JaggedTensor]) -> KJTParts:
    keys = list(jt_dict)
    jts = list(jt_dict.values())
    stride = jts[0].lengths().numel()
    weighted = jts[0].weights_or_none() is not None
    for key, jt in zip(keys, jts, strict=True):
        if jt.lengths().numel() != stride:
            raise ValueError(
                f"{_OWNER}.from_jt_dict: key '{key}' has batch size {jt.lengths().numel()} "
                f"but key '{keys[0]}' has {stride}; every feature needs one bag per row "
                "(use an empty bag, length 0, for rows without values)."
            )
        if (jt.weights_or_none() is not None) != weighted:
            raise ValueError(
                f"{_OWNER}.from_jt_dict: key '{key}' is {_weighted(not weighted)} but key "
                f"'{keys[0]}' is {_weighted(weighted)}; weight all features or none."
            )
    return KJTParts(
        keys=keys,
        values=torch.cat([jt.values() for jt in jts]),
        weights=torch.cat([jt.weights() for jt in jts]) if weighted else None,
        lengths=torch.cat([jt.lengths() for jt in jts]),
        stride=stride,
        # A JaggedTensor's value count is metadata: no sync needed.
        length_per_key=[jt.values().size(0) for jt in jts],
    )


def concat(kjt_list: Sequence[KeyedJaggedTensor]) -> KJTParts:
    if not kjt_list:
        raise ValueError(f"{_OWNER}.concat: got an empty list; pass at least one KJT.")
    stride = kjt_list[0].stride()
    weighted = kjt_list[0].weights_or_none() is not None
    for i, kjt in enumerate(kjt_list):
        if kjt.stride() != stride:
            raise ValueError(
                f"{_OWNER}.concat: KJT {i} (keys {kjt.keys()}) has stride {kjt.stride()} but "
                f"KJT 0 has {stride}; only KJTs of the same batch size concatenate."
            )
        if (kjt.weights_or_none() is not None) != weighted:
            raise ValueError(
                f"{_OWNER}.concat: KJT {i} (keys {kjt.keys()}) is {_weighted(not weighted)} but "
                f"KJT 0 is {_weighted(weighted)}; weight all or none."
            )
    cached = [kjt.length_per_key_or_none() for kjt in kjt_list]
    # Keep the host-side counts only if every input already has them (no sync here).
    length_per_key = (
        [n for c in cached for n in (c or [])] if all(c is not None for c in cached) else None
    )
    return KJTParts(
        keys=[key for kjt in kjt_list for key in kjt.keys()],
        values=torch.cat([kjt.values() for kjt in kjt_list]),
        weights=torch.cat([kjt.weights() for kjt in kjt_list]) if weighted else None,
        lengths=torch.cat([kjt.lengths() for kjt in kjt_list]),
        stride=stride,
        length_per_key=length_per_key,
    )


def permute(
    kjt: KeyedJaggedTensor, indices: Sequence[int], indices_tensor: torch.Tensor | None
) -> KJTParts:
    all_keys = kjt.keys()
    num_keys = len(all_keys)
    for i in indices:
        if not -num_keys <= i < num_keys:
            raise ValueError(
                f"{_OWNER}.permute: index {i} is out of range for {num_keys} keys {all_keys}."
            )
    length_per_key = kjt.length_per_key()
    permuted_length_per_key = [length_per_key[i] for i in indices]
    if indices_tensor is None:
        positive = [i % num_keys for i in indices]
        indices_tensor = torch.tensor(positive, dtype=torch.int32, device=kjt.device())
    lengths, values, weights = sparse_ops.permute_2d_sparse_data(
        indices_tensor,
        kjt.lengths().view(num_keys, kjt.stride()),
        kjt.values(),
        kjt.weights_or_none(),
        sum(permuted_length_per_key),
        length_per_row=length_per_key,
    )
    return KJTParts(
        keys=[all_keys[i] for i in indices],
        values=values,
        weights=weights,
        lengths=lengths.view(-1),
        stride=kjt.stride(),
        length_per_key=permuted_length_per_key,
    )


def split(kjt: KeyedJaggedTensor, segments: Sequence[int]) -> list[KJTParts]:
    keys = kjt.keys()
    if any(s < 0 for s in segments) or sum(segments) != len(keys):
        raise ValueError(
            f"{_OWNER}.split: segments {list(segments)} must be non-negative and sum to the "
            f"number of keys ({len(keys)})."
        )
    offset_per_key, length_per_key = kjt.offset_per_key(), kjt.length_per_key()
    values, weights, lengths, stride = (
        kjt.values(),
        kjt.weights_or_none(),
        kjt.lengths(),
        kjt.stride(),
    )
    parts, start = [], 0
    for segment in segments:
        end = start + segment
        lo, hi = offset_per_key[start], offset_per_key[end]
        parts.append(
            KJTParts(
                keys=keys[start:end],
                values=values[lo:hi],
                weights=None if weights is None else weights[lo:hi],
                lengths=lengths[start * stride : end * stride],
                stride=stride,
                length_per_key=length_per_key[start:end],
            )
        )
        start = end
    return parts


def index_select_batch(kjt: KeyedJaggedTensor, indices: torch.Tensor | Sequence[int]) -> KJTParts:
    owner = f"{_OWNER}.index_select_batch"
    indices = as_index_tensor(indices, "indices", owner, kjt.device())
    stride = kjt.stride()
    if indices.numel():
        low, high = (int(x) for x in torch.aminmax(indices))
        if low < 0 or high >= stride:
            raise ValueError(
                f"{owner}: index {low if low < 0 else high} is out of range for batch size "
                f"{stride}; indices must be in [0, {stride})."
            )
    values, lengths, weights = sparse_ops.keyed_jagged_index_select_dim1(
        kjt.values(), kjt.lengths(), kjt.offsets(), indices, stride, kjt.weights_or_none()
    )
    return KJTParts(kjt.keys(), values, weights, lengths, indices.numel(), None)


def length_per_key(kjt: KeyedJaggedTensor) -> list[int]:
    num_keys, stride = len(kjt.keys()), kjt.stride()
    if num_keys == 0:
        return []
    if stride == 0:
        return [0] * num_keys
    offsets = kjt.offsets_or_none()
    if offsets is not None:
        # Key boundaries are every stride-th offset: O(keys) instead of a full reduction.
        bounds = offsets[::stride]
        return (bounds[1:] - bounds[:-1]).tolist()
    return kjt.lengths().view(num_keys, stride).sum(1).tolist()


def key_view(kjt: KeyedJaggedTensor, index: int) -> JaggedTensor:
    start, end = kjt.offset_per_key()[index], kjt.offset_per_key()[index + 1]
    weights, stride = kjt.weights_or_none(), kjt.stride()
    return JaggedTensor._trusted(
        kjt.values()[start:end],
        None if weights is None else weights[start:end],
        kjt.lengths()[index * stride : (index + 1) * stride],
        None,
    )


def to_dict(kjt: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
    keys, stride = kjt.keys(), kjt.stride()
    if not keys:
        return {}
    split_sizes = kjt.length_per_key()
    values = kjt.values().split(split_sizes)
    weights = kjt.weights_or_none()
    weight_parts = (None,) * len(keys) if weights is None else weights.split(split_sizes)
    rows = BatchedRows(kjt.lengths().view(len(keys), stride))
    return {
        key: JaggedTensor._from_rows(v, w, rows, i)
        for i, (key, v, w) in enumerate(zip(keys, values, weight_parts, strict=True))
    }
