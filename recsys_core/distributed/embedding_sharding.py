"""TorchRec's ``torchrec.distributed.embedding_sharding`` path: bucketizing a KJT's ids by row
block before a row-wise all-to-all.

Worked example (2 buckets, block size 4, one key, 2 bags)::

    values  [1, 6, 3 | 5]         bag 0 = [1, 6, 3], bag 1 = [5]
    bucket  [0, 1, 0 | 1]         id // 4 (ids past num_buckets * 4: id % num_buckets)
    local   [1, 2, 3 | 1]         id % 4  (past the blocks: id // num_buckets)
    result  keys [f, f] (bucket-major), lengths [2, 0 | 1, 1], values [1, 3 | 2, 1]
    unbucketize_permute [0, 2, 1, 3]  (original value i sits at that position)
"""

from __future__ import annotations

import torch

from recsys_core.sparse import KeyedJaggedTensor


def bucketize_kjt_before_all2all(
    kjt: KeyedJaggedTensor,
    num_buckets: int,
    block_sizes: torch.Tensor,
    total_num_blocks: torch.Tensor | None = None,
    output_permute: bool = False,
    bucketize_pos: bool = False,
    block_bucketize_row_pos: list[torch.Tensor] | None = None,
    keep_original_indices: bool = False,
) -> tuple[KeyedJaggedTensor, torch.Tensor | None]:
    """Split each key's ids into ``num_buckets`` row blocks of ``block_sizes[key]`` rows.

    Returns the bucketized KJT (keys repeated per bucket, bucket-major; ids made block-local
    unless ``keep_original_indices``; weights kept, or each id's position in its bag with
    ``bucketize_pos``) and, with ``output_permute``, where each original id went (else None).
    """
    keys = kjt.keys()
    if block_sizes.numel() != len(keys):
        raise ValueError(
            f"bucketize_kjt_before_all2all: expecting block sizes for {len(keys)} features "
            f"({keys}), got {block_sizes.numel()}"
        )
    if num_buckets < 1:
        raise ValueError(f"bucketize_kjt_before_all2all: num_buckets={num_buckets} must be >= 1")
    if total_num_blocks is not None or block_bucketize_row_pos is not None:
        raise ValueError(
            "bucketize_kjt_before_all2all: total_num_blocks / block_bucketize_row_pos (two-level "
            "and uneven row blocks) are not supported here; give equal blocks (block_sizes)"
        )
    values, lengths = kjt.values(), kjt.lengths()
    num_bags = lengths.numel()
    bags = torch.repeat_interleave(torch.arange(num_bags, device=lengths.device), lengths)
    stride = kjt.stride()
    block = block_sizes.to(values.device, values.dtype)[bags // max(stride, 1)]
    if values.numel() and bool((values < 0).any()):
        raise ValueError("bucketize_kjt_before_all2all: negative ids cannot be bucketized by row")
    if bool((block_sizes <= 0).any()):
        raise ValueError(f"bucketize_kjt_before_all2all: block sizes must be positive, got {block_sizes.tolist()}")
    inside = values < block * num_buckets
    bucket = torch.where(inside, values // block, values % num_buckets)
    local = values if keep_original_indices else torch.where(inside, values % block, values // num_buckets)
    slot = bucket * num_bags + bags  # (bucket, key, sample): the output bag of each id
    order = torch.argsort(slot, stable=True)
    new_lengths = torch.bincount(slot, minlength=num_buckets * num_bags).to(lengths.dtype)
    if bucketize_pos:
        starts = torch.cumsum(lengths, 0) - lengths
        weights = (torch.arange(values.numel(), device=values.device) - starts[bags]).to(torch.float32)[order]
    else:
        weights = None if kjt.weights_or_none() is None else kjt.weights()[order]
    out = KeyedJaggedTensor(
        keys=keys * num_buckets, values=local[order], lengths=new_lengths, weights=weights,
        stride=stride,
    )
    permute = None
    if output_permute:
        permute = torch.empty_like(order)
        permute[order] = torch.arange(order.numel(), device=order.device, dtype=order.dtype)
        permute = permute.to(torch.int32)
    return out, permute


__all__ = ["bucketize_kjt_before_all2all"]
