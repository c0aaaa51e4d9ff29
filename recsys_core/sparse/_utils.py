"""Shared eager-only helpers for the sparse types: constructor input checks, printing."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from recsys_core.kernels import sparse_ops

_INDEX_DTYPES = (torch.int32, torch.int64)


class JaggedInputError(ValueError, AssertionError):
    """Lengths/offsets a constructor cannot take (not integers, or neither given).

    A ``ValueError`` like our other input errors, and also an ``AssertionError``: TorchRec's
    constructors assert on the same inputs, so code catching that keeps working.
    """


def as_index_tensor(
    data: torch.Tensor | Sequence[int], name: str, owner: str, device: torch.device
) -> torch.Tensor:
    """``lengths``/``offsets`` as an int32/int64 tensor; Python lists become int64."""
    if isinstance(data, torch.Tensor) and data.dtype in _INDEX_DTYPES:
        return data
    if not isinstance(data, torch.Tensor):
        try:
            # Infer the dtype first: torch.tensor([1.5], dtype=torch.int64) would truncate.
            converted = torch.tensor(data, device=device)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise JaggedInputError(
                f"{owner}: {name} must be a tensor or a list of ints, got {type(data).__name__} "
                f"({exc})."
            ) from exc
        if converted.numel() and (converted.is_floating_point() or converted.dtype == torch.bool):
            raise JaggedInputError(
                f"{owner}: {name} must be a list of ints, got {converted.dtype} entries."
            )
        data = converted.to(torch.int64)
    elif data.numel() == 0:
        # torch.tensor([]) is float32; TorchRec keeps it as given for "no bags", so do we.
        return data
    if data.dtype not in _INDEX_DTYPES and data.numel() > 0:
        raise JaggedInputError(
            f"{owner}: {name} must be an int32 or int64 tensor, got dtype {data.dtype} with "
            f"shape {tuple(data.shape)}; convert it with .to(torch.int64)."
        )
    return data


def check_jagged_inputs(
    owner: str,
    values: torch.Tensor,
    lengths: torch.Tensor | Sequence[int] | None,
    offsets: torch.Tensor | Sequence[int] | None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The constructor checks TorchRec also makes (no device sync): ``values`` is a tensor,
    lengths or offsets is given, and they hold integers. Python lists become int64 tensors."""
    if not isinstance(values, torch.Tensor):
        raise ValueError(f"{owner}: values must be a torch.Tensor, got {type(values).__name__}.")
    device = values.device
    if lengths is not None:
        lengths = as_index_tensor(lengths, "lengths", owner, device)
    if offsets is not None:
        offsets = as_index_tensor(offsets, "offsets", owner, device)
    if lengths is None and offsets is None:
        raise JaggedInputError(f"{owner}: pass lengths or offsets (or both); got neither.")
    return lengths, offsets


def check_kjt_inputs(
    keys: Sequence[str],
    values: torch.Tensor,
    lengths: torch.Tensor | Sequence[int] | None,
    offsets: torch.Tensor | Sequence[int] | None,
    stride_per_key_per_rank: torch.Tensor | list[list[int]] | None,
    length_per_key: Sequence[int] | None = None,
    offset_per_key: Sequence[int] | None = None,
) -> tuple[list[str], torch.Tensor | None, torch.Tensor | None, list[list[int]] | None]:
    """KeyedJaggedTensor's eager constructor checks (host metadata only, no device sync).
    Cached ``length_per_key``/``offset_per_key`` are trusted, as in TorchRec; ``validate()``
    checks them."""
    owner = "KeyedJaggedTensor"
    if isinstance(keys, str):
        raise ValueError(f"{owner}: keys must be a list of strings, got the string {keys!r}")
    if type(keys) is not list:
        keys = list(keys)
    if not isinstance(values, torch.Tensor):
        raise ValueError(f"{owner}: values must be a torch.Tensor, got {type(values).__name__}.")
    # Unlike JaggedTensor, TorchRec accepts a KJT with neither lengths nor offsets (no keys).
    if lengths is not None:
        lengths = as_index_tensor(lengths, "lengths", owner, values.device)
    if offsets is not None:
        offsets = as_index_tensor(offsets, "offsets", owner, values.device)
    if isinstance(stride_per_key_per_rank, torch.Tensor):
        stride_per_key_per_rank = stride_per_key_per_rank.tolist()
    if stride_per_key_per_rank is not None and not all(
        isinstance(per_rank, list) for per_rank in stride_per_key_per_rank
    ):
        raise ValueError(
            f"{owner}: stride_per_key_per_rank must be 2-dimensional (per key, a list of batch "
            f"sizes per rank, e.g. [[2], [3]]), got {stride_per_key_per_rank}."
        )
    return keys, lengths, offsets, stride_per_key_per_rank


def check_values_cover(
    keys: list[str], length_per_key: list[int], offset_per_key: list[int], num_values: int
) -> None:
    """Raise, naming the key, if the bags need more values than there are (values may run
    past the last bag, as TorchRec allows). O(1) on good input: the last cached offset."""
    if offset_per_key[-1] <= num_values:
        return
    end = 0
    for key, count in zip(keys, length_per_key, strict=True):
        start, end = end, end + count
        if end > num_values:
            raise ValueError(
                f"KeyedJaggedTensor: key '{key}' needs values[{start}:{end}] but values has only "
                f"{num_values} entries; lengths and values disagree."
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
    stride_per_key: Sequence[int],
) -> str:
    """TorchRec's KeyedJaggedTensor printout, one ``"key": [[bag], ...]`` line per key."""
    lines = []
    last = 0
    for i, key in enumerate(keys):
        first, last = last, last + stride_per_key[i]
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


def index_select_batch(
    owner: str,
    values: torch.Tensor,
    weights: torch.Tensor | None,
    lengths: torch.Tensor,
    offsets: torch.Tensor,
    stride: int,
    indices: torch.Tensor | Sequence[int],
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, int]:
    """Rows ``indices`` of every key (bounds-checked on the host, one sync)."""
    indices = as_index_tensor(indices, "indices", owner, values.device)
    if lengths.dtype not in _INDEX_DTYPES:
        lengths = lengths.to(torch.int64)  # an empty float lengths tensor (TorchRec allows it)
        offsets = offsets.to(torch.int64)
    if indices.numel():
        low, high = (int(x) for x in torch.aminmax(indices))
        if low < 0 or high >= stride:
            raise ValueError(
                f"{owner}: index {low if low < 0 else high} is out of range for batch size "
                f"{stride}; indices must be in [0, {stride})."
            )
    new_values, new_lengths, new_weights = sparse_ops.keyed_jagged_index_select_dim1(
        values, lengths, offsets, indices, stride, weights
    )
    return new_values, new_weights, new_lengths, indices.numel()
