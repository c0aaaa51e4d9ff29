"""Explicit, syncing validation of jagged inputs (TorchRec: ``torchrec.sparse.jagged_tensor_validator``).

Constructors only store their inputs (as TorchRec's do); these checks read the data, so they
wait for the device. Call them where inputs enter the system (data loaders, a module's first
use), or through ``KeyedJaggedTensor.validate()`` / ``JaggedTensor.validate()``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from recsys_core.sparse.keyed_jagged_tensor import KeyedJaggedTensor

logger = logging.getLogger(__name__)

_OWNER = "KeyedJaggedTensor"


class _FeatureTable(Protocol):
    """What the id-range check reads from an ``EmbeddingBagConfig``."""

    feature_names: list[str]
    num_embeddings: int


def validate_keyed_jagged_tensor(
    kjt: KeyedJaggedTensor, configs: Sequence[_FeatureTable] | None = None
) -> bool:
    """Raise ``ValueError`` (naming the key and the bad value) if ``kjt`` is inconsistent.

    Checks TorchRec's list: lengths or offsets present; offsets start at 0 and agree with
    lengths; no negative lengths; the lengths sum to the number of values; weights (if any)
    have one entry per value; keys are unique and, for a fixed batch, the lengths divide
    evenly among them; for a variable batch (``stride_per_key_per_rank``) the strides sum to
    the number of lengths. With ``configs`` (embedding bag configs) it also checks that every
    id is in ``[0, num_embeddings)`` of its table: as in TorchRec that part only logs a warning
    and returns ``False``. Returns ``True`` when everything holds.
    """
    check_keyed_jagged_tensor(kjt)
    if configs is None:
        return True
    return _ids_in_range(kjt, configs)


def check_keyed_jagged_tensor(kjt: KeyedJaggedTensor) -> list[int]:
    """The raising checks of :func:`validate_keyed_jagged_tensor`; returns length_per_key."""
    _check_kjt_layout(kjt)
    return validate_jagged(
        _OWNER,
        kjt.keys(),
        kjt.stride_per_key(),
        kjt.values(),
        kjt.weights_or_none(),
        kjt.lengths(),
        kjt.offsets_or_none(),
        kjt.length_per_key_or_none(),
        kjt.offset_per_key_or_none(),
    )


def _check_kjt_layout(kjt: KeyedJaggedTensor) -> None:
    """TorchRec's structural checks, before anything reads the data (its phrases included)."""
    lengths, offsets, keys = kjt.lengths_or_none(), kjt.offsets_or_none(), kjt.keys()
    if lengths is None and offsets is None:
        raise ValueError(
            f"{_OWNER}: lengths and offsets cannot be both empty in KeyedJaggedTensor; pass one."
        )
    if offsets is not None:
        if offsets.numel() == 0:
            raise ValueError(f"{_OWNER}: offsets cannot be empty; it needs at least the 0.")
        if int(offsets[0]) != 0:
            raise ValueError(
                f"{_OWNER}: Expected first offset to be 0, but got {int(offsets[0])}; subtract "
                "offsets[0] or pass lengths instead."
            )
        if int(offsets[-1]) != kjt.values().size(0):
            raise ValueError(
                f"{_OWNER}: The last element of offsets must equal to the number of values, "
                f"but got {int(offsets[-1])} and {kjt.values().size(0)}."
            )
    num_lengths = lengths.numel() if lengths is not None else offsets.numel() - 1
    spkpr = kjt._stride_per_key_per_rank
    if spkpr is None:
        if keys and num_lengths % len(keys) != 0:
            raise ValueError(
                f"{_OWNER}: lengths size must be divisible by keys size, but got "
                f"{num_lengths} lengths for {len(keys)} keys {keys}."
            )
        return
    if len(spkpr) != len(keys):
        raise ValueError(
            f"{_OWNER}: stride_per_key_per_rank first dimension must equal num_features "
            f"({len(keys)}), but got {len(spkpr)}."
        )
    total = sum(sum(per_rank) for per_rank in spkpr)
    if total != num_lengths:
        raise ValueError(
            f"{_OWNER}: Sum of stride_per_key_per_rank ({total}) must equal the number of "
            f"lengths ({num_lengths}) for keys {keys}."
        )
    if any(len(per_rank) != 1 for per_rank in spkpr):
        # Legitimate after an input all-to-all (one column per rank), so only a note.
        logger.warning(
            "stride_per_key_per_rank second dimension must be 1 for user-input KJT (got %s); "
            "fine for a KJT after input distribution.",
            spkpr,
        )


def _ids_in_range(kjt: KeyedJaggedTensor, configs: Sequence[_FeatureTable]) -> bool:
    rows = {name: c.num_embeddings for c in configs for name in c.feature_names}
    valid = True
    for key, jt in kjt.to_dict().items():
        if key not in rows or jt.values().numel() == 0:
            continue
        low, high = (int(x) for x in torch.aminmax(jt.values()))
        if low < 0 or high >= rows[key]:
            logger.warning(
                "Feature %s has ids in [%d, %d], outside its table's range [0, %d).",
                key,
                low,
                high,
                rows[key],
            )
            valid = False
    return valid


def validate_jagged(
    owner: str,
    keys: Sequence[str] | None,
    stride_per_key: Sequence[int],
    values: torch.Tensor,
    weights: torch.Tensor | None,
    lengths: torch.Tensor,
    offsets: torch.Tensor | None,
    length_per_key: Sequence[int] | None = None,
    offset_per_key: Sequence[int] | None = None,
) -> list[int]:
    """Full consistency check of a key-major jagged layout; returns length_per_key.

    ``keys=None`` means a single unnamed JaggedTensor (one "key" spanning all of ``lengths``);
    key ``i`` owns the next ``stride_per_key[i]`` lengths (all equal unless variable batch).
    The happy path costs one host transfer: every statistic is packed into one small tensor.
    """
    num_keys = 1 if keys is None else len(keys)
    lengths = lengths.reshape(-1)
    if offsets is not None and offsets.numel() not in (0, lengths.numel() + 1):
        raise ValueError(
            f"{owner}: Expected lengths size to be 1 more than offsets size, but offsets has "
            f"{offsets.numel()} entries and lengths has {lengths.numel()}; offsets needs "
            "len(lengths) + 1 entries (a leading 0)."
        )
    if keys is not None:
        _check_keys(owner, keys, stride_per_key, lengths.numel())
    if weights is not None and weights.size(0) != values.size(0):
        raise ValueError(
            f"{owner}: weights size must equal to values size, but weights has "
            f"{weights.size(0)} entries and values has {values.size(0)}; pass one weight per "
            "value."
        )
    sums = [0] * num_keys
    if lengths.numel() > 0:
        sizes = [lengths.numel()] if keys is None else list(stride_per_key)
        if all(size == sizes[0] for size in sizes):
            per_key = lengths.view(num_keys, sizes[0]).sum(1, dtype=torch.int64)
        else:  # variable batch per key
            key_ids = torch.repeat_interleave(torch.arange(num_keys), torch.tensor(sizes))
            per_key = torch.zeros(num_keys, dtype=torch.int64, device=lengths.device)
            per_key.index_add_(0, key_ids.to(lengths.device), lengths.to(torch.int64))
        stats = [per_key, lengths.min().to(torch.int64).view(1)]
        if offsets is not None:
            stats.append(offsets[:1].to(torch.int64))
            stats.append((offsets[1:] - offsets[:-1] != lengths).sum().view(1))
        packed = torch.cat(stats).tolist()
        sums = packed[:num_keys]
        if packed[num_keys] < 0:
            raise_negative_length(owner, keys, sizes, lengths)
        if offsets is not None:
            if packed[num_keys + 1] != 0:
                raise ValueError(
                    f"{owner}: Expected first offset to be 0, but got {packed[num_keys + 1]}; "
                    "subtract offsets[0] or pass lengths instead."
                )
            if packed[num_keys + 2] != 0:
                raise ValueError(
                    f"{owner}: offsets is not equal to the cumulative sum of lengths (they "
                    f"disagree at {packed[num_keys + 2]} position(s)); pass only one of them."
                )
    elif offsets is not None and offsets.numel() == 1 and int(offsets[0]) != 0:
        raise ValueError(f"{owner}: Expected first offset to be 0, but got {int(offsets[0])}.")
    check_sums(owner, keys, sums, values.size(0), exact=True)
    if length_per_key is not None and keys is not None and list(length_per_key) != sums:
        if len(length_per_key) != len(sums):
            raise ValueError(
                f"{owner}: length_per_key has {len(length_per_key)} entries for {len(keys)} "
                "keys; pass one count per key or leave it out."
            )
        bad = next(i for i, (a, b) in enumerate(zip(length_per_key, sums, strict=True)) if a != b)
        raise ValueError(
            f"{owner}: length_per_key says key '{keys[bad]}' has {length_per_key[bad]} values "
            f"but its lengths sum to {sums[bad]}; drop length_per_key or fix it."
        )
    if offset_per_key is not None:
        expected = [0]
        for n in sums:
            expected.append(expected[-1] + n)
        if list(offset_per_key) != expected:
            raise ValueError(
                f"{owner}: offset_per_key {list(offset_per_key)} does not match the lengths "
                f"(expected {expected}); drop it or fix it."
            )
    return sums


def check_sums(
    owner: str, keys: Sequence[str] | None, sums: list[int], num_values: int, exact: bool
) -> None:
    """Every key's bags lie inside ``values``; with ``exact`` they also cover all of it."""
    end = 0
    for i, count in enumerate(sums):
        start, end = end, end + count
        if end > num_values:
            name = "the bags need" if keys is None else f"key '{keys[i]}' needs"
            raise ValueError(
                f"{owner}: Sum of lengths must equal the number of values: {name} "
                f"values[{start}:{end}] but values has only {num_values} entries."
            )
    if exact and end != num_values:
        last = "" if keys is None or not keys else f" (after the last key '{keys[-1]}')"
        raise ValueError(
            f"{owner}: Sum of lengths must equal the number of values, but lengths sum to "
            f"{end} and values has {num_values} entries{last}."
        )


def _check_keys(
    owner: str, keys: Sequence[str], stride_per_key: Sequence[int], num_lengths: int
) -> None:
    if len(set(keys)) != len(keys):
        repeated = sorted({k for k in keys if list(keys).count(k) > 1})
        raise ValueError(f"{owner}: keys must be unique, but {repeated} appear more than once.")
    if not keys:
        if num_lengths:
            raise ValueError(
                f"{owner}: keys is empty but lengths or offsets is not ({num_lengths} lengths); "
                "pass the feature names in keys."
            )
        return
    if len(stride_per_key) != len(keys) or sum(stride_per_key) != num_lengths:
        raise ValueError(
            f"{owner}: lengths has {num_lengths} entries but the batch sizes per key "
            f"{list(stride_per_key)} for keys {list(keys)} sum to {sum(stride_per_key)}; "
            "lengths needs one entry per (key, batch row) (0 for an empty bag)."
        )


def raise_negative_length(
    owner: str, keys: Sequence[str] | None, sizes: Sequence[int], lengths: torch.Tensor
) -> None:
    position = int(torch.nonzero(lengths < 0)[0, 0])
    raise ValueError(
        f"{owner}: negative length {int(lengths[position])} for "
        f"{describe_position(keys, sizes, position)}; lengths must be >= 0."
    )


def describe_position(keys: Sequence[str] | None, sizes: Sequence[int], position: int) -> str:
    """Where flat lengths entry ``position`` is: ``key 'k' at batch position b`` (key ``i``
    owns the next ``sizes[i]`` entries), or ``batch position p`` without keys."""
    if keys is None:
        return f"batch position {position}"
    key, start = 0, 0
    while position >= start + sizes[key]:
        start += sizes[key]
        key += 1
    return f"key '{keys[key]}' at batch position {position - start}"
