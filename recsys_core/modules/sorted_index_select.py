"""``sorted_index_select``: ``embeddings.index_select(0, indices)`` whose backward is a sorted
segment sum (TorchRec 1.9's ``torchrec.modules.sorted_index_select``).

The forward is the same gather. The backward differs: ``index_select``'s backward scatters
every output row's gradient into its source row (``index_add``, accumulated in the gradient's
dtype, by atomics on CUDA). Here the indices are sorted and each source row's gradients are
summed as one contiguous segment in float32, then rounded once to the gradient's dtype::

    embeddings [3, D], indices [2, 0, 2, 2]
    forward   rows e[2], e[0], e[2], e[2]
    backward  sorted indices [0, 2, 2, 2] -> segments row 0: g[1]; row 1: none;
              row 2: g[0] + g[2] + g[3] (float32)

For float32 gradients the result equals ``index_select``'s up to summation order; for bf16 /
fp16 it is the float32 sum rounded once (more accurate than accumulating in bf16). TorchRec
runs a Triton kernel on the GPU; this is the same reduction with torch's ``segment_reduce``
on any device. As in TorchRec, when there are few duplicates (rows * 2 >= indices) the
backward is the plain ``index_add`` (sorting would cost more than it saves).
"""

from __future__ import annotations

import torch

__all__ = ["maybe_sorted_index_select", "sorted_index_select"]


def _sorted_segment_sum(grad_out: torch.Tensor, indices: torch.Tensor, num_rows: int) -> torch.Tensor:
    """The gradient of ``embeddings`` (``num_rows`` rows) for ``embeddings[indices]``."""
    grad_out = grad_out.contiguous()
    if num_rows * 2 >= indices.numel():
        out = grad_out.new_zeros(num_rows, grad_out.size(1))
        return out.index_add_(0, indices, grad_out)
    sorted_indices, order = torch.sort(indices)
    counts = torch.bincount(sorted_indices, minlength=num_rows)
    summed = torch.segment_reduce(
        grad_out.index_select(0, order).float(), "sum", lengths=counts, axis=0
    )
    return summed.to(grad_out.dtype)


class _SortedIndexSelect(torch.autograd.Function):
    @staticmethod
    def forward(ctx, embeddings: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(indices)
        ctx.num_rows = embeddings.size(0)
        return embeddings.index_select(0, indices)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor, None]:
        (indices,) = ctx.saved_tensors
        return _sorted_segment_sum(grad_out, indices.long(), ctx.num_rows), None


def sorted_index_select(embeddings: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``embeddings.index_select(0, indices)`` (2-D ``embeddings``) with the sorted,
    float32-accumulated backward described in the module docstring. Training only: the
    backward is not differentiable again."""
    if embeddings.dim() != 2:
        raise ValueError(
            f"sorted_index_select: embeddings must be 2-D [rows, dim], got shape "
            f"{tuple(embeddings.shape)}"
        )
    return _SortedIndexSelect.apply(embeddings, indices)


def maybe_sorted_index_select(
    embeddings: torch.Tensor, indices: torch.Tensor, use_sorted: bool
) -> torch.Tensor:
    """:func:`sorted_index_select` when ``use_sorted``, else ``index_select(0, indices)``
    (also under TorchScript, which cannot compile the custom autograd function; the forward
    is the same)."""
    if torch.jit.is_scripting() or not use_sorted:
        return embeddings.index_select(0, indices)
    return sorted_index_select(embeddings, indices)
