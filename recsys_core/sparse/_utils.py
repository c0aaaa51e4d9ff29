"""Shared helpers for the sparse types: cheap structural checks, full validation, printing."""

from __future__ import annotations

from collections.abc import Sequence

import torch

_INDEX_DTYPES = (torch.int32, torch.int64)


def as_index_tensor(
    data: torch.Tensor | Sequence[int], name: str, owner: str, device: torch.device
) -> torch.Tensor:
    """``lengths``/``offsets`` as an int32/int64 1-D tensor; Python lists become int64."""
    if not isinstance(data, torch.Tensor):
        try:
            # Infer the dtype first: torch.tensor([1.5], dtype=torch.int64) would truncate.
            converted = torch.tensor(data, device=device)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise ValueError(
                f"{owner}: {name} must be a tensor or a list of ints, got {type(data).__name__} "
                f"({exc})."
            ) from exc
        if converted.numel() and (converted.is_floating_point() or converted.dtype == torch.bool):
            raise ValueError(
                f"{owner}: {name} must be a list of ints, got {converted.dtype} entries."
            )
        data = converted.to(torch.int64)
    elif data.numel() == 0 and data.dim() == 1 and data.dtype not in _INDEX_DTYPES:
        # torch.tensor([]) is float32; TorchRec accepts it for "no bags", so do we.
        return data.to(torch.int64)
    if data.dtype not in _INDEX_DTYPES or data.dim() != 1:
        raise ValueError(
            f"{owner}: {name} must be a 1-D int32 or int64 tensor, got dtype {data.dtype} with "
            f"shape {tuple(data.shape)}; convert it with .to(torch.int64) or .view(-1)."
        )
    return data


def check_values_and_weights(
    values: torch.Tensor,
    weights: torch.Tensor | None,
    owner: str,
    integer_weights_ok: bool = False,
) -> None:
    """Metadata-only checks (no device sync). ``integer_weights_ok``: a JaggedTensor may carry
    integer "weights" (TorchRec's EmbeddingCollection(need_indices=True) stores the ids there)."""
    if not isinstance(values, torch.Tensor):
        raise ValueError(f"{owner}: values must be a torch.Tensor, got {type(values).__name__}.")
    if values.dim() == 0:
        raise ValueError(f"{owner}: values must have at least 1 dimension, got a scalar tensor.")
    if weights is None:
        return
    if not isinstance(weights, torch.Tensor) or not (
        weights.is_floating_point() or (integer_weights_ok and weights.dtype in _INDEX_DTYPES)
    ):
        got = weights.dtype if isinstance(weights, torch.Tensor) else type(weights).__name__
        raise ValueError(
            f"{owner}: weights must be a floating-point tensor, got {got}; "
            "convert them with .float()."
        )
    if weights.dim() != 1 or weights.size(0) != values.size(0):
        raise ValueError(
            f"{owner}: weights has shape {tuple(weights.shape)} but values has "
            f"{values.size(0)} entries; pass one weight per value."
        )


def parse_lengths_offsets(
    lengths: torch.Tensor | Sequence[int] | None,
    offsets: torch.Tensor | Sequence[int] | None,
    owner: str,
    device: torch.device,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Convert and check ``lengths``/``offsets`` (at least one given; sizes agree)."""
    if lengths is not None:
        lengths = as_index_tensor(lengths, "lengths", owner, device)
    if offsets is not None:
        offsets = as_index_tensor(offsets, "offsets", owner, device)
        if offsets.numel() == 0:
            # TorchRec code passes an empty offsets tensor for "no bags"; as lengths it is.
            lengths, offsets = (offsets if lengths is None else lengths), None
    if lengths is None and offsets is None:
        raise ValueError(f"{owner}: pass lengths or offsets (or both); got neither.")
    if lengths is not None and offsets is not None and offsets.numel() != lengths.numel() + 1:
        raise ValueError(
            f"{owner}: offsets has {offsets.numel()} entries but lengths has "
            f"{lengths.numel()}; offsets needs len(lengths) + 1 entries (a leading 0)."
        )
    return lengths, offsets


def validate_jagged(
    owner: str,
    keys: Sequence[str] | None,
    stride: int,
    values: torch.Tensor,
    lengths: torch.Tensor,
    offsets: torch.Tensor | None,
    length_per_key: Sequence[int] | None,
    offset_per_key: Sequence[int] | None = None,
) -> list[int]:
    """Full (syncing) consistency check of a key-major jagged layout; returns length_per_key.

    ``keys=None`` means a single unnamed JaggedTensor (one "key" spanning all of ``lengths``).
    The happy path costs one host transfer: every statistic is packed into one small tensor.
    """
    num_keys = 1 if keys is None else len(keys)
    num_values = values.size(0)
    if lengths.numel() == 0:
        sums = [0] * num_keys if keys is not None else [0]
    else:
        per_key = lengths.view(num_keys, -1).sum(1, dtype=torch.int64)
        stats = [per_key, lengths.min().to(torch.int64).view(1)]
        if offsets is not None:
            stats.append(offsets[:1].to(torch.int64))
            stats.append((offsets[1:] - offsets[:-1] != lengths).sum().view(1))
        packed = torch.cat(stats).tolist()
        sums = packed[:num_keys]
        if packed[num_keys] < 0:
            _raise_negative(owner, keys, stride, lengths)
        if offsets is not None:
            if packed[num_keys + 1] != 0:
                raise ValueError(
                    f"{owner}: offsets must start at 0, got {packed[num_keys + 1]}; "
                    "subtract offsets[0] or pass lengths instead."
                )
            if packed[num_keys + 2] != 0:
                raise ValueError(
                    f"{owner}: offsets and lengths disagree at {packed[num_keys + 2]} position(s); "
                    "pass only one of them or make offsets the cumulative sum of lengths."
                )
    if offsets is not None and lengths.numel() == 0 and offsets.numel() == 1:
        first = int(offsets[0])
        if first != 0:
            raise ValueError(f"{owner}: offsets must start at 0, got {first}.")
    _check_sums(owner, keys, sums, num_values)
    if length_per_key is not None and keys is not None and list(length_per_key) != sums:
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


def _raise_negative(
    owner: str, keys: Sequence[str] | None, stride: int, lengths: torch.Tensor
) -> None:
    position = int(torch.nonzero(lengths < 0)[0, 0])
    value = int(lengths[position])
    if keys is None:
        where = f"batch position {position}"
    else:
        where = f"key '{keys[position // stride]}' at batch position {position % stride}"
    raise ValueError(f"{owner}: negative length {value} for {where}; lengths must be >= 0.")


def _check_sums(owner: str, keys: Sequence[str] | None, sums: list[int], num_values: int) -> None:
    end = 0
    for i, count in enumerate(sums):
        start, end = end, end + count
        if end > num_values:
            name = "the bags need" if keys is None else f"key '{keys[i]}' needs"
            raise ValueError(
                f"{owner}: {name} values[{start}:{end}] but values has only "
                f"{num_values} entries; lengths and values disagree."
            )
    if end != num_values:
        last = "" if keys is None or not keys else f" (after the last key '{keys[-1]}')"
        raise ValueError(
            f"{owner}: lengths sum to {end} but values has {num_values} entries{last}; "
            "every value must belong to exactly one bag."
        )


def _values_string(values: list) -> str:
    return "[" + ", ".join(str(v) for v in values) + "]"


def jagged_values_string(values: torch.Tensor, offsets: list[int], first: int, last: int) -> str:
    """``[[1, 2], [], [3]]`` for bags ``first..last-1`` (bounds from host-side ``offsets``)."""
    rows = values[offsets[first] : offsets[last]].tolist()
    base = offsets[first]
    bags = [
        _values_string(rows[offsets[i] - base : offsets[i + 1] - base]) for i in range(first, last)
    ]
    return "[" + ", ".join(bags) + "]"


def keyed_jagged_string(
    keys: Sequence[str],
    values: torch.Tensor,
    weights: torch.Tensor | None,
    offsets: list[int],
    stride: int,
) -> str:
    """TorchRec's KeyedJaggedTensor printout, one ``"key": [[bag], ...]`` line per key."""
    lines = []
    for i, key in enumerate(keys):
        first, last = i * stride, (i + 1) * stride
        bags = jagged_values_string(values, offsets, first, last)
        if weights is None:
            lines.append(f'    "{key}": {bags}')
        else:
            bag_weights = jagged_values_string(weights, offsets, first, last)
            lines.append(
                f'    "{key}": {{\n        "values": {bags},\n'
                f'        "weights": {bag_weights}\n    }}'
            )
    return "KeyedJaggedTensor({\n" + ",\n".join(lines) + "\n})\n"
