"""Jagged-tensor kernels: FBGEMM where it is available and measurably faster, pure torch otherwise.

Every function takes ``use_fbgemm``: ``None`` picks the faster implementation for the tensors'
device, ``True`` forces the FBGEMM kernel (``RuntimeError`` where FBGEMM has none for that
device) and ``False`` forces the torch implementation. Both return identical results; the tests
compare them. ``bench/kjt_ops.py`` reproduces the permute and regroup measurements.

Defaults, measured on the CPU build (fbgemm-gpu-cpu 1.8.0, 2 threads, up to B=4096 x 26 keys):

=============================  ============  ==============================================
op                             default       why
=============================  ============  ==============================================
lengths_to_offsets             FBGEMM        one fused kernel; faster than cumsum + copy
permute_2d_sparse_data         FBGEMM small  FBGEMM copies segments on one thread: slower
                               torch large   than torch.cat once values exceed ~32K entries
keyed_jagged_index_select_dim1 torch on CPU  the CPU build has no kernel for this op; the
                                             forced FBGEMM path uses ``jagged_index_select``
jagged_to_padded_dense         FBGEMM        one kernel; torch needs gather + mask
regroup_keyed_tensor           torch on CPU  FBGEMM's CPU kernel is ~20x slower than
                                             split + cat (it is differentiable on both)
=============================  ============  ==============================================

On CUDA the FBGEMM kernels are used wherever the CUDA build registers them (not measured here:
these machines have no CUDA build of FBGEMM).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from recsys_core.kernels._fbgemm import fbgemm_supports

__all__ = [
    "jagged_to_padded_dense",
    "keyed_jagged_index_select_dim1",
    "lengths_to_offsets",
    "offsets_to_lengths",
    "permute_2d_sparse_data",
    "regroup_keyed_tensor",
]

# Below this many values the single FBGEMM call beats split + cat (fewer Python-level ops);
# above it torch.cat's multi-threaded copy wins on CPU.
_PERMUTE_FBGEMM_MAX_VALUES_CPU = 1 << 15


@functools.cache
def _has_kernel(op: str, device_type: str) -> bool:
    if not fbgemm_supports(torch.device(device_type)):
        return False
    name = f"fbgemm::{op}"
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    backend = "CUDA" if device_type == "cuda" else "CPU"
    return has(name, backend) or has(name, "CompositeImplicitAutograd")


def _use_fbgemm(op: str, device: torch.device, use_fbgemm: bool | None, default: bool) -> bool:
    if use_fbgemm is None:
        return default and _has_kernel(op, device.type)
    if use_fbgemm and not _has_kernel(op, device.type):
        raise RuntimeError(
            f"FBGEMM has no '{op}' kernel for {device.type} tensors in this build; "
            "pass use_fbgemm=None (pick automatically) or use_fbgemm=False (torch)."
        )
    return use_fbgemm


def lengths_to_offsets(lengths: torch.Tensor, *, use_fbgemm: bool | None = None) -> torch.Tensor:
    """Offsets with a leading 0: ``[3, 0, 2] -> [0, 3, 3, 5]`` (same dtype as ``lengths``)."""
    if _use_fbgemm("asynchronous_complete_cumsum", lengths.device, use_fbgemm, True):
        return torch.ops.fbgemm.asynchronous_complete_cumsum(lengths)
    offsets = lengths.new_empty(lengths.numel() + 1)
    offsets[0] = 0
    torch.cumsum(lengths, 0, out=offsets[1:])
    return offsets


def offsets_to_lengths(offsets: torch.Tensor) -> torch.Tensor:
    """``[0, 3, 3, 5] -> [3, 0, 2]``. One subtraction; no kernel to pick."""
    return offsets[1:] - offsets[:-1]


def permute_2d_sparse_data(
    permute: torch.Tensor,
    lengths: torch.Tensor,
    values: torch.Tensor,
    weights: torch.Tensor | None = None,
    permuted_lengths_sum: int | None = None,
    *,
    length_per_row: Sequence[int] | None = None,
    use_fbgemm: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Reorder the rows of a 2-D jagged layout (rows = keys, columns = batch).

    ``lengths`` is ``[R, B]``; row ``r`` owns the next ``lengths[r].sum()`` entries of
    ``values``. Returns ``(lengths[permute], values, weights)`` with the value segments in the
    order of ``permute`` (repeats allowed)::

        lengths = [[1, 2],      values = [a, b, c, d]     permute = [1, 0, 1]
                   [0, 1]]      row 0 -> a b c, row 1 -> d
        -> lengths [[0, 1], [1, 2], [0, 1]], values [d, a, b, c, d]

    ``length_per_row`` (per-row sums, when the caller already knows them) saves the torch path a
    reduction and a device sync. ``permute`` must be int32 for the FBGEMM kernel; other integer
    dtypes are converted.
    """
    device = values.device
    if _use_fbgemm(
        "permute_2D_sparse_data",
        device,
        use_fbgemm,
        device.type != "cpu" or values.numel() <= _PERMUTE_FBGEMM_MAX_VALUES_CPU,
    ):
        return torch.ops.fbgemm.permute_2D_sparse_data(
            permute.to(torch.int32), lengths, values, weights, permuted_lengths_sum
        )
    permuted_lengths = lengths.index_select(0, permute.to(torch.int64))
    rows = permute.tolist()
    if not rows:
        return permuted_lengths, values[:0], None if weights is None else weights[:0]
    sizes = list(length_per_row) if length_per_row is not None else lengths.sum(1).tolist()
    value_parts = values.split(sizes)
    permuted_values = torch.cat([value_parts[r] for r in rows])
    permuted_weights = None
    if weights is not None:
        weight_parts = weights.split(sizes)
        permuted_weights = torch.cat([weight_parts[r] for r in rows])
    return permuted_lengths, permuted_values, permuted_weights


def keyed_jagged_index_select_dim1(
    values: torch.Tensor,
    lengths: torch.Tensor,
    offsets: torch.Tensor,
    indices: torch.Tensor,
    batch_size: int,
    weights: torch.Tensor | None = None,
    selected_lengths_sum: int | None = None,
    *,
    use_fbgemm: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Select batch columns ``indices`` in every key of a key-major jagged layout.

    ``lengths`` is ``[K * batch_size]`` (key 0's batch, then key 1's, ...), ``offsets`` its
    complete cumsum. Returns ``(values, lengths, weights)`` of the ``K * len(indices)`` selected
    bags, still key-major::

        batch_size = 2, lengths = [1, 2 | 0, 1], values = [a, b, c | d], indices = [1, 1, 0]
        -> lengths [2, 2, 1 | 1, 1, 0], values [b, c, b, c, a | d, d]

    Indices are not bounds-checked here (callers check once, on the host).
    """
    device = values.device
    if use_fbgemm is not False and _has_kernel("keyed_jagged_index_select_dim1", device.type):
        out = torch.ops.fbgemm.keyed_jagged_index_select_dim1(
            values, lengths, offsets, indices, batch_size, weights, selected_lengths_sum
        )
        return out[0], out[1], out[2] if weights is not None else None
    num_keys = lengths.numel() // batch_size if batch_size else 0
    if use_fbgemm and _use_fbgemm("jagged_index_select", device, True, True):
        # The CPU build only has the unkeyed kernel: address every (key, column) bag by its row
        # in the flattened [K * batch_size] lengths.
        key_base = torch.arange(num_keys, device=device, dtype=torch.int64) * batch_size
        rows = (key_base.unsqueeze(1) + indices.to(torch.int64).unsqueeze(0)).reshape(-1)
        selected = torch.ops.fbgemm.jagged_index_select(_as_2d(values), lengths, rows)
        out_weights = None
        if weights is not None:
            out_weights = torch.ops.fbgemm.jagged_index_select(_as_2d(weights), lengths, rows)[0]
            out_weights = out_weights.view(-1)
        return selected[0].view(-1, *values.shape[1:]), selected[1], out_weights
    idx = indices.to(torch.int64)
    out_lengths = lengths.view(num_keys, batch_size).index_select(1, idx).reshape(-1)
    starts = offsets[:-1].view(num_keys, batch_size).index_select(1, idx).reshape(-1)
    gather = _segment_gather_index(starts.to(torch.int64), out_lengths, selected_lengths_sum)
    out_weights = None if weights is None else weights.index_select(0, gather)
    return values.index_select(0, gather), out_lengths, out_weights


def _as_2d(t: torch.Tensor) -> torch.Tensor:
    return t.unsqueeze(1) if t.dim() == 1 else t


def _segment_gather_index(
    starts: torch.Tensor, lengths: torch.Tensor, total: int | None
) -> torch.Tensor:
    """Source positions for concatenating segments ``[starts[i], starts[i] + lengths[i])``."""
    out_offsets = lengths_to_offsets(lengths.to(torch.int64))
    if total is None:
        total = int(out_offsets[-1])
    shift = starts - out_offsets[:-1]
    positions = torch.arange(total, device=starts.device, dtype=torch.int64)
    return positions.add_(torch.repeat_interleave(shift, lengths, output_size=total))


def jagged_to_padded_dense(
    values: torch.Tensor,
    offsets: torch.Tensor,
    max_length: int,
    padding_value: float = 0.0,
    *,
    use_fbgemm: bool | None = None,
) -> torch.Tensor:
    """Dense ``[B, max_length, *values.shape[1:]]``: bags truncated or padded with the value.

    ::

        offsets = [0, 1, 3], values = [5, 7, 1], max_length = 3
        -> [[5, 0, 0],
            [7, 1, 0]]
    """
    if _use_fbgemm("jagged_to_padded_dense", values.device, use_fbgemm, True):
        return torch.ops.fbgemm.jagged_to_padded_dense(
            values, [offsets], [max_length], padding_value
        )
    batch = offsets.numel() - 1
    shape = (batch, max_length, *values.shape[1:])
    if values.size(0) == 0 or batch == 0 or max_length == 0:
        return values.new_full(shape, padding_value)
    starts = offsets[:-1].to(torch.int64).unsqueeze(1)
    lengths = (offsets[1:] - offsets[:-1]).to(torch.int64).unsqueeze(1)
    columns = torch.arange(max_length, device=values.device, dtype=torch.int64).unsqueeze(0)
    # Clamping keeps the gather in bounds for padded slots; the mask then overwrites them.
    source = (starts + columns).clamp_(max=values.size(0) - 1).reshape(-1)
    mask = (columns < lengths).view(batch, max_length, *([1] * (values.dim() - 1)))
    dense = values.index_select(0, source).view(shape)
    return dense.masked_fill(~mask, padding_value)


def regroup_keyed_tensor(
    values: Sequence[torch.Tensor],
    keys: Sequence[Sequence[str]],
    lengths: Sequence[Sequence[int]],
    groups: Sequence[Sequence[str]],
    *,
    dim: int = 1,
    use_fbgemm: bool | None = None,
) -> list[torch.Tensor]:
    """Concatenate key slices of several keyed tensors into one tensor per group (autograd-safe).

    ``values[i]`` holds ``keys[i]`` side by side along ``dim`` with widths ``lengths[i]``::

        values = [[a a b], keys = [[x, y]], lengths = [[2, 1]], groups = [[y, x], [y]]
        -> [[b a a]], [[b]]

    A key may appear in several groups (its gradient then accumulates); a key name may appear
    in only one input. Raises ``ValueError`` naming any unknown key or empty group.
    """
    if not (len(values) == len(keys) == len(lengths)):
        raise ValueError(
            f"regroup: got {len(values)} value tensors, {len(keys)} key lists and "
            f"{len(lengths)} length lists; pass one of each per keyed tensor."
        )
    owner: dict[str, int] = {}
    for i, (names, widths) in enumerate(zip(keys, lengths, strict=True)):
        if len(names) != len(widths):
            raise ValueError(
                f"regroup: keyed tensor {i} has {len(names)} keys but {len(widths)} lengths."
            )
        for name in names:
            if name in owner:
                raise ValueError(
                    f"regroup: key '{name}' appears in keyed tensors {owner[name]} and {i}; "
                    "rename one of them so every key names exactly one slice."
                )
            owner[name] = i
    for g, group in enumerate(groups):
        if not group:
            raise ValueError(f"regroup: group {g} is empty; every group needs at least one key.")
        for name in group:
            if name not in owner:
                raise ValueError(
                    f"regroup: group {g} asks for key '{name}', which none of the keyed "
                    f"tensors has (known keys: {sorted(owner)})."
                )
    device = values[0].device if values else torch.device("cpu")
    if _use_fbgemm("regroup_keyed_tensor", device, use_fbgemm, device.type == "cuda"):
        if dim != 1:
            raise RuntimeError(
                f"FBGEMM regroup_keyed_tensor only concatenates along dim 1, got dim={dim}; "
                "pass use_fbgemm=False."
            )
        return torch.ops.fbgemm.regroup_keyed_tensor(
            list(values),
            [list(k) for k in keys],
            [list(w) for w in lengths],
            [list(g) for g in groups],
        )
    # One split per input keeps backward cheap: a single SplitBackward assembles the input
    # gradient, where per-key narrow() would allocate a full-size zero gradient per key.
    slices: dict[str, torch.Tensor] = {}
    for tensor, names, widths in zip(values, keys, lengths, strict=True):
        slices.update(zip(names, tensor.split(list(widths), dim=dim), strict=True))
    return [torch.cat([slices[name] for name in group], dim=dim) for group in groups]
