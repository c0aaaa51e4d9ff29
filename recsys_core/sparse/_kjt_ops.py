"""KeyedJaggedTensor algorithms on plain tensors and host lists (TorchScript-compilable).

``KeyedJaggedTensor`` methods call these and wrap the results; they never re-check inputs,
since the parts derive from the KJT itself. ``stride_per_key`` is the number of bags of each
key (all equal to ``stride()`` unless the batch size varies per key).
"""

from __future__ import annotations

import torch

from recsys_core.sparse import _jit_ops
from recsys_core.sparse.jagged import BatchedRows, JaggedTensor, jagged_view, row_views_eager


def compute_stride(
    keys: list[str],
    lengths: torch.Tensor | None,
    offsets: torch.Tensor | None,
    stride_per_key_per_rank: list[list[int]] | None,
    inverse_indices: tuple[list[str], torch.Tensor] | None,
) -> int:
    """TorchRec's rule: with a variable batch, the batch of the inverse indices if given, else
    the largest per-key batch; otherwise the number of bags over the number of keys."""
    if len(keys) == 0:
        return 0
    if stride_per_key_per_rank is not None and len(stride_per_key_per_rank) > 0:
        if inverse_indices is not None and inverse_indices[1].numel() > 0:
            return inverse_indices[1].size(-1)
        return max([sum(per_rank) for per_rank in stride_per_key_per_rank])
    if lengths is not None:
        num_bags = lengths.numel()
    elif offsets is not None and offsets.numel() > 0:
        num_bags = offsets.numel() - 1
    else:
        num_bags = 0
    if num_bags % len(keys) != 0:
        raise ValueError(
            f"KeyedJaggedTensor: lengths has {num_bags} entries, not a multiple of the {len(keys)} keys "
            f"{keys}; every key needs one length per batch row (0 for an empty bag), or pass "
            "stride_per_key_per_rank for a variable batch per key."
        )
    return num_bags // len(keys)


def lengths_from_offsets(offsets: torch.Tensor | None) -> torch.Tensor:
    """The lengths a KJT stored without them: from its ``offsets``, which it must then have."""
    return _jit_ops.offsets_to_lengths(_either(offsets))


def offsets_from_lengths(lengths: torch.Tensor | None) -> torch.Tensor:
    """The offsets a KJT stored without them: from its ``lengths``, which it must then have."""
    return _jit_ops.lengths_to_offsets(_either(lengths))


def _either(t: torch.Tensor | None) -> torch.Tensor:
    # TorchRec accepts a KJT with neither (an empty one): the error comes when one is asked for.
    if t is None:
        raise ValueError(
            "KeyedJaggedTensor has neither lengths nor offsets; pass one of them when "
            "constructing it."
        )
    return t


def length_per_key(
    values: torch.Tensor,
    num_keys: int,
    stride_per_key: list[int],
    variable_stride: bool,
    lengths: torch.Tensor | None,
    offsets: torch.Tensor | None,
) -> list[int]:
    """Number of values of each key (one host sync)."""
    if num_keys == 0:
        return []
    if values.is_meta:
        # Meta tensors hold no data: an even split (remainder on key 0), as TorchRec does.
        even = [values.size(0) // num_keys] * num_keys
        even[0] += values.size(0) % num_keys
        return even
    if variable_stride:
        if lengths is None:
            lengths = lengths_from_offsets(offsets)
        return _jit_ops.sums_by_segments(lengths, stride_per_key)
    stride = stride_per_key[0]
    if stride == 0:
        return [0] * num_keys
    if offsets is not None and offsets.numel() == num_keys * stride + 1:
        # Key boundaries are every stride-th offset: O(keys) instead of a full reduction.
        bounds = offsets[::stride]
        counts: list[int] = (bounds[1:] - bounds[:-1]).tolist()
        return counts
    if lengths is None:
        lengths = lengths_from_offsets(offsets)
    sums: list[int] = lengths.reshape(num_keys, stride).sum(1).tolist()
    return sums


def key_view(
    values: torch.Tensor,
    weights: torch.Tensor | None,
    lengths: torch.Tensor,
    offset_per_key: list[int],
    lengths_offset_per_key: list[int],
    index: int,
) -> JaggedTensor:
    start, end = offset_per_key[index], offset_per_key[index + 1]
    lo, hi = lengths_offset_per_key[index], lengths_offset_per_key[index + 1]
    flat = lengths if lengths.dim() == 1 else lengths.reshape(-1)
    return jagged_view(
        values[start:end],
        None if weights is None else weights[start:end],
        flat[lo:hi],
        None,
    )


def to_dict(
    keys: list[str],
    values: torch.Tensor,
    weights: torch.Tensor | None,
    lengths: torch.Tensor,
    stride_per_key: list[int],
    variable_stride: bool,
    length_per_key: list[int],
    compute_offsets: bool,
) -> dict[str, JaggedTensor]:
    """``{key: JaggedTensor}`` of views; for a fixed batch the per-key lengths/offsets are
    built for all keys at once on first use (one unbind, one batched cumsum)."""
    out: dict[str, JaggedTensor] = {}
    if len(keys) == 0:
        return out
    covered = sum(length_per_key)
    if values.size(0) != covered:
        values = values.narrow(0, 0, covered)
        if weights is not None:
            weights = weights.narrow(0, 0, covered)
    value_parts = torch.split(values, length_per_key)
    weight_parts: list[torch.Tensor] = []
    if weights is not None:
        weight_parts = list(torch.split(weights, length_per_key))
    flat = lengths if lengths.dim() == 1 else lengths.reshape(-1)
    if variable_stride:
        length_parts = torch.split(flat, stride_per_key)
        for i, key in enumerate(keys):
            part = length_parts[i]
            offsets = _jit_ops.lengths_to_offsets(part) if compute_offsets else None
            w = weight_parts[i] if weights is not None else None
            out[key] = jagged_view(value_parts[i], w, part, offsets)
        return out
    if flat.numel() == 0:
        # No bags: empty lengths and offsets [0] per key, as TorchRec 1.9 (1.8 gave empty
        # offsets, which break a JaggedTensor's len(lengths) + 1 rule).
        empty_rows = flat.reshape(len(keys), 0).unbind(0)
        for i, key in enumerate(keys):
            w = weight_parts[i] if weights is not None else None
            offsets = flat.new_zeros(1) if compute_offsets else None
            out[key] = jagged_view(value_parts[i], w, empty_rows[i], offsets)
        return out
    if not compute_offsets:
        rows_lengths = flat.reshape(len(keys), stride_per_key[0]).unbind(0)
        for i, key in enumerate(keys):
            w = weight_parts[i] if weights is not None else None
            out[key] = jagged_view(value_parts[i], w, rows_lengths[i], None)
        return out
    rows = BatchedRows(flat.reshape(len(keys), stride_per_key[0]))
    if not torch.jit.is_scripting():
        return row_views_eager(
            keys, value_parts, weight_parts if weights is not None else None, rows
        )
    for i, key in enumerate(keys):
        w = weight_parts[i] if weights is not None else None
        out[key] = jagged_view(value_parts[i], w, None, None, rows, i)
    return out


def concat_layout(
    strides: list[int],
    variable: list[bool],
    keys_per_kjt: list[list[str]],
    weighted: list[bool],
    has_inverse: list[bool],
) -> None:
    """Raise if the KJTs cannot sit side by side (host metadata only)."""
    if len(strides) == 0:
        raise ValueError("KeyedJaggedTensor.concat: got an empty list; pass at least one KJT.")
    for i in range(len(strides)):
        if variable[i] != variable[0]:
            raise ValueError(
                f"KeyedJaggedTensor.concat: KJT {i} (keys {keys_per_kjt[i]}) has a variable batch per "
                "key but KJT 0 does not (or the reverse); concatenate KJTs of one kind."
            )
        if not variable[0] and strides[i] != strides[0]:
            raise ValueError(
                f"KeyedJaggedTensor.concat: KJT {i} (keys {keys_per_kjt[i]}) has stride {strides[i]} "
                f"but KJT 0 has {strides[0]}; only KJTs of the same batch size concatenate."
            )
        if weighted[i] != weighted[0]:
            raise ValueError(
                f"KeyedJaggedTensor.concat: KJT {i} (keys {keys_per_kjt[i]}) is "
                f"{'weighted' if weighted[i] else 'unweighted'} but KJT 0 is "
                f"{'weighted' if weighted[0] else 'unweighted'}; weight all or none."
            )
        if has_inverse[i] != has_inverse[0]:
            raise ValueError(
                f"KeyedJaggedTensor.concat: KJT {i} (keys {keys_per_kjt[i]}) and KJT 0 disagree on "
                "having inverse_indices; give them to all KJTs or to none."
            )


def check_jt_dict(keys: list[str], strides: list[int], weighted: list[bool]) -> None:
    for i in range(len(keys)):
        if weighted[i] != weighted[0]:
            raise ValueError(
                f"KeyedJaggedTensor.from_jt_dict: key '{keys[i]}' is "
                f"{'weighted' if weighted[i] else 'unweighted'} but key '{keys[0]}' is "
                f"{'weighted' if weighted[0] else 'unweighted'}; weight all features or none."
            )


def check_split(segments: list[int], keys: list[str]) -> None:
    total = 0
    for s in segments:
        if s < 0:
            raise ValueError(
                f"KeyedJaggedTensor.split: segments {segments} must be non-negative and sum to the "
                f"number of keys ({len(keys)})."
            )
        total += s
    if total != len(keys):
        raise ValueError(
            f"KeyedJaggedTensor.split: segments {segments} must be non-negative and sum to the "
            f"number of keys ({len(keys)})."
        )


def check_permute(indices: list[int], keys: list[str]) -> list[int]:
    """Indices made non-negative; raises on one out of range."""
    out: list[int] = []
    for i in indices:
        if i < -len(keys) or i >= len(keys):
            raise ValueError(
                f"KeyedJaggedTensor.permute: index {i} is out of range for {len(keys)} keys {keys}."
            )
        out.append(i % len(keys))
    return out


def sum_by_splits(values: list[int], splits: list[int]) -> list[int]:
    """``[1, 2, 3, 4]``, splits ``[1, 3]`` -> ``[1, 9]``."""
    out: list[int] = []
    start = 0
    for n in splits:
        out.append(sum(values[start : start + n]))
        start += n
    return out


def dist_init_parts(
    num_keys: int,
    tensors: list[torch.Tensor],
    variable_stride_per_key: bool,
    num_workers: int,
    recat: torch.Tensor | None,
    stride_per_rank: list[int] | None,
    stagger: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, list[list[int]] | None, int | None]:
    """A KJT's parts from what an all-to-all received (TorchRec's ``dist_init``).

    ``tensors`` is ``[lengths, values]`` (+ ``strides`` for a variable batch) (+ ``weights``),
    laid out rank-major; ``recat`` reorders the received (rank, key) segments into key-major
    order. Returns lengths, values, weights, stride_per_key_per_rank, stride.
    """
    if len(tensors) < 2 or len(tensors) > 4:
        raise ValueError(
            f"KeyedJaggedTensor.dist_init: expected 2 to 4 tensors, got {len(tensors)}."
        )
    lengths, values = tensors[0], tensors[1]
    weighted = len(tensors) == (4 if variable_stride_per_key else 3)
    weights = tensors[-1] if weighted else None
    if variable_stride_per_key:
        strides: list[int] = tensors[2].tolist()  # rank-major: rank r, key k at r * K + k
        segment_lengths = _jit_ops.sums_by_segments(lengths, strides)
        if recat is not None:
            order: list[int] = recat.tolist()
            lengths = _jit_ops.gather_segments(lengths, strides, order)
            new_weights: torch.Tensor | None = None
            if weights is not None:
                new_weights = _jit_ops.gather_segments(weights, segment_lengths, order)
            values = _jit_ops.gather_segments(values, segment_lengths, order)
            weights = new_weights
        per_key: list[list[int]] = [
            [strides[r * num_keys + k] for r in range(num_workers)] for k in range(num_keys)
        ]
        if len(strides) == 0:
            per_key = [[0] for _ in range(num_keys)]
        elif stagger > 1:
            columns: list[int] = (
                torch.arange(num_workers).view(stagger, -1).t().reshape(-1).tolist()
            )
            per_key = [[row[c] for c in columns] for row in per_key]
        return lengths, values, weights, per_key, None
    if stride_per_rank is None:
        raise ValueError("KeyedJaggedTensor.dist_init: a fixed batch needs stride_per_rank.")
    if recat is not None:
        fixed_order: list[int] = recat.tolist()
        if all([s == stride_per_rank[0] for s in stride_per_rank]):
            stride = stride_per_rank[0]
            if stride > 0:
                rows = lengths.numel() // stride
                row_sizes = [stride] * rows
                row_lengths = _jit_ops.sums_by_segments(lengths, row_sizes)
                lengths = _jit_ops.gather_segments(lengths.reshape(-1), row_sizes, fixed_order)
                values_out = _jit_ops.gather_segments(values, row_lengths, fixed_order)
                if weights is not None:
                    weights = _jit_ops.gather_segments(weights, row_lengths, fixed_order)
                values = values_out
        else:
            entry_lengths: list[int] = lengths.reshape(-1).tolist()
            lengths = lengths.reshape(-1)[torch.tensor(fixed_order, device=lengths.device)]
            values_out = _jit_ops.gather_segments(values, entry_lengths, fixed_order)
            if weights is not None:
                weights = _jit_ops.gather_segments(weights, entry_lengths, fixed_order)
            values = values_out
    return lengths, values, weights, None, sum(stride_per_rank)
