"""Index arithmetic shared by the sparse types, written so TorchScript can compile it.

Eager code takes the fastest kernel (FBGEMM when it pays, through ``recsys_core.kernels``);
scripted code runs the pure-torch path, which gives the same integers. ``torch.jit.is_scripting()``
branches are resolved when scripting, so the eager branch never needs to compile.
"""

from __future__ import annotations

import torch

from recsys_core.kernels import sparse_ops
from recsys_core.sparse import _native_lib


def lengths_to_offsets(lengths: torch.Tensor) -> torch.Tensor:
    """``[3, 0, 2] -> [0, 3, 3, 5]`` (same dtype; 2-D lengths are flattened first)."""
    flat = lengths.reshape(-1)
    if torch.jit.is_scripting():
        return torch.cat([flat.new_zeros(1), torch.cumsum(flat, 0).to(flat.dtype)])
    else:
        return sparse_ops.lengths_to_offsets(flat)


def pin_and_move(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor.to(device)``; a host tensor bound for CUDA goes through pinned memory, so the
    copy does not block the host."""
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device=device, non_blocking=True)
    return tensor.to(device=device, non_blocking=True)


@torch.jit.unused
def cuda_to_cpu_safe(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of a CUDA tensor that waits only for the current stream (see
    :func:`safe_tolist`)."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    torch.cuda.current_stream(tensor.device).synchronize()
    return host


def safe_tolist(tensor: torch.Tensor) -> list[int]:
    """``tensor.tolist()`` that waits only for the current CUDA stream.

    ``.tolist()`` on a CUDA tensor synchronizes the whole device, so it also waits for (and can
    hang on) collectives queued on other streams; copying into pinned host memory and syncing
    the current stream gives the same list. CPU and scripted callers get plain ``tolist()``.
    """
    if torch.jit.is_scripting() or not tensor.is_cuda:
        return tensor.tolist()
    else:
        if tensor.numel() == 0:
            return []
        return cuda_to_cpu_safe(tensor).tolist()


def offsets_to_lengths(offsets: torch.Tensor) -> torch.Tensor:
    """``[0, 3, 3, 5] -> [3, 0, 2]``."""
    if not torch.jit.is_scripting():
        lengths = _native_lib.offsets_to_lengths(offsets)
        if lengths is not None:
            return lengths
    return offsets[1:] - offsets[:-1]


def cumsum(sizes: list[int]) -> list[int]:
    """``[2, 0, 3] -> [0, 2, 2, 5]`` on host ints."""
    out = [0]
    for n in sizes:
        out.append(out[-1] + n)
    return out


def sums_by_segments(lengths: torch.Tensor, segments: list[int]) -> list[int]:
    """Sum of each consecutive ``segments[i]``-long run of ``lengths`` (one host sync)."""
    if len(segments) == 0:
        return []
    flat = lengths.reshape(-1)
    if flat.numel() == 0:
        return [0] * len(segments)
    ids = torch.repeat_interleave(
        torch.arange(len(segments), device=flat.device),
        torch.tensor(segments, device=flat.device),
        output_size=flat.numel(),
    )
    out = torch.zeros(len(segments), dtype=torch.int64, device=flat.device)
    out.index_add_(0, ids, flat.to(torch.int64))
    return out.tolist()


def gather_segments(t: torch.Tensor, sizes: list[int], order: list[int]) -> torch.Tensor:
    """Concatenate segments ``order[i]`` of ``t`` cut into consecutive ``sizes`` (repeats ok)."""
    starts = cumsum(sizes)
    if len(order) == 0:
        return t[:0]
    return torch.cat([t.narrow(0, starts[i], sizes[i]) for i in order])


def permute_keys(
    indices: list[int],
    indices_tensor: torch.Tensor | None,
    lengths: torch.Tensor,
    values: torch.Tensor,
    weights: torch.Tensor | None,
    stride_per_key: list[int],
    length_per_key: list[int],
    fixed_stride: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Reorder whole keys (their lengths segments and value segments) into ``indices`` order."""
    covered = sum(length_per_key)
    if values.size(0) != covered:
        # Values beyond the last key's bags (allowed, as in TorchRec) belong to no key.
        values = values.narrow(0, 0, covered)
        if weights is not None:
            weights = weights.narrow(0, 0, covered)
    if not torch.jit.is_scripting():
        # Eager host permute: one C call for every block copy (None: the helper is absent or
        # the tensors are not plain contiguous host tensors; the torch path below gives the same).
        copied = _native_lib.permute_blocks(
            indices, lengths.reshape(-1), values, weights, stride_per_key, length_per_key
        )
        if copied is not None:
            return copied
    # FBGEMM's kernel takes only float weights; integer ones (TorchRec allows them) use torch.
    # Its backward crashed the process on CPU (fbgemm_gpu-cpu 1.8.0: a segfault), so inputs
    # that need gradients use torch.cat, whose backward is torch's own.
    float_weights = weights is None or weights.is_floating_point()
    needs_grad = values.requires_grad or (weights is not None and weights.requires_grad)
    if fixed_stride and len(stride_per_key) > 0 and float_weights and not needs_grad:
        if not torch.jit.is_scripting():
            # Eager fixed-batch permute: FBGEMM's kernel where it pays (``sparse_ops`` decides).
            total = 0
            for i in indices:
                total += length_per_key[i]
            if indices_tensor is None:
                indices_tensor = torch.tensor(indices, dtype=torch.int32, device=values.device)
            new_lengths, new_values, new_weights = sparse_ops.permute_2d_sparse_data(
                indices_tensor,
                lengths.reshape(len(stride_per_key), -1),
                values,
                weights,
                total,
                length_per_row=length_per_key,
            )
            return new_lengths.reshape(-1), new_values, new_weights
    new_lengths = gather_segments(lengths.reshape(-1), stride_per_key, indices)
    new_values = gather_segments(values, length_per_key, indices)
    new_weights: torch.Tensor | None = None
    if weights is not None:
        new_weights = gather_segments(weights, length_per_key, indices)
    return new_lengths, new_values, new_weights


def padded_dense(
    values: torch.Tensor, offsets: torch.Tensor, length: int, padding_value: float
) -> torch.Tensor:
    """``[B, length, ...]``: bag ``b`` truncated or padded with ``padding_value``."""
    if not torch.jit.is_scripting():
        return sparse_ops.jagged_to_padded_dense(values, offsets, length, padding_value)
    else:
        bags = offsets.numel() - 1
        lengths = offsets[1:] - offsets[:-1]
        shape = [bags, length]
        for s in values.shape[1:]:
            shape.append(s)
        out = torch.full(shape, padding_value, dtype=values.dtype, device=values.device)
        columns = torch.arange(length, device=values.device)
        mask = columns.unsqueeze(0) < lengths.unsqueeze(1)
        source = offsets[:-1].unsqueeze(1).to(torch.int64) + columns.unsqueeze(0)
        out[mask] = values[source[mask]]
        return out
